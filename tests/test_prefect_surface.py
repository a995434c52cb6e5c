"""The Prefect product surface, end to end against a real server: deployments served by
`goodput serve` in a subprocess, runs triggered through the REST API the way the UI does,
artifacts, events and logs read back, cancellation, the per-run training slot, a cron
schedule, and a screenshot of the flow run page in headless Chromium.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from uuid import UUID, uuid4

import httpx
import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ObjectNotFound

from core.config import config_from_dict, dump_config
from flows.prepare import prepare
from flows.train import train
from storage.ledger import Ledger
from tasks.control import TimeLimit
from tasks.reporting import TrainingProgress, worker_log
from tests.helpers import REPO, logs_of, small_config, stop_process_tree, subflow_runs, task_runs_of, wait_for
from training.metrics import read_metrics

SERVE_CRON = "* * * * *"  # the continuation schedule: a run every minute
SERVE_TIME_LIMIT_S = 600  # of each scheduled run: enough to finish `base`'s budget
EVAL_CRON = "0 3 * * *"  # the nightly evaluation (never due while the tests run, but at 3 am)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("surface")


@pytest.fixture(scope="module")
def base(workdir):
    """The served deployments' default config: the defaults of the UI's forms."""
    return small_config(workdir, "run.run_id=served", "training.max_steps=60")


@pytest.fixture(scope="module")
def dataset(prefect_api, base):
    """The dataset of `base`, prepared once (every run id of this module shares it)."""
    return prepare(base)


@pytest.fixture(scope="class")
def served(prefect_api, base, dataset, workdir):
    """`goodput serve` in a subprocess, with both example schedules; yields the deployments.

    The run the continuation schedule continues was started by hand first (in this process)
    with a time limit of 0 s: past it at its first step, it saved step 2 and stopped.
    """
    started = train(base, time_limit_s=0)
    assert started["last_attempt"]["stopped"] == "time limit", started
    assert started["final_step"] == 2, started
    config_file = workdir / "served.yaml"
    config_file.write_text(dump_config(base))
    log = open(workdir / "serve.log", "w")
    # Pick up triggered runs within a second (default: 10 s).
    env = prefect_api.env(PREFECT_RUNNER_POLL_FREQUENCY="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", "--config", str(config_file),
         "--eval-cron", EVAL_CRON, "--train-cron", SERVE_CRON,
         "--train-time-limit", str(SERVE_TIME_LIMIT_S)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        names = ["prepare/goodput-prepare", "train/goodput-train", "evaluate/goodput-evaluate",
                 "pipeline/goodput-pipeline", "train/goodput-train-continue"]
        deployments = wait_for(lambda: read_deployments(names), timeout_s=120,
                               what="served deployments")
        yield deployments
    finally:
        stop_process_tree(proc)
        log.close()


def read_deployments(names: list[str]) -> dict | None:
    with get_client(sync_client=True) as client:
        try:
            return {name.split("/")[1]: client.read_deployment_by_name(name) for name in names}
        except ObjectNotFound:  # not all registered yet
            return None


def api_post(url: str, body: dict, expect: tuple[int, ...] = (200, 201)) -> httpx.Response:
    """POST to the REST API as the UI does; like Prefect's own client (60 s per request),
    retry while the server is busy: SQLite answers 503 when a busy moment outlasts its lock
    timeout, and on two loaded cores a request can outlast the client's timeout. Every POST
    here is safe to repeat: reads, a state the run may already be in, and run creation with
    an idempotency key."""
    for delay in (1, 2, 4, 8, 16, 0):
        try:
            response = httpx.post(url, json=body, timeout=60)
        except httpx.TimeoutException:
            if not delay:
                raise
            time.sleep(delay)
            continue
        if response.status_code not in (429, 503) or not delay:
            break
        time.sleep(delay)
    assert response.status_code in expect, response.text
    return response


def trigger_like_the_ui(api_url: str, deployment_id, parameters: dict) -> UUID:
    """What the UI's "Run > Custom run" form does: POST the form values to the deployment
    (with an idempotency key, so that a retried POST cannot create a second run)."""
    response = api_post(f"{api_url}/deployments/{deployment_id}/create_flow_run",
                        {"parameters": parameters, "idempotency_key": str(uuid4())},
                        expect=(200, 201))
    return UUID(response.json()["id"])


def read_run(flow_run_id: UUID) -> FlowRun:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def wait_final(flow_run_id: UUID, timeout_s: float = 300) -> FlowRun:
    def final():
        run = read_run(flow_run_id)
        return run if run.state and run.state.is_final() else None
    return wait_for(final, timeout_s, f"final state of flow run {flow_run_id}")



def artifacts(api_url: str, key: str) -> list[dict]:
    """Every version of an artifact key, newest first (what the Artifacts page lists)."""
    return api_post(f"{api_url}/artifacts/filter",
                    {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC"}).json()


def events(api_url: str, prefix: str, run_id: str) -> list[dict]:
    return api_post(f"{api_url}/events/filter", {
        "filter": {"event": {"prefix": [prefix]},
                   "any_resource": {"labels": {"goodput.run-id": [run_id]}}},
        "limit": 50}).json()["events"]


def form(base, *overrides: str) -> dict:
    """The RunConfig form as the UI submits it: every field, some edited."""
    from core.config import apply_overrides

    return config_from_dict(apply_overrides(base.model_dump(mode="json"), list(overrides))
                            ).model_dump(mode="json")


def worker_processes(attempt_prefix: str) -> list[psutil.Process]:
    """torchrun and training processes of the attempts whose id starts with `attempt_prefix`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("GOODPUT_ATTEMPT", "").startswith(attempt_prefix):
                found.append(process)
        except psutil.Error:
            pass
    return found


# -- work pool files (no server needed) ---------------------------------------------------------

