"""How a flow run takes charge of a training run: which config, one trainer at a time,
when to stop, and that no worker outlives it.

- `resolve_config`: a deployment is started with the RunConfig form, or with a config
  file; `overrides` (`training.max_steps=600`) apply to either.
- `training_slot`: the run's lease (a file in its directory, renewed while the flow process
  lives), so a schedule, a manual trigger and a pipeline never train the same run at once,
  and workers whose flow process died stop by themselves. A second flow run waits for the
  lease, then resumes from the ledger (or finds nothing to do).
- `TimeLimit`: a per-flow-run wall-clock budget; past it the workers save a checkpoint at
  their next step and stop, and the next run continues from that checkpoint.
- `switch_off_own_schedule`: a scheduled flow run that finds the run finished switches off
  the schedule that created it, so a continuation schedule stops creating flow runs once
  the token budget is spent.
- `settle`: wait for task futures, where a task that never got to run (its engine could
  not reach the API) does not end the flow run.
- `no_orphan_workers`: Prefect raises a cancellation in the flow's thread while the launch
  task's thread keeps supervising the attempt (local or ssh nodes in sessions of their own,
  or a Slurm or Kubernetes job); this stops it there and then.
- `UserErrorsWithoutTracebacks`: a configuration or data error (ConfigError, DataError)
  shows in a flow run's log as its message, which says what to change, without Prefect's
  traceback of the engine around it (two of them a pipeline, about 100 lines each).
- `TasksThatNeverStarted`: such a task's end is a warning in the log, without Prefect's
  advice about unwaited futures (the flow waits for them).
- `LibraryRecordsToTheRun`: what the library logs while a flow runs (a store request
  retried, a file of no known format left out, a ledger the store could not give) is in
  that flow run's log too, where a deployed run's user looks; before, it reached only the
  console of the process, which a worker's flow run has none of.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator
from uuid import UUID

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler
from prefect.runtime import deployment, flow_run

from core.config import ConfigError, RunConfig, apply_overrides, config_from_dict, load_config
from core.errors import DataError
from goodput.evaluation import stop_background_evaluations
from goodput.runs import at_step, record_abandoned_training
from infra.torchrun import RunLease, attempts_running, stop_live_attempts


class UserErrorsWithoutTracebacks(logging.Filter):
    """Drops the traceback from a log record of a ConfigError or DataError (see the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (ConfigError, DataError)):
            record.exc_info, record.exc_text = None, None
        return True


