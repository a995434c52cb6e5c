"""Processes that run work units and import only the library, not Prefect.

Tokenizing holds the GIL, so a prepare on many cores tokenizes in processes. Prefect's own
process pool started each as a new interpreter that imported Prefect and the flows before its
first unit: 3.6 s on 16 cores, 4.7 s on 2, on a unit of about 5 s. Here the units' Prefect task
runs stay on threads of the flow's process, and each hands its unit to one of these
processes. They are forked from multiprocessing's fork server, which imports this library once
(`warm_up`, called before the tokenizer is built): a pool of 16 starts in about one import, and
the next pool in the same process (the next source of a mix) at once.

What the library logs in a unit comes back with its result and is logged again on the
caller's thread, where Prefect sends it to the unit's task run's log.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from core.process_exit import stop_pool_processes_left

# What the fork server imports once, so that every process forked from it starts with it.
PRELOAD = ["goodput.data.prepare"]
# The library's loggers: their lowest level in the caller is what the processes record.
LIBRARY_LOGGERS = ("goodput", "storage", "training", "core")

log = logging.getLogger(__name__)


def warm_up() -> None:
    """Start the fork server now, importing the library in the background, so that the pool
    that follows starts without waiting for the import. Once per process; it lives as long as
    this process does (it ends when this process's end closes its pipe)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    from multiprocessing import forkserver

    forkserver.ensure_running()


class UnitProcessDied(RuntimeError):
    """A process of the pool died in the middle of a unit: killed (the OOM killer, a signal) or
    crashed. The pool is replaced; a retry of the unit runs in a new process."""


class UnitsStopped(RuntimeError):
    """The unit's process was stopped on purpose (`stop_units`: Ctrl-C, a cancel): not a
    failure to retry."""


class UnitTraceback(Exception):
    """Where a unit's exception was raised, in its process (as concurrent.futures says it)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class UnitProcesses:
    """A pool of `workers` processes forked from the fork server; `run` calls a function of
    the library in one of them. Use it as a context manager: its exit stops the processes."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"a pool of {workers} processes")
        self.workers = workers
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._stopping = False

    def __enter__(self) -> UnitProcesses:
        warm_up()
        self._executor = self._new_executor()
        _pools.add(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _pools.discard(self)
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def _new_executor(self) -> ProcessPoolExecutor:
        # The fork server was started with this process's environment and directory of that
        # moment; a later flow in the same process (a worker's, a test session's) may have
        # others: credentials loaded from blocks, a relative data.data_dir.
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("forkserver"),
                                   initializer=_process_setup,
                                   initargs=(os.getpid(), dict(os.environ), os.getcwd()))

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a process of the pool: its result, or its exception raised here (with
        its process's traceback as the cause). `fn` and the arguments go by pickle: a
        module-level function and plain data."""
        with self._lock:
            executor = self._executor
        if executor is None:
            raise RuntimeError("UnitProcesses.run outside its `with` block")
        level = min(logging.getLogger(name).getEffectiveLevel() for name in LIBRARY_LOGGERS)
        try:
            outcome: _Outcome = executor.submit(_call, fn, args, level).result()
        except BrokenProcessPool:
            if self._stopping:
                raise UnitsStopped("the unit's process was stopped (Ctrl-C, or the run cancelled)") from None
            self._replace(executor)
            raise UnitProcessDied(
                f"a process of the prepare pool died while running {getattr(fn, '__name__', fn)} "
                "(killed: out of memory, or by a signal?); a new pool takes the retries. If it "
                "happens again, lower prepare.workers or data.unit_bytes") from None
        for record in outcome.records:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)
        if outcome.error is not None:
            raise outcome.error from UnitTraceback(outcome.traceback)
        return outcome.value

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """A new pool for the units still to run; once, however many were in flight."""
        with self._lock:
            if self._executor is not broken or self._stopping:
                return
            self._executor = self._new_executor()
        broken.shutdown(wait=False, cancel_futures=True)


_pools: weakref.WeakSet[UnitProcesses] = weakref.WeakSet()
_in_use: ContextVar[UnitProcesses | None] = ContextVar("goodput_unit_processes", default=None)


@contextmanager
def in_use(processes: UnitProcesses | None) -> Iterator[None]:
    """`processes` is what `current` returns within the block, and in the threads of what it
    submits (Prefect's thread pool runs a task in a copy of the submitter's context)."""
    token = _in_use.set(processes)
    try:
        yield
    finally:
        _in_use.reset(token)


def current() -> UnitProcesses | None:
    """The pool the caller's work units go to; None: run them where the caller runs."""
    return _in_use.get()


def stop_units() -> None:
    """Stop the units in flight in this process's pools now (Ctrl-C, a cancel), and any other
    multiprocessing child left: their units fail with UnitsStopped. Their processes ignore
    Ctrl-C, and a pool's exit waits for the units it runs (minutes for 256 MiB units)."""
    for pool in list(_pools):
        pool._stopping = True
    stop_pool_processes_left()


# -- in the pool's processes ------------------------------------------------------------------

@dataclass
class _Outcome:
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    records: list[logging.LogRecord] = field(default_factory=list)


class _Recorder(logging.Handler):
    """Keeps the records of the call in progress, ready to be pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        self.records.append(record)


_recorder = _Recorder()


def _process_setup(owner: int, environment: dict[str, str], directory: str) -> None:
    """First thing in each process of the pool, for `owner` (the pid whose pool it is)."""
    _end_with(owner)
    # Ctrl-C reaches the terminal's whole process group: the owner stops the units, and a
    # KeyboardInterrupt here as well would only print its traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environment)
    # Each process tokenizes on one core: the processes are the parallelism, and tokenizers'
    # own thread pool on top of them would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.chdir(directory)
    root = logging.getLogger()
    root.handlers = [_recorder]  # nothing to a console of its own: the owner logs it again


def _end_with(owner: int) -> None:
    """End this process as soon as `owner` ends, however it ends (kill -9, the OOM killer).

    Nothing else would: a pool's processes outlived such an end, each holding its memory
    (hundreds of MB) for ever. The kernel's parent-death signal cannot do it here: the parent
    is the fork server, which ends only once no process holds its pipe, and these hold it.
    """
    try:
        owner_fd = os.pidfd_open(owner)  # readable once the owner has ended (Linux 5.3)
    except ProcessLookupError:
        os._exit(1)  # the owner ended before this process started
    except (AttributeError, OSError):  # no pidfd here: ask every second
        def watch() -> None:
            while _alive(owner):
                time.sleep(1.0)
            os._exit(1)
    else:
        def watch() -> None:
            select.select([owner_fd], [], [])
            os._exit(1)
    threading.Thread(target=watch, name="goodput-end-with-owner", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, as another user
        return True
    return True


def _call(fn: Callable[..., Any], args: tuple, level: int) -> _Outcome:
    logging.getLogger().setLevel(level)
    _recorder.records = []
    try:
        outcome = _Outcome(value=fn(*args))
    except Exception as e:
        outcome = _Outcome(error=_picklable(e), traceback="".join(traceback.format_exception(e)))
    outcome.records, _recorder.records = _recorder.records, []
    return outcome


def _picklable(error: Exception) -> Exception:
    """The exception itself where it survives a pickle, else one that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__qualname__}: {error}")
