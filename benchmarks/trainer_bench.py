"""Trainer throughput: `python -m training` against a bare PyTorch loop, and per layout.

    python benchmarks/trainer_bench.py [--steps 40] [--rounds 2] [--layouts]

1. One process, same model, batch, data and optimizer: tokens/s of the trainer (median
   step of its own metrics) over tokens/s of a bare loop (median step, timed the same way).
   Rounds alternate the two so machine load hits both alike. Target: ratio >= 0.97.
2. With --layouts: tokens/s per parallelism layout on 2 and 4 CPU processes (torchrun).
Prints a table; results belong in benchmarks/RESULTS.md with this command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.max_seq_len=256",
         "training.seq_len=256", "training.micro_batch_size=8", "training.warmup_steps=2",
         "checkpoint.every_steps=100000", "faults.spike_factor=null"]
LAYOUTS = {
    2: {"ddp": ["parallelism.dp_replicate=2"],
        "fsdp": ["parallelism.dp_replicate=1", "parallelism.dp_shard=2"],
        "tp": ["parallelism.dp_replicate=1", "parallelism.tp=2"],
        "pp-1f1b": ["parallelism.dp_replicate=1", "parallelism.pp=2"]},
    4: {"ddp": ["parallelism.dp_replicate=4"],
        "hsdp": ["parallelism.dp_replicate=2", "parallelism.dp_shard=2"],
        "fsdp-tp": ["parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.tp=2"],
        "pp-fsdp": ["parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.pp=2"]},
}


def config_for(workdir: Path, steps: int, *overrides: str):
    from tests.helpers import small_config

    return small_config(workdir, *MODEL, f"training.max_steps={steps}", *overrides)


def trainer_tokens_per_s(workdir: Path, dataset: Path, steps: int, nproc: int, *overrides: str) -> float:
    """Median tokens/s of the trainer's own per-step metrics (first steps are warm-up)."""
    import shutil

    from goodput.runs import write_run_config
    from infra.torchrun import free_port
    from training.metrics import read_metrics

    config = config_for(workdir, steps, f"parallelism.nproc_per_node={nproc}", *overrides)
    shutil.rmtree(config.run_dir, ignore_errors=True)
    args = ["-m", "training", "--config", str(write_run_config(config)), "--dataset", str(dataset),
            "--resume", "none"]
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=env)
    rates = [r["tokens_per_s"] for r in read_metrics(config.run_dir)][steps // 4:]
    return statistics.median(rates)


def bare_tokens_per_s(workdir: Path, dataset: Path, steps: int) -> float:
    """The same model, optimizer, batches and schedule in a plain loop, nothing else."""
    import torch

    from storage.manifests import DatasetManifest
    from training.data import DistributedSampleLoader, TokenStream
    from training.model import Transformer, model_args_from_config
    from training.train import build_optimizer, lr_at

    config = config_for(workdir, steps)
    tcfg, manifest = config.training, DatasetManifest.load(dataset)
    torch.manual_seed(tcfg.seed)
    model = Transformer(model_args_from_config(config.model, manifest.vocab_size))
    optimizer = build_optimizer(model, tcfg, torch.device("cpu"))
    loader = DistributedSampleLoader(TokenStream(dataset, manifest, "train"), tcfg.seq_len,
                                     tcfg.micro_batch_size, 0, 1, tcfg.seed)
    rates = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tcfg)
        inputs, targets = loader.next_batch()
        loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the trainer also reads the loss every step
        rates.append(tcfg.micro_batch_size * tcfg.seq_len / (time.perf_counter() - start))
    return statistics.median(rates[steps // 4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", action="store_true")
    args = parser.parse_args()
    from tests.helpers import synthetic_dataset

    workdir = Path(tempfile.mkdtemp(prefix="goodput-trainer-bench-"))
    dataset = synthetic_dataset(workdir / "dataset", vocab_size=4096, docs_per_shard=2000)
    torch_threads = os.cpu_count() or 1
    import torch

    torch.set_num_threads(torch_threads)
    trainer, bare = [], []
    for _ in range(args.rounds):
        bare.append(bare_tokens_per_s(workdir, dataset, args.steps))
        trainer.append(trainer_tokens_per_s(workdir, dataset, args.steps, 1,
                                            "parallelism.nproc_per_node=1"))
    print("\none process, same model / batch / data / optimizer")
    print(f"{'round':>5} {'bare tok/s':>12} {'trainer tok/s':>14} {'ratio':>7}")
    for i, (b, t) in enumerate(zip(bare, trainer), 1):
        print(f"{i:>5} {b:>12,.0f} {t:>14,.0f} {t / b:>7.3f}")
    print(f"{'all':>5} {statistics.median(bare):>12,.0f} {statistics.median(trainer):>14,.0f} "
          f"{statistics.median(trainer) / statistics.median(bare):>7.3f}")
    if args.layouts:
        print(f"\n{'procs':>5} {'layout':<9} {'tok/s':>10}")
        for nproc, layouts in LAYOUTS.items():
            for name, overrides in layouts.items():
                rate = trainer_tokens_per_s(workdir, dataset, args.steps, nproc, *overrides)
                print(f"{nproc:>5} {name:<9} {rate:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
