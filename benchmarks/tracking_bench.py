"""What logging to the tracking backends costs the trainer per step.

    python benchmarks/tracking_bench.py [--records 2000] [--step-ms 100]

Times `Trackers.log` (what rank 0 calls once per logged step, with a real metrics record)
for: TensorBoard alone; TensorBoard + MLflow (a real local MLflow server started here) +
W&B (offline mode); and the same three while the MLflow server is down (its port closed).
Printed: microseconds per logged step and the share of a --step-ms training step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.launchers import free_port  # noqa: E402


def record(step: int) -> dict:
    return {"step": step, "loss": 3.0 - step * 1e-4, "lr": 3e-4, "grad_norm": 0.9, "tokens_seen": step * 2**20,
            "tokens_per_s": 1.2e6, "step_time_s": 0.1, "checkpoint_s": 0.0, "save_in_flight": False,
            "window_steps": 1, "window_time_s": 0.1, "data_wait_s": 0.001, "data_wait_share": 0.01,
            "flops_per_s_per_device": 4e14, "mfu": 0.4, "attempt": "a1", "max_memory_allocated_gb": 61.0}


def timed(trackers, records: int) -> float:
    started = time.perf_counter()
    for step in range(1, records + 1):
        trackers.log(step, record(step))
    per_step = (time.perf_counter() - started) / records
    trackers.close()
    return per_step


def main() -> None:
    from training.tracking import open_trackers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=100.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tracking-bench-"))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                               str(port), "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
                               "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(180):
        try:
            urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=5)
            break
        except OSError:
            time.sleep(0.5)
    cases = {
        "TensorBoard": SimpleNamespace(tensorboard=True, mlflow_uri=None, wandb_project=None),
        "TensorBoard + MLflow + W&B offline": SimpleNamespace(
            tensorboard=True, mlflow_uri=url, mlflow_experiment="bench", wandb_project="bench",
            wandb_entity=None, wandb_mode="offline"),
        "the same, MLflow server down": SimpleNamespace(
            tensorboard=True, mlflow_uri=f"http://127.0.0.1:{free_port()}", mlflow_experiment="bench",
            wandb_project="bench", wandb_entity=None, wandb_mode="offline"),
    }
    print(f"{args.records} logged steps each; share of a {args.step_ms:.0f} ms step")
    try:
        for i, (name, tracking) in enumerate(cases.items()):
            per_step = timed(open_trackers(tracking, work / f"run{i}", f"bench-{i}"), args.records)
            print(f"  {name:<38} {per_step * 1e6:8.1f} us/step  {per_step * 1e3 / args.step_ms:7.3%}")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
