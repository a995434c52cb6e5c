"""Crashes inside a checkpoint save, and a checkpoint disk that fills up.

Each case runs real torchrun attempts through `goodput.runs.train_attempt` (what the Prefect
launch task calls, minus Prefect): the first attempt dies, the second resumes from the newest
checkpoint that validates and finishes with the uninterrupted run's losses.
"""

import subprocess

import pytest

from goodput.runs import read_outcomes, train_attempt
from infra.torchrun import TrainingFailed
from storage.ledger import Ledger
from storage.store import store_from_config
from tests.helpers import losses_by_step, small_config, synthetic_dataset, torchrun_training
from training.checkpoint.verify import verify_checkpoint
from training.metrics import read_metrics

STEPS = 20


def config_for(root, run_id, *overrides):
    return small_config(root, f"run.run_id={run_id}", f"training.max_steps={STEPS}",
                        "checkpoint.every_steps=5", *overrides)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run (synchronous saves) whose losses every recovery must reproduce."""
    root = tmp_path_factory.mktemp("crashes")
    dataset = synthetic_dataset(root / "dataset")
    config = config_for(root, "clean")
    proc = torchrun_training(config, dataset)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, dataset, losses_by_step(config.run_dir)


def attempt(config, dataset, name, lines):
    return train_attempt(config, dataset, store_from_config(config.storage), name, lines.append)


@pytest.mark.chaos
@pytest.mark.parametrize("point, resumed_from", [
    # (slow: CI's bounded set keeps the write cut short and the commit not yet in the ledger)
    pytest.param("staging", 5, marks=pytest.mark.slow),  # rank 1's copy of the state fails; rank 0's write waits for it
    ("writing", 5),           # rank 1 dies while shards are being written: debris, never loaded
    pytest.param("before_manifest", 5, marks=pytest.mark.slow),  # every shard durable, no manifest: still debris
    ("after_manifest", 10),   # committed but not yet in the ledger: validated, then resumed from
])
def test_kill_during_a_background_save(baseline, tmp_path, point, resumed_from):
    root, dataset, clean = baseline
    config = config_for(tmp_path, f"kill-{point}", "checkpoint.async_mode=thread",
                        "faults.save_crash_at_step=10", f"faults.save_crash_point={point}",
                        "faults.crash_rank=1", "checkpoint.failed_save_wait_s=5")
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as failed:
        attempt(config, dataset, "crash-1", lines)
    assert failed.value.failure_class == "retryable" and failed.value.retry
    if point == "staging":  # every rank stopped (rank 0 without waiting out its stuck write)
        assert "checkpoint failed: rank 1: step-00000010: OSError: injected: rank 1 could not stage" in str(
            failed.value)
    step_10 = config.run_dir.checkpoint(10)
    assert (config.run_dir.committed_checkpoints()[-1] == step_10) == (point == "after_manifest")
    if point == "before_manifest":  # the data was all there; only the commit was missing
        assert (step_10 / ".metadata").is_file()

    result = attempt(config, dataset, "crash-2", lines)
    assert result.failure_class == "done"
    assert f"resuming from step-{resumed_from:08d}" in "\n".join(lines)
    assert [o["resumed_from"] for o in read_outcomes(config)] == [0, resumed_from]
    ledger = Ledger(config.run_dir, config.run.run_id).read()
    assert not ledger.steps("rejected")
    assert [p.name for p in config.run_dir.committed_checkpoints()] == [
        f"step-{s:08d}" for s in (5, 10, 15, 20)]  # the debris was replaced by a real save
    assert all(verify_checkpoint(p)["ok"] for p in config.run_dir.committed_checkpoints())
    assert losses_by_step(config.run_dir) == clean


@pytest.mark.chaos
@pytest.mark.parametrize("interval", ["fixed", "auto"])  # auto: the ranks agree on the next one
def test_a_rank_lost_while_rank_0_commits_keeps_the_record_of_the_committed_step(baseline, tmp_path,
                                                                                interval):
    """Rank 1 dies while rank 0 commits the synchronous save of step 10: the checkpoint is
    committed and the next attempt resumes after step 10, so rank 0 must have written step
    10's record before its next collective (which fails), or nobody ever would. A
    checkpointed step is recorded whatever training.log_every says, for the same reason."""
    root, dataset, clean = baseline
    config = config_for(tmp_path, "lost-at-commit", "faults.save_crash_at_step=10",
                        "faults.save_crash_point=while_committing", "faults.crash_rank=1",
                        "training.log_every=4", f"checkpoint.interval={interval}")
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as failed:
        attempt(config, dataset, "lost-1", lines)
    assert failed.value.retry, "\n".join(lines[-40:])
    assert config.run_dir.committed_checkpoints()[-1] == config.run_dir.checkpoint(10)
    windows = [(r["step"], r["window_steps"]) for r in read_metrics(config.run_dir)]
    assert windows == [(4, 4), (5, 1), (8, 3), (10, 2)], "\n".join(lines[-40:])

    result = attempt(config, dataset, "lost-2", lines)
    assert result.failure_class == "done"
    assert "resuming from step-00000010" in "\n".join(lines)
    losses = losses_by_step(config.run_dir)
    assert sorted(losses) == [4, 5, 8, 10, 12, 15, 16, 20]
    assert losses == {step: clean[step] for step in losses}


@pytest.mark.chaos
@pytest.mark.parametrize("mode", ["sync",  # CI: the barrier after the commit is where it fails
                                  pytest.param("thread", marks=pytest.mark.slow)])
def test_a_rank_lost_while_the_emergency_save_commits_keeps_its_steps(baseline, tmp_path, mode):
    """Preempted at step 13: while rank 0 commits the emergency checkpoint, rank 1 dies (a
    node lost as the job is stopped). The checkpoint is committed and the next attempt resumes
    after step 13, so steps 11-13 must be on record before that commit: with synchronous
    saves rank 0 fails in the barrier after it and records nothing more."""
    root, dataset, clean = baseline
    config = config_for(tmp_path, "lost-at-emergency-commit", "faults.sigterm_at_step=13",
                        "faults.save_crash_at_step=13", "faults.save_crash_point=while_committing",
                        "faults.crash_rank=1", "training.log_every=4",
                        f"checkpoint.async_mode={mode}")
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as failed:
        attempt(config, dataset, "lost-1", lines)
    assert failed.value.retry, "\n".join(lines[-40:])
    assert [p.name for p in config.run_dir.committed_checkpoints()] == [
        "step-00000005", "step-00000010", "step-00000013"], "\n".join(lines[-40:])
    windows = [(r["step"], r["window_steps"]) for r in read_metrics(config.run_dir)]
    assert windows == [(4, 4), (5, 1), (8, 3), (10, 2), (12, 2), (13, 1)], "\n".join(lines[-40:])

    result = attempt(config, dataset, "lost-2", lines)
    assert result.failure_class == "done"
    assert "resuming from step-00000013" in "\n".join(lines)
    assert [o["resumed_from"] for o in read_outcomes(config)] == [0, 13]
    losses = losses_by_step(config.run_dir)
    assert sorted(losses) == [4, 5, 8, 10, 12, 13, 15, 16, 20]
    assert losses == {step: clean[step] for step in losses}


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mount point the test sizes itself (needs root, as in CI)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    probe = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {probe.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.chaos
def test_a_full_checkpoint_disk_stops_the_run_without_losing_a_checkpoint(baseline, tmp_path,
                                                                         small_disk):
    root, dataset, clean = baseline
    checkpoint_bytes = sum(f.stat().st_size for f in
                           config_for(root, "clean").run_dir.checkpoint(5).iterdir())
    # Room for two checkpoints and a half: the save at step 15 runs out of space.
    subprocess.run(["mount", "-o", f"remount,size={int(checkpoint_bytes * 2.5)}", str(small_disk)],
                   check=True)
    config = config_for(tmp_path, "full", "checkpoint.async_mode=thread")
    config.run_dir.path.mkdir(parents=True)
    (config.run_dir / "checkpoints").symlink_to(small_disk, target_is_directory=True)

    lines: list[str] = []
    with pytest.raises(TrainingFailed) as failed:
        attempt(config, dataset, "full-1", lines)
    assert failed.value.failure_class == "disk_full" and not failed.value.retry
    assert "no space left" in str(failed.value).lower()
    assert "free space on it" in str(failed.value)  # the error says what to do
    assert [p.name for p in config.run_dir.committed_checkpoints()] == ["step-00000005",
                                                                       "step-00000010"]

    # Someone frees space (here: a larger disk); the run continues from the newest good one.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    result = attempt(config, dataset, "full-2", lines)
    assert result.failure_class == "done"
    assert "resuming from step-00000010" in "\n".join(lines)
    assert [p.name for p in config.run_dir.committed_checkpoints()] == [
        f"step-{s:08d}" for s in (5, 10, 15, 20)]
    assert all(verify_checkpoint(p)["ok"] for p in config.run_dir.committed_checkpoints())
    assert losses_by_step(config.run_dir) == clean
