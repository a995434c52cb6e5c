"""The exit-code contract of `python -m training` (shared/DESIGN.md, section 3).

torchrun reports only that a worker failed, not how, so each worker also leaves an exit
record (`<run_dir>/attempts/<attempt>/rank-<r>.json`) that the launch task reads to tell
failure classes apart.
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


def attempt_dir(run_dir: str | Path, attempt: int | str) -> Path:
    return Path(run_dir) / "attempts" / f"attempt-{attempt}"


def write_exit_record(run_dir: str | Path, attempt: int | str, rank: int, code: int,
                      reason: str, step: int | None, failure_class: str | None = None,
                      **details) -> None:
    directory = attempt_dir(run_dir, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "code": code,
              "class": failure_class or CLASS_OF_CODE.get(code, "unknown"),
              "reason": reason, "step": step, "time": time.time(), "pid": os.getpid(), **details}
    (directory / f"rank-{rank}.json").write_text(json.dumps(record))


def read_exit_records(run_dir: str | Path, attempt: int | str) -> list[dict]:
    directory = attempt_dir(run_dir, attempt)
    if not directory.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank-*.json"))]
