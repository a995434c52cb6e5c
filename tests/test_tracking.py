"""Tracking backends and in-loop validation: TensorBoard event files read back, W&B in its
offline mode read back from its run files, MLflow against a real tracking server, a server
that is down, and the held-out loss measured inside training."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from infra.launchers import free_port
from tests.helpers import REPO, losses_by_step, small_config, synthetic_dataset, torchrun_training, wait_for
from training.metrics import read_metrics
from training.tracking import MLflowTracker, curves, mlflow_name, open_trackers

STEPS = 12
TRACKED = ("training.max_steps=12", "checkpoint.every_steps=4", "eval.every_steps=4", "eval.in_loop_batches=2")


def test_metrics_records_become_tagged_curves():
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 900.0, "mfu": None,
              "save_in_flight": True, "attempt": "a1", "val_loss": 2.7, "val_loss/web": 2.6,
              "data_wait_share": 0.01, "eval/hellaswag/acc": 0.3, "grad_norm": float("nan")}
    assert curves(record) == {"train/loss": 2.5, "train/lr": 1e-3, "perf/tokens_per_s": 900.0,
                              "val/loss": 2.7, "val/loss/web": 2.6, "perf/data_wait_share": 0.01,
                              "eval/hellaswag/acc": 0.3}


def test_a_cpu_worker_logs_its_peak_resident_memory_as_a_curve():
    """README lists peak memory among metrics.jsonl's fields: on CPU it is the worker's peak
    resident set (the kernel's VmHWM), read once per logged record, and the trackers show it
    beside CUDA's figure."""
    import torch

    from training.train import device_memory

    def hwm_gib() -> float:
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024 / 2**30

    before = hwm_gib()
    logged = device_memory(torch.device("cpu"))
    assert set(logged) == {"max_rss_gb"} and before <= logged["max_rss_gb"] <= hwm_gib()
    assert curves({"step": 1, **logged}) == {"memory/max_rss_gb": logged["max_rss_gb"]}


def test_a_worker_s_peak_is_its_own_not_its_launcher_s():
    """getrusage's ru_maxrss carries the peak of the process that exec'd the worker (a torchrun
    worker's starts at the agent's 0.22 GiB before it imports anything). A worker started by a
    process holding 1 GiB logs its own peak."""
    held = bytearray(2**30)
    for page in range(0, len(held), 4096):  # resident, not only reserved
        held[page] = 1
    code = ("import resource; from training.metrics import peak_resident_bytes; "
            "print(peak_resident_bytes() / 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout.split()
    logged, inherited = float(out[0]), float(out[1])
    del held
    assert inherited >= 1.0  # the kernel's figure: this test process's peak, not the child's
    assert logged < 0.5, logged  # the child's own: the interpreter (device_memory's figure)


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard shows for `directory`, by tag and step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shown = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    shown.Reload()
    return {tag: {e.step: e.value for e in shown.Scalars(tag)} for tag in shown.Tags()["scalars"]}


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B offline run file (its record log: 32 KiB blocks of records,
    each with a 7-byte header of crc32, length and type; payloads are wandb's protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()[7:]  # the file header: "W&B" magic and version
    rows, pending, offset = [], b"", 0
    while offset + 7 <= len(data):
        block_left = 32768 - (offset + 7) % 32768
        if block_left < 7:  # a block's tail too short for a header is padding
            offset += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if length == 0 and kind == 0:
            break
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.HasField("history"):
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow.server", reason="the MLflow server (pip install mlflow)")
    tmp_path = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
         "--default-artifact-root", str(tmp_path / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # ready: it answers an API call (its database is up)
        try:
            with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1",
                                        timeout=5) as answer:
                if answer.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the MLflow server did not start within 90 s")
    yield url
    os.killpg(proc.pid, 9)
    proc.wait()


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, mlflow_server):
    """One run tracked by TensorBoard, W&B (offline) and the MLflow server, whose first
    attempt dies at step 10 (rank 0, after the checkpoint of step 8) and whose second resumes
    and finishes (its config; the tests below read what each backend shows)."""
    tmp_path = tmp_path_factory.mktemp("tracked")
    dataset = synthetic_dataset(tmp_path / "dataset")
    tracked = (*TRACKED, "tracking.wandb_project=goodput-test", "tracking.wandb_mode=offline",
               f"tracking.mlflow_uri={mlflow_server}")
    first = torchrun_training(small_config(tmp_path, *tracked, "faults.crash_at_step=10"), dataset)
    assert first.returncode != 0
    config = small_config(tmp_path, *tracked)
    resumed = torchrun_training(config, dataset)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return config


def test_training_logs_to_tensorboard_and_wandb_and_validates_in_the_loop(tracked_run):
    config = tracked_run
    # metrics.jsonl: the in-loop held-out loss every 4 steps, its time outside the step's.
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    validated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert all(r["val_time_s"] > 0 for r in records if "val_loss" in r)
    assert validated[12] < validated[4]  # it learns
    losses = losses_by_step(config.run_dir)  # the later of a step's runs

    # TensorBoard shows each step once: the resumed attempt hid what the crashed one logged
    # for steps 9 and 10, now redone.
    scalars = tensorboard_scalars(config.run_dir.path / "tensorboard")
    assert sorted(scalars["train/loss"]) == list(range(1, STEPS + 1))
    assert scalars["train/loss"] == pytest.approx(losses, rel=1e-6)
    assert scalars["val/loss"] == pytest.approx({s: validated[s] for s in (4, 8, 12)}, rel=1e-6)
    for tag in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/data_wait_share",
                "checkpoint/stall_s", "train/resumed_at_step"):
        assert tag in scalars, tag
    assert scalars["train/resumed_at_step"] == {8: 8.0}

    # W&B offline: W&B cannot resume an offline run, so each attempt is a run of its own in
    # the run's group (a directory each, named by start time and id); the second continued at
    # step 9, marked, against trainer/step. The killed attempt's own .wandb file may be lost
    # with it: W&B's service writes it, and rank 0 was SIGKILLed 2 steps in.
    from training.tracking import TRAINER_STEP

    attempts = sorted((config.run_dir.path / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and len({d.name.rsplit("-", 1)[1] for d in attempts}) == 2
    second = wandb_history(next(attempts[1].glob("run-*.wandb")))
    steps = [row[TRAINER_STEP] for row in second if "train/loss" in row]
    assert steps == list(range(9, STEPS + 1))
    assert [row["train/loss"] for row in second if "train/loss" in row] == pytest.approx(
        [losses[s] for s in steps], rel=1e-6)
    assert any(row.get("val/loss") == pytest.approx(validated[12]) for row in second)
    assert [row[TRAINER_STEP] for row in second if "train/resumed_at_step" in row] == [8]


def test_an_attempt_that_fails_before_its_first_checkpoint_flushes_and_is_hidden_by_the_retry(tmp_path):
    """The failing attempt's trackers are closed on its way out (TensorBoard flushes every 5 s:
    without it its last steps were lost); the retry, from scratch, hides them and marks 0."""
    dataset = synthetic_dataset(tmp_path / "dataset")
    failing = small_config(tmp_path, "training.max_steps=6", "faults.nan_at_step=3")
    first = torchrun_training(failing, dataset)
    assert first.returncode != 0
    assert sorted(tensorboard_scalars(failing.run_dir.path / "tensorboard")["train/loss"]) == [1, 2]
    config = small_config(tmp_path, "training.max_steps=6")
    resumed = torchrun_training(config, dataset)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    scalars = tensorboard_scalars(config.run_dir.path / "tensorboard")
    assert scalars["train/loss"] == pytest.approx(losses_by_step(config.run_dir), rel=1e-6)
    assert sorted(scalars["train/loss"]) == list(range(1, 7)) and scalars["train/resumed_at_step"] == {0: 0.0}


def test_scores_of_checkpoints_training_has_passed_reach_wandb(tmp_path):
    """W&B ignores values logged at a step below its run's current step, and training is past
    a checkpoint's step by the time it is evaluated: an evaluation logs to a W&B run of its
    own in the training run's group, against a trainer/step axis, in any order."""
    from training.tracking import TRAINER_STEP, WandbTracker

    tracker = WandbTracker("goodput-test", None, "offline", "run-x", tmp_path, None, job="eval")
    tracker.log(30, {"eval/loss": 2.0})
    tracker.log(10, {"eval/loss": 3.0})  # an earlier checkpoint evaluated later
    tracker.close()
    train = WandbTracker("goodput-test", None, "offline", "run-x", tmp_path, None)
    assert train._init["id"] != tracker._init["id"] and train._init["group"] == tracker._init["group"] == "run-x"
    train.close()
    # Online, every attempt resumes the one run of its id; offline, each is a run of its own.
    ids = [WandbTracker("goodput-test", None, mode, "run-x", tmp_path / mode, None)
           for mode in ("online", "online", "offline", "offline")]
    for tracker in ids:
        tracker.close()
    assert ids[0]._init["id"] == ids[1]._init["id"]
    assert len({ids[0]._init["id"], ids[2]._init["id"], ids[3]._init["id"]}) == 3
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's service process writes the file: under load, after finish() has returned.
    def scores() -> list[dict] | None:
        rows = [row for row in wandb_history(run) if "eval/loss" in row]
        return rows if len(rows) >= 2 else None

    rows = wait_for(scores, timeout_s=60, what="both scores in the W&B run file")
    assert [(row[TRAINER_STEP], row["eval/loss"]) for row in rows] == [(30, 2.0), (10, 3.0)]




def test_a_tracking_server_that_is_down_never_slows_the_trainer(caplog):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracker = MLflowTracker(down, "goodput", "run-down", None)
    tracker.close_timeout_s = 2.0
    started = time.perf_counter()
    for step in range(1, 1001):
        tracker.log(step, {"train/loss": 1.0 / step})
    assert time.perf_counter() - started < 0.5  # 1000 records handed over without waiting
    with caplog.at_level(logging.WARNING, logger="training.tracking"):
        closing = time.perf_counter()
        tracker.close()
    assert time.perf_counter() - closing < 30
    assert "never sent" in caplog.text and down in caplog.text


def test_training_logs_to_a_real_mlflow_server_and_a_resume_continues_its_run(tracked_run,
                                                                              mlflow_server):
    from mlflow.tracking import MlflowClient

    config = tracked_run
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("goodput").experiment_id],
                              "tags.`goodput.run_id` = 'test'")
    assert len(runs) == 1  # both attempts logged into one MLflow run
    run_id = runs[0].info.run_id
    history = client.get_metric_history(run_id, "train/loss")
    losses = losses_by_step(config.run_dir)
    assert {m.step for m in history} == set(range(1, STEPS + 1))
    latest = {}
    for metric in sorted(history, key=lambda m: m.timestamp):
        latest[metric.step] = metric.value
    assert latest == pytest.approx(losses, rel=1e-6)
    marker = client.get_metric_history(run_id, "train/resumed_at_step")
    assert [(m.step, m.value) for m in marker] == [(8, 8.0)]  # the redone steps 9, 10 follow it
    assert runs[0].data.params["training.max_steps"] == "12"
    assert runs[0].info.status == "FINISHED" and runs[0].info.end_time is not None


def test_the_mlflow_run_status_follows_training(mlflow_server):
    """RUNNING while an attempt trains, then how it ended (FINISHED, KILLED, FAILED);
    RUNNING again when an attempt continues the run. An evaluation leaves the status alone,
    unless it made the run itself."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)

    def status(goodput_run: str) -> str:
        experiment = client.get_experiment_by_name("goodput").experiment_id
        [run] = client.search_runs([experiment], f"tags.`goodput.run_id` = '{goodput_run}'")
        return run.info.status

    def attempt(goodput_run: str, ended: str, job: str = "train", steps=(1, 2)) -> None:
        tracker = MLflowTracker(mlflow_server, "goodput", goodput_run, None, job=job)
        for step in steps:
            tracker.log(step, {"train/loss": 1.0 / step})
        if job == "train":  # the run is made (or found) by the first send
            wait_for(lambda: tracker.run is not None and status(goodput_run) == "RUNNING",
                     timeout_s=30, what="the MLflow run RUNNING while the attempt trains")
        tracker.close(ended)

    attempt("preempted", "KILLED")
    assert status("preempted") == "KILLED"
    attempt("preempted", "FINISHED", steps=(3,))  # continued: RUNNING, then FINISHED
    assert status("preempted") == "FINISHED"
    attempt("preempted", "FINISHED", job="eval", steps=(3,))  # a score logged later
    assert status("preempted") == "FINISHED"
    attempt("failing", "FAILED")
    assert status("failing") == "FAILED"

    running = MLflowTracker(mlflow_server, "goodput", "evaluated-while-training", None)
    running.log(1, {"train/loss": 1.0})
    wait_for(lambda: running.run is not None, timeout_s=30, what="the MLflow run made")
    attempt("evaluated-while-training", "FINISHED", job="eval", steps=(1,))
    assert status("evaluated-while-training") == "RUNNING"  # training goes on
    running.close()
    assert status("evaluated-while-training") == "FINISHED"

    attempt("evaluated-only", "FINISHED", job="eval", steps=(5,))  # no training logged there
    assert status("evaluated-only") == "FINISHED"


def test_in_loop_validation_gives_the_same_loss_under_pipeline_and_fsdp_layouts(tmp_path):
    """The same 4 validation samples: one batch of 4 through 2 pipeline stages, or two
    batches of 2, one per FSDP rank."""
    dataset = synthetic_dataset(tmp_path / "dataset")
    found = []
    for run, layout in (("pp", ("parallelism.pp=2", "training.micro_batch_size=4", "eval.in_loop_batches=1")),
                        ("fsdp", ("parallelism.dp_shard=2", "training.micro_batch_size=2",
                                  "eval.in_loop_batches=2"))):
        config = small_config(tmp_path, f"run.run_id={run}", "training.max_steps=4", "eval.every_steps=2",
                              "tracking.tensorboard=false", *layout)
        done = torchrun_training(config, dataset)
        assert done.returncode == 0, done.stderr[-3000:]
        found.append({r["step"]: r["val_loss"] for r in read_metrics(config.run_dir) if "val_loss" in r})
    assert sorted(found[0]) == [2, 4] and found[0] == pytest.approx(found[1], rel=1e-5)


@pytest.mark.slow  # about 3.5 min; the nightly evaluation of tests/test_prefect_surface evaluates beside a run in CI
def test_checkpoints_are_evaluated_while_training_goes_on(prefect_api, tmp_path, caplog):
    from flows.train import train
    from goodput.checkpoint_lifecycle import best_by_eval
    from goodput.evaluation import report_path
    from storage.ledger import Ledger
    from storage.manifests import EvalReport

    from goodput.data.prepare import prepare_dataset

    config = small_config(tmp_path, "eval.every_validated=1", "eval.num_samples=0")
    prepare_dataset(config)
    train(config)
    # Prefect's warning that tagged tasks may deadlock a runner of one thread: not here.
    assert not [r for r in caplog.records if "workers available" in r.getMessage()]
    reports = {step: EvalReport.model_validate_json(config.run_dir.eval_report(step).read_text())
               for step in (10, 20, 30)}
    ledger = Ledger(config.run_dir).read()
    assert all(ledger.entries[step].eval == report.scores() for step, report in reports.items())
    losses = {step: report.loss for step, report in reports.items()}
    assert best_by_eval(config) == min(losses, key=losses.get)
    by_perplexity = config.model_copy(update={"eval": config.eval.model_copy(update={"best_metric": "perplexity"})})
    assert best_by_eval(by_perplexity) == best_by_eval(config)
    assert (config.run_dir.eval_dir / "history.png").stat().st_size > 0
    scalars = tensorboard_scalars(config.run_dir.path / "tensorboard")
    assert scalars["eval/loss"] == pytest.approx(losses)
    # Another run's checkpoint gets a report of its own, never this run's step-N.json.
    elsewhere = tmp_path / "other-run" / "checkpoints" / "step-00000010"
    assert report_path(config, elsewhere).parent.name == "other"
    assert report_path(config, config.run_dir.checkpoint(10)) == config.run_dir.eval_report(10)


@pytest.mark.parametrize("metric, message", [
    ("loss/wbe", "use one of loss, perplexity, bits_per_byte, or set eval.tasks"),
    ("hellaswag/acc", "or set eval.tasks and name '<task>/<metric>'"),
    ("accuracy", "is not a score the evaluation reports"),
])
def test_a_best_metric_no_report_has_is_refused_naming_the_field(metric, message):
    from core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.best_metric") as raised:
        load_config(None, [f"eval.best_metric={metric}"])
    assert message in str(raised.value)
    assert load_config(None, ["eval.best_metric=hellaswag/acc_norm", "eval.tasks=[hellaswag]"])
    mixed = ["data.sources=[{name: web, weight: 1, source: a}, {name: code, weight: 1, source: b}]"]
    assert load_config(None, [*mixed, "eval.best_metric=loss/code"])


def test_scores_made_with_other_eval_settings_than_the_runs_get_curves_of_their_own(tmp_path):
    """A one-off `goodput evaluate eval.limit=12` of a step already evaluated with the run's
    settings: its scores must not join the run's eval/ curve at the same step."""
    from core.config import dump_config
    from storage.manifests import EvalReport
    from training.evaluate import curves_prefix, eval_curves

    config = small_config(tmp_path, "eval.tasks=[capitals]")
    one_off = small_config(tmp_path, "eval.tasks=[capitals]", "eval.limit=12", "eval.num_fewshot=2")

    def report(made_with) -> EvalReport:
        return EvalReport(run_id="r", step=30, checkpoint="c", dataset_id="d", loss=1.0,
                          perplexity=2.7, tokens_evaluated=1, samples=[], wall_time_s=1.0,
                          created_at=0.0, eval_hash=made_with.eval_hash())

    assert curves_prefix(config, report(one_off)) == "eval"  # no run saved here: its own
    config.run_dir.path.mkdir(parents=True)
    config.run_dir.config_file.write_text(dump_config(config))
    assert curves_prefix(config, report(config)) == "eval"
    prefix = curves_prefix(one_off, report(one_off))
    assert prefix == f"eval-{one_off.eval_hash()[:8]}" and prefix != "eval"
    assert set(eval_curves(report(one_off), prefix)) == {f"{prefix}/loss", f"{prefix}/perplexity"}
    # ... under that name in every tracker (the trackers' tags dropped it: no tracker had them)
    assert set(curves(eval_curves(report(one_off), prefix))) == {f"{prefix}/loss", f"{prefix}/perplexity"}


def test_mlflow_takes_the_scores_of_filtered_lm_eval_metrics(tmp_path):
    """lm-eval names a filtered metric "exact_match (strict-match)"; MLflow refuses
    parentheses, and one such name lost the whole batch of the checkpoint's scores."""
    from mlflow.tracking import MlflowClient

    from core.config import TrackingConfig

    assert mlflow_name("eval/gsm8k/exact_match (strict-match)") == "eval/gsm8k/exact_match/strict-match"
    assert mlflow_name("eval/t/acc,none[0]") == "eval/t/acc_none_0_"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = open_trackers(TrackingConfig(tensorboard=False, mlflow_uri=uri), tmp_path, "r", job="eval")
    trackers.log(120, {"eval/loss": 5.9, "eval/genfilt/exact_match (strict-match)": 0.25})
    trackers.close()
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("goodput").experiment_id])
    assert run.data.metrics == {"eval/loss": 5.9, "eval/genfilt/exact_match/strict-match": 0.25}


