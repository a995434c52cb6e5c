"""The whole pipeline through real Prefect flow runs, real torchrun workers, real stores."""

import json
import math
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import dump_config
from flows.local_api import HEARTBEAT_EVENT
from flows.pipeline import pipeline
from flows.train import train
from goodput import evaluation
from goodput.checkpoint_lifecycle import ledger_of
from storage import open_store
from storage.ledger import Ledger
from storage.manifests import CheckpointManifest, EvalReport
from tests.helpers import (
    COMMAND_THEN_MODULES,
    REPO,
    losses_by_step,
    small_config,
    stop_process_tree,
)
from training.metrics import read_metrics

STEPS = 30


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def finished(prefect_api, workdir):
    """One uninterrupted pipeline run of the small config (shared by the tests below)."""
    config = small_config(workdir, "run.run_id=clean", "checkpoint.validate_batches=2")
    with pytest.MonkeyPatch.context() as patch:
        told = evaluation._started_evaluation
        patch.setattr(evaluation, "_started_evaluation",
                      lambda argv: EVALUATION_PROCESSES.append(told(argv)) or EVALUATION_PROCESSES[-1])
        result = pipeline(config)
    return config, result


# What the pipeline's evaluation ran in: the process its train flow started as training
# ended, or None (a new one).
EVALUATION_PROCESSES: list = []


def test_pipeline_completes_and_learns(finished):
    config, result = finished
    summary = json.loads((config.run_dir / "summary.json").read_text())
    assert result["final_step"] == STEPS == summary["train"]["final_step"]
    assert summary["prepare"]["dataset_id"] == result["dataset_id"]
    first_loss = losses_by_step(config.run_dir)[1]
    assert math.isclose(first_loss, math.log(512), rel_tol=0.1)  # a fresh model is near uniform
    assert result["eval_loss"] < first_loss - 0.5, (result, first_loss)
    assert summary["evaluate"]["perplexity"] == pytest.approx(math.exp(summary["evaluate"]["loss"]))
    for stage in ("prepare", "train", "evaluate"):
        assert summary[stage]["wall_time_s"] > 0
    records = read_metrics(config.run_dir)
    assert all(0 < r["data_wait_s"] < r["window_time_s"] and r["data_wait_share"] ==
               pytest.approx(r["data_wait_s"] / r["window_time_s"]) for r in records)
    assert summary["train"]["data_wait_share"] == pytest.approx(
        sum(r["data_wait_s"] for r in records) / sum(r["window_time_s"] for r in records))
    # TensorBoard, by default: the training curves and the evaluation's scores.
    from tests.test_tracking import tensorboard_scalars

    scalars = tensorboard_scalars(config.run_dir.path / "tensorboard")
    assert sorted(scalars["train/loss"]) == list(range(1, STEPS + 1))
    assert scalars["eval/loss"] == pytest.approx({STEPS: result["eval_loss"]})
    goodput = summary["goodput"]
    parts = ("productive_s", "lost_work_s", "checkpoint_s", "restart_s", "evaluation_s",
             "hung_s", "startup_s", "securing_s")
    assert sum(goodput[p] for p in parts) == pytest.approx(goodput["total_s"])
    assert 0 < goodput["goodput"] < 1 and goodput["lost_work_s"] == 0
    assert goodput["restart_s"] == 0  # one attempt, never restarted
    assert goodput["attempts"] == {"done": 1}

    ledger = Ledger(config.run_dir, "clean").read()
    assert ledger.steps("uploaded") == [10, 20, 30]
    validated = [h.note for e in ledger.entries.values() for h in e.history if h.state == "validated"]
    assert len(validated) == 3 and all("held-out loss" in note for note in validated)
    store = open_store(config.storage.uri)
    for step in (10, 20, 30):
        assert store.exists(f"runs/clean/checkpoints/step-{step:08d}/manifest.json")
    assert json.loads(store.get_bytes("runs/clean/ledger.json"))["entries"]["30"]["state"] == "uploaded"
    report = json.loads((config.run_dir / "eval" / "step-00000030.json").read_text())
    assert len(report["samples"]) == 2 and all(s["completion"] for s in report["samples"])


