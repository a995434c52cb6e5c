"""Logging in the workers: `[component] message` lines, rank-aware.

Loggers are named `goodput.<component>` (train, checkpoint, faults, eval) and print as
`[train] ...`: informational lines on stdout, warnings and errors on stderr. Under the
launchers torchrun prefixes each line with `[node<i> rank<r>]`; without that prefix (a
torchrun started by hand) the rank is written into the line when there is more than one.
"""

from __future__ import annotations

import logging
import os
import sys


def get_logger(component: str) -> logging.Logger:
    return logging.getLogger(f"goodput.{component}")


class _WorkerFormatter(logging.Formatter):
    def __init__(self, rank_prefix: str):
        super().__init__()
        self.rank_prefix = rank_prefix

    def format(self, record: logging.LogRecord) -> str:
        component = record.name.removeprefix("goodput.")
        text = f"{self.rank_prefix}[{component}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def setup_worker_logging(rank: int | None = None, also: tuple[str, ...] = ()) -> None:
    """Route the `goodput.*` loggers of this process, and those named in `also`, to
    stdout/stderr (idempotent)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    prefixed = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" in os.environ
    formatter = _WorkerFormatter(f"[rank{rank}] " if several and not prefixed else "")
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_Below(logging.WARNING))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(formatter)
    for name in ("goodput", *also):
        root = logging.getLogger(name)
        root.handlers[:] = [out, err]
        root.setLevel(logging.INFO)
        root.propagate = False
