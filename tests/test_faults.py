"""Failure classes and what the pipeline does about each: real flows, real torchrun."""

import os
import signal
import time
from pathlib import Path

import pytest

from core.config import load_config
from core.protocol import (ResumeSpec, RunDir, copy_id, read_exit_records, read_heartbeat,
                           read_starts, step_of)
from flows.prepare import prepare
from flows.train import train
from goodput.runs import read_outcomes, read_summary, retry_decision, write_run_config
from infra.torchrun import run_attempt
from storage.ledger import Ledger
from storage.store import open_store
from tests.helpers import (
    Watcher,
    committed,
    corrupt_largest_shard,
    losses_by_step,
    small_config,
    synthetic_dataset,
)
from training.data import DistributedSampleLoader, TokenStream
from training.metrics import read_metrics
from training.resilience import LossGuard

STEPS = 30


# -- the policy, as plain functions -------------------------------------------------------------

def test_loss_guard_flags_non_finite_and_spikes():
    guard = LossGuard(factor=2.0, window=3)
    assert guard.problem(float("nan"), 1.0).startswith("non-finite loss")
    assert guard.problem(1.0, float("inf")).startswith("non-finite gradient")
    for loss in (5.0, 4.0, 3.0):
        assert guard.problem(loss, 1.0) is None  # filling the window: no verdict yet
    assert guard.problem(9.5, 1.0).startswith("loss spike 9.5000 > 2.0 x rolling mean 4.0000")
    assert guard.problem(3.5, 1.0) is None  # the spike did not enter the window


def _outcome(cls, resumed_from=0, newest=10):
    return {"class": cls, "resumed_from": resumed_from, "newest_checkpoint": newest}


def test_retry_policy_budgets_per_class_and_no_progress():
    config = load_config(None, ["run.retry_budgets={retryable: 2, rollback: 1, hang: 0, unknown: 0}",
                                "run.no_progress_attempts=2"])
    assert retry_decision(config, [_outcome("config")]) == (False, "configuration or data error: "
                                                                   "fix the input and rerun")
    assert retry_decision(config, [_outcome("retryable"), _outcome("retryable", 10, 20)])[0]
    spent = retry_decision(config, [_outcome("retryable", 0, 10), _outcome("retryable", 10, 20),
                                    _outcome("retryable", 20, 30)])
    assert spent[0] is False and "exceed their budget of 2" in spent[1]
    oom = retry_decision(config, [_outcome("oom")])
    assert oom[0] is False and "goodput plan" in oom[1]
    assert retry_decision(config, [_outcome("hang")])[0] is False  # its budget: 0
    assert retry_decision(config, [_outcome("corrupt_checkpoint")])[0]  # not given: the default, 2
    assert retry_decision(config, [_outcome("no_such_class")])[0] is False  # unknown: 0
    stalled = retry_decision(config, [_outcome("retryable", 10, 10), _outcome("rollback", 10, 10)])
    assert stalled[0] is False and "committed no checkpoint newer" in stalled[1]
    # The flow run's last attempt: Prefect retries no more, and the log said "retrying".
    last = retry_decision(load_config(None, ["run.max_attempts=2"]),
                          [_outcome("retryable", 0, 10), _outcome("retryable", 10, 20)])
    assert last == (False, "run.max_attempts=2 attempts made in this flow run; the next "
                           "`goodput train` resumes from the newest validated checkpoint")


def _committed(run_dir, step):
    from storage.manifests import CheckpointManifest

    path = RunDir.of(run_dir).checkpoint(step)
    path.mkdir(parents=True)
    CheckpointManifest(step=step, tokens_seen=0, files=[], world_size=1, layout={},
                       config_hash="", dataset_id="", model_args={}, created_at=0).save(path)
    return path


