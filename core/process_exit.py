"""A process's end: without the interpreter's teardown, and with its parent."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading


def exit_without_teardown(code: int) -> None:
    """Exit with `code` once the exit handlers have run, skipping Python's own teardown.

    With torch loaded, the teardown after the last exit handler (a last garbage collection
    over every module, torch's operator-library finalizers) took 0.3-1.5 s on 2 cores, and
    frees only memory, which the OS takes back anyway. The exit handlers still run, in the
    order of a normal exit: first threading's (Prefect's log and event services send what
    they hold), then atexit's (logging flushes, coverage saves, child processes stopped).
    A thread that is not a daemon would be waited for on a normal exit: then the exit is the
    normal one.
    """
    if any(not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        sys.exit(code)
    threading._shutdown()  # what a normal exit runs first: the threading._register_atexit hooks
    stop_pool_processes_left()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written
            pass
    os._exit(code)


def stop_pool_processes_left(wait_s: float = 5.0) -> list[int]:
    """Terminate the multiprocessing children still alive (their pids). A process pool whose
    manager thread died (a Ctrl-C reaches its workers too, and the KeyboardInterrupt one of
    them returned is raised again in that thread) never tells its workers to stop, and
    multiprocessing's own exit handler then waits for them forever: `goodput prepare` hung
    after "interrupted" until two more Ctrl-C. At a normal end none is left."""
    if "multiprocessing" not in sys.modules:
        return []
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(wait_s)
    return [child.pid for child in children]


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send this process `sig` when its parent dies (Linux: PR_SET_PDEATHSIG;
    elsewhere nothing, False). It follows the thread that started the process. Called in a
    child before exec, or first thing in one; True when set."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return True


# The pid of the process that started this one, in the environment of a child that must not
# outlive it (die_with_the_parent_that_started_it).
PARENT_PID = "GOODPUT_PARENT_PID"


def die_with_the_parent_that_started_it(sig: int = signal.SIGTERM) -> None:
    """die_with_parent, for a child started with PARENT_PID in its environment: a parent that
    died before the call (the child reparented already) ends the child at once. Call it
    first thing, before slow imports."""
    if die_with_parent(sig) and os.environ.get(PARENT_PID, str(os.getppid())) != str(os.getppid()):
        os._exit(1)

