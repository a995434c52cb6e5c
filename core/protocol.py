"""The contract between the supervisor (the launch task) and the workers (`python -m training`).

Everything the two sides exchange is here:

- `RunDir`: every path of a run directory, which both sides read and write.
- `FailureClass`: how an attempt ended. Each class carries the workers' exit code, whether
  an in-job restart (torchrun --max-restarts) can help, its default retry budget and what
  the user can do about it.
- `ResumeSpec`: where the workers start (the `--resume` argument).
- The files they leave for each other: each rank's exit record, the worker group's starts,
  rank 0's heartbeat; and the environment the supervisor sets for the workers.

torchrun reports only that a worker failed, not how, so each worker leaves an exit record
(`attempts/attempt-<id>/rank-<r>.json`). torchrun may restart the workers within an attempt:
a rank's record then holds how its latest run ended, and `starts.jsonl` gets a line per start
of the worker group, so restarts are counted across nodes too. A failure class a restart
cannot fix ends the attempt: restarted workers find its record and exit at once with its code.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from core.files import exclusive_lock, sha256_bytes

# -- the run directory ----------------------------------------------------------------------

CHECKPOINT_MANIFEST = "manifest.json"  # written last: a checkpoint directory without it is debris
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class RunDir:
    """Every path of one run's directory (`<run.runs_dir>/<run.run_id>/`).

        config.yaml      the resolved RunConfig the workers read
        init_from.json   a sample of model.init_from's weights when the run started
        checkpoints/     step-XXXXXXXX/ (DCP + manifest.json), rejected/, superseded/,
                         .from-store/ (files fetched to resume from the store)
        ledger.json      checkpoint states (mirrored to the store)
        metrics.jsonl    rank 0, one line per logged step;  heartbeat.json  its latest step
        lease.json       who supervises the run (a flow run), renewed while it lives
        attempts/        per attempt: exit records, starts, outcome, torchrun's logs
        faults/          markers of injected faults that fired (each fires once per run)
        eval/            step-XXXXXXXX.json reports
        profiles/        step-A-B/rank<r>.trace.json.gz and .top.txt (profiling.steps)
        summary.json     what the stages produced, wall time per stage
    """

    path: Path

    @classmethod
    def of(cls, where: RunDir | str | os.PathLike) -> RunDir:
        return where if isinstance(where, RunDir) else cls(Path(where))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def init_from_record(self) -> Path:
        """model.init_from's weights when the run started (goodput.runs.write_run_config)."""
        return self.path / "init_from.json"

    @property
    def ledger_file(self) -> Path:
        return self.path / "ledger.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def heartbeat_file(self) -> Path:
        return self.path / "heartbeat.json"

    @property
    def lease_file(self) -> Path:
        """Who is in charge of the run (a flow run, or an attempt), renewed while it lives."""
        return self.path / "lease.json"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def loss_curve(self) -> Path:
        return self.path / "loss_curve.png"

    @property
    def fault_markers(self) -> Path:
        return self.path / "faults"

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"

    def eval_report(self, step: int) -> Path:
        return self.eval_dir / f"step-{step:08d}.json"

    def profile_dir(self, first: int, last: int) -> Path:
        """The profile of steps first..last (training.profiling), a file per rank."""
        return self.path / "profiles" / f"step-{first}-{last}"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"

    def holds_checkpoint(self, path: str | os.PathLike) -> bool:
        """Whether `path` is one of this run's checkpoint directories (checkpoints/step-N),
        on this machine or not: another run's, or a directory elsewhere, is not."""
        return Path(path).resolve().parent == self.checkpoints.resolve()

    def aside(self, kind: str) -> Path:
        """Where copies moved out of reach of resume are kept: 'rejected' or 'superseded'."""
        return self.checkpoints / kind

    def fetched_from_store(self, step: int) -> Path:
        """The files of checkpoint `step` that this node's workers fetched from the store."""
        return self.checkpoints / ".from-store" / f"step-{step:08d}"

    def committed_checkpoints(self) -> list[Path]:
        """Checkpoint directories with a manifest, oldest first. Others are crash debris."""
        if not self.checkpoints.is_dir():
            return []
        found = [p for p in self.checkpoints.iterdir()
                 if p.is_dir() and _STEP_DIR.match(p.name) and is_committed(p)]
        return sorted(found, key=step_of)

    @property
    def attempts(self) -> Path:
        return self.path / "attempts"

    def attempt(self, attempt: int | str) -> Path:
        return self.attempts / f"attempt-{attempt}"


