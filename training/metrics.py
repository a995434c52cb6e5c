"""Rank 0's view of progress: one JSON line per step, and a heartbeat file.

The heartbeat is rewritten atomically every step; the launch task watches it to tell a
slow step from a hung job and to show live progress.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected lost time (Young/Daly, first order):
    sqrt(2 x C x MTBF), for checkpoint cost C (training time blocked per save)."""
    return math.sqrt(2 * checkpoint_cost_s * mtbf_s)


class MetricsWriter:
    def __init__(self, run_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self.heartbeat_path = Path(run_dir) / "heartbeat.json"
        if enabled:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.metrics_path, "a", buffering=1)  # line-buffered: tail-able

    def log(self, record: dict) -> None:
        if self.enabled:
            self._file.write(json.dumps({**record, "time": time.time()}) + "\n")

    def heartbeat(self, **fields) -> None:
        if not self.enabled:
            return
        tmp = self.heartbeat_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**fields, "time": time.time(), "pid": os.getpid()}))
        os.replace(tmp, self.heartbeat_path)

    def close(self) -> None:
        if self.enabled:
            self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_heartbeat(run_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "heartbeat.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# Dense bf16 peak FLOP/s by device name fragment, for the MFU estimate.
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device_name: str, configured: float | None) -> float | None:
    if configured:
        return configured
    for fragment, flops in GPU_PEAK_FLOPS.items():
        if fragment in device_name:
            return flops
    return None
