"""The Prefect API a `goodput` command's flow runs report to: a configured server, or else
a temporary one for the life of the command (infra.temporary_server), with Prefect's settings
pointed at it while the flows run and, before it stops, the wait until it has recorded them.
Used by the CLI's commands and by `goodput serve` (flows.deployments).

    server = temporary_server()              # None where PREFECT_API_URL names a server
    with flow_runs_recorded_by(server):      # serves, flows imported meanwhile
        ...run flows...
    let_the_api_record(server, began)
    server and server.stop()
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from infra.temporary_server import TemporaryServer


def server_configured() -> bool:
    """Whether Prefect's settings name a server (PREFECT_API_URL): a command's flow run is
    then recorded there, in the UI where users watch their runs.

    Prefect's own resolution decides, but importing it costs a second or more (five on a
    busy machine): where none of the places it reads settings from exists (a PREFECT_PROFILE
    or PREFECT_PROFILES_PATH variable, a profiles.toml in PREFECT_HOME, ./.env,
    ./prefect.toml, [tool.prefect] in ./pyproject.toml), nothing can name a server and
    Prefect is not imported."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    pyproject = Path("pyproject.toml")
    if not ({"PREFECT_PROFILE", "PREFECT_PROFILES_PATH"} & os.environ.keys()
            or (home / "profiles.toml").exists() or Path(".env").exists()
            or Path("prefect.toml").exists()
            or (pyproject.is_file() and "tool.prefect" in pyproject.read_text(errors="replace"))):
        return False
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def temporary_server() -> TemporaryServer | None:
    """For a flow command with no Prefect server configured: the temporary server its flow
    runs will need, spawned now so that its imports overlap the command's own check
    (infra.temporary_server). None where a server is configured, or where Prefect's settings
    turn temporary servers off (PREFECT_SERVER_EPHEMERAL_ENABLED=false: Prefect then asks for
    PREFECT_API_URL, as before)."""
    if server_configured():
        return None
    profiles = {"PREFECT_PROFILE", "PREFECT_PROFILES_PATH"} & os.environ.keys()
    if "prefect.settings" in sys.modules or profiles:
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_ENABLED

        enabled = PREFECT_SERVER_EPHEMERAL_ENABLED.value()
    else:  # Prefect's default profile ("ephemeral") turns them on; the environment may not
        off = ("0", "off", "f", "false", "n", "no")  # pydantic's false, as Prefect parses it
        enabled = all(os.environ.get(name, "true").strip().lower() not in off
                      for name in ("PREFECT_SERVER_EPHEMERAL_ENABLED",
                                   "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"))
    return TemporaryServer() if enabled else None


def _import_flows() -> None:
    """Import the flows (Prefect's engine: about 1 s of one core), ignoring a failure:
    the command's own import of them raises it again, where it is reported."""
    try:
        import flows.pipeline  # noqa: F401 (it imports the other three flows)
    except BaseException:
        pass


