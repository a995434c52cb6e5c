"""The production Prefect stack, for real: PostgreSQL, a Prefect server on it with API auth,
the process work pool, a worker and prefect.yaml's deployments, all started by
infra.prefect_stack as `goodput server` starts them. Flow runs are triggered through the
API and run in the worker's processes, as a team's runs would.

And the orchestrator as a failure domain: the server killed and restarted mid-training,
the flow run's own process killed mid-training.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import psutil
import pytest

from infra.launchers import free_port
from infra.prefect_stack import (
    DEPLOYED_HASH_FILE,
    PrefectStack,
    StackClient,
    _prefect,
    deployments_to_deploy,
    missing_postgres,
    prefect_yaml_hash,
)
from storage.ledger import Ledger
from tests.helpers import REPO, small_config, wait_for
from training.metrics import read_metrics

pytestmark = pytest.mark.prefect_stack

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    missing = missing_postgres()
    if missing:
        pytest.skip(f"PostgreSQL not installed ({', '.join(missing)} missing): "
                    "apt-get install postgresql, or run scripts/setup.sh as root")
    # Not under pytest's temporary directory (closed to other users): the database runs as
    # the user postgres, which must reach its directory.
    directory = tempfile.mkdtemp(prefix="goodput-stack-")
    try:
        with PrefectStack(directory, port=free_port()) as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def api(stack) -> StackClient:
    return stack.client()


@pytest.fixture(scope="module")
def workdir(api, tmp_path_factory):
    """A directory of runs whose dataset is prepared (by the prepare deployment)."""
    workdir = tmp_path_factory.mktemp("stack-runs")
    prepared = api.wait_final(api.trigger("prepare/goodput-prepare",
                                          {"config": form(workdir, "run.run_id=prepare")}), 600)
    assert prepared["state"]["type"] == "COMPLETED", prepared["state"]
    return workdir


def form(workdir, *overrides: str) -> dict:
    """The RunConfig form of a small run in `workdir`, as the UI submits it."""
    return small_config(workdir, *overrides).model_dump(mode="json")


def trained_to(run_dir) -> int:
    try:
        return json.loads((run_dir / "heartbeat.json").read_text()).get("step") or 0
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def processes_of(run_dir) -> list[psutil.Process]:
    """torchrun and training processes of this run."""
    found = []
    for process in psutil.process_iter():
        try:
            if any(str(run_dir) in arg for arg in process.cmdline()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def attempt_of(process: psutil.Process) -> str:
    """The training attempt a process runs for (GOODPUT_ATTEMPT); "" for one that has ended
    meanwhile (gone, or a zombie not reaped yet: its environment no longer reads)."""
    try:
        return process.environ().get("GOODPUT_ATTEMPT", "")
    except psutil.Error:
        return ""


def flow_process(flow_run_id: str) -> psutil.Process:
    """The process the worker started for a flow run: of the processes in that flow run's
    environment (its torchrun agents and workers inherit it), the one whose parent is not.
    Not the lowest pid: after a long test session pids wrap, and a worker's may be lower."""
    def runs_it(process: psutil.Process) -> bool:
        try:
            return process.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
        except psutil.Error:
            return False

    for process in psutil.process_iter():
        if runs_it(process):
            try:
                parent = process.parent()
            except psutil.Error:
                continue
            if parent is None or not runs_it(parent):
                return process
    raise LookupError(f"no process runs flow run {flow_run_id}")


# -- who may use it ---------------------------------------------------------------------------

def test_the_api_asks_for_the_auth_string_and_listens_on_loopback_only(stack, api):
    assert httpx.post(f"{stack.api_url}/flows/filter", json={}).status_code == 401
    assert httpx.post(f"{stack.api_url}/flows/filter", json={},
                      auth=("goodput", "not-the-secret")).status_code == 401
    assert api.post("/flows/filter", {}).status_code == 200
    # Bound to 127.0.0.1: no listening socket on another address has the server's port.
    listening = [c for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == stack.port]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    # The secret is a file only its owner reads, and the deployments are there.
    assert (stack.directory / "api-auth-string").stat().st_mode & 0o777 == 0o600
    deployments = {d["name"] for d in api.post("/deployments/filter", {}).json()}
    assert {"goodput-prepare", "goodput-train", "goodput-evaluate", "goodput-pipeline"} <= deployments
    # A command without the auth string is told which one to give (exit 2: its input).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", "run.run_id=no-auth"],
                          env={**env, "PREFECT_API_URL": stack.api_url}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "401 Unauthorized" in proc.stderr and "PREFECT_API_AUTH_STRING" in proc.stderr


