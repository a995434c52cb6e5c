"""Start `torchrun ... -m training` on every node and supervise the attempt until it ends.

The supervisor starts the nodes through a launcher (infra/launchers.py: local, ssh, slurm,
kubernetes), streams the workers' output line by line to a callback (the Prefect run log),
watches rank 0's heartbeat to catch a hung job, ends every node on hang, cancel, error or
the failure of any one node, and turns the exit into a failure class the launch task maps
to a retry decision (the contract is core/protocol.py).

Two lines of defence against a crash: torchrun restarts the workers within the attempt
(`--max-restarts`, launch.max_restarts; they resume from the newest validated checkpoint),
and when that does not help the attempt fails and the launch task's retry starts a new one.
A node that dies as a whole (its torchrun agent gone) ends the attempt at once.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from core.config import RunConfig
from core.protocol import (ENV_ATTEMPT, ENV_MTBF_S, ENV_RESTART_WAIT_S, ENV_RUN_DIR, ENV_STOP_AFTER,
                           FailureClass, ResumeSpec, in_job_restarts, read_exit_records,
                           read_heartbeat)
from infra.launchers import NodeLaunch, free_port, make_launcher  # noqa: F401 (free_port: API)


class TrainingFailed(RuntimeError):
    """An attempt that ended without finishing; `failure_class` says what to do about it."""

    def __init__(self, message: str, failure_class: FailureClass, step: int | None = None,
                 retry: bool = True):
        super().__init__(message)
        self.failure_class = failure_class
        self.step = step
        self.retry = retry  # the retry policy's verdict (goodput.runs.retry_decision)


@dataclass
class AttemptResult:
    exit_code: int
    failure_class: FailureClass
    reason: str
    step: int | None
    wall_time_s: float
    records: list[dict] = field(default_factory=list)
    restarts: int = 0  # in-job restarts of the worker group (torchrun --max-restarts)


def torchrun_command(config: RunConfig, config_path: Path, dataset_dir: Path, attempt: str,
                     start: ResumeSpec = ResumeSpec.validated()) -> list[str]:
    """The torchrun command line, the same on every node. The rendezvous endpoint and each
    node's own settings reach torchrun through its environment (infra/launchers.py).

    `start`: where the workers start; by default the newest checkpoint validated so far,
    which is also what workers torchrun restarts in-job resume from (the same line)."""
    log_dir = config.run_dir.attempt(attempt).resolve() / "torchrun"
    par = config.parallelism
    return [
        config.launch.python or sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={par.nnodes}",
        f"--nproc-per-node={par.nproc_per_node}",
        "--rdzv-backend=c10d",
        # Per attempt: a node left over from an earlier attempt cannot join this one.
        f"--rdzv-id={config.run.run_id}-{attempt}",
        # In-job restarts first; the launch task's retries resume from a validated checkpoint.
        f"--max-restarts={config.launch.max_restarts}",
        # Worker output to the console with a [node rank] prefix, and per rank to files
        # next to the attempt's exit records.
        "--tee=3", f"--log-dir={log_dir}",
        "-m", "training",
        "--config", str(config_path.resolve()),
        "--dataset", str(dataset_dir.resolve()),
        "--resume", str(start),
    ]


def worker_env(config: RunConfig, attempt: str, mtbf_s: float = 0.0,
               stop_after: float | None = None) -> dict[str, str]:
    """What every worker needs on top of its node's own environment (core.protocol names
    the variables of the contract). `mtbf_s`: the run's mean time between failures so far,
    for checkpoint.interval=auto; `stop_after`: the flow run's deadline (Unix time)."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # workers share the cores
           "PYTHONUNBUFFERED": "1", ENV_ATTEMPT: attempt,
           # Where to leave the exit record even when the config file fails to load there.
           ENV_RUN_DIR: str(config.run_dir.path.resolve()),
           # A shared rendezvous TCP store made restarts flaky (STACK_NOTES): rank 0's node
           # opens a fresh store for the workers on every attempt.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TOKENIZERS_PARALLELISM": "false",
           # torchrun passes a SIGTERM on to its workers and SIGKILLs them after this long
           # (30 s unless told): give the emergency checkpoint the whole faults.emergency_save_s.
           # Only a stop and the end of a failed attempt wait for it; torchrun's in-job restart
           # after a crashed worker keeps its own fixed 30 s. An environment variable, not
           # --shutdown-timeout: a node's older torchrun ignores it instead of failing.
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(config.faults.emergency_save_s)),
           # After an in-job restart: how long to wait for the verdict on recent checkpoints.
           ENV_RESTART_WAIT_S: str(config.launch.restart_verdict_wait_s)}
    # (glibc's malloc thresholds: the worker fixes them itself, training.allocator; a
    # MALLOC_*_THRESHOLD_ in launch.env wins.)
    if mtbf_s:  # else the workers take faults.mtbf_hours (0 here would override it)
        env[ENV_MTBF_S] = str(mtbf_s)
    if stop_after is not None:
        env[ENV_STOP_AFTER] = repr(stop_after)
    if config.launch.network_interface:  # which NIC the collectives use between hosts
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = config.launch.network_interface
    return {**env, **config.launch.env}


