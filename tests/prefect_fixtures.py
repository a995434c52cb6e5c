"""One real Prefect server for the whole test session (`prefect server start`, about 10 s).

Flows called inside the tests run against it (`prefect_api`); processes the tests start
(`goodput serve`, workers) get its address from `prefect_server.env()`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from infra.prefect_stack import LEASES_ON_DISK
from infra.torchrun import free_port

# `prefect server start`, its garbage collected off its event loop as goodput's temporary
# server's is (infra.temporary_server.collect_garbage_off_the_event_loop, after the imports):
# on SQLite a collection on the loop froze this server for 60 s, and a test's flow run,
# whose request timed out meanwhile, came back without its result.
PREFECT_SERVER_START = [sys.executable, "-c", "import prefect.cli, prefect.server.api.server; "
                        "from infra.temporary_server import collect_garbage_off_the_event_loop; "
                        "collect_garbage_off_the_event_loop(); prefect.cli.app()",
                        "server", "start"]


@dataclass
class PrefectServer:
    url: str  # the UI; the API is under /api
    home: Path
    log: Path

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a process that talks to this server."""
        return {**os.environ, "PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> PrefectServer:
    home = tmp_path_factory.mktemp("prefect-home")
    url = f"http://127.0.0.1:{free_port()}"
    server = PrefectServer(url, home, home / "server.log")
    env = server.env(
        PREFECT_UI_API_URL=server.api_url,  # the UI otherwise calls 127.0.0.1:4200
        # Tests wait on schedules: look for due deployments every 2 s, not every 60 s.
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        # A `* * * * *` schedule gets 5 runs ahead, not an hour's worth (60 rows to write, and
        # to delete when it is switched off, on a SQLite file that every test shares).
        PREFECT_SERVER_SERVICES_SCHEDULER_MAX_RUNS="5",
        PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=LEASES_ON_DISK,  # as goodput's CLI and stack do
    )
    host, port = url.removeprefix("http://").split(":")
    with open(server.log, "w") as log:
        proc = subprocess.Popen([*PREFECT_SERVER_START, "--host", host, "--port", port],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(server, proc, timeout_s=120)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(server: PrefectServer, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    http = httpx.Client(timeout=2)  # one SSL context, not one per poll
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited ({proc.returncode}):\n"
                               f"{server.log.read_text()[-3000:]}")
        try:
            if http.get(f"{server.api_url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {timeout_s}s:\n"
                       f"{server.log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def prefect_api(prefect_server):
    """Flows called in this process run against the session's server."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url,
                             PREFECT_HOME: prefect_server.home / "client"}):
        # Prefect's log and event workers run in threads of their own, which see the global
        # settings rather than this context's; prefect_test_harness makes the same switch.
        with _temporary_global_settings_context(get_settings_context()):
            yield prefect_server
            # Deliver queued logs and events while the server is still up.
            APILogWorker.drain_all()
            EventsWorker.drain_all()
