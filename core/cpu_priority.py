"""Work beside training runs at the lowest CPU priority (SCHED_IDLE, nice 19).

A background checkpoint write, the manifest's hashing, the validation reload and the upload
run while training runs. At normal priority every CPU second they take on busy cores is
taken from a training step; at the idle class they get the cycles training leaves idle
(waiting in a collective, on the GPU, on I/O), and take longer instead.

Linux keeps the priority per thread and a new thread inherits its creator's: lowering one
thread lowers the threads it starts (DCP's writers, boto3's transfer threads) and nothing
else. Priorities count within a scheduling group (an autogroup per session; a cgroup under
Slurm or Kubernetes). A thread cannot raise its priority back without privileges, so a
long-lived thread hands the work to a new one (`at_background_priority`).

Where the kernel groups each session (sched_autogroup_enabled, the default of most
distributions), every session's group gets an equal share of a busy CPU whatever its
threads' priorities, and torchrun starts each worker in a session of its own: a background
process in a session of its own (the checkpoint verifier, an evaluation beside training)
took as much CPU as a training worker. Whoever starts such a process lowers its session's
group too (`lower_session_priority`).
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from pathlib import Path
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


def lower_session_priority(pid: int, nice: int = BACKGROUND_NICE) -> bool:
    """Give the session group (autogroup) of process `pid`, which leads a session of its own
    (started with start_new_session), the priority `nice`: on a busy CPU the group then takes
    the share of a group at that nice (weight 15 of 1024 at 19) instead of an equal one.
    Returns whether it did; nothing happens where the kernel has no autogroups. A process
    that does not lead its session is left alone: its group is the session it was started
    from, a terminal's say."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    try:
        if sys.platform != "linux" or os.getsid(pid) != pid or not autogroup.exists():
            return False
        for _ in range(5):  # the kernel takes one change per 100 ms from unprivileged processes
            try:
                autogroup.write_text(str(nice))
                return True
            except BlockingIOError:  # EAGAIN: a change elsewhere on the machine just now
                time.sleep(0.11)
    except OSError:  # gone already, or a sandbox that forbids it: it runs at the group's share
        return False
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

    # In the caller's context (contextvars): a record logged there still knows its flow run.
    worker = threading.Thread(target=contextvars.copy_context().run, args=(run,),
                              name=f"background-{getattr(fn, '__name__', 'work')}")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
