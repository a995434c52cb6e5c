"""Start `torchrun ... -m training` on every node and supervise the attempt until it ends.

The supervisor starts the nodes through a launcher (infra/launchers.py: local, ssh, slurm,
kubernetes), streams the workers' output line by line to a callback (the Prefect run log),
watches rank 0's heartbeat to catch a hung job, ends every node on hang, cancel, error or
the failure of any one node, and turns the exit into a failure class the launch task maps
to a retry decision (the contract is core/protocol.py).

Two lines of defence against a crash: torchrun restarts the workers within the attempt
(`--max-restarts`, launch.max_restarts; they resume from the newest validated checkpoint),
and when that does not help the attempt fails and the launch task's retry starts a new one.
A node that dies as a whole (its torchrun agent gone) ends the attempt at once as node_lost,
unless the run is elastic (elastic.min_nodes below parallelism.nnodes): torchrun's rendezvous
then restarts the workers on the nodes that remain, the layout following the smaller world.
"""

from __future__ import annotations

import contextvars
import math
import os
import re
import signal
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from core.config import RunConfig
from core.files import exclusive_lock
from core.protocol import (ENV_ATTEMPT, ENV_LEASE_HOLDER, ENV_MTBF_S, ENV_ORPHAN_AFTER_S,
                           ENV_RESTART_WAIT_S,
                           ENV_RUN_DIR, ENV_STOP_AFTER, FailureClass, ResumeSpec, in_job_restarts,
                           lease_holder_gone, read_exit_records, read_heartbeat, read_lease,
                           read_starts, workers_gone, write_lease)
from infra.launchers import (RDZV_CONF_ENV, NodeLaunch, SubmitStopped, make_launcher,
                             free_port)  # noqa: F401 (free_port: API)


class LeaseWaitGivenUp(RuntimeError):
    """A wait for the run's lease ended by the caller (its flow run was cancelled)."""


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
    worlds: list[int] = field(default_factory=list)  # world size of each start (elastic: changes)


# torchrun itself (torch.distributed.run), exiting without Python's teardown (1 s an attempt).
AGENT_MODULE = "infra.torchrun_agent"