def step_of(path: str | os.PathLike) -> int:
    """The step of a checkpoint directory `step-XXXXXXXX`."""
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory (expected step-XXXXXXXX)")
    return int(match.group(1))


def is_committed(path: str | os.PathLike) -> bool:
    return (Path(path) / CHECKPOINT_MANIFEST).is_file()


def checkpoint_lock(path: str | os.PathLike):
    """Exclusive lock on the checkpoint directory `path` (a file beside it): the flow's
    validation, upload and download of a step, and the trainer moving a committed copy of
    it aside to save the step again, never overlap."""
    path = Path(path)
    return exclusive_lock(path.parent / f".{path.name}.lock")


def set_aside(path: str | os.PathLike, kind: str) -> Path | None:
    """Move a checkpoint directory out of reach of resume into `checkpoints/<kind>/`
    ('rejected', 'superseded'), kept for inspection; returns where it went (None when there
    was nothing to move)."""
    path = Path(path)
    if not path.exists():
        return None
    aside = path.parent / kind / f"{path.name}-{time.time_ns()}"
    aside.parent.mkdir(parents=True, exist_ok=True)
    path.rename(aside)
    return aside


def copy_id(path: str | os.PathLike) -> str | None:
    """Identity of the committed copy at `path` (None: not committed): a save of the same
    step again is another copy, judged and uploaded on its own."""
    manifest = Path(path) / CHECKPOINT_MANIFEST
    return copy_id_of_manifest(manifest.read_bytes()) if manifest.is_file() else None


def copy_id_of_manifest(raw: bytes) -> str:
    """copy_id of the copy whose manifest file holds `raw` (the store's copy, say)."""
    return sha256_bytes(raw)[:16]


# -- failure classes ------------------------------------------------------------------------

@dataclass(frozen=True)
class _ClassFacts:
    exit_code: int | None  # the workers' exit code (None: decided by the supervisor)
    restartable: bool  # an in-job restart of the workers can help
    default_budget: int  # retries of the launch task, unless run.retry_budgets says otherwise
    hint: str  # what the user can do once the retries are spent


class FailureClass(str, Enum):
    """How an attempt ended. The value is what records and events carry ("retryable")."""

    DONE = "done"
    CONFIG = "config"  # bad configuration or data: never retried
    RETRYABLE = "retryable"  # crash, communication timeout, preemption after an emergency save
    ROLLBACK = "rollback"  # non-finite loss or a loss spike: resume before it, skip its data
    HANG = "hang"  # no heartbeat for too long: the supervisor killed the job
    OOM = "oom"
    DISK_FULL = "disk_full"  # a checkpoint write hit ENOSPC
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # the checkpoint to resume from fails its checksums
    CANCELLED = "cancelled"  # a user or the orchestrator stopped the attempt: not a failure
    NODE_LOST = "node_lost"  # the scheduler lost a node (Slurm NODE_FAIL): a new allocation helps
    ORPHANED = "orphaned"  # the supervisor is gone: the workers saved and stopped by themselves

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def facts(self) -> _ClassFacts:
        return _FACTS[self]

    @property
    def exit_code(self) -> int | None:
        return self.facts.exit_code

    @property
    def restartable(self) -> bool:
        return self.facts.restartable

    @property
    def default_budget(self) -> int:
        return self.facts.default_budget

    @property
    def hint(self) -> str:
        return self.facts.hint

    @classmethod
    def named(cls, value: str) -> FailureClass | None:
        """The class a record names; None for one this version does not know."""
        try:
            return cls(value)
        except ValueError:
            return None

    @classmethod
    def of_exit_code(cls, code: int) -> FailureClass:
        """The class a bare exit code stands for (no record says more): any code that is not
        the contract's is a crash, retried."""
        return {0: cls.DONE, 2: cls.CONFIG, 76: cls.ROLLBACK}.get(code, cls.RETRYABLE)