@pytest.mark.slow  # CI keeps a crash's retry in the UI run and the fault tests
def test_the_pipeline_evaluates_in_the_process_started_as_training_ended(finished):
    """Its imports (torch, the model's) overlap the end of the train flow."""
    assert [process is not None and process.returncode for process in EVALUATION_PROCESSES] == [0]


def test_crash_resumes_to_the_same_losses(finished, workdir):
    clean_config, _ = finished
    config = small_config(workdir, "run.run_id=crashy", "faults.crash_at_step=15",
                          "faults.crash_rank=1")
    result = train(config)
    assert result["final_step"] == STEPS
    assert len(list((config.run_dir / "attempts").iterdir())) == 2  # one crash, one retry
    assert (config.run_dir / "faults" / "crash_at_step-15.fired").exists()
    crashed, clean = losses_by_step(config.run_dir), losses_by_step(clean_config.run_dir)
    assert sorted(crashed) == list(range(1, STEPS + 1))
    assert crashed == clean  # exact on CPU: same data order, weights, optimizer state
    goodput = json.loads((config.run_dir / "summary.json").read_text())["goodput"]
    assert goodput["attempts"] == {"retryable": 1, "done": 1}
    assert goodput["lost_work_s"] > 0  # steps 11-15 ran twice
    assert goodput["checkpoint_advice"]["mtbf_source"].startswith("observed (1 failures")


def test_rerun_redoes_no_finished_stage(finished):
    config, result = finished
    attempts = sorted(p.name for p in (config.run_dir / "attempts").iterdir())
    dataset_files = {p: p.stat().st_mtime_ns for p in (config.run_dir.path.parents[1] / "data").rglob("*")}
    report_mtime = (config.run_dir / "eval" / "step-00000030.json").stat().st_mtime_ns

    again = pipeline(config)
    assert again == result
    assert sorted(p.name for p in (config.run_dir / "attempts").iterdir()) == attempts
    assert {p: p.stat().st_mtime_ns for p in dataset_files} == dataset_files
    assert (config.run_dir / "eval" / "step-00000030.json").stat().st_mtime_ns == report_mtime


