"""Where a worker group starts: `--resume` resolved to a checkpoint directory, a step in the
store, or nothing. Rank 0 decides and broadcasts, so every rank loads the same checkpoint.

`validated` asks storage.ledger.choose_resume, the one answer the flow and the evaluation
get too. After an in-job restart (torchrun --max-restarts) the workers first wait, up to
`wait_s`, for the validate task's verdict on checkpoints committed before the failure, so
that they resume from the newest good one rather than an older one, and never from a copy
nobody has verified.
"""

from __future__ import annotations

import time

from core.errors import ConfigError
from core.protocol import ResumeSpec, RunDir, is_committed
from storage.ledger import Ledger, choose_resume, unjudged_copies
from training.distributed import decided_by_rank_0
from training.logs import get_logger

log = get_logger("train")


def resolve_resume(start: ResumeSpec, run_dir: RunDir, wait_s: float = 0.0) -> ResumeSpec | None:
    """`start` as a location to load (a directory or a store step); None: from scratch."""
    if start.kind == "scratch":
        return None
    if start.kind == "newest_committed":
        def newest_committed() -> ResumeSpec | None:
            committed = run_dir.committed_checkpoints()
            return ResumeSpec.directory(committed[-1]) if committed else None
        return decided_by_rank_0(newest_committed)
    if start.kind == "validated":
        return decided_by_rank_0(lambda: newest_validated(run_dir, wait_s))
    if start.kind == "directory" and not is_committed(start.path):
        raise ConfigError(f"--resume {start}: no committed checkpoint there (a step-XXXXXXXX "
                          "directory with a manifest.json)")
    return start


def newest_validated(run_dir: RunDir, wait_s: float) -> ResumeSpec | None:
    """choose_resume, once the checkpoints committed on local disk and newer than its answer
    have a verdict (or `wait_s` has passed)."""
    ledger = Ledger(run_dir)
    deadline, told = time.monotonic() + wait_s, False
    while True:
        data = ledger.read()
        point = choose_resume(run_dir, data)
        pending = [s for s in unjudged_copies(run_dir, data) if point is None or s > point.step]
        if not pending or time.monotonic() >= deadline:
            break
        if not told:
            log.info("waiting up to %.0fs for the verdict on checkpoint(s) %s before resuming",
                     wait_s, pending)
            told = True
        time.sleep(0.5)
    if pending:
        log.info("no verdict yet on checkpoint(s) %s: not resuming from them", pending)
    return point.spec if point is not None else None