class TasksThatNeverStarted(logging.Filter):
    """A task whose engine could not reach the API before it began (the server restarting)
    finishes Pending, and Prefect's task engine logs that at ERROR with advice for a flow
    that returns without waiting for its futures, example code included. Goodput's flows do
    wait (`settle`), which says what is redone: the record keeps its first line, as a
    warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if message.startswith("Finished in state Pending(") and "Please wait for all submitted" in message:
            record.msg = (message.split("\n", 1)[0] + ": the task never started (its engine "
                          "could not reach the API); the flow says what is redone")
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


# On the loggers themselves: Prefect's logging setup, run again, keeps a logger's filters.
# prefect.engine: a worker's flow-run process logs the flow's exception again as it exits.
for _engine_logger in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine"):
    logging.getLogger(_engine_logger).addFilter(UserErrorsWithoutTracebacks())
logging.getLogger("prefect.task_runs").addFilter(TasksThatNeverStarted())


class LibraryRecordsToTheRun(APILogHandler):
    """Sends a record of the library's loggers to the log of the flow run it happens in
    (Prefect's PREFECT_LOGGING_EXTRA_LOGGERS, which leaves the loggers at the root's WARNING
    and warns for each record logged outside a run). Outside a run (the command's own check,
    a script calling the library) there is no run to send to: the console has the record."""

    def emit(self, record: logging.LogRecord) -> None:
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() or TaskRunContext.get():
            super().emit(record)


LIBRARY_LOGGERS = ("goodput", "storage", "tasks", "training", "infra")
for _library_logger in map(logging.getLogger, LIBRARY_LOGGERS):
    if not any(isinstance(h, LibraryRecordsToTheRun) for h in _library_logger.handlers):
        _library_logger.addHandler(LibraryRecordsToTheRun())
    if _library_logger.level == logging.NOTSET:  # a level the user set stays
        _library_logger.setLevel(logging.INFO)


@task(name="resolve-config", cache_policy=NO_CACHE, tags=["config"])
def resolve_config(config: RunConfig, config_file: str | None = None,
                   overrides: tuple[str, ...] = ()) -> RunConfig:
    """The run's configuration: the form (`config`) or `config_file`, then `overrides`.

    Both an edited form and a config file is ambiguous (which one wins?) and fails; a
    relative `config_file` is read from the flow run's working directory.
    """
    if config_file:
        if config != _form_default():
            raise ConfigError(
                "both the config form and config_file were given; use one: leave the form at "
                "its defaults and put extra changes in `overrides`, or clear config_file")
        resolved = load_config(config_file, list(overrides))
    elif overrides:
        tree = apply_overrides(config.model_dump(mode="json"), list(overrides))
        resolved = config_from_dict(tree, "config form + overrides")
    else:
        return config
    get_run_logger().info(f"run {resolved.run.run_id}: config from "
                          f"{config_file or 'the form'} with overrides {list(overrides)}")
    return resolved


def _form_default() -> RunConfig:
    """What the form shows before anyone edits it: the deployment's default, or RunConfig()."""
    if deployment.id:
        with get_client(sync_client=True) as client:
            defaults = client.read_deployment(UUID(deployment.id)).parameters
        if "config" in defaults:  # written by an older Goodput, it may no longer validate
            return config_from_dict(defaults["config"],
                                    f"the config parameter of deployment {deployment.name!r}; "
                                    "redeploy it (prefect deploy) or edit its defaults")
    return RunConfig()


def lease_holder() -> str:
    """Who holds a run's lease while this flow run trains it."""
    return f"flow run {flow_run.id}" if flow_run.id else f"process {os.getpid()}"


@contextmanager
def training_slot(config: RunConfig, give_up: threading.Event | None = None) -> Iterator[RunLease]:
    """Hold the run's lease (infra.torchrun.RunLease) while training; wait, saying so in the
    log, while another flow run trains the run, or while workers whose flow process was
    killed still train it (they stop by themselves). Yields the lease: its holder's name,
    which every attempt's workers watch, and how long it waited (`waited_s`, time another
    holder's training already counts): if this process dies, they stop within
    launch.orphan_timeout_s, and the next holder records what it could not (its time, its
    attempts' outcomes: goodput.runs.record_abandoned_training). `give_up` set while it
    waits (its flow run cancelled) ends the wait: infra.torchrun.LeaseWaitGivenUp.

    A file in the run directory rather than a Prefect concurrency slot: a slot's lease
    lives in the server's memory, so a restarted server forgot it (and killed the flow run
    holding it), and Prefect's temporary server never frees the slot of a killed command.
    """
    holder = lease_holder()
    logger = get_run_logger()
    with RunLease(config, holder).held(logger.info, give_up=give_up) as lease:
        if lease.abandoned is not None and "since" in lease.abandoned:
            _record_abandoned(config, lease.abandoned, logger)
        yield lease


def _record_abandoned(config: RunConfig, lease: dict, logger) -> None:
    """Say, and record, what a holder that vanished with the run's lease left unrecorded;
    what a killed host left may be cut short, which is never a reason not to train."""
    try:
        found = record_abandoned_training(config, lease)
    except Exception as e:
        logger.warning(f"{lease['holder']} vanished without letting run {config.run.run_id} go; "
                       f"its time and attempts could not be recorded: {type(e).__name__}: {e}")
        return
    logger.warning(
        f"{found['holder']} held run {config.run.run_id} until "
        f"{time.strftime('%H:%M:%S', time.localtime(lease['time']))} and vanished without "
        f"letting it go (its process killed or its host lost): its {found['wall_time_s']:.0f}s "
        "count in the run's wall time"
        + "".join(f"; attempt {o['attempt']} recorded as {o['class']} {at_step(o['step'])}"
                  for o in found["outcomes"]))


