"""Checkpoint stall inside the real trainer: `python -m training` under torchrun, the same
~100M-parameter model, data and steps, with `checkpoint.async_mode` sync, thread and process.

    python benchmarks/trainer_checkpoint_bench.py [--steps 16] [--every 4] [--layout ddp|fsdp]

Per mode: the training time blocked per save (what `metrics.jsonl` records as checkpoint_s:
starting the save, plus waiting for background staging before the next optimizer step),
the median step time without a save in flight, and the ratio of blocking to the synchronous
save. Runs the modes one after another in one invocation; prints a markdown table for
benchmarks/RESULTS.md. A benchmark, not a test: nothing here asserts a target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from goodput.config import load_config  # noqa: E402
from goodput.runs import write_run_config  # noqa: E402
from infra.torchrun import free_port  # noqa: E402
from tests.helpers import synthetic_dataset  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

LAYOUTS = {"ddp": ["parallelism.dp_replicate=-1"],
           "fsdp": ["parallelism.dp_replicate=1", "parallelism.dp_shard=-1"]}


def run_mode(root: Path, dataset: Path, mode: str, args) -> dict:
    config = load_config(None, [
        f"run.runs_dir={root / 'runs'}", f"run.run_id=bench-{mode}", f"storage.uri={root / 'store'}",
        # ~100M parameters, as in checkpoint_bench.py: 12 layers of width 640, 32k vocabulary.
        "model.dim=640", "model.n_layers=12", "model.n_heads=10", "model.max_seq_len=128",
        "training.seq_len=128", f"training.max_steps={args.steps}",
        "training.warmup_steps=2", f"checkpoint.every_steps={args.every}",
        f"checkpoint.async_mode={mode}", f"parallelism.nproc_per_node={args.nproc}",
        f"training.micro_batch_size={args.micro_batch}", *LAYOUTS[args.layout]])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "training",
           "--config", str(write_run_config(config)), "--dataset", str(dataset), "--resume", "none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = read_metrics(config.run_dir)
    saves = [r["step"] for r in records if r["step"] % args.every == 0 and r["step"] < args.steps]
    # A save's stall: its own step's checkpoint_s plus the staging wait the step after records.
    by_step = {r["step"]: r for r in records}
    stalls = [by_step[s]["checkpoint_s"] + by_step.get(s + 1, {}).get("checkpoint_s", 0.0)
              for s in saves]
    quiet = [r["step_time_s"] for r in records
             if r["step"] > 2 and (r["step"] - 1) % args.every not in (0, 1)]
    size = sum(f.stat().st_size for f in (config.run_dir / "checkpoints" / f"step-{args.every:08d}").iterdir())
    shutil.rmtree(config.run_dir / "checkpoints")
    return {"stalls": stalls, "step_s": statistics.median(quiet) if quiet else None, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ddp")
    parser.add_argument("--nproc", type=int, default=2, help="workers (1 per GPU on a GPU machine)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="trainer-ckpt-bench-"))
    dataset = synthetic_dataset(root / "dataset", vocab_size=32000, docs_per_shard=400)
    results = {mode: run_mode(root, dataset, mode, args) for mode in ("sync", "thread", "process")}
    base = statistics.median(results["sync"]["stalls"])
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    print(f"\n{device}, {args.nproc} worker(s), layout {args.layout}, {args.steps} steps, a save every {args.every}; checkpoint "
          f"{results['sync']['bytes'] / 1e9:.2f} GB; load {os.getloadavg()[0]:.1f}\n")
    print("| checkpoint.async_mode | stall per save (s) | median stall (s) | vs sync | step time without save (s) |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        median = statistics.median(r["stalls"])
        step_s = "–" if r["step_s"] is None else f"{r['step_s']:.3f}"
        print(f"| {mode} | {', '.join(f'{s:.3f}' for s in r['stalls'])} | {median:.3f} | "
              f"{median / base:.3f} | {step_s} |")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