# -- the deployments ------------------------------------------------------------------------

def test_a_starting_stack_deploys_only_what_is_new_or_changed(tmp_path):
    """All of prefect.yaml when it is not the one last deployed; else only deployments the
    server lacks (the others keep what the UI changed)."""
    prefect_yaml = tmp_path / "prefect.yaml"
    prefect_yaml.write_text("deployments:\n  - name: a\n    entrypoint: f.py:f\n"
                            "  - name: b\n    entrypoint: f.py:g\n")
    deployed = prefect_yaml_hash(prefect_yaml)
    assert deployments_to_deploy(prefect_yaml, None, set()) == ["a", "b"]  # never deployed
    assert deployments_to_deploy(prefect_yaml, None, {"a", "b"}) == ["a", "b"]
    assert deployments_to_deploy(prefect_yaml, deployed, {"a", "b"}) == []
    assert deployments_to_deploy(prefect_yaml, deployed, {"a"}) == ["b"]  # b deleted: back
    prefect_yaml.write_text(prefect_yaml.read_text().replace("f.py:g", "f.py:h"))
    assert deployments_to_deploy(prefect_yaml, deployed, {"a", "b"}) == ["a", "b"]
    prefect_yaml.write_text("deployments: nothing\n")
    with pytest.raises(RuntimeError, match=r"prefect.yaml: cannot read its deployments' names"):
        deployments_to_deploy(prefect_yaml, deployed, set())


def test_a_restart_keeps_what_the_ui_changed_in_the_deployments(stack, api):
    """A schedule switched on and job variables edited in the UI (the same API calls) are
    still there after `goodput server` restarts: prefect.yaml is unchanged since the stack
    deployed it, so nothing is deployed again, and the stack says how to on purpose."""
    assert (stack.directory / DEPLOYED_HASH_FILE).read_text().strip() == \
        prefect_yaml_hash(REPO / "prefect.yaml")
    deployment = api.deployment("evaluate/goodput-evaluate")
    [schedule] = api.http.get(f"{api.url}/deployments/{deployment}/schedules").json()
    assert not schedule["active"]
    edited = {"stream_output": False, "env": {"EDITED_IN_THE_UI": "1"}}
    try:
        api.http.patch(f"{api.url}/deployments/{deployment}/schedules/{schedule['id']}",
                       json={"active": True}).raise_for_status()
        api.http.patch(f"{api.url}/deployments/{deployment}",
                       json={"job_variables": edited}).raise_for_status()
        said = []
        stack.stop()
        stack.start(say=said.append)
        [schedule] = api.http.get(f"{api.url}/deployments/{deployment}/schedules").json()
        assert schedule["active"]
        assert api.http.get(f"{api.url}/deployments/{deployment}").json()["job_variables"] == edited
        assert len(said) == 1 and "deployments left as they are" in said[0]
        assert "prefect --no-prompt deploy --all" in said[0]
    finally:  # as prefect.yaml has them, for the tests after this one
        api.http.patch(f"{api.url}/deployments/{deployment}/schedules/{schedule['id']}",
                       json={"active": False}).raise_for_status()
        api.http.patch(f"{api.url}/deployments/{deployment}",
                       json={"job_variables": {"stream_output": False}}).raise_for_status()


