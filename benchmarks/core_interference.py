"""How much work on another core slows one training thread on this one: a diagnostic of the
machine, not of Goodput. It bounds what any background save can reach on the machine.

    python benchmarks/core_interference.py [--rounds 8] [--seconds 4]

The measured thread runs a one-thread matmul block of the ~100M-parameter model's size
(2048 tokens x 640 -> 2560 -> 640) over and over, alone and beside one other process doing
one kind of work: a Python loop (no memory traffic), sha256 of a buffer that fits in cache,
sha256 of 600 MB, copying 600 MB, writing 600 MB to a file. Each round measures every case
for `--seconds` (the median block time), in turn. Prints a markdown table: the median block
time and its ratio to the median alone, with the lowest and highest round. On independent
cores every ratio is 1.00x. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

NEIGHBOURS = {
    "alone": None,
    "a Python loop (no memory traffic)": "while True: pass",
    "sha256 of 1 MB, in cache": (
        "import hashlib\nb = bytes(1 << 20)\nh = hashlib.sha256()\nwhile True: h.update(b)"),
    "sha256 of 600 MB": (
        "import hashlib\nb = bytearray(600 << 20)\nwhile True: hashlib.sha256(b).digest()"),
    "copying 600 MB": (
        "import torch\ntorch.set_num_threads(1)\na = torch.ones(150 << 20)\nb = torch.empty(150 << 20)\n"
        "while True: b.copy_(a)"),
    "writing 600 MB to a file": (
        "import os, sys\nb = bytes(600 << 20)\nwhile True:\n"
        "    with open(sys.argv[1], 'wb') as f: f.write(b)\n    os.remove(sys.argv[1])"),
}


def median_block_s(seconds: float) -> float:
    torch.manual_seed(0)
    up, down, x = torch.randn(640, 2560), torch.randn(2560, 640), torch.randn(2048, 640)
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        (x @ up).relu_() @ down
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[float]] = {name: [] for name in NEIGHBOURS}
    with tempfile.TemporaryDirectory() as scratch:
        target = str(Path(scratch) / "written.bin")
        for _ in range(args.rounds):
            for name, code in NEIGHBOURS.items():
                neighbour = subprocess.Popen([sys.executable, "-c", code, target]) if code else None
                time.sleep(0.7)  # let it allocate its buffer and get going
                try:
                    runs[name].append(median_block_s(args.seconds))
                finally:
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.wait()
    print(json.dumps(runs), file=sys.stderr)  # the raw figures, before any formatting
    alone = statistics.median(runs["alone"])
    print("| beside the measured thread | median block (ms) | vs alone: median [lowest–highest round] |")
    print("|---|---|---|")
    for name, times in runs.items():
        ratios = sorted(t / alone for t in times)
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} | "
              f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}–{ratios[-1]:.2f}] |")


if __name__ == "__main__":
    main()
