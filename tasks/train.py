"""Prefect policy around training and the checkpoint lifecycle.

`launch_training` is retried by Prefect; every attempt resumes from the newest validated
checkpoint. A configuration error is never retried (retrying the same inputs cannot help).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import flow_run, task_run

from goodput import checkpoints
from goodput.config import ConfigError, RunConfig
from goodput.runs import train_attempt
from infra.torchrun import TrainingFailed
from storage import open_store
from storage.ledger import LedgerEntry


def open_run_store(config: RunConfig):
    return open_store(config.storage.uri, endpoint_url=config.storage.endpoint_url,
                      region=config.storage.region)


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
    result = train_attempt(config, dataset_dir, open_run_store(config), attempt, logger.info)
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
    entry = checkpoints.upload_checkpoint(config, step, open_run_store(config))
    get_run_logger().info(f"checkpoint step {step} uploaded to {entry.store_url}")
    return entry


@task(name="prune-local-checkpoints", cache_policy=NO_CACHE, tags=["checkpoint"])
def prune_local_checkpoints(config: RunConfig) -> list[int]:
    return checkpoints.prune_local(config)