def render_kubernetes(tmp_path, *options: str) -> dict[str, dict]:
    script = REPO / "scripts" / "render_deploy.py"
    spec = importlib.util.spec_from_file_location("render_deploy", script)
    render_deploy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_deploy)
    render_deploy.main(["--out", str(tmp_path), *options])
    return {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}


def render_template(tmp_path, *options: str) -> dict[str, dict]:
    """The committed examples' render: the placeholder image, default namespace."""
    return render_kubernetes(tmp_path, "--template", *options)


def render_job(files: dict[str, dict], variables: str) -> dict:
    """The Job a Kubernetes worker makes of the template and these job variables (the
    template's defaults, then the deployment's job variables), validated as it validates."""
    import jsonschema
    from prefect.utilities.templating import apply_values

    template, values = files["base-job-template.json"], files[variables]
    schema = template["variables"]
    jsonschema.validate(values, {**schema, "additionalProperties": False})
    defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    return apply_values(template["job_configuration"], {**defaults, **values})["job_manifest"]


def test_kubernetes_files_are_rendered_and_current(tmp_path):
    rendered = render_template(tmp_path)
    committed = REPO / "deploy" / "kubernetes"
    assert set(rendered) == {"base-job-template.json", "job-variables.json",
                             "job-variables-gpu.json"}
    for name, content in rendered.items():
        assert json.loads((committed / name).read_text()) == content, (
            f"deploy/kubernetes/{name} is stale: run python scripts/render_deploy.py --template")


@pytest.mark.parametrize("variables", ["job-variables.json", "job-variables-gpu.json"])
def test_kubernetes_job_variables_render_a_job(variables, tmp_path):
    """Validate the job variables against the template's schema, then render the Job the way
    a Kubernetes worker does (the template's defaults, then the deployment's job variables)."""
    files = render_template(tmp_path)
    values = files[variables]
    job = render_job(files, variables)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == "goodput"
    assert container["image"] == values["image"]
    assert container["resources"]["requests"] == {"cpu": values["cpu_request"],
                                                  "memory": values["memory_request"]}
    if variables == "job-variables-gpu.json":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert pod["nodeSelector"] == {"goodput.dev/pool": "gpu"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    else:  # unset GPU variables leave nothing behind
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        assert "nodeSelector" not in pod and "tolerations" not in pod
    # The flow's pod mounts the claim the training pods mount (launch.kubernetes'
    # volume_claim and mount_path, as the README's example sets them).
    assert pod["volumes"][1] == {"name": "shared",
                                 "persistentVolumeClaim": {"claimName": "goodput-shared"}}
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"},
                                         {"name": "shared", "mountPath": "/goodput"}]


def test_kubernetes_job_variables_without_a_shared_volume(tmp_path):
    files = render_template(tmp_path, "--volume-claim", "", "--mount-path", "/data")
    pod = render_job(files, "job-variables.json")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["dshm"]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    files = render_template(tmp_path, "--volume-claim", "team-runs", "--mount-path", "/data")
    pod = render_job(files, "job-variables-gpu.json")["spec"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"] == {"claimName": "team-runs"}
    assert pod["containers"][0]["volumeMounts"][1] == {"name": "shared", "mountPath": "/data"}


def test_a_cluster_render_needs_its_image_and_keeps_every_option_given(tmp_path, capsys):
    """Without --template the placeholder image is refused (pods could not pull it), and one
    command renders both job variables files with every option given: a second command with
    only the GPU options used to write the placeholder image and namespace back."""
    for no_image in ([], ["--image", "ghcr.io/example/goodput:latest"]):
        with pytest.raises(SystemExit) as refused:
            render_kubernetes(tmp_path, *no_image)
        assert refused.value.code == 2
        assert "give the image your cluster pulls" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))  # nothing written
    files = render_kubernetes(tmp_path, "--image", "registry.example.com/goodput:1.0",
                              "--namespace", "ml", "--gpus", "4",
                              "--gpu-node-label", "cloud.google.com/gke-accelerator=nvidia-h100-80gb")
    for variables in ("job-variables.json", "job-variables-gpu.json"):
        job = render_job(files, variables)
        assert job["metadata"]["namespace"] == "ml", variables
        assert job["spec"]["template"]["spec"]["containers"][0]["image"] == \
            "registry.example.com/goodput:1.0", variables
    gpu_pod = render_job(files, "job-variables-gpu.json")["spec"]["template"]["spec"]
    assert gpu_pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert gpu_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_the_pull_step_enters_goodput_repo_or_the_installed_repository(
        tmp_path, monkeypatch, prefect_api):
    """prefect.yaml's pull step, run by Prefect as a worker's flow run runs it: $GOODPUT_REPO
    when set (refused, naming it, when it is not a repository, or another checkout than the
    worker's code), else the repository the installed flows package lives in. Prefect's set_working_directory, given an unset
    GOODPUT_REPO, entered "" and the flow run failed later on a file it could not find."""
    import asyncio

    import yaml
    from prefect.deployments.steps.core import StepExecutionError, run_steps

    from core.errors import ConfigError
    from flows.deployments import enter_repository

    pull = yaml.safe_load((REPO / "prefect.yaml").read_text())["pull"]
    monkeypatch.chdir(tmp_path)  # a worker started elsewhere
    monkeypatch.delenv("GOODPUT_REPO", raising=False)
    assert asyncio.run(run_steps(pull))["directory"] == str(REPO)
    assert Path.cwd() == REPO

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GOODPUT_REPO", str(REPO))  # named: the same
    assert enter_repository() == {"directory": str(REPO)} and Path.cwd() == REPO
    checkout = tmp_path / "checkout"  # another copy of the repository: its flow files would
    (checkout / "flows").mkdir(parents=True)  # run with this one's modules
    (checkout / "prefect.yaml").write_text("name: goodput\n")
    monkeypatch.setenv("GOODPUT_REPO", str(checkout))
    with pytest.raises(ConfigError, match=rf"GOODPUT_REPO={checkout} is another checkout than "
                                          rf"the one this worker's Python runs \({REPO}\)"):
        enter_repository()
    assert Path.cwd() == REPO  # not entered

    monkeypatch.setenv("GOODPUT_REPO", str(tmp_path))  # not a repository
    with pytest.raises(ConfigError, match=rf"GOODPUT_REPO={tmp_path} is not a Goodput "
                                          r"repository \(it needs prefect.yaml and flows/\)"):
        enter_repository()
    with pytest.raises(StepExecutionError, match="enter_repository"):
        asyncio.run(run_steps(pull))
    assert Path.cwd() == REPO  # not entered