_RETRYABLE_CODE = 75  # sysexits' EX_TEMPFAIL; classes the record tells apart share it
_FACTS = {
    FailureClass.DONE: _ClassFacts(0, False, 0, ""),
    FailureClass.CONFIG: _ClassFacts(2, False, 0, "configuration or data error: fix the input and rerun"),
    FailureClass.RETRYABLE: _ClassFacts(_RETRYABLE_CODE, True, 4, ""),
    FailureClass.ROLLBACK: _ClassFacts(76, False, 3, ""),  # the window to skip is recorded first
    FailureClass.HANG: _ClassFacts(None, False, 2, ""),
    FailureClass.OOM: _ClassFacts(_RETRYABLE_CODE, False, 0, (
        "lower training.micro_batch_size, or shard more (parallelism.dp_shard, "
        "activation_checkpointing); `goodput plan` estimates memory")),
    FailureClass.DISK_FULL: _ClassFacts(_RETRYABLE_CODE, False, 0, (
        "the checkpoint disk is full: free space on it, lower checkpoint.keep_local or "
        "checkpoint.keep_aside, or move run.runs_dir to a larger disk; committed checkpoints "
        "are intact")),
    # The launch task sets the damaged copy aside before the retry, which resumes elsewhere.
    FailureClass.CORRUPT_CHECKPOINT: _ClassFacts(_RETRYABLE_CODE, False, 2, ""),
    FailureClass.CANCELLED: _ClassFacts(None, False, 0, ""),
    # Not restartable: workers restarted in-job would train on unwatched.
    FailureClass.ORPHANED: _ClassFacts(_RETRYABLE_CODE, False, 4, ""),
    FailureClass.NODE_LOST: _ClassFacts(None, False, 4, (
        "nodes keep failing under the job: look at the scheduler's reasons (Slurm: sinfo -R) "
        "and keep the bad nodes out (launch.slurm.extra_sbatch=['--exclude=NODE'])")),
}

# The classes a retry budget applies to (run.retry_budgets); "unknown" is the budget of a
# class this version does not know (an outcome record written by another one).
DEFAULT_RETRY_BUDGETS = {**{c.value: c.default_budget for c in FailureClass
                            if c not in (FailureClass.DONE, FailureClass.CONFIG, FailureClass.CANCELLED)},
                         "unknown": 1}


# -- where the workers start -----------------------------------------------------------------

@dataclass(frozen=True)
class ResumeSpec:
    """The workers' `--resume`: where training starts.

    - `scratch()`            no checkpoint ('none')
    - `newest_committed()`   the newest committed checkpoint of the run ('auto'; for plain
                             torchrun use without the orchestrator)
    - `directory(path)`      that checkpoint directory
    - `store(step)`          the uploaded checkpoint of `step`, read straight from the store,
                             each rank fetching only the files its part of the state is in
    - `validated()`          the newest checkpoint the run's ledger marks validated that this
                             machine can read (local copy or the store's): what the launch task
                             passes, so that workers torchrun restarts in-job resume from what
                             was validated since, never from a copy nobody has verified
    """

    kind: str  # "scratch" | "newest_committed" | "directory" | "store" | "validated"
    path: Path | None = None
    step: int | None = None

    @classmethod
    def scratch(cls) -> ResumeSpec:
        return cls("scratch")

    @classmethod
    def newest_committed(cls) -> ResumeSpec:
        return cls("newest_committed")

    @classmethod
    def directory(cls, path: str | os.PathLike) -> ResumeSpec:
        return cls("directory", path=Path(path))

    @classmethod
    def store(cls, step: int) -> ResumeSpec:
        return cls("store", step=step)

    @classmethod
    def validated(cls) -> ResumeSpec:
        return cls("validated")

    @classmethod
    def parse(cls, text: str) -> ResumeSpec:
        """The command-line form: none | auto | validated | store:STEP | a directory."""
        if text == "none":
            return cls.scratch()
        if text == "auto":
            return cls.newest_committed()
        if text == "validated":
            return cls.validated()
        if text.startswith("store:"):
            try:
                return cls.store(int(text.removeprefix("store:")))
            except ValueError:
                raise ValueError(f"--resume {text}: expected store:STEP with an integer step") from None
        return cls.directory(text)

    def __str__(self) -> str:
        return {"scratch": "none", "newest_committed": "auto", "validated": "validated",
                "store": f"store:{self.step}", "directory": str(self.path)}[self.kind]


# -- the environment the supervisor gives the workers ----------------------------------------

ENV_ATTEMPT = "GOODPUT_ATTEMPT"  # the launch task's attempt id (plain runs: "0")
ENV_RUN_DIR = "GOODPUT_RUN_DIR"  # where to leave the exit record even when the config fails to load
ENV_RESTART_WAIT_S = "GOODPUT_RESTART_WAIT_S"  # after an in-job restart: wait for pending verdicts
ENV_MTBF_S = "GOODPUT_MTBF_S"  # the run's MTBF so far, for checkpoint.interval=auto
# A flow run's time limit (Unix time): from then on the trainer saves a checkpoint at its next
# step and stops, exiting as done before max_steps (the next flow run continues from it).
ENV_STOP_AFTER = "GOODPUT_STOP_AFTER"
# Who holds the run's lease for these workers (a flow run, or the attempt itself), and how
# long without a renewal of it before they stop by themselves: their supervisor is gone.
ENV_LEASE_HOLDER = "GOODPUT_LEASE_HOLDER"
ENV_ORPHAN_AFTER_S = "GOODPUT_ORPHAN_AFTER_S"
TIME_LIMIT = "time limit"  # the reason in such an attempt's exit records and outcome