def test_restarted_workers_resume_from_the_newest_validated_checkpoint(tmp_path):
    """`--resume validated`, what the launch task passes (restarted workers get the same
    line): the newest checkpoint the ledger marks validated that this machine can read."""
    from core.config import ConfigError
    from core.protocol import ResumeSpec
    from training.checkpoint.resume import resolve_resume

    run_dir = RunDir(tmp_path / "run")
    ledger = Ledger(run_dir, "run")
    validated = ResumeSpec.validated()
    start = _committed(run_dir, 10)
    assert resolve_resume(validated, run_dir) is None  # nothing judged yet: from scratch
    ledger.record(5, "uploaded")
    assert resolve_resume(validated, run_dir) == ResumeSpec.store(5)  # only the store has it
    ledger.record(10, "validated")
    assert resolve_resume(validated, run_dir) == ResumeSpec.directory(start)
    for step, state in ((20, "uploaded"), (30, "rejected"), (40, None)):
        _committed(run_dir, step)
        if state:
            ledger.record(step, state)
    # 30 was rejected, 40 has no verdict (and no validator answers within the wait): 20.
    assert resolve_resume(validated, run_dir, wait_s=0.2).path.name == "step-00000020"
    ledger.record(50, "uploaded")
    assert resolve_resume(validated, run_dir) == ResumeSpec.store(50)  # newer than any on disk
    with pytest.raises(ConfigError, match="no committed checkpoint there"):
        resolve_resume(ResumeSpec.directory(tmp_path / "gone"), RunDir(tmp_path / "empty-run"))


def test_torchrun_command_restarts_in_job_and_resumes_from_what_was_validated(tmp_path):
    from infra.torchrun import torchrun_command, worker_env

    config = small_config(tmp_path, "launch.max_restarts=2")
    command = torchrun_command(config, Path("run.yaml"), Path("data"), "a-1")
    assert "--max-restarts=2" in command
    assert command[-2:] == ["--resume", "validated"]  # the same line for restarted workers
    assert worker_env(config, "a-1")["GOODPUT_RESTART_WAIT_S"] == "300.0"


def test_hang_watch_allowances_follow_the_phase_across_in_job_restarts():
    from infra.torchrun import HangWatch

    config = load_config(None, ["run.startup_timeout_s=900", "run.checkpoint_timeout_s=1800",
                                "run.hang_min_s=60"])
    watch = HangWatch(config.run, "a-1")
    assert watch.timeout() == (900, "no first step")
    beats = [({"phase": "startup", "start": 0}, (900, "no first step")),
             ({"phase": "step", "step": 1, "step_time_s": 5.0}, (60, "no training progress")),
             ({"phase": "step", "step": 2, "step_time_s": 5.0}, (100, "no training progress")),
             ({"phase": "checkpoint", "step": 3}, (1800, "checkpoint save stalled")),
             # A worker died and torchrun restarted the group: startup allowance again.
             ({"phase": "startup", "start": 1}, (900, "no first step")),
             ({"phase": "step", "step": 3, "step_time_s": 1.0}, (100, "no training progress")),
             # The last step: the final save may still be in flight, then the shutdown.
             ({"phase": "step", "step": 4, "max_steps": 4}, (1800, "no exit after the last step"))]
    for i, (beat, allowance) in enumerate(beats):
        assert watch.observe({**beat, "attempt": "a-1", "time": i}) is not None
        assert watch.timeout() == allowance, beat
    assert watch.observe({"phase": "step", "step": 9, "attempt": "a-0", "time": 99}) is None


def test_failures_a_restart_cannot_fix_block_in_job_restarts(tmp_path):
    from core import protocol
    from core.protocol import FailureClass

    protocol.write_exit_record(tmp_path, "a-1", 1, FailureClass.RETRYABLE, "peer closed", 14)
    assert protocol.restart_blocker(tmp_path, "a-1") is None  # a crash: restart
    protocol.write_exit_record(tmp_path, "a-1", 0, FailureClass.ROLLBACK, "non-finite loss", 16, sample_end=128)
    blocker = protocol.restart_blocker(tmp_path, "a-1")
    assert (blocker["class"], blocker["code"], blocker["sample_end"]) == ("rollback", 76, 128)
    assert protocol.restart_blocker(tmp_path, "a-2") is None  # per attempt


def _torchrun_failure_report(failures: dict[int, int]) -> list[str]:
    """What torchrun prints when it gives up on a worker group: torch's own formatting of
    its ChildFailedError, global rank -> exit code (negative: killed by that signal)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    report = ChildFailedError("training", {
        rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        for rank, code in failures.items()})
    return f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {report}".splitlines()


def test_a_crash_is_told_by_the_worker_that_failed_first(tmp_path):
    """A rank killed by a signal writes no exit record and the others then fail on its closed
    connection: the reason leads with torchrun's word on the killed rank, not their echo."""
    from core import protocol
    from core.protocol import FailureClass
    from infra.torchrun import TorchrunOutput, classify, crash_reason

    passed_on: list[str] = []
    output = TorchrunOutput(passed_on.append)
    report = _torchrun_failure_report({1: -signal.SIGKILL})
    for line in report:
        output(line)
    assert passed_on == report  # passed on as they came
    assert output.failures == [{"rank": 1, "exit_code": -9, "pid": 1001}]

    peer = "RuntimeError: Connection closed by peer [127.0.0.1]:22414"
    protocol.write_exit_record(tmp_path, "a-1", 0, FailureClass.RETRYABLE, peer, 60)
    result = classify(tmp_path, "a-1", 1, hung=False, wall=1.0, worker_failures=output.failures)
    assert result.failure_class == FailureClass.RETRYABLE
    assert result.reason.startswith("rank 1 was killed by SIGKILL, as the kernel's OOM killer does")
    assert result.reason.endswith(f"rank 0 then failed: {peer}")
    # Without torchrun's word, the same records give what they know.
    assert classify(tmp_path, "a-1", 1, hung=False, wall=1.0).reason == peer

    # A rank that raised wrote its record first; the earliest record leads, named by its rank.
    protocol.write_exit_record(tmp_path, "a-2", 0, FailureClass.RETRYABLE, peer, 60)
    time.sleep(0.01)
    protocol.write_exit_record(tmp_path, "a-2", 1, FailureClass.RETRYABLE, "ValueError: bad batch", 60)
    records = protocol.read_exit_records(tmp_path, "a-2")
    records[1]["time"] = records[0]["time"] - 1.0  # rank 1's record was written first
    assert crash_reason(records, [], 1) == "rank 1: ValueError: bad batch"
    # torchrun naming rank 0 (it noticed that exit first) does not hide rank 1's own error.
    assert crash_reason(records, [{"rank": 0, "exit_code": 4, "pid": 1}], 1) == "rank 1: ValueError: bad batch"
    # Every rank saying the same (a preemption's emergency save): said once.
    same = [{**r, "reason": "preempted"} for r in records]
    assert crash_reason(same, [], 4) == "preempted"
    # Nothing recorded, nothing printed.
    assert crash_reason([], [], 1) == "a worker died (torchrun exit 1)"
    assert crash_reason([], [{"rank": 3, "exit_code": -15, "pid": 1}], 1) == "rank 3 was killed by SIGTERM"


def test_torchruns_traceback_of_the_signal_that_stopped_it_is_one_line():
    """torchrun, stopped by SIGTERM (a cancellation, a preemption), prints some 30 lines of
    its own traceback that say only that; any other traceback is passed on whole, as is one
    whose end never came."""
    from infra.torchrun import TorchrunOutput

    frames = ["Traceback (most recent call last):",
              '  File "/site-packages/torch/distributed/run.py", line 1032, in <module>',
              "    main()",
              "           ^^^^",
              '  File "/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler',
              '    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)']
    stopped = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 18528 got signal: 15"
    passed_on: list[str] = []
    output = TorchrunOutput(passed_on.append)
    for line in ["[node0 rank0] [train] preempted (SIGTERM or SIGHUP)", *frames, stopped, "after"]:
        output(line)
    assert passed_on == ["[node0 rank0] [train] preempted (SIGTERM or SIGHUP)",
                         "torchrun (pid 18528) stopped on SIGTERM, after its workers (its traceback "
                         "left out)", "after"]
    passed_on.clear()
    for line in [*frames, "RuntimeError: rendezvous closed"]:
        output(line)
    assert passed_on == [*frames, "RuntimeError: rendezvous closed"]
    passed_on.clear()
    for line in frames:  # the output ended here
        output(line)
    assert passed_on == []
    output.flush()
    assert passed_on == frames


