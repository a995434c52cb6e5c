"""How a save or a load fails: the errors the trainer turns into failure classes.

DCP gathers every rank's error of a collective save or load into one CheckpointException (a
BaseException); `causes` and `describe` look inside it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

# DCP gathers every rank's error into a CheckpointException, which is a BaseException.
SAVE_ERRORS = (Exception, CheckpointException)


class CheckpointFailed(RuntimeError):
    """A save did not complete (it is never committed). `disk_full` when the cause was ENOSPC:
    retrying cannot help until someone frees space, so that class is not retried."""

    def __init__(self, message: str, disk_full: bool = False, writes_stuck: bool = False):
        super().__init__(message)
        self.disk_full = disk_full
        # A write of this rank is blocked in a collective with a rank whose save failed
        # earlier: its (non-daemon) thread would keep the process from exiting.
        self.writes_stuck = writes_stuck


def causes(error: BaseException) -> list[BaseException]:
    """The underlying errors: DCP gathers each rank's into one CheckpointException."""
    if isinstance(error, CheckpointException):
        return [exc for exc, _trace in error.failures.values()]
    return [error]


def describe(error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                         for rank, (exc, _trace) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def is_disk_full(error: BaseException, path: Path) -> bool:
    """ENOSPC somewhere in the error, or (as torch.save's zip writer turns ENOSPC into a bare
    RuntimeError) less than 1 MiB left on the checkpoint filesystem after the failure."""
    try:
        stats = os.statvfs(path.parent)
        if stats.f_bavail * stats.f_frsize < 1 << 20:
            return True
    except OSError:
        pass
    for cause in causes(error):
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                return True
            cause = cause.__cause__ or cause.__context__
    return False


class CheckpointCorrupt(Exception):
    """A file of a committed checkpoint no longer matches its manifest when a rank loads it:
    damaged after validation (disk, a stray write) or in the store. Never loaded; the launch
    task sets that copy aside and the next attempt resumes from another."""

    def __init__(self, step: int, source: str, reason: str, from_store: bool):
        super().__init__(f"checkpoint step {step} at {source}: {reason}")
        self.step, self.source, self.reason, self.from_store = step, source, reason, from_store

    def __reduce__(self):  # DCP pickles each rank's error to every rank
        return type(self), (self.step, self.source, self.reason, self.from_store)