def attempt_of_worker() -> str:
    return os.environ.get(ENV_ATTEMPT, "0")


def supervised() -> bool:
    """Started by the launch task (attempt ids are unique), not by hand (plain runs reuse "0")."""
    return ENV_ATTEMPT in os.environ


def restart_count() -> int:
    """How often torchrun restarted this node's workers in the current job (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# -- the files the two sides exchange -------------------------------------------------------

STARTS_FILE = "starts.jsonl"


def _write_json_atomically(path: Path, record: dict) -> None:
    # Restarted workers and the launch task read these while others write them.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def write_exit_record(run_dir: RunDir | Path, attempt: int | str, rank: int,
                      failure: FailureClass, reason: str, step: int | None, **details) -> None:
    """How this rank's run ended; the exit code it returns is `failure.exit_code`."""
    directory = RunDir.of(run_dir).attempt(attempt)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "code": failure.exit_code, "class": failure.value,
              "reason": reason, "step": step, "time": time.time(), "pid": os.getpid(),
              "restart": restart_count(), **details}
    _write_json_atomically(directory / f"rank-{rank}.json", record)


def read_exit_records(run_dir: RunDir | Path, attempt: int | str) -> list[dict]:
    directory = RunDir.of(run_dir).attempt(attempt)
    if not directory.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank-*.json"))]


def restart_blocker(run_dir: RunDir | Path, attempt: int | str) -> dict | None:
    """The exit record, from an earlier run of this attempt's workers, of a failure that an
    in-job restart cannot fix; None when the workers may (re)start. (A class this version
    does not know blocks too: the launch task decides.)"""
    def blocks(value: str) -> bool:
        failure = FailureClass.named(value)
        return failure is not FailureClass.DONE and not (failure and failure.restartable)

    return next((r for r in read_exit_records(run_dir, attempt) if blocks(r["class"])), None)


