"""The output layer and loss in chunks (parallelism.loss_chunk_tokens) against the whole
micro-batch's logits: time and memory of forward + backward of the head alone.

    python benchmarks/loss_chunks_bench.py [--tokens 8192] [--dim 768] [--vocab 50304]
                                           [--chunks 0 4096 1024 256] [--bf16] [--repeats 5]

Each chunk size runs in a process of its own (0: the whole micro-batch, today's default
path: F.linear, then cross_entropy on the fp32 logits), on the same random hidden states,
weight and targets: the median wall time of --repeats forward + backward passes after one
warm-up, and the peak growth of the resident set over the process's state before the first
pass (Linux: VmHWM reset through /proc/self/clear_refs; every allocation above 64 KiB its own
mapping, so the peak follows the tensors alive at once). Ratios are against chunk 0 of the
same run. The default shape is GPT-2-124M's head at a micro-batch of 8 x 1024 tokens. On a
GPU (--device cuda) the peak is torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(args) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from training.model import cross_entropy, linear_cross_entropy

    device = torch.device(args.device)
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, device=device, generator=generator)
    weight = (torch.randn(args.vocab, args.dim, device=device, generator=generator) * 0.02
              ).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=generator)

    def one_pass() -> float:
        h = hidden.clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = (linear_cross_entropy(h, weight, targets, args.chunk) if args.chunk
                    else cross_entropy(F.linear(h, weight), targets))
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        weight.grad = None
        return time.perf_counter() - start, loss.item()

    one_pass()  # warm-up: kernels, thread pools, autocast's weight copy
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    runs = [one_pass() for _ in range(args.repeats)]
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss("VmHWM")) - base
    return {"chunk": args.chunk, "seconds": statistics.median(r[0] for r in runs),
            "peak_bytes": peak, "loss": runs[-1][1]}


def _rss(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of a micro-batch")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 1024, 256])
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args()
    if args.chunk is not None:
        print(json.dumps(measure(args)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for chunk in args.chunks:
        cmd = [sys.executable, __file__, "--chunk", str(chunk), "--tokens", str(args.tokens),
               "--dim", str(args.dim), "--vocab", str(args.vocab), "--device", args.device,
               "--repeats", str(args.repeats)] + (["--bf16"] if args.bf16 else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    whole = next((r for r in rows if r["chunk"] == 0), rows[0])
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, torch threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}; {args.tokens} tokens x dim {args.dim} "
          f"x vocab {args.vocab}, {'bf16 autocast' if args.bf16 else 'fp32'}, {args.device}")
    print("| chunk (tokens) | forward + backward | vs whole | peak memory | vs whole | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk'] or 'whole'} | {r['seconds'] * 1000:.0f} ms | "
              f"{r['seconds'] / whole['seconds']:.2f}x | {r['peak_bytes'] / 2**20:,.0f} MiB | "
              f"{r['peak_bytes'] / whole['peak_bytes']:.2f}x | {r['loss']:.6f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
