"""Mixtures: the realized token share of each source, and after a resume at another world size.

    python benchmarks/mixture_bench.py [--tokens 10M] [--weights 0.6,0.3,0.1] [--workdir DIR]

It writes one dataset per source (uint16 shards in the real format; source s's tokens are
drawn from ids [1000 s + 1, 1000 s + 999], so every token handed out tells its source) and
reads --tokens training tokens with the trainer's loader (seq 2048, micro-batch 8):

- on one rank, counting each source's tokens in what the loader hands out;
- on one rank for the first half, then resumed from that state (as a checkpoint holds it) on
  four ranks for the second half, the ranks' batches counted together;
- with a curriculum stage at the half that moves the weights to the reverse order.

Printed: each source's share against its weight (percentage points apart) over the whole
run and over each half, whether the resumed run handed out exactly the tokens of the
uninterrupted one, the loader state's size, and batches per second for the mix against the
same loader on a single source.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARD_TOKENS, SEQ, MICRO_BATCH, WINDOW = 2**18, 2048, 8, 2**22


def write_source(directory: Path, index: int, tokens: int):
    from core.files import sha256_file
    from storage.manifests import DatasetManifest, ShardInfo
    from storage.shards import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(index)
    splits = {"train": [], "validation": []}
    for split, n in (("train", max(1, tokens // SHARD_TOKENS)), ("validation", 1)):
        for i in range(n):
            doc = rng.integers(1000 * index + 1, 1000 * index + 1000, SHARD_TOKENS, dtype=np.uint16)
            path = directory / f"{split}-{i:05d}.arrow"
            n_tokens, n_docs = write_shard(path, [doc], "uint16")
            splits[split].append(ShardInfo(path=path.name, n_tokens=n_tokens, n_docs=n_docs,
                                           size=path.stat().st_size, sha256=sha256_file(path)))
    manifest = DatasetManifest(dataset_id=f"source{index}", source="random tokens",
                               tokenizer="tokenizer.json", tokenizer_sha256="", vocab_size=50000,
                               eos_id=0, dtype="uint16", splits=splits, created_at=time.time())
    manifest.save(directory)
    return manifest


def loader_for(dirs, manifests, stages, rank=0, ranks=1):
    from training.data import DistributedSampleLoader, TokenStream

    streams = {name: TokenStream(dirs[name], manifests[name], "train") for name in dirs}
    return DistributedSampleLoader(streams, SEQ, MICRO_BATCH, rank, ranks, seed=1337,
                                   shuffle_window_tokens=WINDOW, stages=stages)


def count(batches: list, n_sources: int) -> np.ndarray:
    """Tokens of each source in these input batches (a token's id tells its source)."""
    ids = np.concatenate([b.numpy().ravel() for b in batches])
    return np.bincount(ids // 1000, minlength=n_sources)[:n_sources]


def report(label: str, counts: np.ndarray, weights: np.ndarray) -> float:
    shares = counts / counts.sum()
    apart = np.abs(shares - weights / weights.sum()) * 100
    print(f"  {label:<34} " + "  ".join(f"{s:.4f} ({d:.3f} pp)" for s, d in zip(shares, apart)))
    return float(apart.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="10M", help="training tokens handed out (K/M/G suffixes)")
    parser.add_argument("--weights", default="0.6,0.3,0.1")
    parser.add_argument("--source-tokens", type=int, default=2**21, help="tokens per source dataset")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    total = int(float(args.tokens.rstrip("KMG")) * {"K": 1e3, "M": 1e6, "G": 1e9}.get(args.tokens[-1], 1))
    weights = np.array([float(w) for w in args.weights.split(",")])
    names = [f"s{i}" for i in range(len(weights))]
    steps = total // (SEQ * MICRO_BATCH)
    half = steps // 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mixture-bench-"))
    dirs = {name: workdir / name for name in names}
    manifests = {name: write_source(dirs[name], i, args.source_tokens) for i, name in enumerate(names)}
    stages = [(0, dict(zip(names, weights)))]
    print(f"{len(names)} sources, weights {args.weights}, {steps} batches of {SEQ * MICRO_BATCH:,} "
          f"tokens = {steps * SEQ * MICRO_BATCH:,} tokens; each source {args.source_tokens:,} tokens")

    print("realized shares (share, percentage points from the weight):")
    one = loader_for(dirs, manifests, stages)
    started = time.perf_counter()
    batches = [one.next_batch()[0] for _ in range(steps)]
    mix_rate = steps / (time.perf_counter() - started)
    worst = report("one rank, whole run", count(batches, len(names)), weights)
    worst = max(worst, report("one rank, first half", count(batches[:half], len(names)), weights))

    first = loader_for(dirs, manifests, stages)
    for _ in range(half):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    four = [loader_for(dirs, manifests, stages, rank, 4) for rank in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    # One step of four ranks of micro-batch 8 is four batches of the one-rank run.
    rounds = (steps - half) // 4
    resumed = [torch.cat([loader.next_batch()[0] for loader in four]) for _ in range(rounds)]
    worst = max(worst, report("resumed on 4 ranks, second half", count(resumed, len(names)), weights))
    same = torch.equal(torch.cat(resumed), torch.cat(batches[half:half + 4 * rounds]))
    print(f"  resumed on 4 ranks hands out exactly the uninterrupted run's tokens: {same}")

    staged = [(0, dict(zip(names, weights))), (half * MICRO_BATCH, dict(zip(names, weights[::-1])))]
    curriculum = loader_for(dirs, manifests, staged)
    taken = [curriculum.next_batch()[0] for _ in range(steps)]
    worst = max(worst, report("stage 1 (weights)", count(taken[:half], len(names)), weights))
    worst = max(worst, report("stage 2 (weights reversed)", count(taken[half:], len(names)), weights[::-1]))
    print(f"largest deviation: {worst:.3f} percentage points (target: within 0.5)")

    single = loader_for({names[0]: dirs[names[0]]}, {names[0]: manifests[names[0]]}, None)
    started = time.perf_counter()
    for _ in range(min(steps, 400)):
        single.next_batch()
    single_rate = min(steps, 400) / (time.perf_counter() - started)
    print(f"loader state: {len(json.dumps(state))} bytes of JSON; batches/s: mix {mix_rate:.0f}, "
          f"single source {single_rate:.0f} ({mix_rate / single_rate:.2f}x)")


if __name__ == "__main__":
    main()