def test_a_best_metric_spelt_almost_as_a_task_of_eval_tasks_is_refused_at_load():
    """A subtask of a group (not in eval.tasks) loads; a typo of a task of eval.tasks does
    not (the flows' check-eval-tasks refuses the rest: test_downstream)."""
    from core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"eval.best_metric='capitls/acc': 'capitls' is not in "
                       r"eval.tasks \(capitals\); did you mean capitals/acc\?"):
        load_config(None, ["eval.tasks=[capitals]", "eval.best_metric=capitls/acc"])
    assert load_config(None, ["eval.tasks=[mmlu]", "eval.best_metric=mmlu_anatomy/acc"])


def test_scores_lm_eval_marks_lower_is_better_are_ranked_so():
    from storage.manifests import EvalReport, lower_is_better
    from training.downstream import lower_is_better_scores

    results = {"higher_is_better": {"mytask": {"acc": True, "brier_score": False}}}
    assert lower_is_better_scores(results) == ["mytask/brier_score"]
    report = EvalReport(run_id="r", step=1, checkpoint="c", dataset_id="d", loss=1.0, perplexity=2.7,
                        tokens_evaluated=1, samples=[], wall_time_s=0.0, created_at=0.0,
                        downstream={"mytask": {"acc": 0.5, "brier_score": 0.2}},
                        downstream_lower_is_better=["mytask/brier_score"])
    assert lower_is_better("mytask/brier_score", [report]) and not lower_is_better("mytask/acc", [report])
    assert lower_is_better("loss") and lower_is_better("mytask/word_perplexity")


