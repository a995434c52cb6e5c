"""Processes that run work units and import only the library, not Prefect.

Tokenizing holds the GIL, so a prepare on many cores tokenizes in processes. Prefect's own
process pool started each as a new interpreter that imported Prefect and the flows before its
first unit: 3.6 s on 16 cores, 4.7 s on 2, on a unit of about 5 s. Here the units' Prefect task
runs stay on threads of the flow's process, and each hands its unit to one of these
processes. They are forked from multiprocessing's fork server, which imports this library once
(`warm_up`, called before the tokenizer is built): a pool of 16 starts in about one import, and
the next pool in the same process (the next source of a mix) at once.

What the library logs in a unit comes back with its result and is logged again on the
caller's thread, where Prefect sends it to the unit's task run's log. A process that dies (the
OOM killer, a signal) fails only the unit it ran, and Ctrl-C (`stop_units`) ends the units in
flight at once.
"""

from __future__ import annotations

import functools
import itertools
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
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from multiprocessing import spawn
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext, ForkServerProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from core.process_exit import stop_pool_processes_left

# What the fork server imports once, so that every process forked from it starts with it.
PRELOAD = ["goodput.data.prepare"]
# The library's loggers: their lowest level in the caller is what the processes record.
LIBRARY_LOGGERS = ("goodput", "storage", "training", "core")


def _without_the_callers_main(get_preparation_data: Callable[[str], dict]) -> Callable[[str], dict]:
    """multiprocessing has a new process import the caller's __main__ again (as __mp_main__)
    before it runs anything; a unit process needs only the library. Where the caller is a
    deployment's flow run (`python -m prefect.engine`), that main is Prefect itself: seconds
    in every process. Left out for this module's processes, which it names."""
    def preparation_data(name: str) -> dict:
        data = get_preparation_data(name)
        if name.startswith(_PROCESS_NAME):
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data
    return preparation_data


_PROCESS_NAME = "goodput-unit-process"
if not hasattr(spawn.get_preparation_data, "__wrapped__"):  # once, whatever reloads this module
    spawn.get_preparation_data = functools.wraps(spawn.get_preparation_data)(
        _without_the_callers_main(spawn.get_preparation_data))


class _UnitProcess(ForkServerProcess):
    _counter = itertools.count(1)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = f"{_PROCESS_NAME}-{next(self._counter)}"


class _UnitContext(ForkServerContext):
    Process = _UnitProcess


def warm_up() -> None:
    """Start the fork server now, importing the library in the background, so that the pool
    that follows starts without waiting for the import. Once per process; it lives as long as
    this process does (it ends when this process's end closes its pipe)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    from multiprocessing import forkserver

    forkserver.ensure_running()


class UnitProcessDied(RuntimeError):
    """The process running a unit died before it returned: killed (the OOM killer, a signal)
    or crashed. Only that unit fails; its retry runs in a new process."""


_STOPPED = "the unit was stopped (Ctrl-C, or the run cancelled)"


class UnitProcessesCannotStart(RuntimeError):
    """No process can be started for the units (the fork server failed to import the library):
    not a failure a retry mends."""


class UnitsStopped(RuntimeError):
    """The unit's process was stopped on purpose (`stop_units`: Ctrl-C, a cancel): not a
    failure to retry."""


class UnitTraceback(Exception):
    """Where a unit's exception was raised, in its process."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class UnitProcesses:
    """Up to `workers` processes forked from the fork server, each running one unit at a time,
    kept from unit to unit (a unit's tokenizer stays loaded); `run` calls a function of the
    library in an idle one, or in a new one. A process that dies fails only the unit it ran
    (concurrent.futures' pool fails every unit in flight with it, and noticed the death of a
    process it had started on demand only at its next result). Use it as a context manager:
    its exit ends the processes."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"a pool of {workers} processes")
        self.workers = workers
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._open = False
        self._stopping = False

    def __enter__(self) -> UnitProcesses:
        warm_up()
        self._open = True
        _pools.add(self)
        return self

    def __exit__(self, *exc_info) -> None:
        """Idle processes end at their pipe's end; one still running a unit (a caller that was
        not waited for) is killed after 5 s."""
        _pools.discard(self)
        with self._lock:
            self._open = False
            workers, self._idle, self._all = list(self._all), [], set()
        for worker in workers:
            worker.connection.close()
        deadline = time.monotonic() + 5
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            worker.kill()
            worker.close()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a process of the pool: its result, or its exception raised here (with
        its process's traceback as the cause). `fn` and the arguments go by pickle: a
        module-level function and plain data. Waits for a process while `workers` are busy."""
        if not self._open:
            raise RuntimeError("UnitProcesses.run outside its `with` block")
        level = min(logging.getLogger(name).getEffectiveLevel() for name in LIBRARY_LOGGERS)
        payload = ForkingPickler.dumps((fn, args, level))  # what does not pickle fails here
        with self._slots:
            worker = self._take()
            try:
                outcome = worker.call(payload)
            except _Died as died:
                self._discard(worker)
                if self._stopping or not self._open:
                    raise UnitsStopped(_STOPPED) from None
                raise UnitProcessDied(
                    f"the process running {getattr(fn, '__name__', fn)} {died}. Its retry runs in "
                    "a new process. If it happens again, lower prepare.workers or data.unit_bytes") from None
            except BaseException:  # an interrupt, an answer that does not unpickle: what the
                self._discard(worker)  # process would say next must not reach the next caller
                raise
            with self._lock:
                if self._open and not self._stopping:
                    self._idle.append(worker)
                    worker = None
            if worker is not None:  # the pool ended meanwhile
                self._discard(worker)
        for record in outcome.records:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)
        if outcome.error is not None:
            raise outcome.error from UnitTraceback(outcome.traceback)
        return outcome.value

    def _take(self) -> _Worker:
        with self._lock:
            if self._stopping or not self._open:
                raise UnitsStopped(_STOPPED)
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                self._all.discard(worker)  # killed while idle
                worker.close()
        # The fork server was started with this process's environment and directory of that
        # moment; a later flow in the same process (a worker's, a test session's) may have
        # others: credentials loaded from blocks, a relative data.data_dir.
        try:
            worker = _Worker(os.getpid(), dict(os.environ), os.getcwd())
        except Exception as e:  # the fork server did not start, or died: its error is on stderr
            raise UnitProcessesCannotStart(
                f"no process could be started for the work units ({type(e).__name__}: {e}); the "
                f"fork server's own error, importing {', '.join(PRELOAD)}, is above on stderr") from e
        with self._lock:
            self._all.add(worker)
            stopping = self._stopping or not self._open
        if stopping:  # stop() or the pool's end came while it started
            self._discard(worker)
            raise UnitsStopped(_STOPPED)
        return worker

    def _discard(self, worker: _Worker) -> None:
        """Out of the pool, and ended (killed if it was still running)."""
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            if worker in self._idle:
                self._idle.remove(worker)
        worker.process.join(0)  # reaped, if it has ended
        worker.close()

    def stop(self) -> None:
        """End the units in flight now, and refuse the next ones (UnitsStopped)."""
        with self._lock:
            self._stopping = True
            workers = list(self._all)
        for worker in workers:
            worker.kill()