def record_start(run_dir: RunDir | Path, attempt: int | str, fresh: bool = False) -> int:
    """Note a start of the worker group (call on global rank 0); returns how many came before.
    `fresh`: a new job reusing the attempt id (plain runs all use "0"): forget earlier starts."""
    directory = RunDir.of(run_dir).attempt(attempt)
    directory.mkdir(parents=True, exist_ok=True)
    if fresh:
        (directory / STARTS_FILE).unlink(missing_ok=True)
    before = len(read_starts(run_dir, attempt))
    line = {"start": before, "restart": restart_count(), "time": time.time(), "pid": os.getpid(),
            "node": int(os.environ.get("GROUP_RANK", "0")),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),  # an elastic job's changes
            "holder": os.environ.get(ENV_LEASE_HOLDER)}  # who supervises: None for a plain run
    with open(directory / STARTS_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")
    return before


def read_starts(run_dir: RunDir | Path, attempt: int | str) -> list[dict]:
    """The starts recorded so far; a last line still being appended (no newline yet, as a
    reader polling it may see on a shared filesystem) is not one yet."""
    path = RunDir.of(run_dir).attempt(attempt) / STARTS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def in_job_restarts(run_dir: RunDir | Path, attempt: int | str) -> int:
    """Worker-group restarts within the attempt (after a start, before the first step too)."""
    return max(0, len(read_starts(run_dir, attempt)) - 1)


def write_heartbeat(run_dir: RunDir | Path, **fields) -> None:
    """Rank 0, every step (and at a start, and before a save): the supervisor tells a slow
    attempt from a hung one by it. `phase`: 'startup', 'step' or 'checkpoint'. It also says
    where its workers run (workers_gone)."""
    _write_json_atomically(RunDir.of(run_dir).heartbeat_file,
                           {**fields, "time": time.time(), "pid": os.getpid(), **_where_workers_run()})


@functools.lru_cache(maxsize=1)
def _where_workers_run() -> dict:
    import socket

    return {"host": socket.gethostname(), "pid_space": _pid_space(), "agent_pid": os.getppid(),
            # every worker on this one machine (torchrun's LOCAL_WORLD_SIZE is all of them)
            "one_machine": os.environ.get("WORLD_SIZE", "1") == os.environ.get("LOCAL_WORLD_SIZE", "1")}


def workers_gone(beat: dict) -> bool:
    """Whether the workers that wrote heartbeat `beat` are known to be dead: they all ran on
    this machine (as this process sees its pids), and rank 0 and its torchrun agent are gone
    (the kernel kills an agent's workers with it: training.__main__.die_with_agent). After
    a kill -9 of a whole training the next waited launch.orphan_timeout_s for them."""
    return (bool(beat.get("one_machine")) and isinstance(beat.get("agent_pid"), int)
            and lease_holder_gone(beat) and lease_holder_gone({**beat, "pid": beat["agent_pid"]}))


def read_heartbeat(run_dir: RunDir | Path) -> dict | None:
    try:
        return json.loads(RunDir.of(run_dir).heartbeat_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# -- the run's lease: one supervisor, and no workers without one ------------------------------

def write_lease(run_dir: RunDir | Path, holder: str, released: bool = False,
                since: float | None = None, orphan_after_s: float | None = None) -> None:
    """`holder` (a flow run, or an attempt) is in charge of the run: renewed while it lives,
    or let go of (`released`); `since`: when it took the lease (default now);
    `orphan_after_s`: the holder's launch.orphan_timeout_s, which its workers go by."""
    import socket

    now = time.time()
    _write_json_atomically(RunDir.of(run_dir).lease_file,
                           {"holder": holder, "pid": os.getpid(), "host": socket.gethostname(),
                            "pid_space": _pid_space(), "time": now,
                            "since": now if since is None else since,
                            "released": released, "orphan_after_s": orphan_after_s})


def _pid_space() -> str | None:
    """Which pids a process sees: this boot of this kernel and this pid namespace (containers
    sharing a host name, or a network namespace, need not share their pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def lease_holder_gone(lease: dict) -> bool:
    """Whether the process that holds `lease` is known to be dead: it ran where this process
    sees the same pids (same host, boot and pid namespace) and its pid is gone. (A pid reused
    since reads as alive: the lease then runs out as usual.)"""
    import socket

    import psutil

    here = _pid_space()
    if lease.get("host") != socket.gethostname() or here is None or lease.get("pid_space") != here:
        return False
    return isinstance(lease.get("pid"), int) and not psutil.pid_exists(lease["pid"])


def read_lease(run_dir: RunDir | Path) -> dict | None:
    try:
        return json.loads(RunDir.of(run_dir).lease_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class LeaseWatch:
    """A worker's view of its supervisor, the run lease's `holder`: `orphaned()` says why
    the workers should stop — the lease not renewed for `after_s` (the supervisor died: a
    killed flow process or worker), or held by someone else — else "".

    A renewal is seen as the lease changing, timed by this process's own clock, so the
    supervisor's clock (maybe another host's) does not matter. Reads at most every
    `every_s`."""

    def __init__(self, run_dir: RunDir | Path, holder: str, after_s: float, every_s: float = 2.0):
        self.run_dir, self.holder, self.after_s, self.every_s = run_dir, holder, after_s, every_s
        self.seen: dict | None = None
        self.renewed_at = self.read_at = time.monotonic()

    def orphaned(self) -> str:
        now = time.monotonic()
        if now - self.read_at >= self.every_s:
            self.read_at = now
            lease = read_lease(self.run_dir)
            if lease is not None and lease != self.seen:
                self.seen, self.renewed_at = lease, now
            if lease is not None and lease["holder"] != self.holder:
                return f"{lease['holder']} took charge of the run"
        if now - self.renewed_at > self.after_s:
            return (f"no word from the supervisor for {now - self.renewed_at:.0f}s "
                    "(launch.orphan_timeout_s): it is gone")
        return ""


# -- a request to a process that imported first and serves when asked -----------------------
# (the verifier's `--serve`, goodput.verifier_pool; the evaluation's `--when-told`,
# goodput.evaluation): one JSON line, the options its main() parses and the directory its
# relative paths mean something in.

def request_line(argv: list[str]) -> str:
    """The request for `argv`, made in this process's working directory."""
    return json.dumps({"cwd": os.getcwd(), "argv": argv}) + "\n"


def take_request(line: str) -> list[str]:
    """The options of a request_line, once in the working directory it was made in."""
    request = json.loads(line)
    os.chdir(request["cwd"])
    return request["argv"]