def run_attempt(config: RunConfig, config_path: Path, dataset_dir: Path, attempt: str,
                log: Callable[[str], None], poll_s: float = 0.5,
                on_progress: Callable[[dict], None] | None = None, mtbf_s: float = 0.0,
                start: ResumeSpec = ResumeSpec.validated(),
                stop_after: float | None = None) -> AttemptResult:
    """Run one training attempt on every node to its end; never leaves a worker behind.

    `stop_after` (Unix time): the workers end the attempt, as done, right after the first
    checkpoint they save from then on.

    `on_progress` receives every new heartbeat (step, loss, tokens/s, ...) as it appears.
    While it runs, `stop_live_attempts` (another thread: a cancelled flow) can end it: the
    attempt then ends as cancelled, whatever the workers' exit records say.
    """
    launcher = make_launcher(NodeLaunch.of(
        config, torchrun_command(config, config_path, dataset_dir, attempt, start),
        worker_env(config, attempt, mtbf_s, stop_after), config.run_dir.attempt(attempt),
        name=f"goodput-{config.run.run_id}-{attempt}"))
    log(f"launch attempt {attempt}: {config.parallelism.nnodes} node(s) x "
        f"{config.parallelism.nproc_per_node} worker(s), launcher {config.launch.kind}")
    started = time.monotonic()
    hung = False
    watch = HangWatch(config.run, attempt)
    # The launcher's grace and torchrun's (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, worker_env) are
    # both faults.emergency_save_s: whichever ends first, the workers had that long.
    live = _LiveAttempt(launcher, grace_s=config.faults.emergency_save_s)
    try:
        live.start(log)
        while launcher.poll() is None and not live.stopping:
            time.sleep(poll_s)
            if not launcher.started:  # queued by a scheduler: waiting is not hanging
                watch.restart()
                continue
            beat = watch.observe(read_heartbeat(config.run_dir))
            if beat is not None and beat.get("phase") == "startup":
                if beat.get("start"):
                    log(f"workers restarted in-job (restart {beat['start']} of this attempt; "
                        f"launch.max_restarts={config.launch.max_restarts} per node): resuming "
                        "from the newest validated checkpoint")
            elif beat is not None and on_progress is not None:
                on_progress(beat)
            stalled = watch.stalled()
            if stalled:
                log(f"{stalled}: killing the job")
                hung = True
                break
    finally:
        # Hang, cancellation, a failed node or the normal end: make sure no node and no worker
        # survives. Workers that can still run get time for an emergency checkpoint; hung
        # ones do not deserve the wait.
        returncode = live.stop(grace_s=5.0 if hung else None)
    result = classify(config.run_dir, attempt, returncode, hung, time.monotonic() - started)
    if live.cancelled and result.failure_class != FailureClass.DONE:
        result.failure_class, result.reason = FailureClass.CANCELLED, "stopped by a cancellation"
    return result


class _LiveAttempt:
    """An attempt's launcher while it runs, registered so that another thread can stop it:
    a cancellation reaches the flow's main thread while the thread in run_attempt goes on
    supervising. Stopping happens once, whichever thread asks first; the other waits for
    the same exit code."""

    _registry: set["_LiveAttempt"] = set()
    _registry_lock = threading.Lock()

    def __init__(self, launcher, grace_s: float):
        self.launcher, self.grace_s = launcher, grace_s
        self.stopping = False
        self.cancelled = False  # stopped from outside (stop_live_attempts), not by the supervisor
        self._lock = threading.Lock()
        self._code: int | None = None
        with self._registry_lock:
            self._registry.add(self)

    def start(self, log) -> None:
        """Start the launcher, unless a stop came first; a stop that comes during the start
        waits for it, so it finds the job to stop."""
        with self._lock:
            if self._code is not None:
                raise RuntimeError("the attempt was stopped before it started")
            self.launcher.start(log)

    def stop(self, grace_s: float | None = None) -> int:
        self.stopping = True
        with self._lock:
            if self._code is None:
                try:
                    self._code = self.launcher.stop(grace_s=self.grace_s if grace_s is None else grace_s)
                finally:
                    with self._registry_lock:
                        self._registry.discard(self)
            return self._code

    @classmethod
    def live(cls) -> list["_LiveAttempt"]:
        with cls._registry_lock:
            return list(cls._registry)