def test_torchruns_traceback_above_its_report_of_failed_workers_is_one_line():
    """When torchrun gives up on its workers it prints about 20 lines of its own frames, then
    its report (which worker failed first, how): the frames become one line, the report is
    passed on and read."""
    from infra.torchrun import TorchrunOutput

    frames = ["Traceback (most recent call last):",
              '  File "<frozen runpy>", line 198, in _run_module_as_main',
              '  File "/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent',
              "    raise ChildFailedError("]
    report = _torchrun_failure_report({0: -signal.SIGKILL})
    assert report[0].rstrip() == "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    passed_on: list[str] = []
    output = TorchrunOutput(passed_on.append)
    for line in [*frames, *report]:
        output(line)
    assert passed_on == ["torchrun gave up on its workers; its report follows (its traceback "
                         "left out)", *report[1:]]
    assert output.failures == [{"rank": 0, "exit_code": -9, "pid": 1000}]


def test_loader_skips_windows_deterministically(tmp_path):
    from storage.manifests import DatasetManifest

    directory = synthetic_dataset(tmp_path / "ds")
    stream = TokenStream(directory, DatasetManifest.load(directory), "train")
    plain = DistributedSampleLoader(stream, 16, 2, 0, 1, seed=1)
    skipping = DistributedSampleLoader(stream, 16, 2, 0, 1, seed=1)
    skipping.skip_windows([(2, 6)])
    batches = [plain.next_batch()[0] for _ in range(5)]
    skipped = [skipping.next_batch()[0] for _ in range(3)]
    assert (skipped[0] == batches[0]).all()
    assert (skipped[1] == batches[3]).all() and (skipped[2] == batches[4]).all()


# -- the pipeline under faults -------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(prefect_api, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("faults")
    prepare(small_config(workdir))
    return workdir


@pytest.fixture(scope="module")
def clean(workdir):
    config = small_config(workdir, "run.run_id=clean")
    train(config)
    return losses_by_step(config.run_dir)


@pytest.mark.chaos
@pytest.mark.slow  # CI: test_a_shard_corrupted_after_commit_..., an in-job restart from step 10 too
def test_a_killed_worker_is_restarted_in_job_from_the_newest_validated_checkpoint(workdir, clean):
    config = small_config(workdir, "run.run_id=injob", "launch.max_restarts=1",
                          "faults.crash_at_step=15", "faults.crash_rank=1")
    assert train(config)["final_step"] == STEPS
    # One Prefect attempt: torchrun restarted the workers once and they finished the job.
    [outcome] = read_outcomes(config)
    assert (outcome["class"], outcome["restarts"]) == ("done", 1)
    attempt = outcome["attempt"]
    assert [r["restart"] for r in read_exit_records(config.run_dir, attempt)] == [1, 1]
    assert [s["restart"] for s in read_starts(config.run_dir, attempt)] == [0, 1]
    # Rank 1 died (SIGKILL) right after step 15; the restart resumed from step 10, the newest
    # checkpoint validated by then (the restarted workers wait for its verdict).
    steps = [m["step"] for m in read_metrics(config.run_dir)]
    assert steps == list(range(1, 16)) + list(range(11, STEPS + 1))
    assert losses_by_step(config.run_dir) == clean
    assert Ledger(config.run_dir, "injob").read().steps("uploaded") == [10, 20, 30]
    goodput = read_summary(config.run_dir)["goodput"]
    assert goodput["attempts"] == {"done": 1} and goodput["in_job_restarts"] == 1
    assert goodput["lost_work_s"] > 0 and 0 < goodput["goodput"] < 1  # steps 11-15 ran twice