def lasting_ui() -> tuple[str, str]:
    """Where the flow runs a temporary server records can be seen once the command has ended:
    the UI of `prefect server start` (its host and port from Prefect's settings, or the user's
    own PREFECT_UI_URL), and the database both use (PREFECT_HOME's SQLite file, or
    PREFECT_API_DATABASE_CONNECTION_URL's)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if "ui_url" in settings.model_fields_set:  # set by the user, not derived from the API's
        ui_url = settings.ui_url
    else:
        host = settings.server.api.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        host = f"[{host}]" if ":" in host else host
        ui_url = f"http://{host}:{settings.server.api.port}"
    connection_url = settings.server.database.connection_url
    connection_url = connection_url.get_secret_value() if connection_url else ""
    if connection_url.startswith("sqlite") and ":///" in connection_url:
        database = connection_url.split(":///", 1)[1]
    elif connection_url:
        database = "the database of PREFECT_API_DATABASE_CONNECTION_URL"
    else:
        database = str(settings.home / "prefect.db")
    return ui_url, database


# The settings a command's clients of its temporary server get (in-process and in the
# environment of its child processes), restored after.
CLIENT_SETTINGS = ("PREFECT_API_URL", "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED", "PREFECT_UI_URL")


@contextmanager
def flow_runs_recorded_by(server: TemporaryServer | None) -> Iterator[None]:
    """The flows imported, and with `server` (the command's temporary one): told to serve
    meanwhile, Prefect pointed at it (PREFECT_API_URL: in Prefect's settings, for this
    context and for the threads of Prefect's log and event services, and in the environment,
    for the command's child processes; all restored after), flow runs without heartbeats
    unless an automation watches them. With no temporary server: Prefect's settings as they
    are."""
    if server is None:
        _import_flows()
        yield
        return
    timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 120)
    previous = {name: os.environ.get(name) for name in CLIENT_SETTINGS}
    try:
        server.serve(timeout_s, while_it_starts=_import_flows)
        ui_url, database = lasting_ui()
        print(f"goodput: no Prefect server configured: a temporary one ({server.url}, no UI, "
              f"for this command only) records its flow runs in {database}; "
              f"`prefect server start` shows them there after, at {ui_url} "
              "(`goodput server` runs a dedicated server)")
        # Prefect read its settings when the flows imported it, without this URL: those are
        # the settings it returns to after the command (main() called again in-process).
        from prefect.context import _temporary_global_settings_context, get_settings_context
        from prefect.settings import (
            PREFECT_API_URL,
            PREFECT_CLIENT_CSRF_SUPPORT_ENABLED,
            PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED,
            PREFECT_UI_URL,
            temporary_settings,
        )

        # Prefect links each flow run to a UI derived from the API's address: here that is
        # the temporary server, which has no UI and is gone once the command ends.
        settings = {PREFECT_API_URL: server.api_url, PREFECT_UI_URL: ui_url}
        # The server has the command's settings: without CSRF protection (Prefect's default),
        # each new client would ask it for a token and be told it needs none (16 requests in
        # a pipeline).
        if not PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED.value():
            settings[PREFECT_CLIENT_CSRF_SUPPORT_ENABLED] = False
        os.environ.update({setting.name: str(value).lower() if isinstance(value, bool) else value
                           for setting, value in settings.items()})  # for child processes
        # Prefect's log and event workers run in threads of their own, which see the global
        # settings, not this context's: both switch, as prefect_test_harness does.
        with temporary_settings(settings), \
                _temporary_global_settings_context(get_settings_context()), \
                no_heartbeats_unless_watched():
            yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"


def heartbeats_watched() -> bool:
    """Whether an enabled automation on the API's database reacts to flow-run heartbeats
    (Prefect's recipe for marking a run whose process died as crashed)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        automations = client.read_automations()
    return any(automation.enabled and HEARTBEAT_EVENT in automation.trigger.model_dump_json()
               for automation in automations)


def no_heartbeats_unless_watched():
    """On Prefect's temporary server: flow runs send no heartbeats, unless an automation
    reacts to them.

    Each flow run's end waits up to 1 s for its heartbeat thread (it sleeps in 1 s steps):
    about 1.2 s of a no-op prepare flow, five flow runs in a pipeline. The temporary server
    lives only as long as the command, and nothing else watches the heartbeats there; but
    it uses the database of `prefect server start` (PREFECT_HOME), where a user may have
    made an automation that marks runs without heartbeats as crashed.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    try:
        watched = heartbeats_watched()
    except Exception:  # the automations unreadable: heartbeats as Prefect sends them
        watched = True
    if watched:
        return nullcontext()
    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


# Prefect's task engine logs "Finished in state <name>(...)" as each task run ends; these
# names are of states that are not final (any other name is: Completed, Cached, Failed,
# TimedOut, Crashed, Cancelled, or a task's own name for one of those).
NOT_FINAL_STATE_NAMES = ("Pending", "NotReady", "Scheduled", "Late", "AwaitingRetry",
                         "AwaitingConcurrencySlot", "Running", "Retrying", "Paused",
                         "Suspended", "Cancelling")
FINAL_STATE_TYPES = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
_ENDED = re.compile(r"Finished in state (\w+)")


def _task_run_ends_reach_the_api() -> bool:
    """Whether this process sends the task engine's "Finished in state" lines (INFO) to the
    API: logging to it is on, and the task-run logger lets INFO through to its handler."""
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED

    logger = logging.getLogger("prefect.task_runs")
    if not (PREFECT_LOGGING_TO_API_ENABLED.value() and logger.isEnabledFor(logging.INFO)):
        return False
    while logger is not None:
        if any(isinstance(handler, APILogHandler) and handler.level <= logging.INFO
               for handler in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def send_prefect_queues() -> None:
    """Send the events and logs this process's Prefect client still holds (it sends them in
    the background) to the API."""
    if "prefect.events.worker" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        EventsWorker.drain_all()
        APILogWorker.drain_all()


def let_the_api_record(server: TemporaryServer | None, since: float, timeout_s: float = 60.0,
                        quiet_s: float = 2.0, window_s: float = 60.0) -> None:
    """Before the command's temporary server stops: wait until it has recorded every task run
    of the flow runs started since `since` (Unix time), in its final state.

    Task-run states reach the server as events, which its recorder writes to the database
    behind the API about once a second; a server stopped before then loses them (a flow of
    200 quick tasks kept 43 of them, most not final). The client's event and log queues are
    sent first. Logs, unlike events, are written as they arrive: the task engine's "Finished
    in state ..." lines of the last `window_s` name the task runs that ended lately, and the
    wait ends once each of them is recorded final and no task run is recorded unfinished.
    The recorder writes events in the order they came, so the task runs that ended earlier
    are recorded by then. Otherwise (those lines do not reach the API: logging to it off, or
    above INFO; a task run recorded unfinished: one whose process died, or whose end was
    logged elsewhere), the task runs' states are counted until they stop changing for
    `quiet_s`. A request the server answers 503 (its database busy) is asked again. A
    dedicated server (`goodput server`, PREFECT_API_URL) needs none of it.
    """
    if server is None or not server.serving:
        return
    import httpx
    from prefect.settings import get_current_settings

    send_prefect_queues()
    url, http = server.api_url, httpx.Client(timeout=30)  # one SSL context for all requests
    page = min(200, get_current_settings().server.api.default_limit)  # the most it returns

    def post(path: str, body: dict):
        response = http.post(f"{url}/{path}", json=body)
        response.raise_for_status()
        return response.json()

    def utc(unix_time: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_time))

    def ended_lately() -> list[str]:
        ids, after = set(), utc(max(since, time.time() - window_s))
        for offset in itertools.count(0, page):
            logs = post("logs/filter", {
                "logs": {"timestamp": {"after_": after}, "task_run_id": {"is_null_": False}},
                "limit": page, "offset": offset})
            ids |= {log["task_run_id"] for log in logs
                    if (ended := _ENDED.match(log["message"]))
                    and ended[1] not in NOT_FINAL_STATE_NAMES}
            if len(logs) < page:
                return sorted(ids)

    def count(state_types, ids=None) -> int:
        task_runs = {"state": {"type": {"any_": list(state_types)}}}
        if ids is not None:
            return post("task_runs/count", {"task_runs": {**task_runs, "id": {"any_": ids}}})
        return post("task_runs/count", {"flow_runs": {"start_time": {"after_": utc(since)}},
                                        "task_runs": task_runs})

    deadline = time.monotonic() + timeout_s
    ids, seen, seen_since = None, None, time.monotonic()
    try:
        while time.monotonic() < deadline:
            try:
                if ids is None:
                    ids = ended_lately() if _task_run_ends_reach_the_api() else []
                if ids:
                    if count(FINAL_STATE_TYPES, ids) < len(ids):
                        time.sleep(0.1)
                        continue
                    if not count(("PENDING", "RUNNING")):
                        return
                    ids = []  # one recorded unfinished: counted until the counts settle
                now = tuple(count((state,)) for state in ("PENDING", "RUNNING", *FINAL_STATE_TYPES))
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 503:
                    return  # nothing this wait can change: the command goes on to its end
                time.sleep(0.5)  # its database busy: asked again
                continue
            if now != seen:
                seen, seen_since = now, time.monotonic()
            elif time.monotonic() - seen_since >= quiet_s:
                return
            time.sleep(0.25)
    except (httpx.HTTPError, ValueError):
        return  # the server is gone already: nothing more can be recorded
    finally:
        http.close()
