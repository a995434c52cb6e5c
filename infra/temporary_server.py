"""Prefect's temporary API server for one `goodput` command, when no server is configured.

Prefect starts the same server itself on first use (`SubprocessASGIServer`: uvicorn serving
`prefect.server.api.server:create_app`, no UI, ephemeral services, on the SQLite database in
PREFECT_HOME). Started here instead:

- The command does not import Prefect's server module to start it: that import (the whole
  API app) took 2.1 s of a core, and the process it starts imports it all again.
- It starts early, beside the command's own work: the process imports the server and
  builds its app (about 2.8 s) while the command decides whether it has anything to do and
  imports the flows. Told to serve, it answers about 0.4 s later (the database opened, its
  migrations checked, the services started).
  It opens the database and serves only when told (`serve`). Told nothing, it exits having
  touched neither the database nor its port: a command with nothing to do.
- It runs in a session of its own, out of a terminal's Ctrl-C (which goes to the flow, which
  records the interruption), and the kernel ends it if the command dies (parent-death
  signal). Its port is bound here and handed to it: no other process can take it meanwhile.

    server = TemporaryServer()               # spawned: importing, not serving
    if there_is_work:
        server.serve(timeout_s=120)          # then PREFECT_API_URL=server.api_url for the flows
        ...
    server.stop()                            # a server never told to serve: ends at once
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from core.process_exit import die_with_parent

SERVE = b"serve\n"
# What Prefect's own temporary server runs with (SubprocessASGIServer._run_uvicorn_command):
# no UI, the services of an ephemeral server. And no block types registered at its start:
# that registration is for the UI's catalogue (a server without a UI has none), and to see
# whether a type changed it imports every installed collection (prefect-aws and its boto3,
# prefect-ray, ...): 0.7 s of the 5.3 s this server took to answer, each command waiting for
# it. A block saved from Python registers its own type (Block.save); `prefect server start`
# on the same database registers them all as before.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
              "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
              "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}
# uvicorn's exit status when the server failed to start.
STARTUP_FAILURE = 3
# How soon a client is asked to retry a request the server answered 503 (Service Unavailable):
# on SQLite that is a write that met another one (SQLITE_BUSY, at once for a read that turned
# into a write; after PRAGMA busy_timeout's 30 s otherwise). The other write has committed
# milliseconds later, yet without a Retry-After header Prefect's client waits 2 s, then 4,
# 8, ...: a whole stage of `make pipeline` took 2 s longer for one such request. Its retry
# count (PREFECT_CLIENT_MAX_RETRIES) still bounds how often it tries.
BUSY_RETRY_AFTER_S = "0.5"


def _settings_set_in_this_process() -> dict[str, str]:
    """Prefect settings changed in this process (temporary_settings) since it read the
    environment, as environment variables: Prefect hands them to its server the same way."""
    if "prefect.settings" not in sys.modules:
        return {}
    from prefect.settings import get_current_settings

    return get_current_settings().to_environment_variables(exclude_unset=True)


class TemporaryServer:
    """A Prefect API server process for the life of one command (see the module's doc)."""

    def __init__(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        env = {**os.environ, **SERVER_ENV, **_settings_set_in_this_process()}  # as Prefect does
        env.pop("PREFECT_API_URL", None)  # the server's own settings: it is the API
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "infra.temporary_server", str(listener.fileno())],
                stdin=subprocess.PIPE, pass_fds=(listener.fileno(),), env=env,
                start_new_session=True, preexec_fn=die_with_parent)  # SIGTERM: it stops as asked
        finally:
            listener.close()  # the child holds it now
        self.serving = False  # True once it has answered: Prefect's clients may use it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def serve(self, timeout_s: float = 120.0, while_it_starts=lambda: None) -> None:
        """Tell it to serve, call `while_it_starts`, then wait until the API answers.
        RuntimeError if it exits first or does not answer within `timeout_s`."""
        try:
            self.process.stdin.write(SERVE)
            self.process.stdin.flush()
        except BrokenPipeError:  # it exited already: reported below with its status
            pass
        while_it_starts()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Prefect's temporary server exited with status "
                                   f"{self.process.returncode} before it answered on {self.url} "
                                   "(its errors are above)")
            if self.healthy():
                self.serving = True
                return
            time.sleep(0.05)
        raise RuntimeError(f"Prefect's temporary server did not answer on {self.url} within "
                           f"{timeout_s:.0f} s: a busy machine may need more "
                           "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS), or run a "
                           "dedicated server (`goodput server`, PREFECT_API_URL)")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop it as Prefect stops its own (SIGTERM: uvicorn shuts down, the services stop),
        killing it if it has not exited within `timeout_s`. Never told to serve, it is still
        importing or waiting: it has opened neither the database nor its port, and ends at
        once."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class RetrySoonWhenBusy:
    """ASGI middleware: a 503 response carries `Retry-After: BUSY_RETRY_AFTER_S` unless the
    app set one itself."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", BUSY_RETRY_AFTER_S.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)


class _NoCancellationTracebacks(logging.Filter):
    """Drops records of a task cancelled (asyncio.CancelledError): in this server that is its
    stop, and a service cancelled mid-write (the task-run recorder's flush) logged a 40-line
    traceback into the output of a command stopped by Ctrl-C."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def collect_garbage_off_the_event_loop(every_s: float = 1.0,
                                       full_every_s: float = 60.0) -> threading.Thread:
    """Python's cycle collector run by a thread of its own, never by the thread that happens
    to allocate, which in a server is mostly its event loop: the young generations every
    `every_s`, the whole heap every `full_every_s`.

    On SQLite a statement that failed ("database is locked", which the server answers 503)
    leaves its cursor in a reference cycle with the exception's traceback (SQLAlchemy's
    aiosqlite adapter does not close it). Freeing such a cursor resets its statement, which
    takes its connection's lock. If that connection is meanwhile waiting for the write lock
    (another write of the server's, in its aiosqlite thread), and the transaction holding the
    write lock needs the event loop to commit, a collection on the event loop waits for the
    waiting write and the write for the event loop: the server froze until SQLite gave up,
    after Prefect's 60 s busy timeout, and the request that had waited failed (benchmarks/
    RESULTS.md, "the 60 s stall found"; it froze the tests' server too). On a thread of its
    own the collection waits there while the event loop commits. sqlite3 lets go of the GIL
    while it waits for the lock, so nothing else waits.

    Why not the whole heap every second: a full collection of a running server's heap takes
    about 0.16 s of CPU, and once a second that was 16% of a core, all the time, whatever
    the server did (a server started for a command takes it from the training the command
    runs; two in the tests, 10 CPU-s a minute). A young collection sees only what was made
    since the one before, and catches a failed statement's cursor if it became garbage
    young; one that lived through two of them is freed by the next full collection, on this
    thread too. The objects alive now (the imported server and its app) are moved out of the
    collector's sight (gc.freeze)."""
    gc.freeze()
    gc.disable()

    def collect() -> None:
        last_full = time.monotonic()
        while True:
            time.sleep(every_s)
            if time.monotonic() - last_full >= full_every_s:
                gc.collect()
                last_full = time.monotonic()
            else:
                gc.collect(1)

    collector = threading.Thread(target=collect, name="garbage-collector", daemon=True)
    collector.start()
    return collector


def _quiet_cancellations() -> None:
    """The filter on every handler Prefect's logging set up in this process."""
    quiet = _NoCancellationTracebacks()
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            handler.addFilter(quiet)


def _serve_when_told(listener_fd: int) -> int:
    """The server process: import the server, then serve on the inherited socket once the
    command says so; exit quietly at the end of its input."""
    import uvicorn
    from prefect.server.api.server import create_app

    # What the server's start does before it opens the database, done while the command is
    # still deciding: uvicorn's logging set up, then the app built (its factory call, which
    # sets up Prefect's logging over it).
    config = uvicorn.Config(create_app, factory=True, log_level="error", lifespan="on")
    config.load()
    config.loaded_app = RetrySoonWhenBusy(config.loaded_app)
    listener = socket.socket(fileno=listener_fd)
    if sys.stdin.buffer.readline() != SERVE:
        return 0
    _quiet_cancellations()
    collect_garbage_off_the_event_loop()
    server = uvicorn.Server(config)  # serves the loaded app
    server.run(sockets=[listener])
    return 0 if server.started else STARTUP_FAILURE


if __name__ == "__main__":
    sys.exit(_serve_when_told(int(sys.argv[1])))
