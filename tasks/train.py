"""Prefect policy around training and the checkpoint lifecycle.

`launch_training` is retried by Prefect; every attempt resumes from the newest validated
checkpoint. A configuration error is never retried (retrying the same inputs cannot help),
nor is a cancelled attempt.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import flow_run, task_run
from prefect.states import Cancelled

from core.config import ConfigError, RunConfig
from core.cpu_priority import at_background_priority
from core.errors import DataError
from core.protocol import TIME_LIMIT, FailureClass, read_heartbeat
from goodput import checkpoint_lifecycle as lifecycle
from goodput.data.prepare import dataset_for_training, publish_for_training
from goodput import runs
from goodput.runs import train_attempt
from infra.torchrun import TrainingFailed
from storage.ledger import LedgerEntry
from storage.store import store_from_config
from tasks.control import TimeLimit
from tasks.reporting import (
    TrainingProgress,
    WorkerLogs,
    attempt_failed_event,
    checkpoint_event,
    layout_changed_event,
    worker_log,
)


def retry_per_policy(task, task_run, state) -> bool:
    """Prefect retry condition: the library's verdict (per-class budgets, no-progress guard;
    configuration or data errors and cancellations never retry)."""
    try:
        state.result()
    except TrainingFailed as e:
        return e.retry
    except (ConfigError, DataError):
        return False
    except Exception:
        return True
    return False


def retry_unless_config_error(task, task_run, state) -> bool:
    try:
        state.result()
    except (ConfigError, DataError):
        return False
    except Exception:
        return True
    return False


@task(name="launch-training", cache_policy=NO_CACHE, retry_condition_fn=retry_per_policy,
      tags=["training"])
def launch_training(config: RunConfig, dataset_dir: Path, time_limit_s: float | None = None,
                    worker_logs: WorkerLogs = "rank0", started: float | None = None,
                    lease_holder: str | None = None) -> dict:
    """Run torchrun to max_steps (one attempt per Prefect try), worker output in this log.
    An attempt stopped by a cancellation (of the flow run, Ctrl-C) ends the task run
    Cancelled, not Failed.

    Each heartbeat updates the progress artifact. `time_limit_s` after `started` (the flow
    run's start; retries share the budget) the workers save a checkpoint at their next step
    and stop after it, and the task returns normally with `stopped: "time limit"` (the next
    flow run continues from there). The first try always launches (it stops at its second
    step when the deadline has passed already); a retry that begins after the deadline does
    not. `lease_holder`:
    who holds the run's lease (the flow run), watched by the workers.
    """
    logger = get_run_logger()
    # The random tail of the run id: scheduled runs' ids (uuid7) share their time-ordered head.
    attempt = f"{str(flow_run.id or 'local')[-8:]}-{task_run.run_count}"
    progress = TrainingProgress(config, attempt)
    limit = TimeLimit(time_limit_s, started)
    if task_run.run_count > 1 and limit.passed():
        logger.info(f"the flow run's time limit ({time_limit_s} s) passed before this retry: not "
                    "launching; the next run resumes from the newest validated checkpoint")
        return {"attempt": attempt, "step": None, "wall_time_s": 0.0, "stopped": TIME_LIMIT}

    def layout_changed(change: dict) -> None:  # an elastic job lost or gained nodes
        progress.layout_changed(change)
        layout_changed_event(config, attempt, change)

    ended = "failed"
    try:
        result = train_attempt(config, dataset_dir, store_from_config(config.storage), attempt,
                               worker_log(logger.info, worker_logs), on_progress=progress,
                               stop_after=limit.deadline, lease_holder=lease_holder,
                               on_layout_change=layout_changed)
        ended = result.reason  # done, time limit
    except TrainingFailed as failure:
        ended = str(failure.failure_class)
        if failure.failure_class == FailureClass.CANCELLED:  # no failure: the task run says so
            return Cancelled(message=str(failure))
        attempt_failed_event(config, attempt, failure.failure_class, str(failure), failure.step)
        raise
    finally:  # the job may have ended between two polls of its heartbeat: show where it ended
        progress.show_last(read_heartbeat(config.run_dir), ended)
    outcome = {"attempt": attempt, "step": result.step, "wall_time_s": result.wall_time_s}
    if result.reason == TIME_LIMIT:  # the workers stopped themselves at a checkpoint
        logger.info(limit.reached_at(result.step))
        outcome["stopped"] = TIME_LIMIT
    return outcome


@task(name="validate-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      tags=["checkpoint"], task_run_name="validate-step-{step}")
def validate_checkpoint(config: RunConfig, step: int, dataset_dir: Path | None = None,
                        ) -> LedgerEntry | None:
    """Judge the checkpoint in a verifier process apart from training (its held-out loss on
    `dataset_dir`, when the check is on). A verifier that gives no verdict (it crashed, ran
    out of memory or time) leaves the checkpoint unjudged, never resumed from: logged, not a
    failure of the run."""
    logger = get_run_logger()
    try:
        entry = lifecycle.validate_checkpoint(config, step, dataset_dir)
    except lifecycle.VerifierCrashed as e:
        logger.warning(f"{e}: checkpoint step {step} stays unjudged and is not resumed from")
        return None
    checkpoint_event(config, entry)
    if entry.state == "rejected":
        logger.warning(f"checkpoint step {step} rejected: {entry.reason}")
    else:
        logger.info(f"checkpoint step {step} {entry.state}")
    return entry


@task(name="upload-checkpoint", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30],
      tags=["checkpoint", "upload"], task_run_name="upload-step-{step}")
def upload_checkpoint(config: RunConfig, step: int) -> LedgerEntry | None:
    before = lifecycle.ledger_of(config).read().entries[step].state
    if before == "committed":
        get_run_logger().warning(f"checkpoint step {step} has no verdict: not uploaded")
        return None
    try:
        entry = lifecycle.upload_checkpoint(config, step, store_from_config(config.storage))
    except lifecycle.CopySuperseded as e:  # not a failure: the new copy has its own upload
        get_run_logger().warning(f"{e}; its new copy is validated and uploaded on its own")
        return None
    if entry.state == "rejected":
        if before != "rejected":  # rejected here (its files changed since validation): said once
            checkpoint_event(config, entry)
            get_run_logger().warning(f"checkpoint step {step} rejected: {entry.reason}; not uploaded")
        return entry
    checkpoint_event(config, entry)
    get_run_logger().info(f"checkpoint step {step} uploaded to {entry.store_url}")
    return entry


@task(name="apply-retention", cache_policy=NO_CACHE, tags=["checkpoint"])
def apply_retention(config: RunConfig) -> dict[str, list]:
    """Retention for both tiers (checkpoint.keep_local, checkpoint.store_keep_every) and for
    copies moved aside (checkpoint.keep_aside), after every upload: an interrupted run keeps
    no more than a finished one."""
    deleted = lifecycle.apply_retention(config, store_from_config(config.storage))
    if any(deleted.values()):
        get_run_logger().info(f"retention deleted: {deleted}")
    return deleted


@task(name="locate-dataset", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_config_error, tags=["training"])
def locate_dataset(config: RunConfig) -> Path:
    """The prepared dataset of this config: read in place when it is on this machine, else
    streamed from the store through a local cache (data.cache_limit); found by its data
    settings where the raw sources are gone. One never prepared or damaged fails at once,
    saying which."""
    return dataset_for_training(config, store_from_config(config.storage))


@task(name="publish-dataset-to-run-store", cache_policy=NO_CACHE, tags=["training"])
def publish_dataset_to_run_store(config: RunConfig) -> list[str]:
    """A dataset on this machine that the run's store lacks (prepared with another
    storage.uri) is published there while training runs, at background priority: the run's
    checkpoints go to that store, and a machine with only the store could resume them but
    not find their data. A failure is logged, not the run's: its next start tries again."""
    try:
        sent = at_background_priority(publish_for_training, config, store_from_config(config.storage))
    except Exception as e:  # noqa: BLE001 - the run trains on
        get_run_logger().warning(f"the dataset could not be published to the run's store ({e}): "
                                 "a machine with only the store could not resume this run; "
                                 "the next start tries again")
        return []
    for url in sent:
        get_run_logger().info(f"published the dataset to {url}, this run's store, where it was "
                              "missing: a machine with only the store can resume the run")
    return sent


@task(name="record-training", cache_policy=NO_CACHE, tags=["training"])
def record_training(config: RunConfig, outcome: dict, started: float) -> dict:
    """Write the train stage's part of summary.json: final step, ledger, wall time."""
    return runs.record_training(config, outcome, started)
