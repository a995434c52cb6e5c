"""Prefect policy around training and the checkpoint lifecycle.

`launch_training` is retried by Prefect; every attempt resumes from the newest validated
checkpoint. A configuration error is never retried (retrying the same inputs cannot help).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import flow_run, task_run

from goodput import checkpoints
from goodput.config import ConfigError, RunConfig
from goodput.data.prepare import find_prepared, plan_dataset
from goodput.runs import train_attempt, update_summary
from infra.torchrun import TrainingFailed
from storage.ledger import LedgerEntry


def retry_unless_config_error(task, task_run, state) -> bool:
    """Prefect retry condition: retry crashes and hangs, never configuration or data errors."""
    try:
        state.result()
    except TrainingFailed as e:
        return e.failure_class != "config"
    except ConfigError:
        return False
    except Exception:
        return True
    return False


@task(name="launch-training", cache_policy=NO_CACHE, retry_condition_fn=retry_unless_config_error,
      tags=["training"])
def launch_training(config: RunConfig, dataset_dir: Path) -> dict:
    """Run torchrun to max_steps (one attempt per Prefect try), worker output in this log."""
    logger = get_run_logger()
    attempt = f"{str(flow_run.id or 'local')[:8]}-{task_run.run_count}"
    result = train_attempt(config, dataset_dir, config.storage.open(), attempt, logger.info)
    return {"attempt": attempt, "step": result.step, "wall_time_s": result.wall_time_s}


@task(name="validate-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      tags=["checkpoint"], task_run_name="validate-step-{step}")
def validate_checkpoint(config: RunConfig, step: int) -> LedgerEntry:
    entry = checkpoints.validate_checkpoint(config, step)
    logger = get_run_logger()
    if entry.state == "rejected":
        logger.warning(f"checkpoint step {step} rejected: {entry.reason}")
    else:
        logger.info(f"checkpoint step {step} {entry.state}")
    return entry


@task(name="upload-checkpoint", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30],
      tags=["checkpoint", "upload"], task_run_name="upload-step-{step}")
def upload_checkpoint(config: RunConfig, step: int) -> LedgerEntry:
    entry = checkpoints.upload_checkpoint(config, step, config.storage.open())
    get_run_logger().info(f"checkpoint step {step} uploaded to {entry.store_url}")
    return entry


@task(name="prune-local-checkpoints", cache_policy=NO_CACHE, tags=["checkpoint"])
def prune_local_checkpoints(config: RunConfig) -> list[int]:
    return checkpoints.prune_local(config)


@task(name="locate-dataset", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      tags=["training"])
def locate_dataset(config: RunConfig) -> Path:
    """The prepared dataset of this config on local disk (downloaded from the store if needed)."""
    plan = plan_dataset(config)
    if find_prepared(plan, config.storage.open()) is None:
        raise ConfigError(f"dataset {plan.dataset_id} is not prepared for this config; "
                          "run `goodput prepare` (or the pipeline) first")
    return Path(plan.local_dir)


@task(name="record-training", cache_policy=NO_CACHE, tags=["training"])
def record_training(config: RunConfig, outcome: dict, started: float) -> dict:
    """Write the train stage's part of summary.json: final step, ledger, wall time."""
    ledger = checkpoints.ledger_of(config).read()
    newest = ledger.newest()
    values = {"final_step": newest.step if newest else None,
              "final_train_loss": newest.loss if newest else None,
              "last_attempt": outcome, "wall_time_s": time.time() - started,
              "ledger": {str(s): e.state for s, e in sorted(ledger.entries.items())}}
    update_summary(config.run_dir, "train", values)
    return values
