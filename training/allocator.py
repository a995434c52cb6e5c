"""glibc's malloc thresholds for a training process, fixed before the first step.

By default glibc serves a large block (a step's activations, gradients) with a fresh mapping
and raises its mmap threshold as such blocks are freed, so whether a step's tensors come
from the heap or from new zero-filled pages depends on the process's allocation history:
a trainer and a bare loop over the same model took 92,000 against 41,000 minor page faults
per step, and the trainer ran at 0.78-0.93x the bare loop's speed on CPU
(benchmarks/RESULTS.md, "Trainer throughput"). Fixed thresholds keep freed memory in the
process for the next step (its peak recurs every step anyway).
"""

from __future__ import annotations

import ctypes
import os

THRESHOLD_BYTES = 1 << 30
# The same settings as environment variables, for a process glibc starts with them.
THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD_BYTES)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def keep_freed_memory() -> bool:
    """Fix this process's mmap and trim thresholds at THRESHOLD_BYTES (mallopt), unless its
    environment sets either (launch.env: the user's choice wins). False where the C library
    is not glibc."""
    if any(name in os.environ for name in THRESHOLD_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl, macOS: their allocators are left as they are
        return False


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim): for a process that
    goes idle after a peak, such as a verifier between checkpoints. False where the C library
    is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