def test_worker_logs_keep_rank_0_by_default():
    kept = []
    sink = worker_log(kept.append)
    for line in ["launch attempt x: torchrun ...", "[node0 rank0] [train] step 1",
                 "[node0 rank1] [train] step 1", "[node1 rank2] boom", "[node1 rank0x] odd",
                 # kineto's marker at each profile window, as a profiled run printed it
                 "[node0 rank0] USDT:2026-11-30 07:55:50 4898:4898 "
                 "SyncActivityProfilerHandler.cpp:52] profiler_start"]:
        sink(line)
    assert kept == ["launch attempt x: torchrun ...", "[node0 rank0] [train] step 1",
                    "[node1 rank0x] odd"]


def test_progress_text_from_step_and_checkpoint_heartbeats(tmp_path):
    progress = TrainingProgress(small_config(tmp_path), "abc-1")  # 30 steps of 512 tokens
    progress.first = {"step": 10, "time": 100.0}
    assert progress.describe({"step": 20, "time": 110.0, "loss": 3.5, "tokens_per_s": 512.0,
                              "phase": "step"}) == (
        "step 20 / 30 · 10,240 tokens · loss 3.5000 · 512 tokens/s · ETA 0m10s · attempt abc-1")
    assert progress.describe({"step": 30, "time": 120.0, "loss": 3.0, "phase": "checkpoint"}) == (
        "step 30 / 30 · 15,360 tokens · loss 3.0000 · saving a checkpoint · attempt abc-1")


def test_the_progress_artifact_shows_where_a_job_ended_between_two_polls(tmp_path, prefect_api):
    """Throttled updates skip most steps; the heartbeat the job left when it ended (read
    after it, as launch-training does) is shown whatever the throttle, with how it ended."""
    config = small_config(tmp_path)  # 30 steps
    config.run.run_id = "between-polls"

    @flow(name="progress-between-polls")
    def watch() -> None:
        progress = TrainingProgress(config, "abc-1", every_s=3600.0)
        for step in range(1, 13):
            progress({"attempt": "abc-1", "step": step, "time": 100.0 + step, "phase": "step"})
        progress.show_last({"attempt": "other-1", "step": 29, "time": 140.0, "phase": "step"},
                           "done")
        progress.show_last({"attempt": "abc-1", "step": None, "time": 140.0, "phase": "startup"},
                           "done")
        shown_before = progress.shown
        progress.show_last({"attempt": "abc-1", "step": 30, "time": 150.0, "loss": 2.5,
                            "phase": "checkpoint"}, "done")
        assert shown_before["step"] == 1 and progress.shown["step"] == 30

    watch()
    progress = artifacts(prefect_api.api_url, "training-progress-between-polls")[0]
    assert progress["data"] == 100.0
    assert progress["description"] == ("step 30 / 30 · 15,360 tokens · loss 2.5000 · ended: done · "
                                       "attempt abc-1")  # no longer "saving a checkpoint"


def test_a_retry_spends_what_is_left_of_the_flow_runs_time_limit():
    assert TimeLimit(60, started=time.time() - 61).passed()
    assert not TimeLimit(60, started=time.time() - 30).passed()
    assert not TimeLimit(None, started=0).passed() and TimeLimit(None).deadline is None


def test_a_negative_time_limit_is_refused_by_the_parameter_schema():
    """The UI form (the deployment's parameter schema) and the flow's own validation refuse
    time_limit_s < 0; 0 saves the second step and stops, empty trains to the end."""
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    field = parameter_schema(train).model_dump()["properties"]["time_limit_s"]
    assert {"minimum": 0, "type": "number"} in field["anyOf"]
    with pytest.raises(ParameterTypeError, match="time_limit_s: Input should be greater than "
                                                 "or equal to 0"):
        train.validate_parameters({"time_limit_s": -5})
    assert train.validate_parameters({"time_limit_s": 0})["time_limit_s"] == 0
    assert train.validate_parameters({})["time_limit_s"] is None


# -- served deployments (one `goodput serve` for the class) -----------------------------------

@pytest.fixture(scope="class")
def ui_run(served, base, prefect_api):
    """The pipeline deployment run from the UI with an edited form: run id, steps, a crash of
    rank 1 at step 15 (the retry resumes from step 10), and the logs of all ranks."""
    parameters = {"config": form(base, "run.run_id=ui", "training.max_steps=20",
                                 "eval.num_samples=1", "faults.crash_at_step=15",
                                 "faults.crash_rank=1"),
                  "worker_logs": "all"}
    pipeline = served["goodput-pipeline"]
    return wait_final(trigger_like_the_ui(prefect_api.api_url, pipeline.id, parameters),
                      timeout_s=420)