class TimeLimit:
    """A flow run's wall-clock budget: `limit_s` from `started` (the flow run's start, so a
    Prefect retry of the launch task spends what is left of it rather than a fresh one;
    default now). `limit_s=None` is no limit.

    The workers themselves stop at it (GOODPUT_STOP_AFTER = `deadline`): the step after the
    first one past it is saved, whatever checkpoint.every_steps says, and they stop after
    it (as Megatron's --exit-duration-in-mins). That loses no step, unlike killing the job at
    the deadline; it overshoots by about a step and a save, where stopping at the next
    scheduled checkpoint overshot by up to an interval (a scheduled continuation then ran
    into the next tick, which was cancelled); and it depends on no polling here.
    """

    def __init__(self, limit_s: float | None, started: float | None = None):
        self.limit_s = limit_s
        began = time.time() if started is None else started
        self.deadline = None if limit_s is None else began + limit_s

    def passed(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline

    def reached_at(self, step: int) -> str:
        return (f"time limit of {self.limit_s:.0f}s reached: stopped after checkpoint step "
                f"{step}; the next run continues from it")


def switch_off_own_schedule() -> str | None:
    """Deactivate the deployment schedule that created this flow run, if one did.

    Returns the deployment's name, or None for a run triggered by hand, by a parent flow or
    outside a deployment. The server deletes the schedule's pending runs with it. The
    schedule's toggle in the UI switches it back on (for a new run id in its parameters).
    """
    if not flow_run.id:
        return None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run.id))
        creator = run.created_by
        if (run.deployment_id is None or creator is None or creator.type != "SCHEDULE"
                or creator.id is None):
            return None
        client.update_deployment_schedule(run.deployment_id, creator.id, active=False)
        return client.read_deployment(run.deployment_id).name


# Workers' allowance for an emergency checkpoint when the flow run is cancelled.
CANCEL_GRACE_S = 20.0


# From a SIGTERM, what stopping the workers and securing their checkpoint may take: Prefect's
# worker and runner SIGKILL a cancelled flow run's process 30 s after it; the rest unwinds.
SIGTERM_BUDGET_S = 25.0


@contextmanager
def no_orphan_workers(secure_what_training_left: Callable[[], None] | None = None,
                      left_unsecured: Callable[[], list[int]] = lambda: []) -> Iterator[None]:
    """Stop this process's training attempts when the flow leaves the block with an exception.

    A cancellation reaches the flow as a signal in its main thread; the engine then waits
    for the task threads, and the one supervising the attempt would wait for training to
    end. The nodes run in sessions of their own (or on other hosts, or as scheduler jobs),
    so killing the flow run's process group does not reach them either. Here every live
    attempt is stopped on every node, workers first getting CANCEL_GRACE_S for an emergency
    checkpoint (infra.torchrun.stop_live_attempts, in threads the process waits for before
    it exits). The attempt ends as cancelled, never retried.

    Prefect's worker or runner cancels a flow run with SIGTERM (SIGKILL 30 s later), as do
    systemd and Kubernetes when they stop a `goodput train`; the engine starts no task run
    from then on. On SIGTERM, the attempts' end is waited for here and then
    `secure_what_training_left` (which must not raise) validates and uploads the emergency
    checkpoint, with the run's lease still held and the flow run's log open, rather than
    leaving it on this machine's disk for the next run; all within SIGTERM_BUDGET_S. Past
    it the signal goes on (a securing still under way goes on in its thread until the
    process ends) and the next run secures what is left, which a warning names
    (`left_unsecured`: the steps). A Ctrl-C is not waited for here: the command secures
    after it (flows.cli).
    """
    try:
        yield
    except BaseException as e:
        deadline = time.monotonic() + SIGTERM_BUDGET_S
        stops = stop_live_attempts(grace_s=CANCEL_GRACE_S)
        stop_background_evaluations()  # and the evaluations beside it, not waited for
        if secure_what_training_left is not None and isinstance(e, TerminationSignal):
            workers_saving = _secure_by(deadline, stops, secure_what_training_left)
            if workers_saving is not None:
                _say_what_is_left(left_unsecured, workers_saving)
        raise


