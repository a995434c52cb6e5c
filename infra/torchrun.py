"""Start `torchrun ... -m training` and supervise it until it ends.

The supervisor streams the workers' output line by line to a callback (the Prefect run
log), watches rank 0's heartbeat to catch a hung job, kills the whole process tree on
hang, cancel or error, and turns the exit into a failure class the launch task maps to
a retry decision (codes in training/exits.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from goodput.config import RunConfig
from training import exits
from training.metrics import read_heartbeat


class TrainingFailed(RuntimeError):
    """An attempt that ended without finishing; `failure_class` says what to do about it."""

    def __init__(self, message: str, failure_class: str, step: int | None = None):
        super().__init__(message)
        self.failure_class = failure_class
        self.step = step


@dataclass
class AttemptResult:
    exit_code: int
    failure_class: str  # done | retryable | rollback | config | hang
    reason: str
    step: int | None
    wall_time_s: float
    records: list[dict] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(config: RunConfig, config_path: Path, dataset_dir: Path,
                     resume: Path | None, rdzv_endpoint: str) -> list[str]:
    """The torchrun command line for one node (every node runs the same line)."""
    par = config.parallelism
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={par.nnodes}",
        f"--nproc-per-node={par.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={config.run.run_id}",
        "--max-restarts=0",  # the launch task's retries resume from a *validated* checkpoint
        "-m", "training",
        "--config", str(config_path),
        "--dataset", str(dataset_dir),
        "--resume", str(resume) if resume is not None else "none",
    ]


def worker_env(attempt: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # several workers share the cores
    env["PYTHONUNBUFFERED"] = "1"
    env["GOODPUT_ATTEMPT"] = attempt
    # A shared rendezvous TCP store made restarts flaky on one node (STACK_NOTES).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def run_attempt(config: RunConfig, config_path: Path, dataset_dir: Path, resume: Path | None,
                attempt: str, log: Callable[[str], None], poll_s: float = 0.5,
                on_progress: Callable[[dict], None] | None = None) -> AttemptResult:
    """Run one training attempt to its end; never leaves a worker process behind.

    `on_progress` receives every new heartbeat (step, loss, tokens/s, ...) as it appears.
    """
    endpoint = config.parallelism.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    cmd = torchrun_command(config, config_path, dataset_dir, resume, endpoint)
    log(f"launch attempt {attempt}: {' '.join(cmd)}")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(attempt), start_new_session=True, bufsize=1)
    reader = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
    reader.start()
    hung = False
    try:
        last_beat, last_progress = None, time.monotonic()
        while proc.poll() is None:
            time.sleep(poll_s)
            beat = read_heartbeat(config.run_dir)
            if beat is not None and beat != last_beat:
                last_beat, last_progress = beat, time.monotonic()
                if on_progress is not None:
                    on_progress(beat)
            if time.monotonic() - last_progress > config.run.hang_timeout_s:
                log(f"no training progress for {config.run.hang_timeout_s:.0f}s: killing the job")
                hung = True
                break
    finally:
        # Hang, cancellation (an exception raised into this thread) or normal end: make
        # sure no worker survives.
        kill_process_tree(proc)
        reader.join(timeout=5)
    return classify(config.run_dir, attempt, proc.returncode, hung, time.monotonic() - start)


def classify(run_dir: Path, attempt: str, returncode: int, hung: bool, wall: float) -> AttemptResult:
    records = exits.read_exit_records(run_dir, attempt)
    beat = read_heartbeat(run_dir)
    step = beat["step"] if beat else None
    if hung:
        return AttemptResult(returncode, "hang", "heartbeat stalled", step, wall, records)
    if returncode == 0:
        return AttemptResult(0, "done", "done", step, wall, records)
    classes = {r["class"] for r in records}
    for cls in ("config", "rollback"):  # the most specific verdict wins
        if cls in classes:
            reason = next(r["reason"] for r in records if r["class"] == cls)
            return AttemptResult(returncode, cls, reason, step, wall, records)
    reason = next((r["reason"] for r in records if r["class"] == "retryable"),
                  f"a worker died (torchrun exit {returncode})")
    return AttemptResult(returncode, "retryable", reason, step, wall, records)


def _pump(stream, log: Callable[[str], None]) -> None:
    for line in stream:
        log(line.rstrip())


def kill_process_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group (workers may save), then SIGKILL whatever is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # torchrun may be gone while orphaned workers still hold the group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
