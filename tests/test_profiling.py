"""Profiles of chosen training steps (training.profiling): torch.profiler traces, per rank."""

import gzip
import json

import pytest
import torch
from torch.profiler import ProfilerAction

from core.config import ConfigError, ProfilingConfig, load_config
from core.protocol import RunDir
from tests.helpers import losses_by_step, small_config, synthetic_dataset, torchrun_training
from training.profiling import StepProfiler, read_top

NONE, WARMUP = ProfilerAction.NONE, ProfilerAction.WARMUP
RECORD, SAVE = ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE


def actions(tmp_path, first: int, last: int, **cfg) -> dict[int, ProfilerAction]:
    profiler = StepProfiler(ProfilingConfig(**cfg), RunDir(tmp_path), 0, torch.device("cpu"), True)
    return {step: profiler.action(step) for step in range(first, last + 1)}


def test_the_schedule_warms_up_one_step_before_each_window_and_saves_at_its_last_step(tmp_path):
    assert actions(tmp_path, 0, 12, steps=2, start_step=4, every=5) == {
        0: NONE, 1: NONE, 2: NONE, 3: WARMUP, 4: RECORD, 5: SAVE, 6: NONE, 7: NONE, 8: WARMUP,
        9: RECORD, 10: SAVE, 11: NONE, 12: NONE}
    assert actions(tmp_path, 0, 6, steps=3, start_step=2) == {
        0: NONE, 1: WARMUP, 2: RECORD, 3: RECORD, 4: SAVE, 5: NONE, 6: NONE}
    # From the first step: there is no step before it to warm up on (step 0 is none).
    assert actions(tmp_path, 0, 2, steps=1, start_step=1) == {0: NONE, 1: SAVE, 2: NONE}


def test_windows_too_close_for_a_warm_up_step_are_refused():
    with pytest.raises(ConfigError, match=r"profiling.every=3 must exceed profiling.steps=3"):
        load_config(None, ["profiling.steps=3", "profiling.every=3"])
    assert load_config(None, ["profiling.steps=3", "profiling.every=4"]).profiling.every == 4
    # Not part of the run's trajectory: a profiled rerun continues the same run.
    assert (load_config(None, ["profiling.steps=3"]).config_hash()
            == load_config(None, []).config_hash())


def trace_steps(path) -> set[int]:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return {int(e["name"].removeprefix("ProfilerStep#")) for e in events
            if str(e.get("name", "")).startswith("ProfilerStep#")}


def test_a_run_profiled_on_two_ranks_writes_each_ranks_trace_and_trains_the_same(tmp_path):
    """Steps 4-5 and 9 (a window the run's end cuts short) are profiled on both torchrun
    workers: each rank's Chrome trace spans exactly those steps, its table ranks real
    operators, and the losses are those of the same run unprofiled."""
    dataset = synthetic_dataset(tmp_path / "data")
    plain = small_config(tmp_path, "run.run_id=plain", "training.max_steps=9",
                         "checkpoint.every_steps=100")
    profiled = small_config(tmp_path, "run.run_id=profiled", "training.max_steps=9",
                            "checkpoint.every_steps=100", "profiling.steps=2",
                            "profiling.start_step=4", "profiling.every=5")
    for config in (plain, profiled):
        proc = torchrun_training(config, dataset, resume="none")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run_dir = profiled.run_dir
    assert sorted(p.name for p in (run_dir.path / "profiles").iterdir()) == ["step-4-5", "step-9-9"]
    for (first, last) in ((4, 5), (9, 9)):
        directory = run_dir.profile_dir(first, last)
        for rank in (0, 1):
            assert trace_steps(directory / f"rank{rank}.trace.json.gz") == set(range(first, last + 1))
            top = read_top(directory, rank)
            assert top["steps"] == [first, last] and top["time"] == "host"
            names = [row["name"] for row in top["operators"]]
            assert any(name in names for name in ("aten::mm", "aten::addmm", "aten::bmm")), names
            assert 0 < sum(row["self_share"] for row in top["operators"]) <= 1.0 + 1e-9
            assert "Self CPU" in (directory / f"rank{rank}.top.txt").read_text()
    assert "[profile] steps 4-5: " in proc.stdout + proc.stderr
    assert losses_by_step(run_dir.path) == losses_by_step(plain.run_dir.path)
