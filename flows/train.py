"""The train flow: launch torchrun, and secure each checkpoint while training runs."""

from __future__ import annotations

import threading
import time
from typing import Annotated

from prefect import flow
from prefect.exceptions import Abort, CancelledRun
from prefect.logging import get_run_logger
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from core.config import RunConfig
from goodput.checkpoint_lifecycle import (new_checkpoints, secure_checkpoint, secured_text,
                                          unsecured_steps)
from goodput.evaluation import evaluation_due, is_evaluation_following, start_evaluation_process
from goodput.runs import check_run_config, unfinished_training_counted, warn_of_checkpoints_elsewhere
from infra.torchrun import LeaseWaitGivenUp
from storage.store import store_from_config
from tasks.control import (cancelled_on_ctrl_c, no_orphan_workers, resolve_config, settle, stop_training_when_cancelled,
                           training_slot)
from tasks.credentials import load_credentials, uses_blocks
from tasks.evaluate import check_eval_tasks, evaluate_validated
from tasks.layout import check_layout
from tasks.reporting import (
    WorkerLogs,
    announce_committed,
    announce_run_finished,
    publish_training_report,
)
from tasks.train import (
    apply_retention,
    launch_training,
    locate_dataset,
    publish_dataset_to_run_store,
    record_training,
    upload_checkpoint,
    validate_checkpoint,
)


class _OneAtATime(ThreadPoolTaskRunner):
    """Tasks in the order given, one at a time. Prefect warns at each submission with
    wait_for that a task with tags may deadlock a runner of one thread; none can here (what an
    evaluation waits for runs on the flow's own runner, and retention waits for the
    evaluation submitted before it), so that warning, 6 lines a run, is left out."""

    def __init__(self, max_workers: int = 1):  # the argument: Prefect's duplicate() passes it
        super().__init__(max_workers=max_workers)
        self.logger = self.logger.getChild("one-at-a-time")
        self.logger.addFilter(lambda record: "workers available" not in record.getMessage())


# The launch task holds one thread for the whole run; the others validate and upload. The
# bound keeps checkpoints that come faster than they verify from piling up processes.
@flow(name="train", task_runner=ThreadPoolTaskRunner(max_workers=4),
      on_crashed=[cancelled_on_ctrl_c])
def train(config: RunConfig = RunConfig(), config_file: str | None = None,
          overrides: tuple[str, ...] = (),
          time_limit_s: Annotated[float, Field(ge=0)] | None = None,
          worker_logs: WorkerLogs = "rank0") -> dict:
    """Train to `training.max_steps`, resuming from the newest validated checkpoint.

    The layout is checked against the hardware first (check-layout): one that cannot run,
    out of memory say, fails the flow with the fix before any worker starts; so does a name
    in eval.tasks that no task index knows (check-eval-tasks).

    While torchrun runs, every checkpoint it commits is validated in a verifier process
    (apart from training) and uploaded to the store; a failed attempt is retried by Prefect
    and resumes from there. One flow run at a time trains a given run id (it holds the
    run's lease); others wait for it. Workers whose flow run's process dies stop by
    themselves (launch.orphan_timeout_s).

    Args:
        config: The run's configuration (the form); used unless `config_file` is set.
        config_file: A RunConfig YAML file (e.g. configs/tiny.yaml), relative to the
            working directory of the flow run; leave the form at its defaults when set.
        overrides: Field overrides applied last, e.g. ["training.max_steps=600"].
        time_limit_s: Wall-clock budget of this flow run: past it, the workers save a
            checkpoint at their next step and stop (about a step and a save later); a later
            run continues from it. Empty: train to the end.
        worker_logs: Whose output goes to this log: global rank 0 ("rank0") or every rank
            ("all"); each line is prefixed with its node and rank.
    """
    started = time.time()
    config = resolve_config(config, config_file, overrides)
    if uses_blocks(config):  # the store's and W&B's keys, from Prefect blocks
        load_credentials(config)
    check_run_config(config)  # a config the run's checkpoints do not continue: before anything
    warn_of_checkpoints_elsewhere(config)  # a run pointed at another store: its log says so
    try:
        # Configuration checks before anything launches: eval.tasks' names (lm-eval's task
        # index, seconds when not cached) beside the layout check and finding the dataset.
        eval_tasks = check_eval_tasks.submit(config) if config.eval.tasks else None
        check_layout(config)  # a layout that cannot run fails here, before anything launches
        dataset = locate_dataset.submit(config)
        if eval_tasks is not None:
            eval_tasks.result()  # a misspelt task fails the run here, not after training
        dataset_dir = dataset.result()
        published = publish_dataset_to_run_store.submit(config)  # beside training, where the store lacks it
        trained = _train(config, dataset_dir, published, time_limit_s, worker_logs, started)
    except (CancelledRun, Abort, LeaseWaitGivenUp) as e:
        # Cancelled: training stopped, a task (a retry's launch) refused by the server in a
        # flow run being cancelled, or the wait for the run's lease given up. From
        # Cancelling, the server accepts Cancelled alone.
        return Cancelled(message=f"training was cancelled: {e}")
    publish_training_report(config)
    announce_run_finished(config, trained)
    return trained


