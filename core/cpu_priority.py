"""Work off the training path runs at the lowest CPU priority.

A background checkpoint write, the manifest's hashing, the validation reload and the upload
all run while training runs. Where the cores are busy with training (a CPU run; a GPU node
whose data loader or host code saturates it) every CPU second they take at normal priority
is a second taken from a training step. At the idle scheduling class (SCHED_IDLE, and nice
19) the scheduler gives them the cycles training leaves idle (waiting in a collective, on
the GPU, on I/O) and little more, so training keeps its pace; the background work takes
longer instead. It cannot starve for good: the next save waits for the previous one, and
while training waits nothing competes. (A thread inside the training process still shares
its interpreter lock: `checkpoint.async_mode: process` keeps the shard writing out of it.)

Priorities count within a scheduling group. On kernels with autogroups (most desktop and
many server distributions) each session is a group, and groups share the CPU evenly
whatever their threads' priorities. The local launcher starts the training workers in a
session of their own, so there the flow process's validation and upload get an even share
against them, and idle priority only makes them yield to the flow's own threads. (The
validation process stays in the flow's session: in a session of its own, a cancelled flow,
which Prefect stops by signalling its process group, would leave it running.) Where cgroups
divide the CPU (Slurm, Kubernetes), the same holds per cgroup.

Linux keeps the priority per thread, and a thread starts with its creator's, so lowering
one thread lowers the pool threads it later starts (DCP's writer threads, boto3's transfer
threads) and nothing else. A thread's priority cannot be raised back without privileges,
which is why a long-lived thread (a Prefect worker thread) hands the work to a new thread
(`at_background_priority`) instead of lowering itself.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

BACKGROUND_NICE = 19  # the lowest priority: CFS weight 15 against 1024 at nice 0

T = TypeVar("T")


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Put the calling thread (and the threads it starts from now on) at SCHED_IDLE and
    `nice`; returns whether it did. Only on Linux: elsewhere the call would renice a
    whole process (or another one whose id happens to equal the thread id)."""
    if sys.platform != "linux":
        return False
    thread = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, thread) < nice:
            os.setpriority(os.PRIO_PROCESS, thread, nice)
        # SCHED_IDLE on top: a waking training thread preempts it at once, where a nice-19
        # thread may first finish its time slice (EEVDF), delaying every wake-up from a
        # collective by up to a few milliseconds.
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError:  # a sandbox that forbids it: the work still runs, at normal priority
        return False


def at_background_priority(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run `fn(*args, **kwargs)` in a new thread at background priority and return its result
    (or raise its exception); the calling thread keeps its own priority."""
    outcome: dict = {}

    def run() -> None:
        lower_thread_priority()
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller, re-raised there
            outcome["error"] = e

    worker = threading.Thread(target=run, name=f"background-{getattr(fn, '__name__', 'work')}")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