@pytest.mark.chaos
def test_a_shard_corrupted_after_commit_is_rejected_and_never_resumed_from(workdir, clean):
    """(The in-job restart of CI; from tests/test_chaos.py, to share this module's runs.)
    Bytes of a shard of checkpoint 20 flip right after its commit, before validation;
    a worker is killed at step 25. Validation rejects 20, and the in-job restart resumes
    from 10, the newest validated checkpoint, and trains to the end. Its new save of step 20
    is another copy: judged on its own, validated and uploaded."""
    config = small_config(workdir, "run.run_id=corrupt", "launch.max_restarts=1",
                          "faults.crash_at_step=25", "faults.crash_rank=1")
    path = config.run_dir.checkpoint(20)

    watcher = Watcher(lambda: committed(config, 20), lambda: corrupt_largest_shard(path))
    watcher.start()
    try:
        assert train(config)["final_step"] == STEPS
    finally:
        shard = watcher.check()
    # One Prefect attempt: torchrun restarted the workers once and they finished the job.
    [outcome] = read_outcomes(config)
    assert (outcome["class"], outcome["restarts"]) == ("done", 1)
    assert [r["restart"] for r in read_exit_records(config.run_dir, outcome["attempt"])] == [1, 1]
    assert [s["restart"] for s in read_starts(config.run_dir, outcome["attempt"])] == [0, 1]
    entry = Ledger(config.run_dir, "corrupt").read().entries[20]
    [rejected] = [t for t in entry.history if t.state == "rejected"]
    assert "checksum" in rejected.note and shard in rejected.note
    [aside] = (config.run_dir.checkpoints / "rejected").iterdir()
    assert aside.name.startswith("step-00000020") and aside.name in rejected.note
    assert [t.state for t in entry.history] == ["committed", "rejected", "committed", "validated",
                                                "uploaded"]
    assert entry.history[2].note == "saved again after a rejected copy"
    assert entry.copy_id == copy_id(path) != copy_id(aside)
    # Never resumed from: after the crash at step 25 training went on from step 11.
    steps = [m["step"] for m in read_metrics(config.run_dir)]
    assert steps == list(range(1, 26)) + list(range(11, STEPS + 1))
    ledger = Ledger(config.run_dir, "corrupt").read()
    assert ledger.steps("uploaded") == [10, 20, 30]
    store = open_store(config.storage.uri)
    assert store.get_bytes("runs/corrupt/checkpoints/step-00000020/manifest.json") == (
        path / "manifest.json").read_bytes()  # the new copy, not the corrupted one
    assert losses_by_step(config.run_dir) == clean
    goodput = read_summary(config.run_dir)["goodput"]
    assert goodput["attempts"] == {"done": 1} and goodput["in_job_restarts"] == 1
    assert goodput["lost_work_s"] > 0 and 0 < goodput["goodput"] < 1  # steps 11-25 ran twice


@pytest.mark.chaos
def test_preemption_saves_and_resumes_to_the_same_losses(workdir, clean):
    config = small_config(workdir, "run.run_id=preempted", "faults.sigterm_at_step=13")
    assert train(config)["final_step"] == STEPS
    outcomes = read_outcomes(config)
    assert [o["class"] for o in outcomes] == ["retryable", "done"]
    # The signal lands during step 13 (the injection waits until torchrun passed it on); the
    # ranks agree on it at that step's end.
    saved_at = outcomes[0]["step"]
    assert saved_at == 13  # not a regular checkpoint step
    assert f"emergency checkpoint at step {saved_at}" in outcomes[0]["reason"]
    assert outcomes[1]["resumed_from"] == saved_at  # the emergency checkpoint, validated
    assert losses_by_step(config.run_dir) == clean


@pytest.mark.chaos
def test_a_frozen_worker_is_detected_killed_and_resumed(workdir, clean):
    config = small_config(workdir, "run.run_id=frozen", "faults.hang_at_step=12",
                          "faults.crash_rank=1", "run.hang_min_s=4")
    assert train(config)["final_step"] == STEPS
    outcomes = read_outcomes(config)
    assert [o["class"] for o in outcomes] == ["hang", "done"]
    assert outcomes[1]["resumed_from"] == 10
    assert losses_by_step(config.run_dir) == clean
    # The hang is an item of its own in the breakdown: at least run.hang_min_s of it.
    assert read_summary(config.run_dir)["goodput"]["hung_s"] >= 4


@pytest.mark.chaos
def test_nan_rolls_back_and_skips_the_bad_data(workdir, clean):
    config = small_config(workdir, "run.run_id=nan", "faults.nan_at_step=16")
    assert train(config)["final_step"] == STEPS
    outcomes = read_outcomes(config)
    assert [o["class"] for o in outcomes] == ["rollback", "done"]
    assert outcomes[1]["resumed_from"] == 10
    ledger = Ledger(config.run_dir, "nan").read()
    [skip] = ledger.data_skips
    samples_per_step = 4 * 2  # micro_batch_size x data-parallel ranks
    assert (skip.start, skip.end) == (10 * samples_per_step, 16 * samples_per_step)
    assert "non-finite loss" in skip.reason
    losses = losses_by_step(config.run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[s] == clean[s] for s in range(1, 11))  # before the rollback point
    assert losses[11] != clean[11]  # after it, different (later) data