def test_scores_of_a_copy_saved_over_do_not_outlive_it(tmp_path):
    """A step saved again (after a rollback the old copy is set aside) is another checkpoint:
    the ledger drops the old copy's scores, and best-by-eval no longer counts its report."""
    from goodput.checkpoint_lifecycle import best_by_eval, eval_history
    from storage.ledger import Ledger
    from storage.manifests import EvalReport

    config = small_config(tmp_path)
    ledger = Ledger(config.run_dir)
    for step, copy in ((10, "a"), (20, "old")):
        ledger.record(step, "committed", copy_id=copy)
        ledger.record_eval(step, {"loss": 1.0})
    config.run_dir.eval_dir.mkdir(parents=True)
    for step, copy, loss in ((10, "a", 2.0), (20, "old", 1.0)):
        report = EvalReport(run_id="test", step=step, checkpoint="c", dataset_id="d", loss=loss,
                            perplexity=2.7, tokens_evaluated=1, samples=[], wall_time_s=0.0,
                            created_at=0.0, copy_id=copy, eval_hash=config.eval_hash())
        config.run_dir.eval_report(step).write_text(report.model_dump_json())
    assert best_by_eval(config) == 20
    ledger.record(20, "committed", note="saved again", copy_id="new")
    assert ledger.read().entries[20].eval == {} and ledger.read().entries[10].eval == {"loss": 1.0}
    assert [r.step for r in eval_history(config)] == [10] and best_by_eval(config) == 10


