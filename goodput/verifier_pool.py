"""Verifier processes kept between checkpoints.

A checkpoint is judged in a process of its own, apart from training and from the flow, in
bounded memory (training.checkpoint.verify). Starting that process costs importing torch and
its checkpoint modules: about 4 of a verifier's 5.5 CPU-seconds on a small model
(benchmarks/RESULTS.md, "Where the test suite's CPU goes"), taken from training's cores at
every checkpoint. So a flow process keeps its verifiers serving (`--serve`): each checkpoint
goes to an idle one, another starts only while all are busy, and each judgement builds its
model anew from the checkpoint's files, sharing nothing with the one before.

A verifier that gives no verdict (it crashed, was killed for memory, or ran past its time)
is killed and never asked again: VerifierCrashed, which says nothing about the checkpoint.
A verifier left idle exits by itself (training.checkpoint.verify.IDLE_EXIT_S), and when the
flow process ends its verifiers see their input close and exit.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from core.cpu_priority import lower_session_priority
from core.protocol import request_line

# Hand a request only to a verifier idle for less than this: it exits by itself at 300 s
# (IDLE_EXIT_S), and one asked as it leaves would look crashed.
IDLE_REUSE_S = 240.0
KEEP_IDLE = 2  # verifiers kept waiting for the next checkpoint; more that were busy at once exit


class VerifierCrashed(RuntimeError):
    """The verifier process ended without judging the checkpoint (not a verdict on it)."""


class _Verifier:
    """One serving verifier process: a request line in, lines out until the verdict."""

    def __init__(self):
        self.stderr = tempfile.TemporaryFile()  # read only when it crashes: a pipe could fill
        self.process = subprocess.Popen(
            [sys.executable, "-m", "training.checkpoint.verify", "--serve",
             "--background"],  # validation runs beside training: at background priority
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, bufsize=0,
            # Out of the terminal's process group: a Ctrl-C stops training, and the
            # checkpoint being judged still gets its verdict (the verifier exits when the
            # flow process closes its input).
            start_new_session=True)
        # Its session's scheduling group too: at an equal share it took as much CPU from
        # training as a worker, whatever its threads' priority (core.cpu_priority).
        lower_session_priority(self.process.pid)
        self.idle_since = time.monotonic()

    def judge(self, argv: list[str], timeout_s: float) -> dict | None:
        """The verdict line's dict, or None if the process ended first; TimeoutError past
        `timeout_s`."""
        request = request_line(argv).encode()
        try:
            while request:  # an unbuffered pipe may take part of it at a time
                request = request[os.write(self.process.stdin.fileno(), request):]
        except (BrokenPipeError, ValueError):
            return None
        deadline = time.monotonic() + timeout_s
        pending = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.process.stdout], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                return None
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:  # anything else a library printed is passed over
                try:
                    verdict = json.loads(line)
                except ValueError:
                    continue
                if isinstance(verdict, dict) and "ok" in verdict:
                    self.idle_since = time.monotonic()
                    return verdict

    def stderr_tail(self, chars: int = 500) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace").strip()[-chars:]

    def usable(self) -> bool:
        return self.process.poll() is None and time.monotonic() - self.idle_since < IDLE_REUSE_S

    def stop(self, wait_s: float = 5.0) -> None:
        """End of input first (it exits between checkpoints); killed if it does not."""
        try:
            self.process.stdin.close()
            self.process.wait(wait_s)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.stderr.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


_lock = threading.Lock()
_idle: list[_Verifier] = []
_started: set[_Verifier] = set()  # idle or busy, until stopped
_owner = os.getpid()  # a forked child starts its own verifiers, never writes to its parent's


def _take() -> _Verifier:
    global _owner
    with _lock:
        if os.getpid() != _owner:
            _idle.clear()
            _started.clear()
            _owner = os.getpid()
        while _idle:
            verifier = _idle.pop()
            if verifier.usable():
                return verifier
            _started.discard(verifier)
            verifier.stop(wait_s=0.5)
        verifier = _Verifier()
        _started.add(verifier)
        return verifier


def _give_back(verifier: _Verifier) -> None:
    with _lock:
        if len(_idle) < KEEP_IDLE:
            _idle.append(verifier)
            return
        _started.discard(verifier)
    verifier.stop()


def _discard(verifier: _Verifier) -> None:
    with _lock:
        _started.discard(verifier)
    verifier.kill()
    verifier.stderr.close()


def verify(path: Path, timeout_s: float = 600, held_out: list[str] = ()) -> dict:
    """The verifier's verdict on the committed checkpoint at `path`. `held_out`: the
    verifier's --dataset/--eval-batches/--loss-tolerance arguments.

    A verifier that ends without a verdict (killed for memory, a crash in its own setup, past
    `timeout_s`) says nothing about the checkpoint: VerifierCrashed, and the checkpoint stays
    unjudged (never resumed from until a verifier judges it).
    """
    verifier = _take()
    try:
        verdict = verifier.judge([str(path), *held_out], timeout_s)
    except TimeoutError:  # starved or stuck: no verdict on the checkpoint
        _discard(verifier)
        raise VerifierCrashed(f"the verifier of {path} gave no verdict within {timeout_s:.0f} s") from None
    except BaseException:
        _discard(verifier)
        raise
    if verdict is None:
        code = verifier.process.wait()
        tail = verifier.stderr_tail()
        _discard(verifier)
        raise VerifierCrashed(f"the verifier of {path} ended without a verdict (exit {code}): {tail}")
    _give_back(verifier)
    return verdict


@atexit.register
def stop_all() -> None:
    """Stop every verifier this process started (idle ones exit at once)."""
    with _lock:
        verifiers = list(_started) if os.getpid() == _owner else []
        _idle.clear()
        _started.clear()
    for verifier in verifiers:
        verifier.stop(wait_s=2.0)
