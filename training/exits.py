"""The exit-code contract of `python -m training` (shared/DESIGN.md, section 3).

torchrun reports only that a worker failed, not how, so each worker also leaves an exit
record (`<run_dir>/attempts/<attempt>/rank-<r>.json`) that the launch task reads to tell
failure classes apart.

torchrun may restart the workers within an attempt (launch.max_restarts). A rank's record
then holds how its latest run ended, with `restart` = TORCHELASTIC_RESTART_COUNT of its
node; `starts.jsonl` gets one line per start of the worker group (global rank 0 writes it),
so the number of in-job restarts is counted across nodes too (a node restarted because
another one failed keeps its own restart count). A failure class a restart cannot fix
(`NOT_RESTARTABLE`) ends the attempt: restarted workers find its record and exit at once
with the same code, and the launch task decides what comes next.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

DONE = 0
CONFIG_ERROR = 2  # never retried
RETRYABLE = 75  # crash, communication timeout, preemption after an emergency save
ROLLBACK = 76  # non-finite loss or loss spike: resume from an earlier checkpoint

CLASS_OF_CODE = {DONE: "done", CONFIG_ERROR: "config", RETRYABLE: "retryable", ROLLBACK: "rollback"}
# Restarting in-job cannot help these: the same inputs, the same data window (a rollback
# must first record the window to skip), the same memory, the same full disk, the same
# damaged checkpoint (the launch task must first set it aside).
NOT_RESTARTABLE = ("config", "rollback", "oom", "disk_full", "corrupt_checkpoint")
STARTS_FILE = "starts.jsonl"


def attempt_dir(run_dir: str | Path, attempt: int | str) -> Path:
    return Path(run_dir) / "attempts" / f"attempt-{attempt}"


def write_exit_record(run_dir: str | Path, attempt: int | str, rank: int, code: int,
                      reason: str, step: int | None, failure_class: str | None = None,
                      **details) -> None:
    directory = attempt_dir(run_dir, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "code": code,
              "class": failure_class or CLASS_OF_CODE.get(code, "unknown"),
              "reason": reason, "step": step, "time": time.time(), "pid": os.getpid(),
              "restart": restart_count(), **details}
    # Atomically: restarted workers and the launch task read these while others write.
    path = directory / f"rank-{rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_exit_records(run_dir: str | Path, attempt: int | str) -> list[dict]:
    directory = attempt_dir(run_dir, attempt)
    if not directory.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank-*.json"))]


def restart_count() -> int:
    """How often torchrun restarted this node's workers in the current job (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_blocker(run_dir: str | Path, attempt: int | str) -> dict | None:
    """The exit record, from an earlier run of this attempt's workers, of a failure that an
    in-job restart cannot fix; None when the workers may (re)start."""
    return next((r for r in read_exit_records(run_dir, attempt) if r["class"] in NOT_RESTARTABLE),
                None)


def record_start(run_dir: str | Path, attempt: int | str, fresh: bool = False) -> int:
    """Note a start of the worker group (call on global rank 0); returns how many came before.
    `fresh`: a new job reusing the attempt id (plain runs all use "0"): forget earlier starts."""
    directory = attempt_dir(run_dir, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    if fresh:
        (directory / STARTS_FILE).unlink(missing_ok=True)
    before = len(read_starts(run_dir, attempt))
    line = {"start": before, "restart": restart_count(), "time": time.time(), "pid": os.getpid(),
            "node": int(os.environ.get("GROUP_RANK", "0"))}
    with open(directory / STARTS_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")
    return before


def read_starts(run_dir: str | Path, attempt: int | str) -> list[dict]:
    path = attempt_dir(run_dir, attempt) / STARTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def in_job_restarts(run_dir: str | Path, attempt: int | str) -> int:
    """Worker-group restarts within the attempt (after a start, before the first step too)."""
    return max(0, len(read_starts(run_dir, attempt)) - 1)
