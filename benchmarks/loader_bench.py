"""Training data from the store: the loader through a bounded cache against local files, and
the memory of the sample order at a trillion tokens.

    python benchmarks/loader_bench.py [--tokens 2^27] [--step-ms 50] [--workdir DIR] [--trainer-steps N]

It writes a dataset of random tokens (uint16 shards of 2^20 tokens), puts it in a local
SeaweedFS (real S3, started here), and reads it with the trainer's loader (seq 2048, micro-batch 8, a shuffle window of 2^22
tokens):

- from the local files (the dataset prepared on this machine: read in place);
- from S3 through the shard cache, limited to a tenth of the dataset; the cache directory's
  size is sampled after every batch (its peak must stay under the limit).

Each is timed twice: one epoch as fast as the loader goes (no training), and --step-batches
batches with a simulated training step of --step-ms each (the loader then prefetches while
the step runs), with the loader's own data-wait share. Last, the sample order's memory (tracemalloc peak) for a
dataset of 1T tokens at seq 2048, against one of a thousand samples. With --trainer-steps N,
the trainer itself (`python -m training`, a ~113M-parameter model) trains N steps on the local
files and N steps from S3 through the cache: median step time and data-wait share.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARD_TOKENS, SEQ, MICRO_BATCH, WINDOW = 2**20, 2048, 8, 2**22


def write_dataset(directory: Path, tokens: int):
    from core.files import sha256_file
    from storage.manifests import DatasetManifest, ShardInfo
    from storage.shards import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {"train": [], "validation": []}
    for split, n in (("train", tokens // SHARD_TOKENS), ("validation", 1)):
        for i in range(n):
            doc = rng.integers(1, 50000, SHARD_TOKENS, dtype=np.uint16)
            path = directory / f"{split}-{i:05d}.arrow"
            n_tokens, n_docs = write_shard(path, [doc], "uint16")
            splits[split].append(ShardInfo(path=path.name, n_tokens=n_tokens, n_docs=n_docs,
                                           size=path.stat().st_size, sha256=sha256_file(path)))
    (directory / "tokenizer.json").write_text("{}")
    manifest = DatasetManifest(dataset_id="loaderbench", source="random tokens", tokenizer="tokenizer.json",
                               tokenizer_sha256=sha256_file(directory / "tokenizer.json"), vocab_size=50000,
                               eos_id=0, dtype="uint16", splits=splits, created_at=time.time())
    manifest.save(directory)
    return manifest


def read_epoch(dataset_dir: Path, manifest, step_s: float, max_batches: int,
               cache_dir: Path | None = None) -> dict:
    from training.data import DistributedSampleLoader, TokenStream
    from training.shard_cache import disk_usage

    loader = DistributedSampleLoader(TokenStream(dataset_dir, manifest, "train"), SEQ, MICRO_BATCH,
                                     0, 1, seed=1, shuffle_window_tokens=WINDOW)
    batches = min(max_batches, loader.sources[0].samples // MICRO_BATCH)
    peak_cache, start = 0, time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
        if step_s:
            time.sleep(step_s)  # the device computing: the loader's prefetch runs meanwhile
        if cache_dir is not None:
            peak_cache = max(peak_cache, disk_usage(cache_dir))
    wall = time.perf_counter() - start
    return {"batches": batches, "wall_s": wall, "tokens_per_s": batches * MICRO_BATCH * SEQ / wall,
            "data_wait_share": loader.take_wait_s() / wall, "peak_cache_bytes": peak_cache}


def train_steps(dataset_dir: Path, work: Path, name: str, steps: int) -> dict:
    """`python -m training` (one process) on a ~113M-parameter model for `steps` steps:
    its median step time over the steps after the first two, and its data-wait share."""
    import statistics
    import subprocess

    from core.config import load_config
    from goodput.runs import write_run_config
    from training.metrics import read_metrics

    config = load_config(None, [
        f"run.runs_dir={work / 'runs'}", f"run.run_id={name}", "model.dim=640", "model.n_layers=10",
        "model.n_heads=10", f"model.max_seq_len={SEQ // 8}", f"training.seq_len={SEQ // 8}",
        "training.micro_batch_size=4", f"training.max_steps={steps}", "training.warmup_steps=1",
        f"training.shuffle_window_tokens={WINDOW}", "checkpoint.every_steps=100000",
        "tracking.tensorboard=false", "parallelism.nproc_per_node=1"])
    done = subprocess.run([sys.executable, "-m", "training", "--config", str(write_run_config(config)),
                           "--dataset", str(dataset_dir), "--resume", "none"],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    records = read_metrics(config.run_dir)[2:]
    return {"step_s": statistics.median(r["step_time_s"] for r in records),
            "data_wait_share": sum(r["data_wait_s"] for r in records) / sum(r["window_time_s"] for r in records)}


def order_memory(n: int) -> int:
    from training.data import WindowedShuffle

    tracemalloc.start()
    order = WindowedShuffle(n, 2**28 // SEQ, seed=1)
    for i in range(0, 3 * n, max(1, n // 10_000)):
        order(i)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda s: int(eval(s.replace("^", "**"))), default=2**27)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--step-batches", type=int, default=1500,
                        help="batches read with the simulated step (unthrottled: a whole epoch)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--trainer-steps", type=int, default=0,
                        help="also train a ~113M model this many steps on local files and from S3")
    args = parser.parse_args()

    from core.config import StorageConfig
    from infra.seaweedfs import SeaweedFS
    from storage.store import open_store
    from training.shard_cache import write_cache_settings

    work = args.workdir or Path(tempfile.mkdtemp(prefix="loader-bench-"))
    local = work / "local"
    shutil.rmtree(local, ignore_errors=True)
    manifest = write_dataset(local, args.tokens)
    dataset_bytes = sum(s.size for s in manifest.splits["train"])
    limit = dataset_bytes // 10
    rows = {}
    with SeaweedFS(work / "seaweedfs", access_key="bench", secret_key="bench-secret", bucket="bench") as s3:
        import os

        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret")
        storage = StorageConfig(uri="s3://bench/goodput", endpoint_url=s3.endpoint_url)
        store = open_store(storage.uri, endpoint_url=s3.endpoint_url)
        store.upload_dir(local, "datasets/loaderbench")
        for label, step_s, batches in (("unthrottled, one epoch", 0.0, 2**62),
                                       (f"step {args.step_ms:.0f} ms, {args.step_batches} batches",
                                        args.step_ms / 1000, args.step_batches)):
            rows[f"local, {label}"] = read_epoch(local, manifest, step_s, batches)
            cache = work / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
            manifest.save(cache)
            write_cache_settings(cache, storage, "datasets/loaderbench", limit)
            rows[f"S3 through a cache of 1/10, {label}"] = read_epoch(cache, manifest, step_s, batches, cache)
        trained = {}
        if args.trainer_steps:
            trained["local"] = train_steps(local, work, "local", args.trainer_steps)
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
            manifest.save(cache)
            write_cache_settings(cache, storage, "datasets/loaderbench", limit)
            trained["S3 through a cache of 1/10"] = train_steps(cache, work, "s3", args.trainer_steps)
    print(f"dataset: {args.tokens:,} train tokens in {len(manifest.splits['train'])} shards, "
          f"{dataset_bytes / 2**20:.0f} MiB; cache limit {limit / 2**20:.1f} MiB; seq {SEQ}, "
          f"micro-batch {MICRO_BATCH}, shuffle window {WINDOW:,} tokens\n")
    print("| read | tokens/s | vs local | data-wait share | peak cache (MiB) |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        base = rows[name.replace("S3 through a cache of 1/10", "local")]
        print(f"| {name} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{row['data_wait_share']:.1%} | {row['peak_cache_bytes'] / 2**20:.1f} |")
    if trained:
        print(f"\n~113M-parameter model, one process, seq {SEQ // 8}, micro-batch 4, "
              f"{args.trainer_steps} steps (median step after the first two):\n")
        print("| data | step time (s) | vs local | data-wait share |")
        print("|---|---|---|---|")
        for name, row in trained.items():
            print(f"| {name} | {row['step_s']:.3f} | {trained['local']['step_s'] / row['step_s']:.3f}x | "
                  f"{row['data_wait_share']:.2%} |")
    small, huge = order_memory(1000), order_memory(10**12 // SEQ)
    print(f"\nsample order memory (tracemalloc peak): {small:,} bytes for 1,000 samples, "
          f"{huge:,} bytes for 1T tokens ({10**12 // SEQ:,} samples); a permutation array would "
          f"be {8 * 10**12 // SEQ / 2**30:.1f} GiB")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"rows": rows, "trained": trained, "order_bytes": {"1000": small, "1T_tokens": huge}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
