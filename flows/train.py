"""The train flow: launch torchrun, and secure each checkpoint while training runs."""

from __future__ import annotations

import time

from prefect import flow
from prefect.futures import wait

from goodput.checkpoints import new_checkpoints
from goodput.config import RunConfig
from tasks.train import (launch_training, locate_dataset, prune_local_checkpoints,
                         record_training, upload_checkpoint, validate_checkpoint)


@flow(name="train")
def train(config: RunConfig = RunConfig()) -> dict:
    """Train to `training.max_steps`, resuming from the newest validated checkpoint.

    While torchrun runs, every checkpoint it commits is validated in a fresh process and
    uploaded to the store; a failed attempt is retried by Prefect and resumes from there.
    """
    started = time.time()
    dataset_dir = locate_dataset(config)
    training = launch_training.with_options(
        retries=config.run.max_attempts - 1, retry_delay_seconds=config.run.retry_delay_s,
    ).submit(config, dataset_dir)

    def still_running() -> bool:
        training.wait(timeout=1.0)
        return not training.state.is_final()

    secured = []
    for step in new_checkpoints(config, still_running):
        validated = validate_checkpoint.submit(config, step)
        secured.append(upload_checkpoint.submit(config, step, wait_for=[validated]))
    wait(secured)
    outcome = training.result()  # raises when the last attempt failed
    for future in secured:
        future.result()
    prune_local_checkpoints(config)
    return record_training(config, outcome, started)
