"""The checkpoint interval: fixed, or planned by the Young/Daly rule while training runs."""

import json
import math
import os
import subprocess
import sys

from goodput.runs import observed_mtbf_s
from storage.store import store_from_config
from tests.helpers import REPO, small_config, synthetic_dataset
from training.checkpoint.component import CheckpointSchedule
from training.metrics import read_metrics


def test_runs_the_pipeline_launches_must_save_their_last_step(tmp_path):
    import pytest

    from core.config import ConfigError
    from goodput.runs import train_attempt

    config = small_config(tmp_path, "checkpoint.save_at_end=false")
    with pytest.raises(ConfigError, match="checkpoint.save_at_end=false is for throughput measurements"):
        train_attempt(config, tmp_path / "dataset", store_from_config(config.storage), "0", print)
    assert not config.run_dir.path.exists()  # refused before anything was written


def test_fixed_interval_saves_every_n_steps_and_at_the_end(tmp_path):
    schedule = CheckpointSchedule(small_config(tmp_path, "checkpoint.every_steps=10"))
    due = [s for s in range(1, 26) if schedule.due(s, 25) and not schedule.saved(s, 0.1)]
    assert due == [10, 20, 25]


def test_a_fixed_interval_saves_at_its_multiples_after_a_resume_between_them(tmp_path):
    """Resumed from an emergency checkpoint at step 14 (every 10): saves at 20 and 30, as
    torchtitan's step % interval, not at 24 and 34."""
    schedule = CheckpointSchedule(small_config(tmp_path, "checkpoint.every_steps=10"))
    schedule.last_saved = 14
    due = [s for s in range(15, 36) if schedule.due(s, 35) and not schedule.saved(s, 0.1)]
    assert due == [20, 30, 35]


def test_auto_interval_follows_young_daly(tmp_path):
    config = small_config(tmp_path, "checkpoint.interval=auto", "checkpoint.every_steps=500",
                          "faults.mtbf_hours=0.5")
    schedule = CheckpointSchedule(config, observed_mtbf_s(config))
    schedule.step_times.extend([0.2] * 10)
    note = schedule.saved(500, blocked_s=0.4)
    # sqrt(2 x 0.4 s x 1800 s) = 37.9 s between saves = 190 steps of 0.2 s
    assert schedule.every == round(math.sqrt(2 * 0.4 * 1800) / 0.2) == 190
    assert "every 190 steps" in note and "MTBF 1800s" in note
    assert schedule.due(690, 10_000) and not schedule.due(689, 10_000)
    # A cheaper save (say, async staging) makes frequent saves worth it; never above every_steps.
    for _ in range(5):
        schedule.saved(700, blocked_s=0.001)
    assert schedule.every == round(math.sqrt(2 * 0.001 * 1800) / 0.2) == 9


def test_auto_interval_uses_observed_failures_without_configured_mtbf(tmp_path):
    config = small_config(tmp_path, "checkpoint.interval=auto", "checkpoint.every_steps=1000")
    # The third never reached a step (a host that never answered): no work lost, no failure.
    for i, (cls, wall, step) in enumerate([("retryable", 300.0, 40), ("hang", 500.0, 90),
                                           ("node_lost", 0.5, None), ("done", 399.5, 200)]):
        directory = config.run_dir / "attempts" / f"attempt-a-{i}"
        directory.mkdir(parents=True)
        (directory / "outcome.json").write_text(json.dumps({"class": cls, "wall_time_s": wall,
                                                            "step": step}))
    schedule = CheckpointSchedule(config, observed_mtbf_s(config))
    assert schedule.mtbf_s == 1200.0 / 2  # 1200 s of attempts, 2 failures
    schedule.step_times.append(1.0)
    schedule.saved(10, blocked_s=3.0)
    assert schedule.every == round(math.sqrt(2 * 3.0 * 600))  # 60 steps of 1 s


def test_auto_interval_without_any_mtbf_keeps_every_steps(tmp_path):
    schedule = CheckpointSchedule(small_config(tmp_path, "checkpoint.interval=auto",
                                               "checkpoint.every_steps=7"))
    schedule.step_times.append(0.1)
    assert schedule.saved(7, 0.5) == "" and schedule.every == 7


def test_a_real_run_replans_its_interval(tmp_path):
    """One process, no torchrun: the saves land where the plan of the measured costs says."""
    dataset = synthetic_dataset(tmp_path / "dataset")
    config = small_config(tmp_path, "checkpoint.interval=auto", "checkpoint.every_steps=8",
                          "training.max_steps=24", "faults.mtbf_hours=0.000001")  # 3.6 ms
    from goodput.runs import write_run_config

    proc = subprocess.run([sys.executable, "-m", "training", "--config", str(write_run_config(config)),
                           "--dataset", str(dataset)], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[checkpoint] auto interval: every" in proc.stdout
    saves = [r["step"] for r in read_metrics(config.run_dir) if r["checkpoint_s"] > 0]
    assert saves[0] == 8 and saves[-1] == 24
    assert len(saves) > 3  # an MTBF of 3.6 ms asks for far more saves than every 8 steps