def stop_live_attempts(grace_s: float | None = None) -> list[threading.Thread]:
    """Stop every attempt this process runs, on every node: local and ssh nodes get SIGTERM
    then SIGKILL, Slurm jobs SIGTERM then scancel, Kubernetes jobs are deleted. Workers get
    `grace_s` for an emergency checkpoint (default: each attempt's own allowance, from
    faults.emergency_save_s). Returns at once with the threads doing it (not daemons: a
    process on its way out still waits for them). An attempt already being stopped by an
    earlier call is left to that call's thread, so that calling again, to catch an attempt
    started meanwhile, adds no thread per attempt."""
    threads = []
    for attempt in _LiveAttempt.live():
        if attempt.cancelled:
            continue
        attempt.cancelled = True
        thread = threading.Thread(target=attempt.stop, args=(grace_s,), name="stop-training-attempt",
                                  daemon=False)  # also when called from a daemon thread
        thread.start()
        threads.append(thread)
    return threads


class HangWatch:
    """Tells a slow attempt from a hung one, from rank 0's heartbeat.

    Until this attempt's first step, and again from an in-job restart of the workers to their
    first step: `run.startup_timeout_s` (imports, rendezvous, loading a checkpoint,
    first-step compilation). While a checkpoint is being saved, and after the last step (the
    final checkpoint may still be written in the background, then the workers shut down):
    `run.checkpoint_timeout_s`. Otherwise `run.hang_timeout_s`, or when unset
    max(run.hang_min_s, 20 x the slowest step seen).
    """

    def __init__(self, run_cfg, attempt: str):
        self.cfg, self.attempt = run_cfg, attempt
        self.last_beat: dict | None = None
        self.slowest_step_s = 0.0
        self.restart()

    def restart(self) -> None:
        self.since = time.monotonic()

    def observe(self, beat: dict | None) -> dict | None:
        """Returns the heartbeat when it is new progress of this attempt."""
        if beat is None or beat.get("attempt") != self.attempt or beat == self.last_beat:
            return None
        # The first step after a (re)start warms up (compilation, caches): not a measure.
        if (self.last_beat is not None and self.last_beat.get("phase") != "startup"
                and beat.get("phase") != "checkpoint"):
            self.slowest_step_s = max(self.slowest_step_s, beat.get("step_time_s", 0.0))
        self.last_beat = beat
        self.restart()
        return beat

    def timeout(self) -> tuple[float, str]:
        if self.last_beat is None or self.last_beat.get("phase") == "startup":
            return self.cfg.startup_timeout_s, "no first step"
        if self.last_beat.get("phase") == "checkpoint":
            return self.cfg.checkpoint_timeout_s, "checkpoint save stalled"
        if self.last_beat.get("step", 0) >= self.last_beat.get("max_steps", float("inf")):
            return self.cfg.checkpoint_timeout_s, "no exit after the last step"
        if self.cfg.hang_timeout_s is not None:
            return self.cfg.hang_timeout_s, "no training progress"
        return max(self.cfg.hang_min_s, 20 * self.slowest_step_s), "no training progress"

    def stalled(self) -> str:
        limit, what = self.timeout()
        waited = time.monotonic() - self.since
        return f"{what} for {waited:.0f}s (limit {limit:.0f}s)" if waited > limit else ""


def classify(run_dir, attempt: str, returncode: int, hung: bool, wall: float) -> AttemptResult:
    """The attempt's failure class from how it ended and the ranks' exit records: the most
    specific record wins; an exit no record explains is a crash, retried."""
    records = read_exit_records(run_dir, attempt)
    restarts = in_job_restarts(run_dir, attempt)
    beat = read_heartbeat(run_dir)
    step = beat.get("step") if beat and beat.get("attempt") == attempt else None

    def result(failure: FailureClass, reason: str) -> AttemptResult:
        return AttemptResult(returncode, failure, reason, step, wall, records, restarts)

    if hung:
        return result(FailureClass.HANG, "heartbeat stalled")
    if returncode == 0:  # "done", or why the workers ended early ("time limit")
        return result(FailureClass.DONE, next((r["reason"] for r in records
                                               if r["class"] == FailureClass.DONE), "done"))
    for failure in (FailureClass.CONFIG, FailureClass.OOM, FailureClass.DISK_FULL,
                    FailureClass.CORRUPT_CHECKPOINT, FailureClass.ROLLBACK):
        reason = next((r["reason"] for r in records if r["class"] == failure), None)
        if reason is not None:
            return result(failure, reason)
    return result(FailureClass.RETRYABLE,
                  next((r["reason"] for r in records if r["class"] == FailureClass.RETRYABLE),
                       f"a worker died (torchrun exit {returncode})"))