class TestServedDeployments:
    """Deployments served by `goodput serve`; runs triggered the way the UI does."""

    def test_deployments_offer_a_typed_form_with_defaults_and_descriptions(self, served, base):
        for name, deployment in served.items():
            schema = deployment.parameter_openapi_schema
            props = schema["properties"]
            assert props["config"]["$ref"] == "#/definitions/RunConfig", name
            assert props["config_file"]["description"].startswith("A RunConfig YAML file"), name
            assert props["overrides"]["type"] == "array", name
            max_steps = schema["definitions"]["TrainingConfig"]["properties"]["max_steps"]
            assert max_steps["description"] == "Optimizer steps to train."
            assert max_steps["default"] == 300
            assert deployment.parameters["config"]["run"]["run_id"] == "served"  # form defaults
        train_props = served["goodput-train"].parameter_openapi_schema["properties"]
        for name in ("goodput-train", "goodput-pipeline"):  # a select box in the form
            worker_logs = served[name].parameter_openapi_schema["properties"]["worker_logs"]
            assert worker_logs["enum"] == ["rank0", "all"] and worker_logs["default"] == "rank0"
            assert '"all"' in worker_logs["description"]
        assert "Wall-clock budget" in train_props["time_limit_s"]["description"]

        nightly = served["goodput-evaluate"]
        assert [(s.schedule.cron, s.parameters) for s in nightly.schedules] == [(EVAL_CRON, {})]
        assert "checkpoint" not in nightly.parameters  # so: the newest validated checkpoint

        continuation = served["goodput-train-continue"]
        assert [s.schedule.cron for s in continuation.schedules] == [SERVE_CRON]
        assert continuation.parameters["time_limit_s"] == SERVE_TIME_LIMIT_S
        assert continuation.global_concurrency_limit.limit == 1
        assert continuation.concurrency_options.collision_strategy == "CANCEL_NEW"


    # -- a run from the UI -----------------------------------------------------------



    def test_ui_triggered_pipeline_completes_with_artifacts(self, ui_run, base, prefect_api):
        assert ui_run.state.is_completed(), ui_run.state.message
        run_dir = base.run_dir.path.parent / "ui"
        assert Ledger(run_dir, "ui").read().steps("uploaded") == [10, 20]
        api = prefect_api.api_url

        progress = artifacts(api, "training-progress-ui")[0]
        assert progress["type"] == "progress" and progress["data"] == 100.0
        assert progress["description"].startswith("step 20 / 20 · 10,240 tokens")
        metrics = artifacts(api, "training-metrics-ui")[0]
        assert [row["step"] for row in json.loads(metrics["data"])][-1] == 20
        curve = artifacts(api, "loss-curve-ui")[0]
        assert "](data:image/png;base64," in curve["data"]
        png = run_dir / "loss_curve.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        ledger = json.loads(artifacts(api, "checkpoint-ledger-ui")[0]["data"])
        assert [(r["step"], r["state"]) for r in ledger] == [(10, "uploaded"), (20, "uploaded")]
        report = {r["metric"]: r["value"] for r in json.loads(artifacts(api, "eval-ui")[0]["data"])}
        assert report["checkpoint step"] == "20" and float(report["perplexity"]) > 1
        assert report["setting: device"] == "cpu"  # how it was made, beside the scores
        breakdown = {r["metric"]: r["value"] for r in
                     json.loads(artifacts(api, "goodput-ui")[0]["data"])}
        assert 0 < float(breakdown["goodput"]) <= 1 and breakdown["attempts.retryable"] == "1"
        # The newest breakdown, the evaluation's time included, as summary.json has it.
        summary = json.loads((run_dir / "summary.json").read_text())["goodput"]
        assert breakdown["goodput"] == f"{summary['goodput']:.4g}", (breakdown, summary)


    def test_retention_runs_after_every_upload(self, ui_run):
        """An interrupted run keeps no more checkpoints than a finished one: the train flow
        applies retention after each upload, not once at its end."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        train_run = subflow_runs(ui_run.id)["train"]
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[train_run.id])))
        uploads = sorted((r for r in runs if r.name.startswith("upload-step-")), key=lambda r: r.start_time)
        retention = sorted((r for r in runs if r.name.startswith("apply-retention")), key=lambda r: r.start_time)
        assert len(uploads) == len(retention) == 2
        assert all(after.start_time >= upload.end_time for upload, after in zip(uploads, retention))

    def test_ui_triggered_pipeline_emits_events(self, ui_run, prefect_api):
        seen = wait_for(lambda: (lambda e: e if len(e) >= 7 else None)(
            events(prefect_api.api_url, "goodput.", "ui")), timeout_s=30, what="goodput events")
        names = {(e["event"], e["payload"].get("step")) for e in seen}
        for step in (10, 20):
            for state in ("committed", "validated", "uploaded"):
                assert (f"goodput.checkpoint.{state}", step) in names
        failed = [e for e in seen if e["event"] == "goodput.attempt.failed"]
        assert [(e["payload"]["failure_class"], e["payload"]["step"]) for e in failed] == [
            ("retryable", 15)]
        assert "ended: retryable" in failed[0]["payload"]["reason"]
        # The class is a resource label too: automation triggers match on labels.
        assert failed[0]["resource"]["goodput.failure-class"] == "retryable"
        finished = [e for e in seen if e["event"] == "goodput.run.finished"]
        assert finished and finished[0]["payload"]["final_step"] == 20
        assert finished[0]["resource"]["prefect.resource.id"] == "goodput.run.ui"
        # Prefect links each event to the flow run it came from.
        assert any(r["prefect.resource.role"] == "flow-run" for r in finished[0]["related"])


    def test_worker_logs_of_all_ranks_on_request(self, ui_run):
        train_run = subflow_runs(ui_run.id)["train"]
        lines = logs_of(train_run.id)
        assert any(line.startswith("[node0 rank0] [train]") for line in lines)
        assert any(line.startswith("[node0 rank1] [faults] killing rank 1") for line in lines)


    def test_config_file_with_overrides_and_ambiguous_input(self, served, base, workdir,
                                                             prefect_api, ui_run):
        api = prefect_api.api_url
        config_file = workdir / "ui.yaml"
        config_file.write_text(dump_config(config_from_dict(form(base, "run.run_id=ui",
                                                                 "training.max_steps=20"))))
        good = trigger_like_the_ui(api, served["goodput-evaluate"].id, {
            "config_file": str(config_file), "overrides": ["eval.num_samples=2"],
            "checkpoint": "10"})
        both = trigger_like_the_ui(api, served["goodput-train"].id, {
            "config": form(base, "training.max_steps=50"), "config_file": str(config_file)})
        failed = wait_final(both, timeout_s=120)
        assert failed.state.is_failed()
        # The run's last log lines reach the server in the engine's next log batch, which
        # can land after its Failed state.
        wait_for(lambda: any("both the config form and config_file were given" in line
                             for line in logs_of(both)), timeout_s=30, what="refusal in the run's logs")
        # The flow-run process's exit says it again (prefect.engine), without a traceback.
        wait_for(lambda: any("exited with unexpected exception" in line for line in logs_of(both)),
                 timeout_s=30, what="the engine's exit line")
        assert not any("Traceback (most recent call last)" in line for line in logs_of(both)), logs_of(both)
        evaluated = wait_final(good, timeout_s=300)
        assert evaluated.state.is_completed(), evaluated.state.message
        # Its overrides are not the run's eval settings: a report of their own, beside the run's.
        from core.config import load_config
        from goodput.evaluation import report_path

        one_off = load_config(config_file, ["eval.num_samples=2"])
        path = report_path(one_off, one_off.run_dir.checkpoint(10))
        assert path.parent.name.startswith("settings-")
        report = json.loads(path.read_text())
        assert report["step"] == 10 and len(report["samples"]) == 2


    # -- the example schedules ------------------------------------------------------

    def test_nightly_evaluation_takes_the_newest_validated_checkpoint(self, served, base,
                                                                       prefect_api, ui_run):
        """The evaluate deployment run as its nightly schedule runs it (no checkpoint), on run
        `ui` (20 validated) after a newer checkpoint was rejected (30: a copy of 20, judged by
        the validate task as in training) and another is committed, not judged yet (40)."""
        from prefect.settings import PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW, temporary_settings

        from tasks.train import validate_checkpoint

        api = prefect_api.api_url
        nightly = served["goodput-evaluate"]
        (schedule,) = nightly.schedules
        config = config_from_dict(form(base, "run.run_id=ui", "training.max_steps=20"))
        rejected = config.run_dir.checkpoint(30)
        shutil.copytree(config.run_dir.checkpoint(20), rejected)
        with temporary_settings({PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW: "ignore"}):
            assert validate_checkpoint(config, 30).state == "rejected"  # a task, no flow
        Ledger(config.run_dir, "ui").record(40, "committed")

        run = trigger_like_the_ui(api, nightly.id, {**schedule.parameters,
                                                    "config": config.model_dump(mode="json")})
        finished = wait_final(run, timeout_s=180)
        assert finished.state.is_completed(), finished.state.message
        report = next(a for a in artifacts(api, "eval-ui") if a["flow_run_id"] == str(run))
        assert {r["metric"]: r["value"] for r in json.loads(report["data"])}[
            "checkpoint step"] == "20"
        seen = wait_for(lambda: events(api, "goodput.checkpoint.rejected", "ui"), timeout_s=30,
                        what="the rejected event")
        assert [e["payload"]["step"] for e in seen] == [30]
        assert "manifest step 20 != directory step-00000030" in seen[0]["payload"]["reason"]

    def test_continuation_schedule_trains_to_the_budget_then_switches_itself_off(
            self, served, base, prefect_api):
        """Run `served` was started by hand and stopped by its time limit (fixture `served`);
        the `* * * * *` schedule resumes it from the ledger and trains to max_steps. The run
        that reaches it switches the schedule off, so no more runs are created."""
        deployment = served["goodput-train-continue"]
        last_seen = {}  # what the last probe found: said if the wait times out

        def switched_off():
            with get_client(sync_client=True) as client:
                current = client.read_deployment(deployment.id)
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
                    id=DeploymentFilterId(any_=[deployment.id])))
            last_seen.update(active=[s.active for s in current.schedules], runs=[
                (r.name, r.auto_scheduled, r.state.name, str(r.expected_start_time),
                 str(r.start_time), str(r.end_time)) for r in runs])
            # Off, and done: every run it created has ended or is (was) still to come.
            if any(s.active for s in current.schedules) or not all(
                    r.state.is_final() or r.state.is_scheduled() for r in runs):
                return None
            return runs

        # A scheduled run trains 50 steps in seconds; the rest is the scheduler's minute
        # cadence and, on a loaded machine (the full suite on 2 cores), much slower starts:
        # the wait once ran out at 300 s there.
        try:
            runs = wait_for(switched_off, timeout_s=540, every_s=3,
                            what="the continuation schedule switched off")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last seen: schedules active {last_seen.get('active')}, "
                               f"runs (name, auto-scheduled, state, expected start, start, end) "
                               f"{last_seen.get('runs')}") from None
        scheduled = [r for r in runs if r.auto_scheduled]
        completed = [r for r in scheduled if r.state.is_completed()]
        metrics = read_metrics(base.run_dir)
        seen = ([(r.name, r.auto_scheduled, r.state.name, str(r.start_time), str(r.end_time))
                 for r in runs], sorted({(m["attempt"], m["step"] // 10 * 10) for m in metrics}))
        assert completed and all(r.parameters["time_limit_s"] == SERVE_TIME_LIMIT_S
                                 for r in completed), seen
        uploaded = Ledger(base.run_dir, "served").read().steps("uploaded")
        assert uploaded[0] == 2 and uploaded[-1] == 60, uploaded
        # What the scheduled runs trained (by time: runs the scheduler creates together have
        # uuid7 ids sharing their first 8 characters, which attempt ids are made of).
        by_schedule = [m["step"] for m in metrics for r in completed
                       if r.start_time.timestamp() <= m["time"] <= r.end_time.timestamp()]
        assert by_schedule and min(by_schedule) > 2 and max(by_schedule) == 60, (
            f"a scheduled run resumes from the ledger and trains to the budget: {seen}")
        # No scheduled run is left waiting, and the run that finished the budget said why.
        now = time.time()
        assert not [r for r in scheduled if r.state.is_scheduled()
                    and r.expected_start_time.timestamp() > now]
        wait_for(lambda: any("switched off the schedule of deployment 'goodput-train-continue'"
                             in line for line in logs_of(*[r.id for r in completed])),
                 timeout_s=30, what="the log line of the switch")  # logs arrive in batches
        finished = wait_for(lambda: events(prefect_api.api_url, "goodput.run.finished", "served"),
                            timeout_s=30, what="goodput.run.finished event")  # events come in batches too
        assert {e["payload"]["final_step"] for e in finished} == {60}


    # -- cancellation and the per-run training slot ----------------------------------

    def test_cancel_stops_every_worker_and_one_trainer_per_run(self, served, base, prefect_api,
                                                               workdir):
        """A trains run `long`; B (same run, a 1 s budget) waits for A's slot. Cancelling A ends
        it Cancelled with no worker left; B then resumes from A's checkpoints and stops at its
        budget, right after a checkpoint."""
        api = prefect_api.api_url
        run_dir = base.run_dir.path.parent / "long"
        long_form = form(base, "run.run_id=long", "training.max_steps=100000",
                         "checkpoint.every_steps=200")
        a = trigger_like_the_ui(api, served["goodput-train"].id, {"config": long_form})
        wait_for(lambda: read_metrics(run_dir), timeout_s=300, what="run A training")
        b = trigger_like_the_ui(api, served["goodput-train"].id, {"config": long_form,
                                                                  "time_limit_s": 1})
        wait_for(lambda: any(f"is being trained by flow run {a}" in line for line in logs_of(b)),
                 timeout_s=300, what="run B waiting for the slot")
        wait_for(lambda: any(m["step"] > 200 for m in read_metrics(run_dir)), timeout_s=300,
                 what="run A past its first checkpoint")
        assert read_run(b).state.is_running()
        assert not worker_processes(str(b)[-8:]), "B launched while A holds the slot"
        assert worker_processes(str(a)[-8:]), "A's workers should be running"
        # A left worker_logs at its default: rank 0's lines only, prefixed with node and rank.
        wait_for(lambda: any(line.startswith("[node0 rank0] ") for line in logs_of(a)),
                 timeout_s=30, what="rank 0's lines in A's log")
        assert not any(line.startswith("[node0 rank1] ") for line in logs_of(a))

        api_post(f"{api}/flow_runs/{a}/set_state",  # the UI's "Cancel"
                 {"state": {"type": "CANCELLING", "name": "Cancelling"}})
        cancelled = wait_final(a, timeout_s=120)
        assert cancelled.state.is_cancelled(), cancelled.state
        wait_for(lambda: not worker_processes(str(a)[-8:]), timeout_s=10,
                 what="end of A's torchrun and training processes")
        a_steps = [m for m in read_metrics(run_dir) if m["attempt"].startswith(str(a)[-8:])]

        finished = wait_final(b, timeout_s=300)
        assert finished.state.is_completed(), finished.state.message
        b_steps = [m for m in read_metrics(run_dir) if m["attempt"].startswith(str(b)[-8:])]
        assert b_steps[0]["step"] > 1, "B should resume from A's checkpoint, not start over"
        assert b_steps[0]["time"] > a_steps[-1]["time"], "B trained while A still did"
        summary = json.loads((run_dir / "summary.json").read_text())["train"]
        assert summary["last_attempt"]["stopped"] == "time limit"
        # B's workers (past the deadline before they started) saved their second step and
        # stopped, not at the next checkpoint of the cadence (every 200 steps).
        assert summary["final_step"] == b_steps[0]["step"] + 1
        # A's attempt ended as cancelled: its own class, not retried, and no failure event for
        # automations to act on (B's run is over by now: any event of A's has arrived).
        outcomes = [json.loads(p.read_text()) for p in
                    (run_dir / "attempts").glob(f"attempt-{str(a)[-8:]}-*/outcome.json")]
        assert [o["class"] for o in outcomes] == ["cancelled"]
        assert events(api, "goodput.attempt.failed", "long") == []
        # Its launch task says the same: Cancelled, not Failed; torchrun's traceback of the
        # SIGTERM that stopped it is one line. That line is read in the run's console output
        # (the served process's): the API's copy of the last lines a SIGTERM-ended flow run
        # process logs arrives in its final batch, which CI once saw missing under load.
        launched = task_runs_of(a, "launch-training")["launch-training"]
        assert launched.state.is_cancelled(), launched.state
        assert not any("SignalException" in line for line in logs_of(a))
        console = (workdir / "serve.log").read_text()
        assert "stopped on SIGTERM, after its workers (its traceback left out)" in console


    # -- what a person sees ----------------------------------------------------------

    def test_screenshot_of_the_flow_run_page(self, ui_run, prefect_api, tmp_path):
        """The train run's page with its artifacts, kept at .goodput/screenshots/flow-run.png
        (or GOODPUT_SCREENSHOT) for a person to look at; then the loss curve's artifact page,
        where the PNG must render as an image."""
        webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
        chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
        if not (chromium and chromedriver):
            pytest.skip("headless Chromium needs the Debian packages chromium and chromium-driver "
                        "(scripts/setup.sh installs them when run as root)")
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as seen
        from selenium.webdriver.support.ui import WebDriverWait

        train_run = subflow_runs(ui_run.id)["train"]
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}",
                     "--window-size=1400,1300"):
            options.add_argument(flag)
        browser = webdriver.Chrome(service=webdriver.ChromeService(chromedriver), options=options)
        try:
            browser.get(f"{prefect_api.url}/runs/flow-run/{train_run.id}")
            page = (By.TAG_NAME, "body")
            WebDriverWait(browser, 60).until(
                seen.text_to_be_present_in_element(page, train_run.name))
            WebDriverWait(browser, 30).until(
                seen.element_to_be_clickable((By.CSS_SELECTOR, "li.p-tab#artifacts"))).click()
            WebDriverWait(browser, 30).until(
                seen.text_to_be_present_in_element(page, "loss-curve-ui"))
            time.sleep(1)  # let the artifact cards finish their transition
            assert train_run.name in browser.find_element(*page).text
            shot = Path(os.environ.get("GOODPUT_SCREENSHOT")
                        or REPO / ".goodput" / "screenshots" / "flow-run.png")
            shot.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(shot))
            print(f"screenshot of flow run {train_run.name}: {shot}")

            browser.find_element(By.XPATH, "//*[normalize-space(text())='loss-curve-ui']").click()
            width = WebDriverWait(browser, 30).until(lambda b: b.execute_script(
                "const img = document.querySelector('img[src^=\"data:image/png\"]');"
                "return img && img.complete && img.naturalWidth > 0 ? img.naturalWidth : null;"))
        finally:
            browser.quit()
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert width == 700  # the loss curve's 7 in x 100 dpi, decoded by the browser


# -- prefect.yaml on a process work pool ---------------------------------------------------------

@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_a_stopped_serve_cancels_the_runs_it_started(prefect_api, base, dataset, workdir, stop):
    """`systemctl stop` or `docker stop` of `goodput serve` (SIGTERM to it), or Ctrl-C in its
    terminal (SIGINT to its whole process group, its flow runs' processes included): the
    training run it was running is cancelled as from the UI (its workers save an emergency
    checkpoint, the attempt ends cancelled, the flow run Cancelled on the server), no worker
    is left, and serve exits. Prefect's own handler exited at once, leaving the run Running
    on the server and its workers training until launch.orphan_timeout_s."""
    config_file = workdir / f"{stop}.yaml"
    config_file.write_text(dump_config(base))
    log_path = workdir / f"serve-{stop}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_file)],
                                cwd=REPO, env=prefect_api.env(PREFECT_RUNNER_POLL_FREQUENCY="1"),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "goodput serve: serving" in log_path.read_text(), timeout_s=120,
                 what="serve started")
        deployment = read_deployments(["train/goodput-train"])["goodput-train"]
        run_dir = base.run_dir.path.parent / f"stopped-{stop}"
        run = trigger_like_the_ui(prefect_api.api_url, deployment.id, {"config": form(
            base, f"run.run_id=stopped-{stop}", "training.max_steps=100000",
            "checkpoint.every_steps=20")})
        wait_for(lambda: any(m["step"] > 20 for m in read_metrics(run_dir)), timeout_s=300,
                 what="training past its first checkpoint")
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
    text = log_path.read_text()
    assert f"{'SIGTERM' if stop == 'sigterm' else 'SIGINT'}: cancelling the flow runs this process started" in text
    if stop == "ctrl-c":  # the flow-run process, in serve's process group, had it too: no
        # KeyboardInterrupt out of the flow before the attempt's outcome was recorded
        assert "SIGINT (Ctrl-C, here or in the terminal of the process that started this " \
               "flow run): stopping training" in text, text[-3000:]
    assert read_run(run).state.is_cancelled(), (read_run(run).state, text[-3000:])
    assert not worker_processes(str(run)[-8:]), "workers left training"
    outcomes = [json.loads(p.read_text()) for p in (run_dir / "attempts").glob("*/outcome.json")]
    assert [o["class"] for o in outcomes] == ["cancelled"], outcomes
    assert outcomes[0]["newest_checkpoint"] == outcomes[0]["step"]  # an emergency checkpoint


def test_ctrl_c_in_a_script_that_calls_the_train_flow_stops_it_as_a_cancel(prefect_api, base, dataset,
                                                                           workdir):
    """A script (or a notebook, or a flow-run process whose worker's terminal had Ctrl-C) calls
    the train flow and gets a SIGINT, with nobody to cancel the run on the server: training
    stops as for a cancel (the workers' emergency checkpoint, validated and uploaded; the
    attempt's outcome cancelled) and the flow returns Cancelled. The KeyboardInterrupt used to
    leave the flow wherever it was, without waiting for the workers or recording the attempt."""
    config_file = workdir / "script.yaml"
    config_file.write_text(dump_config(base))
    run_dir = base.run_dir.path.parent / "script-ctrl-c"
    log_path = workdir / "script-ctrl-c.log"
    script = ("from flows.train import train\n"
              f"state = train(config_file={str(config_file)!r}, overrides=['run.run_id=script-ctrl-c', "
              "'training.max_steps=100000', 'checkpoint.every_steps=20'], return_state=True)\n"
              "print('the flow returned', state.type.value, flush=True)\n")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=prefect_api.env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: any(m["step"] > 20 for m in read_metrics(run_dir)), timeout_s=300,
                 what="training past its first checkpoint")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
    text = log_path.read_text()
    assert "SIGINT (Ctrl-C, here or in the terminal of the process that started this flow run): " \
           "stopping training" in text, text[-3000:]
    assert "the flow returned CANCELLED" in text, text[-3000:]
    outcomes = [json.loads(p.read_text()) for p in (run_dir / "attempts").glob("*/outcome.json")]
    assert [o["class"] for o in outcomes] == ["cancelled"], outcomes
    emergency = outcomes[0]["step"]
    assert outcomes[0]["newest_checkpoint"] == emergency
    assert emergency in Ledger(run_dir).read().steps("uploaded")
    assert not worker_processes(outcomes[0]["attempt"].split("-")[0]), "workers left training"


# CI: SIGTERM; Ctrl-C reaches the same stop (test_a_stopped_serve_cancels_the_runs_it_started[ctrl-c])
@pytest.mark.parametrize("stop", ["sigterm", pytest.param("ctrl-c", marks=pytest.mark.slow)])
def test_serve_on_a_temporary_server_says_so_and_stops_at_once(tmp_path, stop):
    """`goodput serve` with no Prefect server configured serves on a temporary one: it says
    that nothing else can reach it. SIGTERM to the service (systemd signals every process of
    it) or Ctrl-C in its terminal (SIGINT to its process group) stops it within seconds, with
    no traceback: the signal also ended Prefect's own temporary server, its child, and serve
    then hung on that server's port (ConnectionRefusedError) until SIGKILL."""
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(dump_config(small_config(tmp_path, "run.run_id=temporary")))
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_file)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(lambda: "goodput serve: serving" in log_path.read_text(), timeout_s=120,
                 what="serve started")
        time.sleep(2)  # serving: the runner polls for runs, its cancellation observer listens
        os.killpg(proc.pid, signal.SIGTERM if stop == "sigterm" else signal.SIGINT)
        stopped = time.monotonic()
        rc = proc.wait(timeout=60)  # it hung until SIGKILL
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
    text = log_path.read_text()
    assert rc == 0, (rc, took, text[-3000:])
    assert "Traceback" not in text and "ConnectionRefusedError" not in text, text[-3000:]
    assert "temporary Prefect server" in text and "goodput server" in text, text
    assert "PREFECT_API_URL" in text, text


def test_work_pool_script_deploys_prefect_yaml_and_runs_it(prefect_api, base, dataset, workdir):
    """scripts/work-pool.sh: create the pool, `prefect deploy --all`, a worker; then a run
    with a config file (the prefect.yaml deployments have the plain RunConfig() form)."""
    config_file = workdir / "pool.yaml"
    config_file.write_text(dump_config(base))
    log = open(workdir / "work-pool.log", "w")
    proc = subprocess.Popen(["bash", "scripts/work-pool.sh"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=prefect_api.env(PREFECT_WORKER_QUERY_SECONDS="1"))
    try:
        names = [f"{flow}/goodput-{flow}" for flow in ("prepare", "train", "evaluate", "pipeline")]
        names.append("train/goodput-train-continue")

        def deployed_to_the_pool():  # the served ones of the same names turn into these
            found = read_deployments(names)
            return found if found and all(d.work_pool_name == "goodput"
                                          for d in found.values()) else None

        deployments = wait_for(deployed_to_the_pool, timeout_s=180,
                               what="deployments of prefect.yaml on pool goodput")
        for name, deployment in deployments.items():  # the same typed form as served ones
            props = deployment.parameter_openapi_schema["properties"]
            assert props["config"]["$ref"] == "#/definitions/RunConfig", name
            assert {"config_file", "overrides"} <= set(props), name
        nightly = deployments["goodput-evaluate"].schedules
        assert [(s.schedule.cron, s.active, s.parameters) for s in nightly] == [
            ("0 3 * * *", False, {"config_file": "configs/tiny.yaml"})]  # no checkpoint: newest
        continuation = deployments["goodput-train-continue"]
        schedules = [(s.schedule.cron, s.active) for s in continuation.schedules]
        assert schedules == [("0 * * * *", False)]
        assert continuation.global_concurrency_limit.limit == 1
        assert continuation.concurrency_options.collision_strategy == "CANCEL_NEW"
        run = trigger_like_the_ui(prefect_api.api_url, deployments["goodput-prepare"].id,
                                  {"config_file": str(config_file)})
        finished = wait_final(run, timeout_s=180)
        assert finished.state.is_completed(), finished.state.message
        wait_for(lambda: any(f"dataset {dataset.dataset_id}" in line for line in logs_of(
            run, *[child.id for child in subflow_runs(run).values()])),  # its prepare-source's too
            timeout_s=30, what="the prepare run's log")  # logs arrive in batches
    finally:
        stop_process_tree(proc)
        log.close()


def test_serving_a_finished_run_again_keeps_its_continuation_schedule_off(tmp_path, capsys):
    from flows.deployments import build_deployments
    from goodput.checkpoint_lifecycle import ledger_of

    config = small_config(tmp_path, "training.max_steps=20")

    def continuation_active() -> bool:
        deployments = build_deployments(config, train_cron="*/5 * * * *", train_time_limit_s=60)
        continue_, = [d for d in deployments if d.name == "goodput-train-continue"]
        return continue_.schedules[0].active

    assert continuation_active()  # nothing trained yet
    ledger_of(config).record(10, "validated")
    assert continuation_active()  # half way
    assert "schedule off" not in capsys.readouterr().err
    ledger_of(config).record(20, "uploaded")
    assert not continuation_active()  # the budget is spent: serving again must not revive it
    assert "already reached training.max_steps=20: goodput-train-continue is served with its " \
           "schedule off" in capsys.readouterr().err  # said, not left for the UI to show


def test_serve_refuses_to_take_over_deployments_a_worker_runs(tmp_path, monkeypatch):
    """`goodput serve` beside `goodput server` (prefect.yaml deployed on a work pool): Prefect
    matches deployments by name, and serving would replace theirs (parameters, schedules,
    pull steps). Refused, naming them; they are left as they were. (A server of its own: the
    session's has prefect.yaml's deployments, which other tests use.)"""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from core.errors import ConfigError
    from flows.deployments import build_deployments, on_work_pools, serve_all
    from infra.temporary_server import TemporaryServer

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    with temporary_settings({PREFECT_HOME: tmp_path / "prefect-home"}):
        server = TemporaryServer()
    try:
        server.serve(timeout_s=120)
        config = small_config(tmp_path, "run.run_id=taken")
        with temporary_settings({PREFECT_API_URL: server.api_url}), \
                get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name="served-elsewhere", type="process"))
            deployment_id = build_deployments(config)[0].apply(work_pool_name="served-elsewhere")
            assert on_work_pools(build_deployments(config)) == [
                "prepare/goodput-prepare (work pool served-elsewhere)"]
            with pytest.raises(ConfigError, match=r"already has prepare/goodput-prepare \(work "
                                                  r"pool served-elsewhere\).*take them over"):
                serve_all(config)
            assert client.read_deployment(deployment_id).work_pool_name == "served-elsewhere"
            client.delete_deployment(deployment_id)
            assert on_work_pools(build_deployments(config)) == []
    finally:
        server.stop()
