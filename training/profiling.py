"""Profiles of chosen training steps (torch.profiler): where a step's time goes, per rank.

    profiling.steps=3 profiling.start_step=10      # steps 10..12
    profiling.every=1000                           # and 1010..1012, 2010..2012, ...

Each profile writes, for every rank, in `<run dir>/profiles/step-<first>-<last>/`:
- `rank<r>.trace.json.gz`: a Chrome trace of the host's operators and, on a GPU, the
  device's kernels; `ProfilerStep#N` spans step N. Open it at https://ui.perfetto.dev (or
  chrome://tracing, or Holistic Trace Analysis over the folder).
- `rank<r>.top.txt`: torch's table of operators by self time on the device (the GPU's; the
  host's on a CPU run), and `rank<r>.top.json`, the same rows for scripts.
Rank 0 logs where the profile is and its top operators. The step before each profile runs
under the profiler unrecorded (its start-up would skew the first recorded step). Writing
the trace takes a moment after the last profiled step, and profiled steps run slower:
their step times in metrics.jsonl are not the run's speed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from core.config import ProfilingConfig
from core.protocol import RunDir
from training.logs import get_logger

log = get_logger("profile")
TOP_ROWS = 40  # rows of the table; the log names the first few
# With profiling.every, torch warns at the second window that it clears the first one's
# events: each window is saved as it ends (on_trace_ready), so that is what is wanted.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle",
                        category=UserWarning)


class StepProfiler:
    """A torch.profiler over the training loop that records the configured windows of steps.

        profiler = StepProfiler.for_config(config.profiling, run_dir, rank, device)  # or None
        profiler.start(progress.step)
        while ...:
            profiler.step(progress.step + 1)    # at the top of each step: it is starting
            ...
        profiler.stop()                         # a window cut short by the run's end is saved
    """

    def __init__(self, cfg: ProfilingConfig, run_dir: RunDir, rank: int, device: torch.device,
                 is_main: bool):
        self.cfg, self.run_dir, self.rank, self.is_main = cfg, run_dir, rank, is_main
        self.on_device = device.type == "cuda"
        self.recorded: list[int] = []  # the steps of the window being recorded
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device else [])
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=self.action, on_trace_ready=self._save,
            record_shapes=True, profile_memory=cfg.memory)

    @classmethod
    def for_config(cls, cfg: ProfilingConfig, run_dir: RunDir, rank: int, device: torch.device,
                   is_main: bool) -> StepProfiler | None:
        return cls(cfg, run_dir, rank, device, is_main) if cfg.steps else None

    def action(self, step: int) -> ProfilerAction:
        """What the profiler does during training step `step` (torch.profiler's schedule)."""
        offset = step - self.cfg.start_step
        if offset < -1:
            return ProfilerAction.NONE
        if offset == -1:
            return ProfilerAction.WARMUP if step >= 1 else ProfilerAction.NONE
        if self.cfg.every:
            offset %= self.cfg.every
        if offset < self.cfg.steps - 1:
            return ProfilerAction.RECORD
        if offset == self.cfg.steps - 1:
            return ProfilerAction.RECORD_AND_SAVE
        if self.cfg.every and offset == self.cfg.every - 1:
            return ProfilerAction.WARMUP  # the step before the next window
        return ProfilerAction.NONE

    def start(self, steps_done: int) -> None:
        # ProfilerStep#N names the trainer's step N: steps_done is the one before the first step.
        self.profiler.step_num = steps_done
        self.profiler.start()

    def step(self, step: int) -> None:
        """Step `step` starts (torch.profiler's step(): a recorded window ending before it is
        saved first)."""
        self.profiler.step()
        if self.action(step) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self.recorded.append(step)

    def stop(self) -> None:
        self.profiler.stop()

    def _save(self, profiler: torch.profiler.profile) -> None:
        if not self.recorded:  # resumed past the window's start: nothing of it recorded
            return
        first, last = self.recorded[0], self.recorded[-1]
        self.recorded = []
        directory = self.run_dir.profile_dir(first, last)
        directory.mkdir(parents=True, exist_ok=True)
        trace = directory / f"rank{self.rank}.trace.json.gz"
        profiler.export_chrome_trace(str(trace))
        rows, table = top_operators(profiler, self.on_device)
        (directory / f"rank{self.rank}.top.txt").write_text(table)
        (directory / f"rank{self.rank}.top.json").write_text(json.dumps(
            {"steps": [first, last], "rank": self.rank,
             "time": "device" if self.on_device else "host", "operators": rows}, indent=1))
        if self.is_main:
            where = "GPU" if self.on_device else "CPU"
            shares = ", ".join(f"{_readable(r['name'])} {r['self_share']:.0%}" for r in rows[:5])
            log.info("steps %d-%d: %s (open at https://ui.perfetto.dev); by self %s "
                     "time: %s", first, last, trace, where, shares)


def top_operators(profiler: torch.profiler.profile, on_device: bool) -> tuple[list[dict], str]:
    """The recorded operators by self time (the device's on a GPU, the host's otherwise):
    rows of name, calls, self and total milliseconds and the share of all self time, and
    torch's own table of the same."""
    averages = profiler.key_averages()
    self_us = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    total_us = (lambda e: e.device_time_total) if on_device else (lambda e: e.cpu_time_total)
    events = sorted(averages, key=self_us, reverse=True)
    all_self = sum(self_us(e) for e in events) or 1.0
    rows = [{"name": e.key, "calls": e.count, "self_ms": self_us(e) / 1e3,
             "total_ms": total_us(e) / 1e3, "self_share": self_us(e) / all_self}
            for e in events[:TOP_ROWS] if self_us(e) > 0]
    sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
    return rows, averages.table(sort_by=sort_by, row_limit=TOP_ROWS)


def _readable(operator: str) -> str:
    # ProfilerStep#N spans the whole step: its self time is the time in no operator.
    return "outside any operator" if operator.startswith("ProfilerStep") else operator


def read_top(directory: Path, rank: int = 0) -> dict:
    """A profile's rank<r>.top.json, as `StepProfiler` wrote it."""
    return json.loads((directory / f"rank{rank}.top.json").read_text())