def test_a_best_metric_no_report_has_is_said_once_reports_exist(tmp_path, caplog):
    """A metric name misspelt after its task (capitals/accc) passes the checks before
    training (they know task names, not the metrics a task reports): once reports exist,
    retention says that none has it, and which scores they have."""
    from goodput.checkpoint_lifecycle import best_by_eval
    from storage.manifests import EvalReport

    config = small_config(tmp_path, "eval.tasks=[capitals]", "eval.best_metric=capitals/accc")
    assert best_by_eval(config) is None  # no report yet: nothing to say
    config.run_dir.eval_dir.mkdir(parents=True)
    report = EvalReport(run_id="test", step=10, checkpoint="c", dataset_id="d", loss=2.0,
                        perplexity=7.4, tokens_evaluated=1, samples=[], wall_time_s=0.0,
                        created_at=0.0, eval_hash=config.eval_hash(),
                        downstream={"capitals": {"acc": 0.5, "acc_stderr": 0.1}})
    config.run_dir.eval_report(10).write_text(report.model_dump_json())
    with caplog.at_level(logging.WARNING, logger="goodput.checkpoints"):
        assert best_by_eval(config) is None
        assert best_by_eval(config) is None
    [said] = [r.getMessage() for r in caplog.records if "best_metric" in r.getMessage()]
    assert "eval.best_metric=capitals/accc is a score no report" in said and "capitals/acc," in said


