"""The experts' matmuls: torch's grouped_mm against one matmul per expert (issue 36 / 37).

    python benchmarks/moe_kernels.py --device cuda      # on a GPU (grouped_mm needs sm90)
    python benchmarks/moe_kernels.py --device cpu --tokens 2048 --dim 128 --hidden 256

training.moe.expert_swiglu (the routed experts' SwiGLU) under bf16 autocast with fp32
weights, as the trainer runs it on one GPU: forward and backward, median of --repeats after a
warm-up, once through training.moe.grouped_mm (which takes torch's grouped_mm kernel where it
runs) and once with every expert's rows through a matmul of their own (grouped_mm_loop). Rows
are routed unevenly (a Zipf-like share per expert), as a router's are. Prints one JSON object:
which path grouped_mm took, each path's time, and the largest difference between the two
outputs and weight gradients relative to the largest value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import moe  # noqa: E402


def uneven_counts(tokens: int, experts: int) -> torch.Tensor:
    """Rows per expert, expert e getting a share proportional to 1 / (e + 1)."""
    shares = torch.tensor([1.0 / (e + 1) for e in range(experts)])
    counts = (shares / shares.sum() * tokens).floor().long()
    counts[0] += tokens - counts.sum()
    return counts


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32768, help="(token, expert) rows")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    counts = uneven_counts(args.tokens, args.experts).to(device)
    x = torch.randn(args.tokens, args.dim, device=device)
    weights = [torch.randn(args.experts, *shape, device=device) * 0.02
               for shape in ((args.hidden, args.dim), (args.hidden, args.dim), (args.dim, args.hidden))]
    for w in weights:
        w.requires_grad_(True)

    taken = {"loop": 0}
    loop = moe.grouped_mm_loop

    def counting_loop(*a):
        taken["loop"] += 1
        return loop(*a)

    def step(swiglu_loop: bool):
        moe.grouped_mm_loop = counting_loop
        original = moe.use_grouped_mm
        if swiglu_loop:
            moe.use_grouped_mm = lambda *_: False
        try:
            for w in weights:
                w.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = moe.expert_swiglu(x, counts, *weights)
            out.float().square().mean().backward()
            return out.detach().float(), [w.grad.clone() for w in weights]
        finally:
            moe.use_grouped_mm = original
            moe.grouped_mm_loop = loop

    out_grouped, grads_grouped = step(False)
    path = "grouped_mm" if taken["loop"] == 0 else "loop"
    taken["loop"] = 0
    out_loop, grads_loop = step(True)
    assert taken["loop"] == 3, "the per-expert arm did not take the loop"

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"rows": args.tokens, "experts": args.experts, "dim": args.dim,
                  "hidden": args.hidden, "rows_per_expert": counts.tolist()},
        "grouped_mm_path": path,
        "grouped_ms": 1e3 * timed(lambda: step(False), device, args.repeats),
        "loop_ms": 1e3 * timed(lambda: step(True), device, args.repeats),
        "max_relative_difference": {
            "output": relative(out_grouped, out_loop),
            **{f"grad_w{i}": relative(a, b)
               for i, a, b in zip((1, 3, 2), grads_grouped, grads_loop)}},
    }
    result["loop_over_grouped"] = result["loop_ms"] / result["grouped_ms"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