class _Died(Exception):
    pass


class _Worker:
    """One process of the pool and its end of the pipe to it."""

    def __init__(self, owner: int, environment: dict[str, str], directory: str):
        self.connection, theirs = multiprocessing.Pipe()
        self.process = _UnitContext().Process(target=_serve, args=(theirs, owner, environment, directory),
                                              daemon=True)
        self.process.start()
        theirs.close()
        # The process is the fork server's child: multiprocessing learns its end through the
        # fork server, and takes every one for ended (exit code 255) if that server dies. A
        # pidfd follows the process itself (Linux 5.3); elsewhere, multiprocessing's sentinel.
        try:
            self._pidfd: int | None = os.pidfd_open(self.process.pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def call(self, payload: bytes) -> _Outcome:
        try:
            self.connection.send_bytes(payload)
            # The answer, or the process's end, whichever comes first.
            wait([self.connection, self._ended_handle()])
            answer = self.connection.recv_bytes()
        except (EOFError, OSError, ValueError):  # ValueError: the pool ended, its pipe closed
            self.kill()
            self.process.join(5)
            raise _Died(_how_it_ended(self.process.exitcode)) from None
        return pickle.loads(answer)

    def _ended_handle(self):
        return self._pidfd if self._pidfd is not None else self.process.sentinel

    def alive(self) -> bool:
        return not wait([self._ended_handle()], timeout=0)

    def kill(self) -> None:
        """Its unit, if any, is abandoned: a retry starts it over."""
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self.process.exitcode is None:
            self.process.kill()

    def close(self) -> None:
        self.connection.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (the OOM killer?)" if exitcode == -signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"ended with exit code {exitcode} before it returned (its error, if any, is on stderr)"


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
    Ctrl-C, and the task runner's exit would wait for their units (minutes for 256 MiB ones)."""
    for pool in list(_pools):
        pool.stop()
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
        try:
            kept = logging.makeLogRecord({name: getattr(record, name) for name in _RECORD_FIELDS})
            kept.msg, kept.args = record.getMessage(), None  # its arguments may not pickle
            if record.exc_info:
                kept.exc_text = logging.Formatter().formatException(record.exc_info)
            kept.stack_info = record.stack_info
            self.records.append(kept)
        except Exception:
            self.handleError(record)  # a malformed call: said on stderr, as logging does


# A record's own fields, not what `extra=` added (which may not pickle).
_RECORD_FIELDS = ("name", "levelno", "levelname", "pathname", "filename", "module", "lineno",
                  "funcName", "created", "msecs", "relativeCreated", "thread", "threadName",
                  "process", "processName")


_recorder = _Recorder()


def _serve(connection, owner: int, environment: dict[str, str], directory: str) -> None:
    """A process of the pool: calls as they come, until the pipe's end."""
    _process_setup(owner, environment, directory)
    while True:
        try:
            request = connection.recv_bytes()
        except (EOFError, OSError):  # the owner closed its end, or ended
            return
        try:
            fn, args, level = pickle.loads(request)
        except Exception as e:  # a function or an argument this process cannot rebuild
            outcome = _failed(e)
        else:
            outcome = _call(fn, args, level)
        try:
            connection.send(outcome)
        except OSError:
            return
        except Exception as e:  # a value or a record that does not pickle
            connection.send(_Outcome(error=RuntimeError(f"the unit's outcome cannot be sent back: {e}")))


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
            poller = select.poll()  # not select(): it fails on a descriptor past 1023
            poller.register(owner_fd, select.POLLIN)
            poller.poll()
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
        outcome = _failed(e)
    outcome.records, _recorder.records = _recorder.records, []
    return outcome


def _failed(error: Exception) -> _Outcome:
    return _Outcome(error=_picklable(error), traceback="".join(traceback.format_exception(error)))


def _picklable(error: Exception) -> Exception:
    """The exception itself where it survives a pickle, else one that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__qualname__}: {error}")