def _train(config: RunConfig, dataset_dir, published, time_limit_s: float | None,
           worker_logs: WorkerLogs, started: float) -> dict:
    """The train flow's training, once its inputs are checked: launched, every checkpoint
    secured while it runs, recorded. CancelledRun when it was cancelled."""
    logger = get_run_logger()
    # Outermost to innermost: a flow run that ends unfinished once it holds the run's lease
    # still counts its time (less its wait for the lease, which the holder before counts),
    # the stop and the securing after a SIGTERM included; a SIGKILL in those leaves the count
    # to the next holder (record_abandoned_training), so it is counted once. Evaluations
    # (eval.every_validated) queue on a thread of their own, one at a time, never holding
    # the threads that validate and upload; entered before no_orphan_workers, so that a
    # cancellation stops the evaluation running beside training before that thread is waited for.
    with stop_training_when_cancelled() as cancelled, \
            training_slot(config, give_up=cancelled) as lease, \
            unfinished_training_counted(config, started + lease.waited_s), \
            _OneAtATime() as evaluating, \
            no_orphan_workers(lambda: _secure_without_tasks(config, logger),
                              left_unsecured=lambda: unsecured_steps(config)):
        training = launch_training.with_options(
            retries=config.run.max_attempts - 1, retry_delay_seconds=config.run.retry_delay_s,
        ).submit(config, dataset_dir, time_limit_s, worker_logs, started, lease.holder)

        # Told by the future itself, not by asking the API its state each second (which was
        # a request a second for the whole run).
        finished = threading.Event()
        training.add_done_callback(lambda _: finished.set())

        def still_running() -> bool:
            if finished.wait(timeout=1.0):
                return False
            training.wait(timeout=0)  # where Prefect raises a requested suspension
            return True

        def secure(step: int):
            validated = validate_checkpoint.submit(config, step, dataset_dir)
            uploaded = upload_checkpoint.submit(config, step, wait_for=[validated])
            return validated, apply_retention.submit(config, wait_for=[uploaded])

        secured, evaluations = [], []
        for step in new_checkpoints(config, still_running):
            announce_committed(config, step)
            validated, retained = secure(step)
            secured.append(retained)
            if evaluation_due(config, step):
                evaluated = evaluating.submit(evaluate_validated, {
                    "config": config, "step": step, "dataset_dir": dataset_dir}, wait_for=[validated])
                # Retention again once the score is in (best-by-eval may keep this step),
                # on the evaluations' thread.
                evaluations.append(evaluating.submit(apply_retention, {"config": config},
                                                     wait_for=[evaluated]))
        if is_evaluation_following() and _completed(training):
            # Training has finished. The pipeline's evaluation comes next: its process
            # imports while the last checkpoints are secured and the report is made, on the
            # cores training no longer uses. (Started at the last step's commit instead, it
            # slowed that step's validation, which the flow waits for, by as much as it gained.)
            start_evaluation_process()
        settle(secured + evaluations + [published])  # a failed evaluation shows in its task run, not as training's
        if cancelled.is_set():  # no task runs in a flow run being cancelled
            _secure_without_tasks(config, logger)
            secured = []
        else:
            # A task cannot start while the Prefect API is away (a server restart): the
            # checkpoints it left unjudged or not uploaded are secured now, and their
            # outcome is the one that counts.
            secured = [secure(step)[1] for step in unsecured_steps(config)]
            settle(secured)
        outcome = training.result()  # raises when the last attempt failed (CancelledRun: cancelled)
        for future in secured:
            future.result()
    return record_training(config, outcome, started + lease.waited_s)


def _completed(future) -> bool:
    """Whether the task run of a future that is done ended Completed, by the future's own
    final state (the API's may not have it yet)."""
    try:
        future.wait(timeout=0)
    except Exception:  # noqa: BLE001 - raised again where its result is asked for
        return False
    return future.state.is_completed()


def _secure_without_tasks(config: RunConfig, logger) -> None:
    """What a cancelled training left unsecured (its workers' emergency checkpoint, and
    checkpoints whose tasks the cancellation kept from running), validated and uploaded in
    the flow itself, newest first (the emergency checkpoint is the one no task judges; an
    older step's task may still hold its lock): the server lets no task run start in a flow
    run being cancelled, and without this they waited for the next run, on this machine
    only. After a SIGTERM, tasks.control.no_orphan_workers gives this until Prefect's SIGKILL
    is near. Never raises: a failure is logged, and the next run secures what is left."""
    steps: list[int] = []
    try:
        steps = sorted(unsecured_steps(config), reverse=True)
        store = store_from_config(config.storage)
        for step in list(steps):
            logger.info(f"{secured_text(step, secure_checkpoint(config, step, store))} after "
                        "the cancellation")
            steps.remove(step)
    except Exception as e:  # noqa: BLE001 - the store away, a verifier that crashed, the ledger
        logger.warning(f"checkpoint step(s) {', '.join(map(str, sorted(steps))) or '?'} left for the "
                       f"next run to secure: {type(e).__name__}: {e}")
