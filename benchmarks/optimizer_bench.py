"""The trainer's AdamW step, fused against torch's loop of single-tensor operations, on a
model size's parameter shapes (issue 37: the optimizer was the largest part of a CPU step
after the matmuls).

    python benchmarks/optimizer_bench.py [--size gpt2-124m] [--threads 1] [--steps 5] [--rounds 3]

Each arm builds the size's parameters (mfu_bench.SIZES: embedding, the blocks' attention and
SwiGLU weights, norms, output layer) with gradients set, then times `opt.step()` as
training.train.build_optimizer configures it (two groups, weight decay on matrices only),
`fused` on or off; the median of --steps steps after one, arms alternating per round. It
also checks the two agree: the largest difference of the weights after the same steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parameters(size_name: str, seed: int = 0):
    import torch

    from benchmarks.mfu_bench import SIZES
    from core.config import ModelConfig
    from training.model import Transformer, model_args_from_config

    size = SIZES[size_name]
    cfg = ModelConfig(dim=size.dim, n_layers=size.n_layers, n_heads=size.n_heads,
                      ffn_multiple_of=size.ffn_multiple_of, max_seq_len=size.seq_len)
    torch.manual_seed(seed)
    model = Transformer(model_args_from_config(cfg, size.vocab_size))
    generator = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    return model


def step_times(size_name: str, fused: bool, steps: int):
    import torch

    from core.config import TrainingConfig
    from training.train import build_optimizer

    model = parameters(size_name)
    device = torch.device("cpu")
    optimizer = build_optimizer(model, TrainingConfig(lr=1e-3), device)
    for group in optimizer.param_groups:  # the arm: build_optimizer's choice, or the loop
        group["fused"], group["foreach"] = fused, False
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:]), [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpt2-124m")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a worker's OMP_NUM_THREADS)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = {"fused": [], "loop": []}
    weights = {}
    for r in range(args.rounds):
        for arm in (["fused", "loop"] if r % 2 == 0 else ["loop", "fused"]):
            seconds, weights[arm] = step_times(args.size, arm == "fused", args.steps)
            rows[arm].append(seconds)
            print(f"round {r + 1} {arm}: {seconds * 1e3:.1f} ms a step", flush=True)
    difference = max((a - b).abs().max().item() for a, b in zip(weights["fused"], weights["loop"]))
    largest = max(w.abs().max().item() for w in weights["loop"])
    fused, loop = statistics.median(rows["fused"]), statistics.median(rows["loop"])
    print(f"\n{args.size}, {args.threads} thread(s), median of {args.steps} steps per round, "
          f"{args.rounds} rounds: fused {fused * 1e3:.1f} ms, loop {loop * 1e3:.1f} ms a step "
          f"({loop / fused:.1f}x); largest weight difference after {args.steps + 1} steps "
          f"{difference:.2e} (weights up to {largest:.2f})")


if __name__ == "__main__":
    main()