def _secure_by(deadline: float, stops: list[threading.Thread], secure: Callable[[], None]) -> bool | None:
    """None where `secure` ran to its end before `deadline`; else whether the workers were
    still saving when it passed."""
    for thread in stops:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    while attempts_running() and time.monotonic() < deadline:
        stop_live_attempts(grace_s=CANCEL_GRACE_S)  # one a retry launched meanwhile
        time.sleep(0.2)
    if attempts_running():
        return True  # the next run secures what they commit
    if deadline - time.monotonic() < 2.0:
        return False
    securing = threading.Thread(target=secure, name="secure-after-sigterm", daemon=False)
    securing.start()
    securing.join(timeout=max(0.0, deadline - time.monotonic()))
    return False if securing.is_alive() else None


def _say_what_is_left(left_unsecured: Callable[[], list[int]], workers_saving: bool) -> None:
    """A warning naming what a stop left unsecured: its log ended with the cancel alone, the
    emergency checkpoint's fate unsaid (a walk on a loaded machine)."""
    try:
        steps = left_unsecured()
    except Exception:  # noqa: BLE001 - the ledger unreadable: said as unknown
        steps = None
    try:
        logger = get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow run
        logger = logging.getLogger(__name__)
    if workers_saving:
        logger.warning("the %g s a stop allows ran out while the workers were still saving their "
                       "emergency checkpoint: the next run of this run id judges what they "
                       "committed before it resumes", SIGTERM_BUDGET_S)
    elif steps != []:
        logger.warning("the %g s a stop allows ran out before checkpoint(s) %s were validated and "
                       "uploaded: what this process does not finish before it ends, the next run "
                       "of this run id secures before it resumes", SIGTERM_BUDGET_S,
                       ", ".join(map(str, steps)) if steps else "of this run")


# How often a training flow run asks the API whether it is being cancelled.
CANCEL_POLL_S = 10.0
# How soon a SIGINT to a process running the train flow stops its training.
SIGINT_POLL_S = 0.25


class CtrlC:
    """Whether the user of the `goodput` command in this process pressed Ctrl-C: set by the
    command's signal handler (a plain attribute, as no lock may be taken there)."""

    pressed = False


def cancelled_on_ctrl_c(flow, flow_run, state) -> None:
    """Every flow's on_crashed hook: a flow run that Ctrl-C in the command's terminal ended
    is Cancelled, as the UI's Cancel leaves one, not Crashed. Prefect records a
    KeyboardInterrupt as a crash ("Execution was aborted by an interrupt signal"), so runs
    the user stopped on purpose, their training saved and stopped as a cancel, read as
    failures in the UI. A crash of any other cause, or in a process without the command
    (a worker's), stays Crashed."""
    if not CtrlC.pressed:
        return
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Cancelled(message="stopped by Ctrl-C in the "
                                                         "terminal of the goodput command"),
                                  force=True)