def torchrun_command(config: RunConfig, config_path: Path, dataset_dir: Path, attempt: str,
                     start: ResumeSpec = ResumeSpec.validated()) -> list[str]:
    """The torchrun command line, the same on every node. The rendezvous endpoint and each
    node's own settings reach torchrun through its environment (infra/launchers.py).

    `start`: where the workers start; by default the newest checkpoint validated so far,
    which is also what workers torchrun restarts in-job resume from (the same line)."""
    log_dir = config.run_dir.attempt(attempt).resolve() / "torchrun"
    par = config.parallelism
    low, high = config.node_range
    return [
        config.launch.python or sys.executable, "-m", AGENT_MODULE,
        # Elastic: torchrun's rendezvous admits any count of the range (RDZV_CONF_ENV says
        # how long it waits for more), and restarts the workers when membership changes.
        f"--nnodes={low}:{high}" if low < high else f"--nnodes={par.nnodes}",
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


RDZV_SETTLE_S = 15  # an elastic rendezvous' allowance beyond elastic.wait_for_replacement_s


def worker_env(config: RunConfig, attempt: str, mtbf_s: float = 0.0,
               stop_after: float | None = None, lease_holder: str | None = None) -> dict[str, str]:
    """What every worker needs on top of its node's own environment (core.protocol names
    the variables of the contract). `mtbf_s`: the run's mean time between failures so far,
    for checkpoint.interval=auto; `stop_after`: the flow run's deadline (Unix time);
    `lease_holder`: their supervisor, whose lease they watch (without one, they watch none)."""
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
    if lease_holder is not None:  # without a renewal of its lease, the workers stop by themselves
        env[ENV_LEASE_HOLDER] = lease_holder
        env[ENV_ORPHAN_AFTER_S] = str(config.launch.orphan_timeout_s)
    if mtbf_s:  # else the workers take faults.mtbf_hours (0 here would override it)
        env[ENV_MTBF_S] = str(mtbf_s)
    if stop_after is not None:
        env[ENV_STOP_AFTER] = repr(stop_after)
    if config.elastic_run:
        # last_call: after a loss, how long the remaining nodes wait for more before going
        # on; join: the whole rendezvous' limit, past which fewer than elastic.min_nodes
        # give up: the wait, plus the time a dead node's rendezvous heartbeat takes to expire
        # (interval x attempts: 5 x 3 s by default; 1 x 3 s lets the survivors settle
        # sooner) and a margin for the agents' own steps.
        wait = max(1, math.ceil(config.elastic.wait_for_replacement_s))
        env[RDZV_CONF_ENV] = (f"last_call_timeout={wait},join_timeout={wait + RDZV_SETTLE_S},"
                              "keep_alive_interval=1,keep_alive_max_attempt=3")
    if config.launch.network_interface:  # which NIC the collectives use between hosts
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = config.launch.network_interface
    return {**env, **config.launch.env}


def run_attempt(config: RunConfig, config_path: Path, dataset_dir: Path, attempt: str,
                log: Callable[[str], None], poll_s: float = 0.5,
                on_progress: Callable[[dict], None] | None = None, mtbf_s: float = 0.0,
                start: ResumeSpec = ResumeSpec.validated(),
                stop_after: float | None = None, lease_holder: str | None = None,
                on_layout_change: Callable[[dict], None] | None = None) -> AttemptResult:
    """Run one training attempt on every node to its end; never leaves a worker behind.

    `lease_holder`: who holds the run's lease (RunLease) for this attempt, e.g. the flow run
    that makes it; None: the attempt takes the lease itself, waiting while another holder or
    orphaned workers train the run.

    `stop_after` (Unix time): from then on the workers save a checkpoint at the next step,
    whatever the cadence, and end the attempt after it, as done.

    `on_progress` receives every new heartbeat (step, loss, tokens/s, ...) as it appears;
    `on_layout_change` each new world of an elastic job (layout_change: before and after).
    While it runs, `stop_live_attempts` (another thread: a cancelled flow) can end it: the
    attempt then ends as cancelled, whatever the workers' exit records say.
    """
    with ExitStack() as stack:
        if lease_holder is None:  # nobody holds the run's lease for this attempt: it does
            lease_holder = f"attempt {attempt}"
            stack.enter_context(RunLease(config, lease_holder).held(log))
        return _supervise(config, config_path, dataset_dir, attempt, log, poll_s, on_progress,
                          mtbf_s, start, stop_after, lease_holder, on_layout_change)


def _supervise(config: RunConfig, config_path: Path, dataset_dir: Path, attempt: str,
               log: Callable[[str], None], poll_s: float,
               on_progress: Callable[[dict], None] | None, mtbf_s: float, start: ResumeSpec,
               stop_after: float | None, lease_holder: str,
               on_layout_change: Callable[[dict], None] | None = None) -> AttemptResult:
    log = TorchrunOutput(log)  # reads torchrun's word on which worker failed first
    launcher = make_launcher(NodeLaunch.of(
        config, torchrun_command(config, config_path, dataset_dir, attempt, start),
        worker_env(config, attempt, mtbf_s, stop_after, lease_holder),
        config.run_dir.attempt(attempt), name=f"goodput-{config.run.run_id}-{attempt}"))
    low, high = config.node_range
    log(f"launch attempt {attempt}: {f'{low} to {high}' if low < high else high} node(s) x "
        f"{config.parallelism.nproc_per_node} worker(s), launcher {config.launch.kind}")
    started = time.monotonic()
    hung = False
    # Elastic: between a lost node and the workers' restart the rendezvous may wait for it.
    watch = HangWatch(config.run, attempt, config.elastic.wait_for_replacement_s + RDZV_SETTLE_S
                      if config.elastic_run else 0.0)
    worlds: list[int] = []
    starts_seen = 0
    progress = _NewestOnly(on_progress) if on_progress is not None else None
    # The launcher's grace and torchrun's (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, worker_env) are
    # both faults.emergency_save_s: whichever ends first, the workers had that long.
    live = _LiveAttempt(launcher, grace_s=config.faults.emergency_save_s)
    try:
        live.start(log)
        while not live.stopping and launcher.poll() is None:
            time.sleep(poll_s)
            if not launcher.started:  # queued by a scheduler: waiting is not hanging
                watch.restart()
                continue
            # Each start of the workers from its line in starts.jsonl, which stays: the
            # heartbeat says "startup" only until the first step, and a poll can miss that.
            starts = read_starts(config.run_dir, attempt)
            for begun in starts[starts_seen:]:
                starts_seen += 1
                if begun["start"]:
                    log(f"workers restarted in-job (restart {begun['start']} of this attempt; "
                        f"launch.max_restarts={config.launch.max_restarts} per node): resuming "
                        "from the newest validated checkpoint")
                world = begun.get("world_size")
                if world is None:  # recorded by a version that did not note it
                    continue
                if worlds and world != worlds[-1]:
                    change = layout_change(config, worlds[-1], world)
                    log(change["text"])
                    if on_layout_change is not None:
                        on_layout_change(change)
                worlds.append(world)
                launcher.world_started(world)
            beat = watch.observe(read_heartbeat(config.run_dir))
            if beat is not None and beat.get("phase") != "startup" and progress is not None:
                progress.put(beat)
            stalled = watch.stalled()
            if stalled:
                log(f"{stalled}: killing the job")
                hung = True
                break
    finally:
        # Hang, cancellation, a failed node or the normal end: make sure no node and no worker
        # survives. Workers that can still run get time for an emergency checkpoint; hung
        # ones do not deserve the wait.
        try:
            returncode = live.stop(grace_s=5.0 if hung else None)
        finally:
            log.flush()
        if progress is not None:
            progress.close()
    result = classify(config.run_dir, attempt, returncode, hung, time.monotonic() - started,
                      scheduler_state=getattr(launcher, "final_state", None),
                      worker_failures=log.failures)
    result.worlds = worlds
    if live.cancelled and result.failure_class != FailureClass.DONE:
        result.failure_class, result.reason = FailureClass.CANCELLED, "stopped by a cancellation"
    elif result.failure_class == FailureClass.NODE_LOST and config.elastic_run:
        lost = getattr(launcher, "lost_nodes", [])
        if 0 in lost:  # whatever remained: the rendezvous went with it
            result.reason = (f"{result.reason}; node 0 lost: it hosts the rendezvous, which the "
                             "other nodes cannot go on without")
        else:
            result.reason = (f"{result.reason}; {len(lost) or 'a'} node(s) lost, and fewer than "
                             f"elastic.min_nodes={low} remained for elastic.wait_for_replacement_s="
                             f"{config.elastic.wait_for_replacement_s:g}s")
    return result


def layout_change(config: RunConfig, before: int, after: int) -> dict:
    """An elastic job's new world, `before` and `after` (nodes, workers, layout, gradient
    accumulation), and its log line (`text`)."""
    per_node = config.parallelism.nproc_per_node

    def world(size: int) -> dict:
        dims, accum = config.layout_on(size // per_node)
        return {"nodes": size // per_node, "world_size": size, "layout": dims.degrees,
                "grad_accum_steps": accum, "name": f"{dims.name} x accumulation {accum}"}

    old, new = world(before), world(after)
    text = (f"layout changed: {old['nodes']} -> {new['nodes']} node(s), world {before} -> "
            f"{after}, {old['name']} -> {new['name']} (global batch {config.global_batch} kept)")
    return {"before": old, "after": new, "full_world_size": config.parallelism.world_size,
            "global_batch": config.global_batch, "text": text}


class _NewestOnly:
    """Hands heartbeats to a callback (the progress artifact) on a thread of its own, the
    newest one only: a slow callback, e.g. the Prefect API away during a server restart,
    never holds up supervision (a supervisor blocked there saw no heartbeat for a minute
    and killed a healthy job as hung)."""

    def __init__(self, callback: Callable[[dict], None]):
        self.callback = callback
        self.newest: dict | None = None
        self.closed = False
        self.ready = threading.Condition()
        # In this thread's context (a Prefect task run's): the callback reports to that run.
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._run,),
                                       name="training-progress", daemon=True)
        self.thread.start()

    def put(self, beat: dict) -> None:
        with self.ready:
            self.newest = beat
            self.ready.notify()

    def _run(self) -> None:
        while True:
            with self.ready:
                self.ready.wait_for(lambda: self.newest is not None or self.closed)
                beat, self.newest = self.newest, None
            if beat is None:
                return
            self.callback(beat)

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is pending (for at most `timeout_s`), then stop."""
        with self.ready:
            self.closed = True
            self.ready.notify()
        self.thread.join(timeout=timeout_s)


class RunLease:
    """One supervisor per run, and no workers without one (core.protocol's lease file).

    The holder is whoever supervises: a flow run for all its attempts, or an attempt of its
    own. `acquire` waits while someone else holds a live lease (another flow run training
    this run: two trainers would overwrite each other's checkpoints) or while the workers of
    an attempt still train with no supervisor left (its flow process or worker was killed:
    they stop by themselves within launch.orphan_timeout_s of their supervisor's last
    renewal, after an emergency checkpoint). `held` acquires, renews every few seconds on a
    thread while the caller works, and lets go at the end.

    A lease taken over without its holder having let go (`abandoned`: the lease as that
    holder left it) tells of a supervisor that vanished: nothing it would have recorded was
    (goodput.runs.record_abandoned_training).
    """

    def __init__(self, config: RunConfig, holder: str):
        self.run_dir, self.holder = config.run_dir, holder
        self.orphan_after_s = config.launch.orphan_timeout_s
        self.save_s = config.faults.emergency_save_s
        # A save's writer process (checkpoint.async_mode=process) outlives its worker and
        # finishes the save in flight: killed workers are waited for as before.
        self.writers_outlive_workers = config.checkpoint.async_mode == "process"
        self.renew_every_s = min(5.0, self.orphan_after_s / 4)
        self.since: float | None = None
        self.waited_s = 0.0  # for another holder, or for workers with none, before taking it
        self.abandoned: dict | None = None

    def blocker(self) -> str:
        """Why the lease cannot be taken yet ("" when it can)."""
        now = time.time()
        lease = read_lease(self.run_dir)
        # The holder's own orphan timeout, which its workers go by (a lease written before
        # it was recorded: this config's).
        orphan_after_s = (lease or {}).get("orphan_after_s") or self.orphan_after_s
        if (lease is not None and lease["holder"] != self.holder and not lease["released"]
                and now - lease["time"] < orphan_after_s and not lease_holder_gone(lease)):
            return (f"run {self.run_dir.run_id} is being trained by {lease['holder']} (pid "
                    f"{lease['pid']} on {lease['host']}, lease renewed {now - lease['time']:.0f}s "
                    "ago)")
        beat = read_heartbeat(self.run_dir)
        if beat is None or beat.get("attempt") is None:
            return ""
        other = beat["attempt"]
        if (self.run_dir.attempt(other) / "outcome.json").exists():
            return ""  # its supervisor saw it end
        if any(r["rank"] == 0 and r["time"] >= beat["time"]
               for r in read_exit_records(self.run_dir, other)):
            return ""  # its workers have stopped
        if workers_gone(beat) and not self.writers_outlive_workers:
            return ""  # killed outright on this machine, their agent with them
        age = now - beat["time"]
        if age < orphan_after_s + self.save_s:
            return (f"the workers of attempt {other} still train with no supervisor (heartbeat "
                    f"{age:.0f}s ago); they stop by themselves once launch.orphan_timeout_s="
                    f"{orphan_after_s:.0f}s passes without one")
        return ""

    def acquire(self, log: Callable[[str], None], every_s: float = 1.0,
                give_up: threading.Event | None = None) -> None:
        """Take the lease, waiting while it is held (see blocker); `give_up` set while
        waiting (the flow run cancelled) ends the wait with LeaseWaitGivenUp."""
        told = ""
        began = time.time()
        while True:
            with exclusive_lock(self.run_dir / ".lease.lock"):
                blocker = self.blocker()
                if not blocker:
                    before = read_lease(self.run_dir)
                    if (before is not None and not before["released"]
                            and before["holder"] != self.holder):
                        self.abandoned = before
                    self.since = time.time()
                    self.waited_s = self.since - began
                    write_lease(self.run_dir, self.holder, since=self.since,
                            orphan_after_s=self.orphan_after_s)
                    return
            if blocker.split(" (")[0] != told:
                log(f"waiting: {blocker}")
                told = blocker.split(" (")[0]
            if give_up is not None and give_up.wait(every_s):
                raise LeaseWaitGivenUp(f"gave up waiting for the run's lease ({blocker})")
            if give_up is None:
                time.sleep(every_s)

    @contextmanager
    def held(self, log: Callable[[str], None],
             give_up: threading.Event | None = None) -> Iterator["RunLease"]:
        self.acquire(log, give_up=give_up)
        done = threading.Event()

        def keep_renewing():
            failing = False
            while not done.wait(self.renew_every_s):
                try:
                    write_lease(self.run_dir, self.holder, since=self.since,
                            orphan_after_s=self.orphan_after_s)
                    failing = False
                except OSError as e:  # a full disk, say: said once; the attempt decides the rest
                    if not failing:
                        log(f"the run's lease could not be renewed ({e}); trying again every "
                            f"{self.renew_every_s:.0f} s")
                    failing = True

        thread = threading.Thread(target=keep_renewing, name="run-lease", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            write_lease(self.run_dir, self.holder, released=True, since=self.since,
                        orphan_after_s=self.orphan_after_s)


class _LiveAttempt:
    """An attempt's launcher while it runs, registered so that another thread can stop it:
    a cancellation reaches the flow's main thread while the thread in run_attempt goes on
    supervising. Stopping happens once, whichever thread asks first; the other waits for
    the same exit code."""

    _registry: set["_LiveAttempt"] = set()
    _registry_lock = threading.Lock()

    def __init__(self, launcher, grace_s: float):
        self.launcher, self.grace_s = launcher, grace_s
        # Set by stop() before it waits for start(): a launcher's start that waits (a submit
        # retried while the scheduler's controller is away) sees it and ends at once.
        self.stop_asked = threading.Event()
        launcher.stop_asked = self.stop_asked
        self.cancelled = False  # stopped from outside (stop_live_attempts), not by the supervisor
        self._lock = threading.Lock()
        self._code: int | None = None
        with self._registry_lock:
            self._registry.add(self)

    @property
    def stopping(self) -> bool:
        return self.stop_asked.is_set()

    def start(self, log) -> None:
        """Start the launcher, unless a stop came first; a stop that comes during the start
        waits for it, so it finds the job to stop. A stop ends a start still submitting the
        job (SubmitStopped): the attempt then ends as stopped, as one stopped while running."""
        with self._lock:
            if self._code is not None:
                raise RuntimeError("the attempt was stopped before it started")
            try:
                self.launcher.start(log)
            except SubmitStopped as e:
                log(str(e))

    def stop(self, grace_s: float | None = None) -> int:
        self.stop_asked.set()
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


def attempts_running() -> bool:
    """Whether this process supervises an attempt that has not ended yet. Takes no lock: a
    signal handler may ask (the interrupted thread may hold the registry's lock)."""
    return bool(_LiveAttempt._registry)


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

    def __init__(self, run_cfg, attempt: str, rendezvous_s: float = 0.0):
        self.cfg, self.attempt = run_cfg, attempt
        self.rendezvous_s = rendezvous_s  # an elastic rendezvous may wait this long between steps
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
            return self.cfg.hang_timeout_s + self.rendezvous_s, "no training progress"
        return (max(self.cfg.hang_min_s, 20 * self.slowest_step_s) + self.rendezvous_s,
                "no training progress")

    def stalled(self) -> str:
        limit, what = self.timeout()
        waited = time.monotonic() - self.since
        return f"{what} for {waited:.0f}s (limit {limit:.0f}s)" if waited > limit else ""


class TorchrunOutput:
    """Passes an attempt's output lines on to the log, reading torchrun's own lines on the way.

    - `failures`: torchrun's account of the worker that failed first on each node, its
      global rank and exit code (negative: the signal that killed it). A worker killed by a
      signal (SIGKILL from the kernel's OOM killer, a scheduler or a user) writes no exit
      record; the others then fail on the connection it closed, which is all their records
      can tell. torchrun, its parent, saw how it ended, and prints it under "Root Cause
      (first observed failure)" when it gives up on the worker group.
    - The traceback torchrun prints of the signal that stopped it (SIGTERM: a cancellation,
      a preemption) says only that, in some 30 lines: it becomes one line. So does its
      traceback above the report of failed workers (ChildFailedError), about 20 lines of
      its own frames; the report itself is passed on.

    Lines are read per thread (each node's output has a reader thread of its own); `flush`
    passes on what a thread held back when its output ended.
    """

    ROOT_CAUSE = "Root Cause (first observed failure):"
    RANK = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank")
    EXIT_CODE = re.compile(r"\bexitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
    TRACEBACK = "Traceback (most recent call last):"  # torchrun's own: workers' are prefixed
    STOPPED = re.compile(r"SignalException: Process (\d+) got signal: (?:Signals\.)?(\w+)$")
    HANDLER = "_terminate_process_handler"  # torch's, in the frame that raised it
    WORKERS_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self._reading: dict[int, dict] = {}  # reader thread -> the root cause read so far
        self._held: dict[int, list[str]] = {}  # reader thread -> a traceback's lines so far
        self.failures: list[dict] = []  # {"rank", "exit_code", "pid"}, in the order printed

    def __call__(self, line: str) -> None:
        reader = threading.get_ident()
        held = self._held.get(reader)
        if held is not None:
            if line[:1].isspace():  # the traceback's frames
                held.append(line)
                return
            del self._held[reader]
            stopped = self.STOPPED.search(line)
            # Only torch's frames, ending in its signal handler: nothing else (another node's
            # lines on a shared stream) is left out.
            if stopped is not None and any(self.HANDLER in frame for frame in held[-3:]):
                sig = stopped.group(2)
                self._log(f"torchrun (pid {stopped.group(1)}) stopped on "
                          f"{_signal_name(int(sig)) if sig.isdigit() else sig}, after its "
                          "workers (its traceback left out)")
                return
            if line.rstrip() == self.WORKERS_FAILED and any("raise ChildFailedError(" in frame for frame in held[-3:]):
                self._log("torchrun gave up on its workers; its report follows (its traceback "
                          "left out)")
                return
            for earlier in held:
                self._log(earlier)
        if line == self.TRACEBACK:
            self._held[reader] = [line]
            return
        self._log(line)
        self._read_failure(reader, line)

    def flush(self) -> None:
        for reader in list(self._held):
            for line in self._held.pop(reader, []):
                self._log(line)

    def _read_failure(self, reader: int, line: str) -> None:
        if self.ROOT_CAUSE in line:
            self._reading[reader] = {}
            return
        found = self._reading.get(reader)
        if found is None:
            return
        if (match := self.RANK.search(line)) is not None:
            found["rank"] = int(match.group(1))
        elif (match := self.EXIT_CODE.search(line)) is not None:
            found["exit_code"], found["pid"] = int(match.group(1)), int(match.group(2))
        if "rank" in found and "exit_code" in found:
            del self._reading[reader]
            self.failures.append(found)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _how_it_ended(exit_code: int) -> str:
    if exit_code >= 0:
        return f"exited with code {exit_code} and no exit record"
    name = _signal_name(-exit_code)
    if -exit_code == signal.SIGKILL:
        return (f"was killed by {name}, as the kernel's OOM killer does when a host runs out of "
                "memory (see `dmesg` on its node)")
    return f"was killed by {name}"


def crash_reason(records: list[dict], failures: list[dict], returncode: int) -> str:
    """Why a worker group crashed, the worker that failed first leading: one that ended
    without a word (killed by a signal; torchrun says how), else the earliest exit record (a
    worker that raised writes its record before it exits and closes its connections; the
    others' errors on those connections come after), each named by its rank where the
    ranks tell different stories."""
    latest = max((r.get("restart", 0) for r in records), default=0)
    recorded = {r["rank"] for r in records if r.get("restart", 0) == latest}
    crashes = sorted((r for r in records if r["class"] == FailureClass.RETRYABLE
                      and r.get("restart", 0) == latest), key=lambda r: r.get("time", 0.0))
    silent = next((f for f in failures if f["rank"] not in recorded), None)
    if silent is not None:
        reason = f"rank {silent['rank']} {_how_it_ended(silent['exit_code'])}"
        if crashes:
            reason += f"; rank {crashes[0]['rank']} then failed: {crashes[0]['reason']}"
        return reason
    if not crashes:
        return f"a worker died (torchrun exit {returncode})"
    first = crashes[0]
    if all(r["reason"] == first["reason"] for r in crashes):
        return first["reason"]
    return f"rank {first['rank']}: {first['reason']}"


# How a scheduler says it ended a job, when that explains the attempt's end better than the
# workers can (they saw only a SIGTERM, or nothing: killed with their node).
SCHEDULER_ENDINGS = {
    "NODE_FAIL": (FailureClass.NODE_LOST, "the scheduler lost a node of the job (NODE_FAIL)"),
    "OUT_OF_MEMORY": (FailureClass.OOM, "the scheduler killed the job out of memory"),
    "TIMEOUT": (FailureClass.RETRYABLE, "the job reached its time limit (launch.slurm.time)"),
    "PREEMPTED": (FailureClass.RETRYABLE, "the scheduler preempted the job"),
    "BOOT_FAIL": (FailureClass.NODE_LOST, "a node of the job failed to boot (BOOT_FAIL)"),
    # infra.launchers: a local or ssh node's agent vanished; a Kubernetes pod evicted or its
    # node gone.
    "NODE_LOST": (FailureClass.NODE_LOST, "a node was lost: its torchrun agent vanished (the "
                  "host died, the process was killed, or its connection dropped) or the "
                  "scheduler evicted its pod"),
}


def classify(run_dir, attempt: str, returncode: int, hung: bool, wall: float,
             scheduler_state: str | None = None,
             worker_failures: list[dict] = ()) -> AttemptResult:
    """The attempt's failure class from how it ended, what the scheduler says of it (Slurm's
    job state) and the ranks' exit records: the most specific record wins, then the
    scheduler's word; an exit nothing explains is a crash, retried, its reason led by the
    worker that failed first (`worker_failures`: torchrun's word, TorchrunOutput.failures)."""
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
                    FailureClass.CORRUPT_CHECKPOINT, FailureClass.ROLLBACK, FailureClass.ORPHANED):
        reason = next((r["reason"] for r in records if r["class"] == failure), None)
        if reason is not None:
            return result(failure, reason)
    if scheduler_state in SCHEDULER_ENDINGS:
        return result(*SCHEDULER_ENDINGS[scheduler_state])
    if scheduler_state == "CANCELLED":  # preemption is PREEMPTED; this was scancel
        return result(FailureClass.CANCELLED, (
            "the scheduler's job was cancelled (scancel, by its owner or an administrator)"
            + (" before any worker ran" if not records else
               ", the workers saving an emergency checkpoint first") + ": not retried"))
    return result(FailureClass.RETRYABLE, crash_reason(records, list(worker_failures), returncode))