@contextmanager
def a_worker_of_its_own(stack, tmp_path, env: dict[str, str]) -> Iterator[None]:
    """A process worker started from `tmp_path` with `env`, the stack's own stopped meanwhile
    so that this one takes the runs; its output in tmp_path/worker.log."""
    stack.kill_worker()
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([_prefect(), "worker", "start", "--pool", stack.pool,
                                   "--type", "process"], env=env, cwd=tmp_path,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        stack.start_worker()


def test_a_worker_without_goodput_repo_runs_flows_in_the_installed_repository(
        stack, api, workdir, tmp_path):
    """A worker started elsewhere without GOODPUT_REPO: prefect.yaml's pull step enters the
    repository of the installed flows package, and the flow run completes. Prefect's own
    step entered "" (GOODPUT_REPO unset) and the flow run failed on a file not found."""
    env = {k: v for k, v in stack._env(PREFECT_WORKER_QUERY_SECONDS="1").items()
           if k != "GOODPUT_REPO"}
    with a_worker_of_its_own(stack, tmp_path, env):
        run = api.trigger("prepare/goodput-prepare",
                          {"config": form(workdir, "run.run_id=prepare")})  # prepared: quick
        finished = api.wait_final(run, 300)
        assert finished["state"]["type"] == "COMPLETED", (
            finished["state"], (tmp_path / "worker.log").read_text()[-3000:])
        assert any("enter_repository" in log["message"] for log in api.logs(run))


def test_a_worker_whose_goodput_repo_is_wrong_fails_its_flow_runs_saying_why(stack, api, workdir, tmp_path):
    """GOODPUT_REPO naming no repository: the flow run ends Failed with the reason in its
    state and its log. The pull step's error went to the flow run's own output, which no one
    reads (stream_output: false): the run was Crashed, "Process exited with status code: 1"."""
    env = stack._env(PREFECT_WORKER_QUERY_SECONDS="1", GOODPUT_REPO=str(tmp_path))
    with a_worker_of_its_own(stack, tmp_path, env):
        run = api.trigger("prepare/goodput-prepare", {"config": form(workdir, "run.run_id=prepare")})
        finished = api.wait_final(run, 300)
        reason = f"GOODPUT_REPO={tmp_path} is not a Goodput repository (it needs prefect.yaml and flows/)"
        assert finished["state"]["type"] == "FAILED", (
            finished["state"], (tmp_path / "worker.log").read_text()[-3000:])
        assert reason in finished["state"]["message"]
        assert any(reason in log["message"] for log in api.logs(run))


# -- load -------------------------------------------------------------------------------------

@pytest.mark.slow  # about 5 min on 2 cores; benchmarks/orchestrator_bench.py runs the same load and counts
def test_eight_pipelines_at_once_complete_and_every_task_run_is_recorded(stack, api, workdir):
    """8 pipelines triggered at once through the work pool: all complete; the database holds
    every task run each flow run logged as finished, in a final state; no database error in
    the server's or the worker's log."""
    since = time.time()
    runs = [api.trigger("pipeline/goodput-pipeline", {"config": form(
        workdir, f"run.run_id=load-{i}", "training.max_steps=4", "checkpoint.every_steps=2",
        "parallelism.nproc_per_node=1", "eval.max_batches=2", "eval.num_samples=1")})
        for i in range(8)]
    finished = [api.wait_final(run, 1500) for run in runs]
    assert [run["state"]["type"] for run in finished] == ["COMPLETED"] * 8, \
        [run["state"] for run in finished]
    logged, states = stack.task_runs_since(since)
    assert logged >= 8 * 20  # each pipeline: prepare, train, evaluate and their tasks
    assert states == {"COMPLETED": logged}
    for name in ("server", "worker"):
        text = stack.log(name).read_text()
        for sign in ("database is locked", "deadlock", "DBAPIError", "OperationalError",
                     "Traceback"):
            assert sign not in text, f"{sign!r} in the {name}'s log"


# -- the orchestrator fails -------------------------------------------------------------------

# A validate or upload task that starts while the API is away fails acquiring Prefect's tag
# concurrency slots (a client of its own, never having connected, does not retry a refused
# connection) outside the task's retries; the flow secures those checkpoints once training ends
# (tasks.control.settle), and the run ends Completed.
def test_training_goes_on_through_a_server_restart(stack, api, workdir):
    """The server killed mid-training and started again: the workers train on meanwhile,
    the flow run ends Completed, every checkpoint is validated and uploaded (those whose
    tasks could not start while the API was away included), and logs and events resume."""
    run_dir = workdir / "runs" / "restart"
    flow_run = api.trigger("train/goodput-train", {"config": form(
        workdir, "run.run_id=restart", "training.max_steps=240", "checkpoint.every_steps=40")})
    wait_for(lambda: trained_to(run_dir) >= 50, 600, "training past the first checkpoint", 0.5)
    stack.kill_server()
    down_at, step_at_kill = time.time(), trained_to(run_dir)
    time.sleep(15)
    assert trained_to(run_dir) > step_at_kill, "training stopped with the server"
    stack.start_server()
    back_at = time.time()

    finished = api.wait_final(flow_run, 600)
    failures = [log["message"][-1500:] for log in api.logs(flow_run) if log["level"] >= 40]
    assert finished["state"]["type"] == "COMPLETED", (finished["state"], failures[-5:])
    ledger = Ledger(run_dir).read()
    assert ledger.steps("uploaded") == list(range(40, 241, 40)), ledger.entries
    outcomes = [json.loads(p.read_text()) for p in run_dir.glob("attempts/*/outcome.json")]
    assert [o["class"] for o in outcomes] == ["done"]  # not mistaken for a hang meanwhile
    # Logs and events sent after the restart reach the new server. They come in the
    # background, and may come after the flow run's final state: the client's log and event
    # services may still be in a retry's backoff from the outage (up to 128 s, in a CI run
    # with another test beside it).
    wait_for(lambda: any(_unix(log["timestamp"]) > back_at for log in api.logs(flow_run)),
             180, "log of the flow run sent after the restart", 2)
    wait_for(lambda: any(_unix(event["occurred"]) > back_at
                         for event in api.events("goodput.checkpoint.uploaded", "restart")),
             180, "checkpoint-uploaded event sent after the restart", 2)
    assert down_at < back_at


def test_the_stack_starts_a_stopped_database_again(stack, api):
    """PostgreSQL stopped under the stack: `goodput server`'s watch (keep_up) starts it
    again on its port, and the server with it (its connections died; its health check, which
    reads no table, had answered all along while every other request failed)."""
    stack.postgres.stop()
    assert not stack.postgres.running()
    assert [what for what, _ in stack.keep_up()] == ["PostgreSQL", "the Prefect server"]
    assert stack.postgres.running() and stack.healthy()
    assert api.post("/flows/filter", {"limit": 1}).status_code == 200
    assert stack.keep_up() == []  # all up: nothing to do


def test_a_killed_worker_leaves_its_flow_runs_training_and_stopping_the_stack_cancels_them(
        stack, api, workdir):
    """The worker dies (SIGKILL) while its flow run trains, and is started again, as `goodput
    server` does: the flow run goes on training and securing its checkpoints. Its output
    used to be piped to the worker; the first log line after the worker's death ended it
    (Crashed), its torchrun workers training on unsupervised.

    Then what `goodput server` does on Ctrl-C or SIGTERM before it stops the worker: each flow
    run under way is cancelled as from the UI, its workers saving an emergency checkpoint.
    Stopped with the stack, training went on unsupervised, and the server, back, called the
    flow run Crashed with its checkpoints unsecured. The flow run here is one of a worker the
    stack replaced: no longer a child of the running worker, it was left training with no
    server."""
    run_dir = workdir / "runs" / "stack-stop"
    flow_run = api.trigger("train/goodput-train", {"config": form(
        workdir, "run.run_id=stack-stop", "training.max_steps=100000", "checkpoint.every_steps=50")})
    wait_for(lambda: trained_to(run_dir) >= 55, 600, "training past the first checkpoint", 0.5)
    # Its output goes nowhere the worker holds: with a pipe to it, rich's broken-pipe
    # handler raised SystemExit in whichever thread logged first (the main one: Crashed;
    # the one reading torchrun's output: training on, unread).
    flow = flow_process(flow_run).pid
    assert {os.readlink(f"/proc/{flow}/fd/{fd}") for fd in (1, 2)} == {"/dev/null"}
    stack.kill_worker()
    step = trained_to(run_dir)
    wait_for(lambda: trained_to(run_dir) >= step + 110, 300, "two more checkpoints", 0.5)
    assert api.flow_run(flow_run)["state"]["type"] == "RUNNING"
    wait_for(lambda: Ledger(run_dir).read().steps("uploaded")[:3] == [50, 100, 150], 120,
             "the checkpoints saved while the worker was away uploaded", 0.5)
    stack.start_worker()
    assert stack.cancel_flow_runs() == [flow_run]
    assert api.flow_run(flow_run)["state"]["type"] == "CANCELLED"
    wait_for(lambda: not processes_of(run_dir), 30, "the run's torchrun and workers to end", 0.5)
    outcomes = [json.loads(p.read_text()) for p in run_dir.glob("attempts/*/outcome.json")]
    assert [o["class"] for o in outcomes] == ["cancelled"]
    assert outcomes[0]["newest_checkpoint"] == outcomes[0]["step"]  # an emergency checkpoint


def test_workers_of_a_killed_flow_process_stop_and_the_next_flow_run_waits_for_them(
        stack, api, workdir):
    """Flow run A trains; B, for the same run, waits for A's lease. A's process is killed
    (SIGKILL: no cleanup): its workers, with no supervisor renewing the lease, write an
    emergency checkpoint and stop within launch.orphan_timeout_s; B waits for them, never
    training beside them, then resumes from a checkpoint and finishes."""
    run_dir = workdir / "runs" / "orphans"
    config = form(workdir, "run.run_id=orphans", "training.max_steps=100000",
                  "checkpoint.every_steps=40", "launch.orphan_timeout_s=10", "training.log_every=7")
    a = api.trigger("train/goodput-train", {"config": config})
    wait_for(lambda: trained_to(run_dir) >= 45, 600, "A training past a checkpoint", 0.5)
    b = api.trigger("train/goodput-train", {"config": config, "time_limit_s": 1})
    wait_for(lambda: any("is being trained by flow run" in log["message"] for log in api.logs(b)),
             300, "B waiting for A's lease")

    os.kill(flow_process(a).pid, signal.SIGKILL)
    killed_at = time.monotonic()
    a_attempt = str(a)[-8:]
    wait_for(lambda: not [p for p in processes_of(run_dir)
                          if attempt_of(p).startswith(a_attempt)],
             120, "A's workers to stop by themselves", 0.5)
    assert time.monotonic() - killed_at < 10 + 60  # orphan timeout + the emergency save
    records = [json.loads(p.read_text()) for p in run_dir.glob(f"attempts/attempt-{a_attempt}-*/rank-*.json")]
    assert records and {r["class"] for r in records} == {"orphaned"}

    finished = api.wait_final(b, 600)
    assert finished["state"]["type"] == "COMPLETED", finished["state"]
    steps = read_metrics(run_dir)
    a_steps = [m for m in steps if m["attempt"].startswith(a_attempt)]
    b_steps = [m for m in steps if m["attempt"].startswith(str(b)[-8:])]
    assert b_steps[0]["step"] > 1, "B should resume from a checkpoint A left"
    assert b_steps[0]["time"] > a_steps[-1]["time"], "B trained while A's workers still did"
    # B recorded what A's killed process could not: A's attempt, and A's time in the total.
    [a_outcome] = [json.loads(p.read_text())
                   for p in run_dir.glob(f"attempts/attempt-{a_attempt}-*/outcome.json")]
    assert a_outcome["class"] == "orphaned" and a_outcome["step"] >= 45, a_outcome
    # The steps since A's last record (training.log_every=7) are in its emergency checkpoint,
    # which B resumed after: A logged them as it stopped, so the records tile the run.
    assert a_steps[-1]["step"] == b_steps[0]["step"] - b_steps[0]["window_steps"], (a_steps[-1], b_steps[0])
    assert any("vanished without letting it go" in log["message"] for log in api.logs(b))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["goodput"]["attempts"].get("orphaned") == 1
    train = summary["train"]  # its total: B's time, and A's while it held the lease
    assert train["wall_time_total_s"] - train["wall_time_s"] > a_steps[-1]["time"] - a_steps[0]["time"]


def _unix(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_goodput_server_started_in_the_background_stops_on_sigint(tmp_path_factory):
    """A shell starts `goodput server &` with SIGINT ignored: `kill -INT` left the whole stack
    running (only SIGTERM stopped it). It now stops on either, as on Ctrl-C. PostgreSQL on
    the port --pg-port names (a free one otherwise: a shared host's firewall had no say)."""
    if missing_postgres():
        pytest.skip("PostgreSQL not installed")
    directory = tempfile.mkdtemp(prefix="goodput-stack-sigint-")
    pg_port = free_port()
    try:
        server = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "server", "--dir", directory, "--port",
             str(free_port()), "--pg-port", str(pg_port), "--no-worker"], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `&` leaves it
        lines = []
        for line in server.stdout:  # until it says it is up
            lines.append(line)
            if line.startswith("Prefect server on PostgreSQL"):
                break
        assert server.poll() is None, "".join(lines)
        socket.create_connection(("127.0.0.1", pg_port), timeout=10).close()
        server.send_signal(signal.SIGINT)
        out, _ = server.communicate(timeout=120)
        assert server.returncode == 0, "".join(lines) + out
        assert not psutil.pid_exists(server.pid)
        assert [p for p in psutil.process_iter(["cmdline"])
                if directory in " ".join(p.info["cmdline"] or [])] == []  # PostgreSQL too
    finally:
        if server.poll() is None:  # SIGINT unanswered: the stack stops on SIGTERM
            server.terminate()
            server.wait(timeout=120)
        shutil.rmtree(directory, ignore_errors=True)