@contextmanager
def stop_training_when_cancelled(poll_s: float = CANCEL_POLL_S) -> Iterator[threading.Event]:
    """Stop this process's training when its flow run (or the flow run it is part of, a
    pipeline) is being cancelled, whoever started it. Yields an event set once it did.

    Prefect's worker or runner stops a cancelled flow run by killing the process it started
    itself. One started by a worker since replaced (killed, restarted by `goodput server`),
    or by `goodput train` against a server, has nobody to kill it: the run stayed Cancelling
    while training went on to its end, and the server then gave up and marked it Cancelled
    (5 minutes later in the walk). Here a thread asks for the flow runs' states every
    `poll_s` and, on a cancellation, stops the attempts (workers get CANCEL_GRACE_S for an
    emergency checkpoint), and ends a wait for the run's lease (training_slot's `give_up`);
    the flow then ends Cancelled, the only state the server accepts from a cancelling run. A
    run whose process is killed first is stopped by no_orphan_workers, as before.

    A SIGINT stops training the same way, within SIGINT_POLL_S (`_SigintCancels`): Ctrl-C in
    the terminal of `goodput serve` or `prefect worker start` reaches the flow-run processes
    in their process group; a script or notebook that calls the flow gets it itself."""
    cancelled = threading.Event()
    if not flow_run.id:  # not in a flow run
        yield cancelled
        return
    ids = {flow_run.id}
    try:  # a subflow's root (a pipeline): asked of the API, which may be away for a moment
        ids.add(flow_run.root_flow_run_id)
    except Exception:  # noqa: BLE001 - then this flow run's own cancellation is watched
        pass
    done = threading.Event()
    logger = get_run_logger()

    sigint = _SigintCancels()

    def being_cancelled(client) -> bool:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        from prefect.client.schemas.objects import StateType

        try:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[UUID(i) for i in ids])))
        except Exception:  # noqa: BLE001 - the API away (a server restart): ask again
            return False
        return any(run.state is not None and run.state.type in (StateType.CANCELLING, StateType.CANCELLED)
                   for run in runs)

    def watch() -> None:
        next_ask = time.monotonic() + poll_s
        with get_client(sync_client=True) as client:
            while not done.wait(min(poll_s, SIGINT_POLL_S)):
                if sigint.pressed:
                    why = "SIGINT (Ctrl-C, here or in the terminal of the process that started this flow run)"
                elif time.monotonic() >= next_ask:
                    next_ask = time.monotonic() + poll_s
                    if not being_cancelled(client):
                        continue
                    why = "this flow run is being cancelled"
                else:
                    continue
                if not cancelled.is_set():
                    logger.info(f"{why}: stopping training (its workers get {CANCEL_GRACE_S:.0f} "
                                "s for an emergency checkpoint)")
                    cancelled.set()
                stop_live_attempts(grace_s=CANCEL_GRACE_S)  # and one launched since
                stop_background_evaluations()

    thread = threading.Thread(target=watch, name="cancel-watch", daemon=True)
    thread.start()
    try:
        with sigint:
            yield cancelled
    finally:
        done.set()


class _SigintCancels:
    """While entered in the main thread of a process that runs a flow (a flow-run process, a
    script), SIGINT sets `pressed` instead of raising KeyboardInterrupt;
    stop_training_when_cancelled's thread then stops training as for a cancel. A second
    SIGINT raises as usual. A process that ignores SIGINT (started in the background by a
    script) keeps ignoring it.

    Ctrl-C in the terminal of `goodput serve` (or of a Prefect worker) reaches its flow-run
    processes with it, in its process group. The KeyboardInterrupt then left the train flow
    wherever it was: no_orphan_workers stopped the workers but did not wait for them (the
    `goodput` command, which secures after a Ctrl-C, is not there), the runner's SIGTERM
    ended the flow, and the process exited before the launch task's thread recorded the
    attempt's outcome (a CI run: the attempt without its cancelled outcome). Not entered
    where SIGINT already has a handler of its own (the `goodput` command's, which stops
    training itself), nor outside the main thread."""

    def __init__(self):
        self.pressed = False  # a plain attribute: the handler may take no lock
        self.previous = None

    def __enter__(self) -> "_SigintCancels":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc_info) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def settle(futures: list[PrefectFuture]) -> None:
    """Wait for every future, logging those whose task never ran.

    A task's own failure is its Failed state, and waiting for it raises nothing. A task whose
    engine could not reach the API before the run began raises out of the wait instead:
    while the server restarts, the engine's acquisition of the task's tag concurrency slots
    fails at once (its slot client does not retry a refused connection), outside the task's
    retries, and the task run stays Pending. The caller decides what to redo (the train flow
    secures the checkpoints such tasks left unjudged once training ends), so one refused
    connection does not fail a flow run whose training went on.
    """
    for future in futures:
        try:
            future.wait()
        except Exception as e:  # noqa: BLE001 - whatever the engine raised, the task did not run
            get_run_logger().warning("task run %s did not run (%s: %s); what it was for is "
                                     "redone later", future.task_run_id, type(e).__name__, e)