def test_a_command_with_nothing_to_do_starts_no_flow_run(finished, tmp_path, monkeypatch):
    """Rerun on the finished run, `goodput pipeline`, `train` and `evaluate` find their work
    done by the checks their flows make (dataset prepared and published; run trained to
    max_steps, every checkpoint judged and uploaded; the newest checkpoint's report made
    with these settings), say so and return the flow's result without importing Prefect
    or torch: no temporary server, no flow run."""
    config, result = finished
    config_file = tmp_path / "run.yaml"
    config_file.write_text(dump_config(config))
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    attempts = sorted(p.name for p in (config.run_dir / "attempts").iterdir())
    report_file = config.run_dir / "eval" / "step-00000030.json"
    report_mtime = report_file.stat().st_mtime_ns
    outputs = {}
    for command in ("pipeline", "train", "evaluate"):
        proc = subprocess.run([sys.executable, "-c", COMMAND_THEN_MODULES, command, "--config",
                               str(config_file)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)  # elsewhere than the repository: no ./.env
        assert proc.returncode == 0, proc.stderr
        assert f"goodput: {command}: nothing to do; no flow run started" in proc.stderr
        assert "imported: []" in proc.stdout
        outputs[command] = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    assert outputs["pipeline"] == result
    assert outputs["train"]["final_step"] == STEPS
    assert outputs["train"]["last_attempt"]["already_complete"]
    assert outputs["evaluate"]["step"] == STEPS and outputs["evaluate"]["loss"] == result["eval_loss"]
    assert not (tmp_path / "prefect" / "prefect.db").exists()
    assert sorted(p.name for p in (config.run_dir / "attempts").iterdir()) == attempts
    assert report_file.stat().st_mtime_ns == report_mtime
    summary = json.loads((config.run_dir / "summary.json").read_text())
    assert summary["train"]["final_step"] == STEPS and summary["evaluate"]["step"] == STEPS
    # Another learning rate is another run: not "nothing to do" (the flow says why it refuses).
    from flows import cli

    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", env["PREFECT_HOME"])  # no profile names a server
    monkeypatch.chdir(tmp_path)  # nor a settings file
    other_lr = config.model_copy(update={"training": config.training.model_copy(update={"lr": 1e-4})})
    assert cli._without_a_flow("train", config)["final_step"] == STEPS
    assert cli._without_a_flow("train", other_lr) is None


@pytest.mark.s3
@pytest.mark.slow  # CI: test_a_pipeline_takes_its_keys_from_blocks_..., the same pipeline on S3
def test_pipeline_with_an_s3_store(prefect_api, s3_server, s3_uri, tmp_path):
    config = small_config(tmp_path, "run.run_id=s3run", f"storage.uri={s3_uri}",
                          f"storage.endpoint_url={s3_server.endpoint_url}", "training.max_steps=20")
    result = pipeline(config)
    assert result["final_step"] == 20
    store = open_store(s3_uri, endpoint_url=s3_server.endpoint_url)
    keys = store.list()
    assert f"datasets/{result['dataset_id']}/manifest.json" in keys
    assert "runs/s3run/checkpoints/step-00000020/manifest.json" in keys
    assert "runs/s3run/ledger.json" in keys
    assert Ledger(config.run_dir, "s3run").read().steps("uploaded") == [10, 20]


def test_training_needs_only_the_store_once_the_data_is_prepared(prefect_api, tmp_path):
    """The raw sources and the local dataset copy are gone: the train flow (and the held-out
    check of its validation) finds the dataset by its data settings in the store, and reads
    its shards from there through a cache smaller than the dataset."""
    import shutil

    from flows.evaluate import evaluate
    from flows.prepare import prepare
    from goodput.data.corpus import build_builtin_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(build_builtin_corpus(tmp_path / "builtin"), corpus / "docs.jsonl")
    config = small_config(tmp_path, "run.run_id=nosources", f"data.source={corpus}",
                          "data.shard_tokens=16384", "data.cache_limit=420KiB",
                          "training.shuffle_window_tokens=16384",
                          "training.max_steps=10", "checkpoint.validate_batches=2")
    manifest = prepare(config)
    assert sum(s.size for s in manifest.splits["train"]) > 420 * 2**10
    shutil.rmtree(corpus)
    shutil.rmtree(config.data.data_dir)
    assert train(config)["final_step"] == 10
    ledger = Ledger(config.run_dir, "nosources").read()
    assert ledger.steps("uploaded") == [10]
    assert any("held-out loss" in h.note for h in ledger.entries[10].history if h.state == "validated")
    report = evaluate(config)  # the evaluator reads the validation split through the cache too
    assert report.step == 10 and report.dataset_id == manifest.dataset_id
    assert math.isfinite(report.loss) and report.tokens_evaluated > 0
    assert not (tmp_path / "data" / manifest.dataset_id).exists()  # nothing downloaded whole
    cache = tmp_path / "data" / "cache" / manifest.dataset_id
    assert 0 < sum(p.stat().st_size for p in cache.glob("*.arrow")) <= 420 * 2**10
    # The pipeline's prepare stage on such a host finds it the same way: nothing to tokenize.
    assert prepare(config) == manifest


@pytest.mark.slow  # CI: test_prepare's test_training_publishes_to_its_store_only_what_the_store_lacks
def test_training_publishes_a_dataset_its_store_lacks(prefect_api, tmp_path):
    """Prepared with one storage.uri and trained with another: the run's checkpoints go to
    the second store, and so does the dataset now (it stayed on the first machine, and a
    machine with only that store could resume the checkpoints but not find their data)."""
    import shutil

    from flows.prepare import prepare
    from goodput.data.corpus import build_builtin_corpus
    from goodput.data.prepare import dataset_for_training
    from storage.store import store_from_config

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(build_builtin_corpus(tmp_path / "builtin"), corpus / "docs.jsonl")
    overrides = ("run.run_id=moved", f"data.source={corpus}", "training.max_steps=10")
    manifest = prepare(small_config(tmp_path, *overrides, f"storage.uri={tmp_path / 'first'}"))
    config = small_config(tmp_path, *overrides, f"storage.uri={tmp_path / 'second'}")
    assert train(config)["final_step"] == 10
    store = store_from_config(config.storage)
    assert store.exists(f"datasets/{manifest.dataset_id}/manifest.json")
    # Another machine, with only the second store: the sources and the data dir are not there.
    shutil.rmtree(corpus)
    elsewhere = small_config(tmp_path / "elsewhere", *overrides, f"storage.uri={tmp_path / 'second'}")
    assert dataset_for_training(elsewhere, store).parent.name == "cache"  # streamed from the store
    assert Ledger(config.run_dir, "moved").read().steps("uploaded") == [10]


def test_cli_reports_config_errors_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "model.n_heads=3"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "model: n_heads=3 does not divide dim=128" in proc.stderr


def test_a_pipeline_flow_run_that_would_not_continue_its_run_fails_before_preparing(prefect_api, tmp_path):
    """A deployment run from the UI with another max_steps for an existing run: refused
    first, not after its dataset was prepared (the check was in the launch task)."""
    from core.errors import ConfigError
    from goodput.runs import write_run_config
    from tests.helpers import small_config

    write_run_config(small_config(tmp_path))
    longer = small_config(tmp_path, "training.max_steps=600")
    with pytest.raises(ConfigError, match="already exists .* with a different data/tokenizer/model"):
        pipeline(longer)
    assert not Path(longer.data.data_dir).exists() or not any(Path(longer.data.data_dir).glob("*/manifest.json"))


def test_a_cancel_nobody_acts_on_stops_training_and_secures_its_checkpoint(prefect_api, tmp_path):
    """A flow run that no worker or runner of its own can kill (its worker was replaced, or
    `goodput train` against a server) and that is cancelled from the UI: it used to stay
    Cancelling while training went on to its end. The flow now sees the cancellation,
    stops the workers (emergency checkpoint), secures that checkpoint itself (the server
    runs no task in a cancelling flow run) and ends Cancelled."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    from goodput.checkpoint_lifecycle import ledger_of
    from goodput.runs import read_outcomes
    from tasks.control import CANCEL_POLL_S

    config = small_config(tmp_path, "run.run_id=cancelled-in-the-ui", "training.max_steps=100000",
                          "checkpoint.every_steps=100000")
    from goodput.data.prepare import prepare_dataset

    prepare_dataset(config)
    ended = {}
    flow = threading.Thread(target=lambda: ended.update(state=train(config, return_state=True)))
    flow.start()
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(config.run_dir) and flow.is_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert read_metrics(config.run_dir), "training did not start"
        # Its flow run: the one whose id ends as the attempt's id begins.
        [attempt_dir] = (config.run_dir.path / "attempts").glob("attempt-*")
        tail = attempt_dir.name.removeprefix("attempt-").split("-")[0]
        with get_client(sync_client=True) as client:
            running = FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
            [run] = [r for r in client.read_flow_runs(flow_run_filter=running)
                     if str(r.id).endswith(tail)]
            client.set_flow_run_state(run.id, Cancelling(), force=True)  # the UI's Cancel
        flow.join(timeout=CANCEL_POLL_S + 120)
        assert not flow.is_alive(), "the flow run went on training after its cancellation"
    finally:
        if flow.is_alive():
            from infra.torchrun import stop_live_attempts

            for stopping in stop_live_attempts(grace_s=0):
                stopping.join()
            flow.join()
    assert ended["state"].is_cancelled(), ended["state"]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run.id).state.is_cancelled()
    [outcome] = read_outcomes(config)
    assert outcome["class"] == "cancelled"
    entries = ledger_of(config).read().entries  # the emergency checkpoint, secured
    assert entries and entries[max(entries)].state == "uploaded", entries


def test_the_sigterm_of_a_cancel_still_secures_the_emergency_checkpoint(prefect_api, tmp_path):
    """Prefect's worker or runner cancels a flow run it started with SIGTERM (SIGKILL 30 s
    later); the engine then starts no task run. The flow's process used to stop the workers
    and exit, leaving their emergency checkpoint unjudged and not uploaded (and missing
    from the ledger) until the next run on that machine. It is now secured before the
    process exits. A `goodput train` against the server, sent the same SIGTERM."""
    from goodput.checkpoint_lifecycle import ledger_of
    from goodput.data.prepare import prepare_dataset
    from goodput.runs import read_outcomes

    config = small_config(tmp_path, "run.run_id=terminated", "training.max_steps=100000",
                          "checkpoint.every_steps=100000")
    prepare_dataset(config)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(dump_config(config))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", str(config_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=prefect_api.env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(config.run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert read_metrics(config.run_dir), "training did not start"
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
            proc.communicate()
    [outcome] = read_outcomes(config)
    assert outcome["class"] == "cancelled", outcome
    entries = ledger_of(config).read().entries  # the emergency checkpoint, and nothing else
    assert list(entries) == [outcome["step"]] and entries[outcome["step"]].state == "uploaded", (
        entries, text[-3000:])
    assert f"checkpoint step {outcome['step']} validated and uploaded to " in text, text[-3000:]
    assert "after the cancellation" in text


def test_a_cancel_while_waiting_for_the_runs_lease_ends_the_wait(prefect_api, tmp_path):
    """The same cancel while another holder trains the run: the wait for the lease ends and
    the flow run ends Cancelled (it waited for the holder, possibly hours)."""
    import logging
    import threading
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from goodput.data.prepare import prepare_dataset
    from infra.torchrun import RunLease
    from tasks.control import CANCEL_POLL_S

    class WaitSeen(logging.Handler):
        """Set when the flow run (a thread of this process) logs that it waits for the lease:
        the cancel must reach the wait itself, not the stages before it (on a loaded machine
        those took a minute)."""
        def __init__(self):
            super().__init__()
            self.seen = threading.Event()
            self.flow_run_id = None

        def emit(self, record):
            if "is being trained by another flow run" in record.getMessage():
                self.flow_run_id = getattr(record, "flow_run_id", None)
                self.seen.set()

    config = small_config(tmp_path, "run.run_id=waiting")
    prepare_dataset(config)
    ended = {}
    wait_seen = WaitSeen()
    flow_runs_logger = logging.getLogger("prefect.flow_runs")
    flow_runs_logger.addHandler(wait_seen)
    try:
        with RunLease(config, "another flow run").held(print):  # held, renewed, by this process
            flow = threading.Thread(
                target=lambda: ended.update(state=train(config, return_state=True)))
            flow.start()
            deadline = time.monotonic() + 600
            while not wait_seen.seen.wait(0.5) and flow.is_alive() and time.monotonic() < deadline:
                pass
            assert wait_seen.seen.is_set(), f"the flow run never waited for the lease: {ended}"
            time.sleep(1)  # into the wait
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(UUID(wait_seen.flow_run_id), Cancelling(), force=True)
            flow.join(timeout=CANCEL_POLL_S + 60)
            assert not flow.is_alive(), "the flow run went on waiting after its cancellation"
    finally:
        flow_runs_logger.removeHandler(wait_seen)
    assert ended["state"].is_cancelled(), ended["state"]
    assert "gave up waiting for the run's lease" in ended["state"].message
    assert not (config.run_dir.path / "attempts").exists() or not list(
        (config.run_dir.path / "attempts").glob("attempt-*"))  # nothing launched


def test_ctrl_c_stops_the_cli_on_prefects_temporary_api(tmp_path):
    """No server configured: Ctrl-C in a terminal signals the whole foreground process group.
    It used to kill Prefect's temporary API server too, and the command then hung for minutes
    retrying the dead API instead of stopping. The workers, in sessions of their own, are
    stopped by the command (attempt cancelled, not retried); their checkpoints are kept, and
    the emergency one is validated and uploaded before the command ends. A second press while
    they save (it tore the API down under the stop's logging) is told to wait."""
    config = small_config(tmp_path, "training.max_steps=2000", "launch.max_restarts=1")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(dump_config(config))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "pipeline", "--config", str(config_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=env, start_new_session=True)  # a terminal's foreground group
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if "committed step-00000010" in line:
                break
        else:
            pytest.fail("the CLI ended before its first checkpoint:\n" + "".join(output)[-5000:])
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # a double press: the stop goes on, said so
        started = time.monotonic()
        try:
            output.append(proc.communicate(timeout=100)[0])
        except subprocess.TimeoutExpired:  # where is it stuck? (the CLI dumps its threads on SIGUSR1)
            os.kill(proc.pid, signal.SIGUSR1)
            try:
                output.append(proc.communicate(timeout=25)[0])
            except subprocess.TimeoutExpired:
                stop_process_tree(proc)
                output.append(proc.communicate()[0])
        text = "".join(output)
        dump = re.search(r"^(Current thread|Thread) 0x", text, re.MULTILINE)
        assert time.monotonic() - started < 130, (text[dump.start():dump.start() + 12000] if dump
                                                  else text[-3000:])
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
            proc.communicate()
    assert proc.returncode == 130, text[-3000:]
    assert "goodput: pipeline interrupted" in text
    assert re.search(r"attempt \S+ cancelled at step \d+: not retrying", text), text[-3000:]
    assert re.search(r"launch-training-\w+' - Finished in state Cancelled\('training attempt", text)
    # What cancelled it (a scancel says so too; the command had called every cancel the UI's).
    assert re.search(r"was cancelled at step \d+: stopped by a cancellation", text), text[-3000:]
    assert "SignalException" not in text  # torchrun's traceback of its SIGTERM: one line
    assert "goodput: stopping: the workers are saving an emergency checkpoint" in text
    assert "Logging error" not in text and "Traceback" not in text
    assert (config.run_dir.path / "checkpoints" / "step-00000010").is_dir()
    # The flow runs Ctrl-C ended are Cancelled, as the UI's Cancel leaves them, not Crashed.
    db = sqlite3.connect(tmp_path / "prefect" / "prefect.db")
    states = dict(db.execute("SELECT flow.name, flow_run.state_type FROM flow_run JOIN flow ON flow.id = "
                             "flow_run.flow_id WHERE flow.name IN ('pipeline', 'train')"))
    assert states == {"pipeline": "CANCELLED", "train": "CANCELLED"}, states
    # The emergency checkpoint is secured before the command ends, not by the next run.
    from goodput.checkpoint_lifecycle import ledger_of

    entries = ledger_of(config).read().entries
    last = max(entries)
    assert last >= 10 and entries[last].state == "uploaded", entries
    if last > 10:  # (a stop exactly at step 10 has no emergency checkpoint of its own)
        assert f"checkpoint step {last} validated and uploaded to " in text, text[-3000:]


def test_cli_evaluates_a_given_checkpoint(finished, tmp_path):
    """On Prefect's temporary server (no server configured): the command's output holds no
    traceback, and before the server stops with it, it has recorded every task run the
    flow logged as finished, in a final state. Its flow runs sent no heartbeats (no
    automation there watches them). The command's own process never imported torch: the
    model runs in processes of their own."""
    config, _ = finished
    config_file = tmp_path / "run.yaml"
    config_file.write_text(dump_config(config))
    home = tmp_path / "prefect"
    proc = subprocess.run([sys.executable, "-c", COMMAND_THEN_MODULES, "evaluate", "--config",
                           str(config_file), "--checkpoint", "20", "eval.num_samples=1"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PREFECT_HOME": str(home)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run directory: {config.run_dir.path.resolve()}" in proc.stdout
    # eval.num_samples=1 is not the run's setting: its report lies apart from the run's own.
    from core.config import load_config
    from goodput.evaluation import report_path

    path = report_path(load_config(config_file, ["eval.num_samples=1"]), config.run_dir.checkpoint(20))
    assert path.parent.name.startswith("settings-")
    report = json.loads(path.read_text())
    assert report["step"] == 20 and report["loss"] > 0 and len(report["samples"]) == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "imported: ['prefect']" in proc.stdout
    db = sqlite3.connect(home / "prefect.db")
    logged = db.execute("SELECT count(DISTINCT task_run_id) FROM log WHERE task_run_id IS NOT "
                        "NULL AND message LIKE 'Finished in state%'").fetchone()[0]
    states = dict(db.execute("SELECT state_type, count(*) FROM task_run GROUP BY state_type"))
    assert logged >= 5 and states == {"COMPLETED": logged}
    events = dict(db.execute("SELECT event, count(*) FROM events GROUP BY event"))
    assert events.get("prefect.flow-run.Completed") and HEARTBEAT_EVENT not in events


def test_a_trained_run_names_its_newest_checkpoint_and_the_export_that_works_on_it(finished, tmp_path, capsys):
    """`goodput train` (here with nothing left to do) ends naming the newest checkpoint and
    the command that makes a transformers model of it; that command, run as printed, works."""
    import shlex

    config, _ = finished
    config_file = tmp_path / "run.yaml"
    config_file.write_text(dump_config(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    # As after `goodput train` alone: the summary holds no prepare (the export hint had no
    # --tokenizer then; the checkpoint names its dataset).
    summary_file = config.run_dir / "summary.json"
    kept = summary_file.read_bytes()
    summary_file.write_text(json.dumps({k: v for k, v in json.loads(kept).items() if k != "prepare"}))
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", str(config_file)],
                              capture_output=True, text=True, cwd=REPO, timeout=300,
                              env={**env, "PREFECT_HOME": str(tmp_path / "prefect")})
    finally:
        summary_file.write_bytes(kept)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [said] = [line for line in proc.stdout.splitlines() if line.startswith("newest checkpoint: ")]
    checkpoint = config.run_dir.checkpoint(STEPS).resolve()
    assert said.startswith(f"newest checkpoint: {checkpoint} (step {STEPS}); as a Hugging Face model: ")
    export = said.split("as a Hugging Face model: ", 1)[1]
    argv = shlex.split(export)
    assert argv[:2] == ["goodput", "export"] and "--tokenizer" in argv
    argv[argv.index("--out") + 1] = str(tmp_path / "hf")  # not into the run shared by the tests
    exported = subprocess.run([sys.executable, "-m", "flows.cli", *argv[1:]], capture_output=True,
                              text=True, cwd=REPO, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()

    # A machine that trained from the store has no dataset directory: the hint named no
    # --tokenizer, and lm-eval could not load the export. It names the dataset in the store.
    from flows.cli import _say_how_to_export

    elsewhere = config.model_copy(update={"data": config.data.model_copy(update={"data_dir": str(tmp_path / "empty")})})
    _say_how_to_export(elsewhere)
    argv = shlex.split(capsys.readouterr().out.split("as a Hugging Face model: ", 1)[1])
    dataset = CheckpointManifest.load(checkpoint).dataset_id
    assert argv[argv.index("--tokenizer") + 1] == str(Path(config.storage.uri).resolve() / "datasets" / dataset)
    argv[argv.index("--out") + 1] = str(tmp_path / "hf-store")
    exported = subprocess.run([sys.executable, "-m", "flows.cli", *argv[1:]], capture_output=True,
                              text=True, cwd=REPO, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "hf-store" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()


def test_an_evaluation_s_own_warnings_reach_the_log(finished, caplog):
    """Scores that a tracking server never got were said only on the evaluation process's
    stderr, which a successful evaluation threw away."""
    import logging

    from goodput.evaluation import evaluate
    from infra.torchrun import free_port
    from tasks.train import locate_dataset

    config, _ = finished
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    elsewhere = config.model_copy(update={  # eval settings of its own: evaluated again
        "tracking": config.tracking.model_copy(update={"mlflow_uri": down}),
        "eval": config.eval.model_copy(update={"max_batches": 1, "num_samples": 1})})
    with caplog.at_level(logging.WARNING, logger="goodput.evaluation"):
        report = evaluate(elsewhere, config.run_dir.checkpoint(10), locate_dataset.fn(elsewhere))
    assert report.step == 10
    assert "never sent" in caplog.text and down in caplog.text, caplog.text


def test_evaluating_another_runs_checkpoint_leaves_this_runs_summary_and_ledger(finished, tmp_path):
    """`goodput evaluate --checkpoint DIR` of a checkpoint that is not the run's: its report
    goes to eval/other/, and the run's summary.json and ledger keep the run's own scores."""
    from core.errors import ConfigError
    from goodput.evaluation import evaluate, pick_checkpoint, record_eval
    from tasks.train import locate_dataset

    config, _ = finished
    foreign = tmp_path / "elsewhere" / "step-00000010"
    shutil.copytree(config.run_dir.checkpoint(10), foreign)
    summary, ledger = (config.run_dir / "summary.json").read_bytes(), ledger_of(config).read()
    report = evaluate(config, foreign, locate_dataset(config))
    values = record_eval(config, report, time.time())
    assert Path(values["report"]).parent == config.run_dir.eval_dir / "other"
    assert (config.run_dir / "summary.json").read_bytes() == summary
    assert ledger_of(config).read() == ledger
    # Its file:// URL (as the ledger and the upload log name a local store's copies) is that
    # directory; a URL of the store's copy asks for the step number instead.
    assert pick_checkpoint(config, None, foreign.as_uri()) == foreign
    with pytest.raises(ConfigError, match="give the step number"):
        pick_checkpoint(config, None, "s3://bucket/runs/clean/checkpoints/step-00000010")


def test_an_eval_report_is_reused_only_for_the_same_checkpoint_copy_and_settings(finished):
    """The saved report of a step answers a later evaluation only when nothing it depends on
    changed: other eval settings, or another copy of the step, are evaluated again."""
    from goodput.evaluation import evaluate, record_eval, report_path
    from tasks.train import locate_dataset

    config, _ = finished
    checkpoint, dataset_dir = config.run_dir.checkpoint(10), locate_dataset(config)
    first = evaluate(config, checkpoint, dataset_dir)
    assert first.copy_id and first.eval_hash == config.eval_hash()
    assert evaluate(config, checkpoint, dataset_dir) == first  # the same: reused

    more_samples = config.model_copy(update={"eval": config.eval.model_copy(update={"num_samples": 1})})
    saved_config = config.run_dir.config_file.read_bytes()
    ledger = ledger_of(config).read()
    second = evaluate(more_samples, checkpoint, dataset_dir)
    assert len(second.samples) == 1 != len(first.samples) and second.created_at > first.created_at
    # A one-off evaluation's settings stay out of the run's config.yaml (they became its
    # defaults), and its own copy of them is gone.
    assert config.run_dir.config_file.read_bytes() == saved_config
    assert not list(config.run_dir.eval_dir.glob(".*config.yaml"))
    # Its report is apart, named by its settings: the run's report, its scores in the ledger
    # and so the best checkpoint by eval stay those of the run's own settings.
    one_off = report_path(more_samples, checkpoint)
    assert one_off == config.run_dir.eval_dir / f"settings-{more_samples.eval_hash()[:12]}" / "step-00000010.json"
    assert EvalReport.model_validate_json(config.run_dir.eval_report(10).read_text()) == first
    record_eval(more_samples, second, time.time())
    assert ledger_of(config).read() == ledger
    assert evaluate(more_samples, checkpoint, dataset_dir) == second  # reused where it lies

    # The step saved again (an in-job restart re-trains it): another manifest, another copy.
    saved = CheckpointManifest.load(checkpoint)
    original = (checkpoint / "manifest.json").read_bytes()
    try:
        saved.model_copy(update={"created_at": saved.created_at + 1}).save(checkpoint)
        third = evaluate(more_samples, checkpoint, dataset_dir)
        assert third.copy_id != second.copy_id and third.created_at > second.created_at
        # The report it replaced (scores a user asked for once) is kept, named by its settings.
        [kept] = (one_off.parent / "earlier").glob(f"step-00000010.{second.eval_hash[:12]}.*.json")
        assert EvalReport.model_validate_json(kept.read_text()) == second
    finally:
        (checkpoint / "manifest.json").write_bytes(original)