def test_every_nth_checkpoint_is_chosen_by_the_ledger_across_flow_runs(tmp_path):
    """eval.every_validated=2 evaluates the 2nd, 4th, ... checkpoint of the run, counted in
    the ledger (a rejected copy does not count), not by a counter each flow run restarts."""
    from goodput.evaluation import evaluation_due
    from storage.ledger import Ledger

    config = small_config(tmp_path, "eval.every_validated=2")
    ledger = Ledger(config.run_dir)
    ledger.record(10, "validated")
    assert evaluation_due(config, 20)  # the 2nd
    ledger.record(20, "rejected", note="bad")
    assert evaluation_due(config, 30)  # a retried flow run's first: the run's 2nd good one
    ledger.record(30, "validated")
    assert not evaluation_due(config, 40)  # the 3rd
    ledger.record(40, "validated")
    assert evaluation_due(config, 50)
    assert not evaluation_due(small_config(tmp_path), 30)  # every_validated=0: never


def test_every_nth_checkpoint_counts_the_ones_not_in_the_ledger_yet(tmp_path):
    """The train flow asks as it finds a checkpoint, before the validation tasks of the ones
    just before it have entered them in the ledger: every_validated=3 with checkpoints 10,
    20, 30 evaluated nothing (walk), and =2 evaluated 10, 15, 20, 25, 30. The committed
    checkpoints on disk count too."""
    from goodput.evaluation import evaluation_due
    from storage.ledger import Ledger

    config = small_config(tmp_path, "eval.every_validated=3")
    for step in (10, 20):  # committed, not yet judged: only on disk
        directory = config.run_dir.checkpoint(step)
        directory.mkdir(parents=True)
        (directory / "manifest.json").write_text("{}")
    assert evaluation_due(config, 30)
    assert not evaluation_due(config, 20) and not evaluation_due(config, 10)
    Ledger(config.run_dir).record(20, "rejected", note="bad")  # counted in neither
    directory = config.run_dir.checkpoint(30)
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{}")
    assert not evaluation_due(config, 30) and evaluation_due(config, 40)
