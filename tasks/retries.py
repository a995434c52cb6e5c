"""Retry conditions the tasks share (Prefect's `retry_condition_fn`)."""

from __future__ import annotations

import errno

from core.errors import ConfigError, DataError
from goodput.data.unit_processes import UnitProcessesCannotStart, UnitsStopped

_NOT_TRANSIENT = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS}


def retry_if_transient(task, task_run, state) -> bool:
    """Bad input (DataError, ConfigError), refused credentials, a full or read-only disk, and
    work units stopped on purpose (Ctrl-C) or with no process to run in, fail at once; other
    errors (a network filesystem, the store, a vanished object) are worth a retry."""
    try:
        state.result()
    except (DataError, ConfigError, PermissionError, UnitsStopped, UnitProcessesCannotStart):
        return False
    except OSError as e:
        return e.errno not in _NOT_TRANSIENT
    except Exception:
        return True
    return True
