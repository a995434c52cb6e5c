"""Rank 0's view of progress: one JSON line per logged step, and the heartbeat.

The heartbeat (core.protocol) is rewritten every step; the launch task watches it to tell a
slow step from a hung job and to show live progress.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from core.protocol import RunDir, write_heartbeat


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected lost time (Young/Daly, first order):
    sqrt(2 x C x MTBF), for checkpoint cost C (training time blocked per save)."""
    return math.sqrt(2 * checkpoint_cost_s * mtbf_s)


class MetricsWriter:
    """metrics.jsonl and the heartbeat, written by rank 0 (`enabled`) only; every record also
    goes to the tracking backends (training.tracking), when given."""

    def __init__(self, run_dir: RunDir | str | Path, enabled: bool, trackers=None):
        self.run_dir = RunDir.of(run_dir)
        self.enabled, self.trackers = enabled, trackers
        if enabled:
            self.run_dir.path.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir.metrics_file, "a", buffering=1)  # line-buffered: tail-able

    def log(self, record: dict) -> None:
        if self.enabled:
            self._file.write(json.dumps({**record, "time": time.time()}) + "\n")
            if self.trackers is not None:
                self.trackers.log(record["step"], record)

    def heartbeat(self, **fields) -> None:
        if self.enabled:
            write_heartbeat(self.run_dir, **fields)

    def close(self, status: str = "FINISHED") -> None:
        """Idempotent: the trainer closes it at its end, and on its way out of a failure
        (`status` for the trackers: FINISHED, KILLED or FAILED)."""
        if self.enabled and not self._file.closed:
            self._file.close()
            if self.trackers is not None:
                self.trackers.close(status)


class StepMetrics:
    """What the loop reports after each step: a heartbeat every step, a metrics record every
    `log_every` steps (and at the last, and at each checkpointed step). A record accounts for
    every step since the previous one (`window_steps`, `window_time_s`, `checkpoint_s`,
    `data_wait_s`), so goodput counts every step's time, not only the logged ones.
    `data_wait_s` is time inside the steps spent waiting for batches; `data_wait_share` its
    share of the window's step time."""

    def __init__(self, writer: MetricsWriter, *, attempt: str, max_steps: int, log_every: int,
                 tokens_per_step: int, flops_per_token: float, world_size: int,
                 device_peak_flops: float | None, device_memory=lambda: {}):
        self.writer, self.attempt, self.max_steps, self.log_every = writer, attempt, max_steps, log_every
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.world_size, self.device_peak_flops = world_size, device_peak_flops
        self.device_memory = device_memory
        self.window_steps, self.window_time_s, self.window_checkpoint_s = 0, 0.0, 0.0
        self.window_data_wait_s = 0.0
        self.last_step: dict = {}  # the newest step's own numbers, for the record of its window

    def step(self, step: int, *, loss: float, lr: float, grad_norm: float, tokens_seen: int,
             step_time_s: float, checkpoint_s: float, save_in_flight: bool,
             data_wait_s: float = 0.0, validation: dict | None = None,
             checkpointed: bool = False, model_stats: dict | None = None) -> None:
        """`validation`: the in-loop held-out losses measured after this step (and
        `val_time_s`, outside the step's time); a step with them is always logged.
        `checkpointed`: a checkpoint of this step was saved (or started); such a step is always
        logged, as an attempt that resumes from it never logs the steps up to it.
        `model_stats`: the step's own figures of the model (a mixture of experts' loads) and
        of its data (a mix's samples drawn from each source)."""
        tokens_per_s = self.tokens_per_step / step_time_s
        self.window_steps += 1
        self.window_time_s += step_time_s
        self.window_checkpoint_s += checkpoint_s
        self.window_data_wait_s += data_wait_s
        self.last_step = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens_seen": tokens_seen, "tokens_per_s": tokens_per_s,
                          "step_time_s": step_time_s,
                          # rank 0's background save was still writing or hashing when this
                          # step ended: the step shared the CPU with it (benchmarks/ measures it)
                          "save_in_flight": save_in_flight,
                          "checkpointed": checkpointed,  # a save of this step began (its count)
                          # the workers this step ran on: an elastic job's shrinks and grows
                          "world_size": self.world_size, **(model_stats or {})}
        if step % self.log_every == 0 or step == self.max_steps or validation or checkpointed:
            self._log(validation or {})
        self.writer.heartbeat(step=step, loss=loss, tokens_per_s=tokens_per_s,
                              step_time_s=step_time_s, data_wait_share=data_wait_s / step_time_s,
                              max_steps=self.max_steps,
                              attempt=self.attempt, phase="step")

    def log_window(self) -> None:
        """Log the steps since the last record now: before an emergency save keeps them (the
        attempt takes no later step whose record would stand for them, and the next attempt
        does not train them again), and at a mix stage's last step."""
        if self.window_steps:
            self._log({})

    def _log(self, validation: dict) -> None:
        """The record of the last step, standing for the window of steps up to it."""
        achieved = self.flops_per_token * self.last_step["tokens_per_s"] / self.world_size
        self.writer.log({
            **self.last_step, "checkpoint_s": self.window_checkpoint_s,
            # this record stands for steps (step - window_steps, step]
            "window_steps": self.window_steps, "window_time_s": self.window_time_s,
            "data_wait_s": self.window_data_wait_s,
            "data_wait_share": self.window_data_wait_s / self.window_time_s,
            "flops_per_s_per_device": achieved,
            "mfu": achieved / self.device_peak_flops if self.device_peak_flops else None,
            "attempt": self.attempt, **self.device_memory(), **validation})
        self.window_steps, self.window_time_s, self.window_checkpoint_s = 0, 0.0, 0.0
        self.window_data_wait_s = 0.0

    def saving(self, step: int, loss: float) -> None:
        """A save, or a wait for one, is under way: the supervisor allows it a save's time."""
        self.writer.heartbeat(step=step, loss=loss, attempt=self.attempt, phase="checkpoint",
                              max_steps=self.max_steps)


def read_metrics(run_dir: RunDir | str | Path) -> list[dict]:
    path = RunDir.of(run_dir).metrics_file
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Dense bf16 peak FLOP/s by device name fragment, for the MFU estimate.
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device_name: str, configured: float | None) -> float | None:
    if configured:
        return configured
    for fragment, flops in GPU_PEAK_FLOPS.items():
        if fragment in device_name:
            return flops
    return None


def peak_resident_bytes() -> int:
    """This process's own peak resident set. Linux's /proc/self/status VmHWM, not getrusage's
    ru_maxrss: the kernel carries the peak of the process that exec'd us into ru_maxrss, so a
    worker whose launcher (torchrun's agent, an srun step) once held more reports the
    launcher's figure (a torchrun worker's starts at the agent's 0.22 GiB)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no procfs (macOS): the peak as getrusage gives it
        pass
    import resource
    import sys

    kib = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib
