"""CPU time of one checkpoint save in one process: DCP's own writer plus hashing every file
afterwards for the manifest (what rank 0 did before ShardWriter), against ShardWriter, which
hashes each file as it writes it and skips torch.save's zip CRC.

    python benchmarks/save_cpu_bench.py [--params 100e6] [--repeats 4] [--dir /tmp/save-cpu-bench]

The state is `--params` float32 parameters plus AdamW's two moments (1.2 GB for 100M), in
450 tensors. Prints a markdown table for benchmarks/RESULTS.md; asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from storage.manifests import list_files  # noqa: E402
from training.checkpoint.writer import WRITTEN_DIGESTS, ShardWriter, written_digests  # noqa: E402


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/save-cpu-bench")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    per_tensor = int(args.params) // 150
    state = {f"{kind}{i}": torch.randn(per_tensor) for kind in ("param", "exp_avg", "exp_avg_sq")
             for i in range(150)}
    path = Path(args.dir)
    print("| run | DCP's writer (s CPU) | + hashing every file (s CPU) | = total | "
          "ShardWriter, hashing as written, manifest listing included (s CPU) |")
    print("|---|---|---|---|---|")
    for run in range(1, args.repeats + 1):
        shutil.rmtree(path, ignore_errors=True)
        write = cpu_seconds(lambda: dcp.save(state, checkpoint_id=str(path), no_dist=True))
        hashing = cpu_seconds(lambda: list_files(path))
        shutil.rmtree(path)

        def shard_writer_save():
            dcp.save(state, storage_writer=ShardWriter(path), no_dist=True)
            list_files(path, exclude=(WRITTEN_DIGESTS,), known=written_digests(path))

        ours = cpu_seconds(shard_writer_save)
        print(f"| {run} | {write:.2f} | {hashing:.2f} | {write + hashing:.2f} | {ours:.2f} |", flush=True)
    size = sum(f.stat().st_size for f in path.iterdir())
    shutil.rmtree(path)
    print(f"\ncheckpoint {size / 1e9:.2f} GB, one process, torch {torch.__version__}")


if __name__ == "__main__":
    main()
