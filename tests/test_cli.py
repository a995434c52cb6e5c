"""The `goodput` command itself: what it decides before (and instead of) starting a flow run."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import load_config
from flows import cli, local_api
from goodput.data import prepare as prep
from storage.store import store_from_config
from tests.helpers import COMMAND_THEN_MODULES, REPO


def small_overrides(root: Path) -> list[str]:
    return [f"data.data_dir={root / 'data'}", f"storage.uri={root / 'store'}",
            f"run.runs_dir={root / 'runs'}", "data.max_docs=300", "data.shard_tokens=16384",
            "tokenizer.vocab_size=512", "prepare.progress=false"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The builtin corpus (300 documents) prepared and published by the library."""
    root = tmp_path_factory.mktemp("prepared")
    config = load_config(None, small_overrides(root))
    return root, config, prep.prepare_dataset(config)


def test_a_prepare_with_nothing_to_do_says_what_it_found_and_starts_no_flow_run(prepared, tmp_path):
    root, config, manifest = prepared
    prefect_home = tmp_path / "prefect-home"
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")}
    env |= {"PREFECT_HOME": str(prefect_home), "OMP_NUM_THREADS": "1"}
    # Run elsewhere than the repository: no settings file there (./.env, prefect.toml) names
    # a Prefect server.
    proc = subprocess.run([sys.executable, "-c", COMMAND_THEN_MODULES, "prepare",
                           *small_overrides(root)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    where = prep.plan_dataset(config).dir
    assert (f"dataset {manifest.dataset_id} is already prepared in {where} (from the same "
            "listing and settings) and published: nothing to tokenize or upload") in proc.stderr
    assert "nothing to do; no flow run started" in proc.stderr
    result = json.loads(proc.stdout[:proc.stdout.index("}") + 1])
    assert result == {"dataset_id": manifest.dataset_id, "vocab_size": manifest.vocab_size,
                      "dataset_dir": str(where)}  # for torchrun --dataset, export --tokenizer
    # Neither Prefect (nor torch) was imported, so no flow run and no temporary server, whose
    # database would be in PREFECT_HOME.
    assert "imported: []" in proc.stdout
    assert not (prefect_home / "prefect.db").exists()
    # The stage is recorded in summary.json as the flow records it: found, not tokenized.
    summary = json.loads(config.run_dir.summary_file.read_text())["prepare"]
    assert summary["dataset_id"] == manifest.dataset_id and summary["tokenize_s"] is None


def test_a_data_error_through_the_flows_is_its_message_and_exit_status_2(tmp_path):
    """A user's error (here a source path that matches nothing) reaches the terminal as its
    message, which says what to change, without Prefect's tracebacks around it (about 200
    lines) and once, not once per flow run around it; it ends the command as a configuration
    error does: status 2, no run directory named where none was made.

    Its flow runs, on the command's temporary server, are linked to where they can be seen
    after it: the UI of `prefect server start` on the same database (its port from Prefect's
    settings), not the temporary server, which has no UI and is gone."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH",
                           "PREFECT_UI_URL")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SERVER_API_PORT"] = "4311"
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", f"data.source={missing}",
                           f"run.runs_dir={tmp_path / 'runs'}", f"data.data_dir={tmp_path / 'data'}",
                           f"storage.uri={tmp_path / 'store'}"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"goodput: prepare failed: '{missing}' (data.source='{missing}') does not exist" in proc.stderr
    assert "Traceback" not in out and "run directory:" not in out
    # Once where it happened (the task run's line), once as the command's answer: not again
    # as each of the two flow runs around it fails (7 times in all, before).
    assert out.count(f"'{missing}' (data.source='{missing}') does not exist") == 2, out[-3000:]
    assert f"exception DataError: '{missing}'" in out
    assert (f"records its flow runs in {tmp_path / 'prefect-home' / 'prefect.db'}; `prefect "
            "server start` shows them there after, at http://127.0.0.1:4311") in out
    links = [line.split("View at ", 1)[1] for line in out.splitlines() if "View at " in line]
    assert links and all(link.startswith("http://127.0.0.1:4311/runs/flow-run/")
                         for link in links), links


def test_the_flow_runs_when_there_is_something_to_publish_or_a_server_to_show_it(
        prepared, monkeypatch, tmp_path):
    _, config, manifest = prepared
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))  # no profile names a server
    monkeypatch.chdir(tmp_path)  # nor a settings file
    found = cli._without_a_flow("prepare", config)
    assert found == {"dataset_id": manifest.dataset_id, "vocab_size": manifest.vocab_size,
                     "dataset_dir": str(prep.plan_dataset(config).dir)}

    # A configured server shows every command's flow run: the flow decides there.
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert cli._without_a_flow("prepare", config) is None
    monkeypatch.delenv("PREFECT_API_URL")

    # What publish would send is work: the flow does it (a dataset prepared while the store
    # was down, a lost pointer from the data settings).
    store, plan = store_from_config(config.storage), prep.plan_dataset(config)
    store.delete(plan.store_key("manifest.json"))
    store.delete(f"datasets/{prep.BY_SETTINGS}/{plan.settings_key}.json")
    assert prep.unpublished(plan, store) == ["dataset", "pointer"]
    assert cli._without_a_flow("prepare", config) is None
    prep.publish(plan, manifest, store)
    assert prep.unpublished(plan, store) == []
    assert cli._without_a_flow("prepare", config) == found


def test_flow_runs_on_the_temporary_server_send_heartbeats_only_where_an_automation_watches(
        prefect_api):
    """Each flow run's end waits up to 1 s for its heartbeat thread, and on the temporary
    server nothing reads the heartbeats, unless its database (PREFECT_HOME, the one `prefect
    server start` uses too) has an automation that marks runs without them as crashed:
    Prefect's recipe, made here as a user would (matching no real run, so that it cannot
    touch the other tests' runs on this shared server)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.settings import get_current_settings

    def heartbeat_frequency_while_the_flows_run():
        with local_api.no_heartbeats_unless_watched():
            return get_current_settings().flows.heartbeat_frequency

    default = get_current_settings().flows.heartbeat_frequency
    assert default and not local_api.heartbeats_watched()
    assert heartbeat_frequency_while_the_flows_run() is None

    zombies = EventTrigger(
        match={"prefect.resource.id": "prefect.flow-run.00000000-0000-0000-0000-000000000000"},
        after={local_api.HEARTBEAT_EVENT}, expect={local_api.HEARTBEAT_EVENT, "prefect.flow-run.Completed"},
        for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1, within=90)
    with get_client(sync_client=True) as client:
        ids = [client.create_automation(AutomationCore(
            name=f"crash zombie flows ({state})", enabled=enabled, trigger=zombies,
            actions=[ChangeFlowRunState(state=StateType.CRASHED)]))
            for state, enabled in (("off", False), ("on", True))]
        try:
            assert local_api.heartbeats_watched()
            assert heartbeat_frequency_while_the_flows_run() == default
            client.delete_automation(ids.pop())  # the enabled one: a disabled one acts on nothing
            assert not local_api.heartbeats_watched()
            assert heartbeat_frequency_while_the_flows_run() is None
        finally:
            for automation_id in ids:
                client.delete_automation(automation_id)


def test_the_temporary_server_opens_nothing_until_told_to_serve(tmp_path, monkeypatch):
    """Spawned beside the command's own check, the temporary server only imports until the
    command tells it to serve: stopped before that (the command had nothing to do), it
    exits at once, its port never answered and no database was made. Told to serve, it
    answers on the port the command bound for it, on PREFECT_HOME's database."""
    import urllib.request

    from prefect.settings import PREFECT_HOME, temporary_settings

    from infra.temporary_server import TemporaryServer

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    with temporary_settings({PREFECT_HOME: tmp_path}):  # where this process read it before
        unused, served = TemporaryServer(), TemporaryServer()
    assert unused.port != served.port
    time.sleep(1.0)
    assert not unused.healthy()
    started = time.monotonic()
    unused.stop()
    assert time.monotonic() - started < 5 and unused.process.returncode is not None
    assert not (tmp_path / "prefect.db").exists()

    served.serve(timeout_s=120)
    try:
        with urllib.request.urlopen(f"{served.api_url}/health", timeout=10) as response:
            assert response.read() == b"true"
        assert (tmp_path / "prefect.db").exists()
        # No block types registered at its start (nor the collections imported to see them):
        # a server without a UI has no catalogue to fill.
        request = urllib.request.Request(f"{served.api_url}/block_types/filter", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()) == []
    finally:
        served.stop()
    assert served.process.returncode is not None and not served.healthy()


def test_a_client_retries_soon_a_request_the_temporary_server_found_busy(monkeypatch):
    """A request the server answers 503 (SQLite busy) is retried by Prefect's own client after
    the server's Retry-After (0.5 s), not its backoff of 2 s, 4 s, ...; a Retry-After the
    app set itself is kept, and other answers are left as they were."""
    import anyio
    import httpx
    from prefect.client.base import PrefectHttpxAsyncClient

    from infra.temporary_server import RetrySoonWhenBusy

    answers = iter([(503, []), (503, [(b"retry-after", b"3")]), (200, [])])

    async def busy_then_ready(scope, receive, send):
        status, headers = next(answers)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    waits = []

    async def record_wait(seconds):
        waits.append(seconds)

    monkeypatch.setattr(anyio, "sleep", record_wait)

    async def ask():
        transport = httpx.ASGITransport(app=RetrySoonWhenBusy(busy_then_ready))
        async with PrefectHttpxAsyncClient(transport=transport, base_url="http://server") as client:
            response = await client.get("/api/health")
        return response.status_code, response.headers.get("retry-after")

    assert anyio.run(ask) == (200, None)
    assert len(waits) == 2
    assert 0.5 <= waits[0] < 1.0, waits  # the server's 0.5 s, Prefect's jitter above it
    assert 3.0 <= waits[1] < 4.0, waits  # the app's own Retry-After kept


# A server's lot on SQLite, with sqlite3 alone: the cursor of a write that failed ("database
# is locked") left in a reference cycle; the same connection then waits for the write lock
# in a thread of its own (aiosqlite's) while the main thread (the event loop) holds the
# other connection's write, which it commits a moment later.
WRITE_WHILE_THE_CURSOR_IS_COLLECTED = """
import gc, sqlite3, sys, threading, time, weakref
from infra.temporary_server import collect_garbage_off_the_event_loop

if sys.argv[1] == "off-the-loop":  # its first collection halfway through the write's wait
    collect_garbage_off_the_event_loop(every_s=0.5)
path = sys.argv[2]
with sqlite3.connect(path) as setup:
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (x)")
waiting = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=0.05)
holding = sqlite3.connect(path, isolation_level=None)
holding.execute("BEGIN IMMEDIATE")
holding.execute("INSERT INTO t VALUES (1)")
failed = waiting.cursor()
try:
    failed.execute("INSERT INTO t VALUES (2)")
except sqlite3.OperationalError:
    pass
waiting.execute("PRAGMA busy_timeout = 3000")
freed = weakref.ref(failed)
cycle = [failed]
cycle.append(cycle)
del failed, cycle
outcome = []

def write():
    try:
        waiting.execute("INSERT INTO t VALUES (3)")
        outcome.append("written")
    except sqlite3.OperationalError as e:
        outcome.append(str(e))

writer = threading.Thread(target=write)
writer.start()
time.sleep(0.3)  # the writer waits for the lock
if sys.argv[1] == "on-the-loop":
    gc.collect()  # as an allocation here would set it off
else:
    time.sleep(0.6)  # the collector's thread meets the cursor meanwhile
holding.execute("COMMIT")
writer.join()
time.sleep(0.2)
print(outcome[0], "freed" if freed() is None else "kept")
"""


@pytest.mark.parametrize("collected", ["on-the-loop", "off-the-loop"])
def test_a_failed_statements_cursor_collected_off_the_event_loop_stalls_no_write(tmp_path, collected):
    """Why the temporary server collects garbage on a thread of its own
    (collect_garbage_off_the_event_loop): collected on the thread that must commit, the
    failed statement's cursor waited for its connection, which waited for that commit, until
    SQLite's busy timeout failed the write (the server froze 60 s, then answered 503). Off
    that thread the write waits only for the commit, and the cursor is freed all the same."""
    proc = subprocess.run([sys.executable, "-c", WRITE_WHILE_THE_CURSOR_IS_COLLECTED, collected,
                           str(tmp_path / "server.db")], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "database is locked freed" if collected == "on-the-loop" else "written freed"
    assert proc.stdout.strip() == expected, proc.stdout + proc.stderr[-2000:]


# The collector's thread, watched through gc.callbacks while the main thread makes cyclic
# garbage (as a server's requests do): which thread collects, and which generations.
COLLECTIONS_WHILE_ALLOCATING = """
import gc, json, threading, time
from infra.temporary_server import collect_garbage_off_the_event_loop

kept = [[object() for _ in range(100)] for _ in range(2000)]  # as a server's app
seen = []
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(
    (threading.current_thread().name, info["generation"])))
collect_garbage_off_the_event_loop(every_s=0.02, full_every_s=0.5)
deadline = time.monotonic() + 1.6
while time.monotonic() < deadline:
    cycle = [object() for _ in range(50)]
    cycle.append(cycle)
    del cycle
    time.sleep(0.0005)
print(json.dumps(seen))
"""


def test_the_collectors_thread_collects_young_garbage_often_and_the_whole_heap_seldom():
    """collect_garbage_off_the_event_loop: no collection on the thread that allocates; the
    young generations each `every_s`, the whole heap once per `full_every_s`. A whole-heap
    pass every second was 16% of a core for an idle server (benchmarks/RESULTS.md)."""
    proc = subprocess.run([sys.executable, "-c", COLLECTIONS_WHILE_ALLOCATING], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert {thread for thread, _ in seen} == {"garbage-collector"}, seen
    full = sum(1 for _, generation in seen if generation == 2)
    young = sum(1 for _, generation in seen if generation < 2)
    assert 1 <= full <= 4 and young >= 3 * full, seen  # 1.6 s: at most one per 0.5 s


@pytest.mark.parametrize("protected", [False, True], ids=["no-csrf-protection", "csrf-protected"])
def test_clients_of_the_temporary_server_ask_it_for_csrf_tokens_only_where_it_wants_them(
        tmp_path, monkeypatch, protected):
    """The temporary server has the command's settings. Without CSRF protection (Prefect's
    default) its clients ask for no token (each new one asked, and was told it needs none:
    16 requests a pipeline); where a user turned protection on, they ask, and their changes
    are accepted. Either way the command's environment is as it was afterwards."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.settings import (
        PREFECT_HOME,
        PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED,
        get_current_settings,
        temporary_settings,
    )

    from infra.temporary_server import TemporaryServer

    for name in ("PREFECT_API_URL", "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED", str(protected).lower())
    with temporary_settings({PREFECT_HOME: tmp_path,
                             PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED: protected}):
        server = TemporaryServer()
        try:
            with local_api.flow_runs_recorded_by(server):
                assert get_current_settings().client.csrf_support_enabled is protected
                assert os.environ.get("PREFECT_CLIENT_CSRF_SUPPORT_ENABLED") == (
                    None if protected else "false")
                with get_client(sync_client=True) as client:
                    client.create_variable(VariableCreate(name="csrf-checked", value=protected))
                    assert client.read_variable_by_name("csrf-checked").value is protected
        finally:
            server.stop()
    assert "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED" not in os.environ
    assert "PREFECT_API_URL" not in os.environ


# A flow of quick tasks on the command's temporary server, then the command's wait for the
# server to record them (in the configuration a `goodput` command gives Prefect), then the stop.
MANY_QUICK_TASKS = """
import os, sys, time
from flows import cli, local_api
from infra.temporary_server import TemporaryServer

cli._prefect_defaults()
server = TemporaryServer()
os.environ["PREFECT_API_URL"] = server.api_url
server.serve(timeout_s=120)
from prefect import flow, task

@task
def quick(i):
    return i

@flow
def many(n):
    return sum(future.result() for future in [quick.submit(i) for i in range(n)])

began = time.time()
assert many(int(sys.argv[1])) == sum(range(int(sys.argv[1])))
waited = time.time()
local_api.let_the_api_record(server, began)
print(f"waited {time.time() - waited:.2f} s")
server.stop()
"""


@pytest.mark.parametrize("logs_to_api", [True, False], ids=["task-run-ends-logged", "no-api-logs"])
def test_the_temporary_server_records_every_task_run_before_it_stops(tmp_path, logs_to_api):
    """The recorder writes task runs about once a second, behind the flow: the command
    waits, then stops the server, and every task run is in the database, final. With the
    task runs' ends logged to the API (the default) the wait knows which to wait for;
    without, it waits for the counts to settle."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")}
    env |= {"PREFECT_HOME": str(tmp_path), "PREFECT_LOGGING_TO_API_ENABLED": str(logs_to_api).lower()}
    proc = subprocess.run([sys.executable, "-c", MANY_QUICK_TASKS, "150"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "prefect.db")
    states = dict(db.execute("SELECT state_type, count(*) FROM task_run GROUP BY state_type"))
    assert states == {"COMPLETED": 150}, proc.stdout


# Exit hooks of both kinds, something left in stdout's buffer, then goodput's way out.
EXIT_HOOKS = """
import atexit, sys, threading
from core.process_exit import exit_without_teardown

threading._register_atexit(lambda: open(sys.argv[1], "a").write("threading\\n"))
atexit.register(lambda: open(sys.argv[1], "a").write("atexit\\n"))
print("buffered", end="")
exit_without_teardown(3)
"""


def test_the_command_exits_without_the_teardown_but_after_every_exit_hook(tmp_path):
    """`goodput` skips the interpreter's teardown (seconds with torch loaded), not what a
    normal exit runs first: threading's exit hooks (where Prefect's log and event services
    send what they hold), then atexit's, then the flush of stdout; with the exit status."""
    hooks = tmp_path / "hooks.txt"
    proc = subprocess.run([sys.executable, "-c", EXIT_HOOKS, str(hooks)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert hooks.read_text() == "threading\natexit\n"
    assert proc.stdout == "buffered"


def test_ctrl_c_ends_a_prepare_whose_units_run_in_a_process_pool(tmp_path):
    """Ctrl-C reaches the pool's workers too; the KeyboardInterrupt one returns kills the
    pool's manager thread, which then never tells the others to stop, and multiprocessing's
    exit handler waited for them forever: the command hung after "interrupted". Now they
    ignore it and the flow's process stops them: the command ends without their tracebacks,
    leaving no process behind."""
    import psutil
    import signal

    from tests.test_prepare import write_source

    words = [f"word{i}" for i in range(3000)]
    docs = [" ".join(words[(d * 31 + j) % 3000] for j in range(120)) for d in range(12000)]
    write_source(tmp_path / "corpus", "jsonl", docs)  # about 9 MB: 9 units of 1 MiB
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "prepare", f"data.source={tmp_path / 'corpus'}",
         f"run.runs_dir={tmp_path / 'runs'}", f"data.data_dir={tmp_path / 'data'}",
         f"storage.uri={tmp_path / 'store'}", "data.unit_bytes=1MiB", "prepare.workers=2",
         "tokenizer.vocab_size=512", "prepare.progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
        start_new_session=True)  # a terminal's foreground group
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if "Task run 'tokenize-unit-" in line and "Finished in state Completed" in line:
                break
        else:
            pytest.fail("prepare ended before its first unit:\n" + "".join(output)[-3000:])
        family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        output.append(proc.communicate(timeout=60)[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    text = "".join(output)
    assert proc.returncode == 130, text[-3000:]
    assert "goodput: prepare interrupted" in text
    # The pool's processes ignore Ctrl-C: the flow's process stops them, and none prints its
    # traceback of the KeyboardInterrupt (about 150 lines before).
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    time.sleep(1)
    assert not [pid for pid in family if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "processes left"


@pytest.mark.parametrize("error, status", [
    ("config", 2), ("retryable", 1), ("permission", 2), ("other", 1), ("hub", 1)])
def test_an_input_error_that_ends_training_exits_2(monkeypatch, tmp_path, capsys, error, status):
    """Scripts tell the input from a crash by the exit status: 2 also when the refusal reached
    the command as a training attempt's failure of class config (a worker refused the data),
    or as the store refusing the credentials; 1 for what is not the input's fault."""
    import httpx

    import flows.train
    from core.protocol import FailureClass
    from infra.torchrun import TrainingFailed

    raised = {"config": TrainingFailed("attempt a-1 ended: config (the dataset's tokenizer ...)",
                                       FailureClass.CONFIG, 5, retry=False),
              "retryable": TrainingFailed("attempt a-1 ended: retryable", FailureClass.RETRYABLE, 5),
              "permission": PermissionError("s3://b/p: access denied (SignatureDoesNotMatch)"),
              "other": RuntimeError("boom"),
              # Another service's refusal (a gated dataset) is no word from the Prefect server.
              "hub": httpx.HTTPStatusError(
                  "403 Forbidden: gated repo", request=httpx.Request("GET", "https://huggingface.co/d"),
                  response=httpx.Response(403))}[error]

    def train(config):
        raise raised

    monkeypatch.setattr(flows.train, "train", train)
    config = load_config(None, small_overrides(tmp_path))
    args = cli.build_parser().parse_args(["train"])
    assert cli._run_flow(args, config, None, None) == status
    err = capsys.readouterr().err
    assert f"goodput: train failed: {raised}" in err and "PREFECT_API_AUTH_STRING" not in err


def test_a_store_too_slow_to_answer_leaves_the_decision_to_the_flow(prepared, monkeypatch, tmp_path, capsys):
    """The nothing-to-do check reads the store; an unreachable endpoint, each request retried,
    held the command for minutes before its flow (which retries the same and reports it) even
    started. Past PRECHECK_S the flow decides."""
    _, config, _ = prepared
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    slow = prep.nothing_to_prepare

    def unreachable(*args):
        time.sleep(3)
        return slow(*args)

    monkeypatch.setattr(prep, "nothing_to_prepare", unreachable)
    monkeypatch.setattr(cli, "PRECHECK_S", 0.5)
    started = time.monotonic()
    assert cli._without_a_flow("prepare", config) is None
    assert time.monotonic() - started < 2.5
    assert "the check for work to do took over 0.5 s" in capsys.readouterr().err


def test_a_store_that_cannot_be_reached_stops_the_command_before_any_flow_run(tmp_path, monkeypatch,
                                                                           capsys):
    """A wrong storage.endpoint_url took about 3 minutes to fail: the check for work to do,
    then the flow's task, each request and operation retried. Now the command says so after
    STORE_REACH_S, having started no flow run."""
    from infra.launchers import free_port

    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setattr(cli, "STORE_REACH_S", 1.0)
    endpoint = f"http://127.0.0.1:{free_port()}"
    overrides = [*small_overrides(tmp_path), "storage.uri=s3://goodput-test/runs",
                 f"storage.endpoint_url={endpoint}"]
    started = time.monotonic()
    assert cli.main(["prepare", *overrides]) == 1
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert f"goodput: the store s3://goodput-test/runs cannot be reached at {endpoint}: nothing listens" in err
    assert "Start the store, or name its endpoint (storage.endpoint_url" in err
    assert not (tmp_path / "prefect-home").exists()  # no flow run: the temporary server never served


def test_a_warning_of_the_commands_check_is_not_shown_again_by_its_flow(tmp_path):
    """The check for work to do lists the sources, as the flow's plan task does after it: a
    folder with a test.jsonl was warned about twice on the console, once as a bare line."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (corpus / name).write_text("".join(json.dumps({"text": f"document {i} of {name}"}) + "\n"
                                           for i in range(200)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", *small_overrides(tmp_path),
                           f"data.source={corpus}"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "test.jsonl included" in line]
    assert len(warned) == 1 and warned[0].startswith("goodput: warning: "), warned
    assert "Beginning flow run" in proc.stderr  # the flow ran, and made the same check


def test_a_prefect_server_that_cannot_be_reached_is_named_with_what_to_do(tmp_path):
    from infra.launchers import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",
            "PREFECT_HOME": str(tmp_path / "prefect-home")}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", *small_overrides(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Failed to reach API at" in proc.stderr
    assert "is the Prefect server up? (`goodput server`, `prefect server start`)" in proc.stderr


def test_a_config_that_would_not_continue_the_run_is_refused_before_anything_starts(tmp_path):
    """Another worker count changes the global batch, a longer max_steps the LR schedule: the
    command refuses at once (no flow run, no temporary server: it took 15 s and printed the
    refusal three times), with status 2 and the overrides that keep the run's trajectory."""
    from goodput.runs import write_run_config

    overrides = [f"run.runs_dir={tmp_path / 'runs'}", f"data.data_dir={tmp_path / 'data'}",
                 f"storage.uri={tmp_path / 'store'}"]
    saved = write_run_config(load_config(None, overrides))  # 2 workers x 8 samples: 16
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)

    def refusal(*changes: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", str(saved),
                               *changes], capture_output=True, text=True, cwd=REPO, env=env,
                              timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert proc.stderr.count("already exists") == 1, proc.stderr
        return proc.stderr

    said = refusal("parallelism.nproc_per_node=1")
    assert "training.global_batch: 16 in the run, 8 here" in said
    assert ("add training.micro_batch_size=16 or training.grad_accum_steps=2" in said), said
    said = refusal("training.max_steps=600")
    assert "model.init_from=DIR" in said and "goodput export" in said
    assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # no server was started


@pytest.mark.parametrize("error", ["no files match /data/x*.jsonl: check data.source",
                                   "no files match '/data/x*.jsonl': check data.source",
                                   "two lines:\nthe second names data.source"])
def test_the_console_shows_an_error_once_however_prefect_quotes_it(error):
    """Prefect writes a state's message with repr(): in '...' unless the text holds a ',
    newlines escaped. The task run's line shows; the flow runs' lines around it do not, and
    their other lines do."""
    import logging

    def record(logger: str, message: str, error: Exception | None = None) -> logging.LogRecord:
        exc_info = (type(error), error, None) if error is not None else None
        return logging.LogRecord(logger, logging.INFO, __file__, 1, message, None, exc_info)

    once = cli._EachErrorOnceOnTheConsole()
    raised = ValueError(error)
    state = f"Finished in state Failed({('Task run encountered an exception ValueError: ' + error)!r})"
    assert once.filter(record("prefect.task_runs", state))
    assert not once.filter(record("prefect.flow_runs", f"Encountered exception during execution: "
                                                       f"{raised!r}", raised))
    flow_state = f"Finished in state Failed({('Flow run encountered an exception: ValueError: ' + error)!r})"
    assert not once.filter(record("prefect.flow_runs", flow_state))
    assert once.filter(record("prefect.flow_runs", "Finished in state Completed()"))
    assert once.filter(record("prefect.task_runs", state))  # a retry's own line still shows


def test_overrides_are_taken_anywhere_on_the_command_line(capsys):
    import yaml

    tiny = str(REPO / "configs/tiny.yaml")
    assert cli.main(["show-config", "training.max_steps=50", "--config", tiny, "model.dim=64",
                     "training.max_steps=70"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["dim"] == 64 and shown["training"]["max_steps"] == 70  # the last wins
    args = cli.parse_args(["evaluate", "--config", tiny, "eval.limit=5", "--checkpoint", "300",
                           "eval.max_batches=2"])
    assert (args.overrides, args.checkpoint, args.config) == (["eval.limit=5", "eval.max_batches=2"],
                                                              "300", tiny)
    assert cli.main(["plan", "--config", tiny, "parallelism.device=cpu", "--strict",
                     "parallelism.nproc_per_node=2", "parallelism.dp_replicate=1",
                     "parallelism.dp_shard=2"]) == 0
    assert "dp_shard=2" in capsys.readouterr().out.replace(" ", "")
    with pytest.raises(SystemExit) as refused:  # an unknown option is still refused
        cli.parse_args(["show-config", "model.dim=64", "--config", tiny, "--frobnicate"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "usage: goodput show-config" in err
    assert "unrecognized arguments: --frobnicate" in err
    assert cli.main(["show-config", "model.dim=64", "--config", tiny, "oops"]) == 2
    assert "override 'oops' must look like section.field=value" in capsys.readouterr().err


@pytest.mark.parametrize("argv, override", [
    (["train", "--nproc_per_node", "2"], "parallelism.nproc_per_node=2"),
    (["train", "--nproc-per-node", "2"], "parallelism.nproc_per_node=2"),
    (["train", "--max_steps", "5"], "training.max_steps=5"),
    (["pipeline", "--config", "configs/tiny.yaml", "--max-steps=5", "model.dim=64"],
     "training.max_steps=5"),
    (["plan", "--micro-batch-size", "4"], "training.micro_batch_size=4"),
])
def test_a_torchrun_or_megatron_flag_is_answered_with_the_override_to_use(argv, override, capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2
    assert f"usage: goodput {argv[0]}" in err and "unrecognized arguments" not in err
    assert f"give the config field as an override: {override}" in err


def test_seaweedfs_on_a_busy_port_names_the_option_to_choose_another(tmp_path, capsys):
    import socket

    from infra import seaweedfs

    with socket.socket() as taken:
        taken.bind((seaweedfs.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = seaweedfs.main(["--dir", str(tmp_path / "s3"), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"port {port}" in err and "--port" in err and "Traceback" not in err


def test_seaweedfs_restarted_on_its_data_directory_keeps_its_keys(tmp_path):
    """Every start made new keys: a store restarted on the same --dir (the README's command)
    refused the running pipeline's uploads (InvalidAccessKeyId) until it was restarted too."""
    import signal

    from infra.seaweedfs import _free_ports

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def keys_served() -> list[str]:
        port = _free_ports(1)[0]
        proc = subprocess.Popen([sys.executable, "-m", "infra.seaweedfs", "--dir", str(tmp_path / "s3"),
                                 "--port", str(port)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("Ctrl-C stops it"):
                    break
            return [line.strip() for line in lines if line.startswith("export AWS_") and "KEY" in line]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    first = keys_served()
    assert len(first) == 2 and first[0].startswith("export AWS_ACCESS_KEY_ID=goodput-")
    assert keys_served() == first


def test_a_run_pointed_at_another_store_is_warned_that_its_checkpoints_are_not_there(tmp_path, capsys):
    """A finished run given a new storage.uri uploaded nothing there, and said nothing: a
    machine resuming from the new store would not find its checkpoints."""
    from goodput.runs import checkpoints_elsewhere
    from storage.ledger import Ledger, checkpoint_key
    from storage.store import open_store

    old = open_store(str(tmp_path / "old-store"))
    config = load_config("configs/tiny.yaml", [f"run.runs_dir={tmp_path / 'runs'}",
                                               f"storage.uri={tmp_path / 'old-store'}"])
    ledger = Ledger(config.run_dir)
    for step in (50, 100):
        ledger.record(step, "uploaded", store_url=old.url(checkpoint_key(config.run.run_id, step)))
    assert checkpoints_elsewhere(config) is None  # its own store
    moved = load_config("configs/tiny.yaml", [f"run.runs_dir={tmp_path / 'runs'}",
                                              "storage.uri=s3://goodput/experiments"])
    said = checkpoints_elsewhere(moved)
    assert said.startswith(f"run 'tiny' has its newest checkpoint (step 100) uploaded to {old.uri}, "
                           "not to this config's store s3://goodput/experiments")
    assert "set storage.uri to that store" in said and "choose a new run.run_id" in said
    # A store that holds the old one (its parent): still not where a resume looks.
    parent = load_config("configs/tiny.yaml", [f"run.runs_dir={tmp_path / 'runs'}", f"storage.uri={tmp_path}"])
    assert checkpoints_elsewhere(parent) is not None
    # Moved on purpose: the newest checkpoint is in the new store; older ones left behind are fine.
    ledger.record(150, "uploaded", store_url=f"s3://goodput/experiments/{checkpoint_key('tiny', 150)}")
    assert checkpoints_elsewhere(moved) is None


def test_the_export_hint_is_not_given_for_a_model_export_refuses():
    """A run of configs/tiny-moe.yaml was told to `goodput export` its checkpoint, which
    export then refused (routing unlike Mixtral's); the hint now says why instead, in the
    words export uses, and the fewest overrides that would train one that exports: Qwen3-MoE
    allows its dense first block and unnormalised top-k, so two, not Mixtral's three."""
    moe = load_config("configs/tiny-moe.yaml")
    assert cli._why_not_exportable(moe) == ([
        "model.moe.first_dense_layers=1 (Mixtral: 0)", "model.moe.route_norm=False (Mixtral: True)",
        "a routing bias (model.moe.bias_update_rate, e.g. its expert_bias tensors), which Mixtral's "
        "router does not have"], ["model.qk_norm=true", "model.moe.bias_update_rate=0"])
    assert cli._why_not_exportable(load_config("configs/tiny-moe.yaml", [
        "model.qk_norm=true", "model.moe.bias_update_rate=0"])) == ([], [])  # exports as Qwen3-MoE
    # As near as Qwen3-MoE (one override each): Mixtral's, which adds no weights (q/k norms).
    assert cli._why_not_exportable(load_config("configs/tiny-moe.yaml", [
        "model.moe.first_dense_layers=0", "model.moe.bias_update_rate=0"]))[1] == [
        "model.moe.route_norm=true"]
    deepseek = load_config("configs/deepseek-v3.yaml")
    assert cli._why_not_exportable(deepseek)[1] == [
        "model.moe.shared_experts=0", "model.moe.first_dense_layers=0", "model.moe.score_func=softmax",
        "model.moe.route_scale=1.0", "model.moe.bias_update_rate=0"]
    assert cli._why_not_exportable(load_config("configs/tiny.yaml")) == ([], [])
    assert cli._why_not_exportable(load_config("configs/tiny.yaml", [
        "model.qkv_bias=true", "model.qk_norm=true"]))[1] == ["model.qkv_bias=false"]