@pytest.mark.chaos
def test_configuration_errors_are_not_retried(workdir):
    from prefect import flow

    from tasks.train import launch_training

    config = small_config(workdir, "run.run_id=nodata")

    @flow
    def launch_with_missing_dataset():
        return launch_training.with_options(retries=3, retry_delay_seconds=0)(
            config, workdir / "no-such-dataset")

    state = launch_with_missing_dataset(return_state=True)
    assert state.is_failed()
    outcomes = read_outcomes(config)
    assert [o["class"] for o in outcomes] == ["config"]  # one attempt, no retries
    assert "no-such-dataset" in outcomes[0]["reason"]


@pytest.mark.chaos
def test_a_full_disk_under_the_supervisor_ends_the_attempt_as_disk_full_unretried(workdir, monkeypatch):
    """The run directory's disk full where the launch task itself writes (the run's config,
    the lease, the records): no retry can help (it retried five times a second apart), and the
    workers' disk_full record could not be written there. The task says so, with the fix."""
    from prefect import flow

    import goodput.runs
    import tasks.train as train_tasks
    from infra.torchrun import TrainingFailed

    tries = []

    def on_a_full_disk(config):  # the run's config.yaml, written first in an attempt
        tries.append(1)
        with open("/dev/full", "w") as f:  # the kernel's ENOSPC, as a full disk gives it
            f.write("config.yaml")
            f.flush()

    monkeypatch.setattr(goodput.runs, "write_run_config", on_a_full_disk)
    config = small_config(workdir, "run.run_id=fulldisk")

    @flow
    def launch_on_a_full_disk():
        return train_tasks.launch_training.with_options(retries=3, retry_delay_seconds=0)(
            config, workdir / "data")

    state = launch_on_a_full_disk(return_state=True)
    assert state.is_failed()
    with pytest.raises(TrainingFailed, match="No space left on device .*free space on it, lower "
                                             "checkpoint.keep_local") as failed:
        state.result()
    assert str(failed.value.failure_class) == "disk_full" and len(tries) == 1  # not retried


def test_a_file_missing_in_a_worker_is_a_crash_to_retry_not_a_config_error(tmp_path):
    """Only errors raised as configuration or data errors where they are detected end a run
    unretried; a shard the manifest lists but a shared filesystem lost for a moment is a
    crash (retryable). A --dataset without a prepared dataset is a configuration error."""
    import subprocess
    import sys

    from tests.helpers import REPO

    dataset = synthetic_dataset(tmp_path / "dataset")
    config = small_config(tmp_path)
    config_path = write_run_config(config)

    def worker(dataset_dir: Path, attempt: str) -> tuple[int, dict]:
        proc = subprocess.run(
            [sys.executable, "-m", "training", "--config", str(config_path), "--dataset",
             str(dataset_dir), "--resume", "none"], capture_output=True, text=True, cwd=REPO,
            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "GOODPUT_ATTEMPT": attempt})
        [record] = read_exit_records(config.run_dir, attempt)
        return proc.returncode, record

    (dataset / "train-00001.arrow").unlink()
    code, record = worker(dataset, "lost-1")
    assert (code, record["class"]) == (75, "retryable") and "FileNotFoundError" in record["reason"]
    code, record = worker(tmp_path / "elsewhere", "wrong-1")
    assert (code, record["class"]) == (2, "config") and "no prepared dataset there" in record["reason"]


def test_a_config_file_the_workers_cannot_load_ends_the_attempt_as_a_config_error(tmp_path):
    """The flow loaded the config; a node's copy of the file does not load (edited, another
    version): the workers still leave the record that makes it a config error, not a crash
    to retry, and restarted workers do not try again."""
    config = small_config(tmp_path, "launch.max_restarts=1")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: lots\n")
    lines = []
    result = run_attempt(config, bad, tmp_path / "dataset", "badcfg-1", lines.append)
    assert result.failure_class == "config", "\n".join(lines[-20:])
    assert "bad.yaml" in result.reason and "model.dim" in result.reason
    assert result.restarts <= 1


@pytest.mark.slow  # CI keeps the time limit through test_an_attempt_the_time_limit_stops_...
def test_the_workers_save_the_step_after_the_deadline_and_stop(tmp_path):
    """A flow run's time limit reaches the workers (GOODPUT_STOP_AFTER): past it, both ranks
    save the next step together, whatever the checkpoint cadence, and stop; the attempt ends
    as done before max_steps with nothing lost; a deadline still ahead stops nothing."""
    dataset = synthetic_dataset(tmp_path / "dataset")
    config = small_config(tmp_path, "training.max_steps=30", "checkpoint.every_steps=7")
    config_path = write_run_config(config)
    lines: list[str] = []

    def attempt(name: str, stop_after: float, resume: ResumeSpec):
        result = run_attempt(config, config_path, dataset, name, lines.append, start=resume,
                             stop_after=stop_after)
        assert result.failure_class == "done", "\n".join(lines[-30:])
        [record] = [r for r in read_exit_records(config.run_dir, name) if r["rank"] == 0]
        return result, record

    result, record = attempt("limit-1", time.time(), ResumeSpec.scratch())  # already past
    assert (result.step, result.reason, record["reason"]) == (2, "time limit", "time limit")
    assert [step_of(p) for p in config.run_dir.committed_checkpoints()] == [2]
    # Its last word to the supervisor: a save to wait for (a save's allowance, not a step's).
    assert read_heartbeat(config.run_dir)["phase"] == "checkpoint"
    # Resumed at 2, the deadline long passed: step 3 votes, step 4 is saved (every_steps is 7).
    result, record = attempt("limit-2", time.time() - 3600, ResumeSpec.newest_committed())
    assert (result.step, record["reason"]) == (4, "time limit")
    assert [step_of(p) for p in config.run_dir.committed_checkpoints()] == [2, 4]
    result, record = attempt("limit-3", time.time() + 3600, ResumeSpec.newest_committed())
    assert (result.step, record["reason"]) == (30, "done")
    steps = [m["step"] for m in read_metrics(config.run_dir)]
    assert steps == list(range(1, 31)), "no step trained twice, none skipped"


def test_pipeline_stages_on_two_nodes_stop_together_at_the_time_limit(tmp_path):
    """A stage per node (PP across nodes, as the planner lays it out), saves in the
    background: past the deadline both nodes' workers save the next step and stop, its
    checkpoint committed and whole before they exit as done.

    training.log_every=5 and a checkpoint every 7 steps: the attempt stopped after step 2
    (saved off the cadence) logs steps 1-2 as it stops (no later step of it would; the next
    attempt resumes after them), so the loss curve and the goodput accounting hold every
    step the model holds."""
    from goodput.accounting import step_times
    from training.checkpoint.verify import verify_checkpoint

    dataset = synthetic_dataset(tmp_path / "dataset")
    config = small_config(tmp_path, "training.max_steps=10", "checkpoint.every_steps=7",
                          "training.log_every=5",
                          "parallelism.nnodes=2", "parallelism.nproc_per_node=1",
                          "parallelism.dp_replicate=1", "parallelism.pp=2",
                          "checkpoint.async_mode=thread")
    lines: list[str] = []
    result = run_attempt(config, write_run_config(config), dataset, "limit", lines.append,
                         start=ResumeSpec.scratch(), stop_after=time.time())
    assert (result.failure_class, result.exit_code, result.step) == ("done", 0, 2), \
        "\n".join(lines[-30:])
    records = read_exit_records(config.run_dir, "limit")
    assert [(r["rank"], r["reason"], r["step"]) for r in records] == [(0, "time limit", 2),
                                                                      (1, "time limit", 2)]
    [checkpoint] = config.run_dir.committed_checkpoints()
    assert step_of(checkpoint) == 2 and verify_checkpoint(checkpoint)["ok"]
    metrics = read_metrics(config.run_dir)
    assert [(r["step"], r["window_steps"]) for r in metrics] == [(2, 2)]
    assert sorted(step for r in metrics for step in step_times(r)) == list(range(1, 3))
    assert metrics[-1]["checkpoint_s"] > 0  # the save of step 2 blocked training


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_ask_for_an_emergency_checkpoint(signum):
    """SIGTERM (a scheduler preempting or cancelling) and SIGHUP (an ssh node's connection
    closed; its torchrun passes the hangup on to the workers) both set the preemption flag
    the training loop checks at every step boundary."""
    from training.resilience import PreemptionFlag

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        flag = PreemptionFlag()
        assert not flag.received
        os.kill(os.getpid(), signum)
        assert flag.received
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
