"""Upload throughput to S3: the store's `upload_dir` against `aws s3 cp --recursive` of the
same files, both to one local SeaweedFS (`weed mini` on loopback).

    python benchmarks/upload_bench.py [--files 4] [--file-mb 125] [--rounds 3] [--aws PATH]

The directory looks like a checkpoint: a few large shards of random bytes (incompressible),
a small `.metadata` and a `manifest.json` listing every file's size and sha256. The two
tools take turns, round after round, so load from other processes hits both alike; the page
cache is warmed first so both read from memory. `upload_dir` is called as the checkpoint
upload calls it (goodput.checkpoints.upload_checkpoint), with the manifest's sha256s, and
includes what it always does: sha256 and CRC32 computed locally while the bytes go out, every
object checked (HEAD) after upload, manifest last. Besides wall time it reports the client's
CPU-seconds per upload (on 2 cores shared with the server, they decide who wins under load)
and the peak memory of a fresh process uploading the directory once. A benchmark: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.seaweedfs import REGION, SeaweedFS  # noqa: E402
from storage.manifests import CheckpointManifest, list_files  # noqa: E402
from storage.store import MiB, open_store  # noqa: E402

BUCKET = "bench"
ACCESS_KEY, SECRET_KEY = "bench-access", "bench-secret"  # a throwaway server's own keys


def make_checkpoint_like(directory: Path, files: int, file_mb: int) -> int:
    """Shards of random bytes, DCP's `.metadata` and a checkpoint manifest of them (hashed
    here, as the trainer does when it commits a checkpoint); returns the total size in bytes."""
    directory.mkdir(parents=True)
    for i in range(files):
        with open(directory / f"__{i}_0.distcp", "wb") as f:
            for _ in range(file_mb):
                f.write(os.urandom(MiB))
    (directory / ".metadata").write_bytes(os.urandom(100 * 1024))
    CheckpointManifest(step=1, tokens_seen=0, files=list_files(directory), world_size=1, layout={},
                       config_hash="bench", dataset_id="bench", model_args={}, created_at=time.time()
                       ).save(directory)
    return sum(p.stat().st_size for p in directory.iterdir())


def store_upload(store, local: Path, prefix: str) -> None:
    """What the checkpoint upload does: the manifest's digests passed to `upload_dir`."""
    known = {f.path: f.sha256 for f in CheckpointManifest.load(local).files}
    store.upload_dir(local, prefix, last=("manifest.json",), known_sha256=known)


def find_aws(given: str | None) -> str:
    """The AWS CLI: --aws, else the one beside this Python (a venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("aws")
    aws = given or (str(beside) if beside.exists() else shutil.which("aws"))
    if aws is None:
        raise SystemExit("no `aws` found; install awscli (pip install awscli) or pass --aws PATH")
    return aws


def aws_upload(aws: str, local: Path, prefix: str, endpoint: str) -> None:
    subprocess.run([aws, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", endpoint,
                    str(local), f"s3://{BUCKET}/{prefix}"], check=True)


def hash_like_upload_dir(local: Path) -> None:
    """The local hashing `upload_dir` does, now while the bytes go out: sha256 and CRC32 (for
    the stored-object check) of every file, 4 files at a time (its default max_workers)."""
    def digest(path: Path) -> None:
        sha256, crc = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while chunk := f.read(8 * MiB):
                sha256.update(chunk)
                crc = zlib.crc32(chunk, crc)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(digest, local.iterdir()))


def timed(fn, cpu: list[float] | None = None) -> float:
    """Wall seconds of `fn()`; appends to `cpu` the CPU-seconds this process and its children
    spent in it."""
    def cpu_s() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
    start, start_cpu = time.perf_counter(), cpu_s()
    fn()
    if cpu is not None:
        cpu.append(cpu_s() - start_cpu)
    return time.perf_counter() - start


def peak_rss_mb_of_one_upload(local: Path, endpoint: str) -> float:
    """Peak RSS of a fresh Python process that opens the store and uploads `local` once: its
    own (training.metrics.peak_resident_bytes), not this process's carried across the exec."""
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
              "from benchmarks.upload_bench import store_upload; from storage.store import open_store; "
              "from training.metrics import peak_resident_bytes; "
              f"store_upload(open_store('s3://{BUCKET}', endpoint_url={endpoint!r}, region={REGION!r}), "
              f"__import__('pathlib').Path({str(local)!r}), 'rss'); "
              "print(peak_resident_bytes())")
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4, help="large shards in the directory")
    parser.add_argument("--file-mb", type=int, default=125, help="MiB per shard")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--aws", help="path of the aws CLI (default: venv's, else PATH's)")
    args = parser.parse_args()
    aws = find_aws(args.aws)
    aws_version = subprocess.run([aws, "--version"], capture_output=True, text=True).stdout.strip()

    # Both tools find the server's keys in the standard variables; nothing else may steer them.
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION)

    with tempfile.TemporaryDirectory(prefix="goodput-upload-bench-") as tmp:
        local = Path(tmp) / "step-00000001"
        total = make_checkpoint_like(local, args.files, args.file_mb)
        for p in local.iterdir():  # warm the page cache: both tools then read from memory
            p.read_bytes()
        with SeaweedFS(Path(tmp) / "weed", access_key=ACCESS_KEY, secret_key=SECRET_KEY, bucket=BUCKET) as server:
            store = open_store(f"s3://{BUCKET}", endpoint_url=server.endpoint_url, region=REGION)
            store_tool, aws_tool, hashing = ("store.upload_dir", "aws s3 cp --recursive",
                                             "(hashing alone, overlapped in upload_dir)")
            times: dict[str, list[float]] = {store_tool: [], aws_tool: [], hashing: []}
            cpu: dict[str, list[float]] = {tool: [] for tool in times}
            load_before = os.getloadavg()[0]
            for r in range(args.rounds):
                times[store_tool].append(timed(lambda: store_upload(store, local, f"store/{r}"), cpu[store_tool]))
                times[aws_tool].append(
                    timed(lambda: aws_upload(aws, local, f"aws/{r}", server.endpoint_url), cpu[aws_tool]))
                times[hashing].append(timed(lambda: hash_like_upload_dir(local), cpu[hashing]))
                for tool in ("store", "aws"):  # both uploaded every file; then free the space
                    assert len(store.list(f"{tool}/{r}")) == args.files + 2, tool
                    store.delete_prefix(f"{tool}/{r}")
            load_after = os.getloadavg()[0]
            peak_rss_mb = peak_rss_mb_of_one_upload(local, server.endpoint_url)

    mb = total / 1e6
    print(f"{args.files} x {args.file_mb} MiB shards + .metadata + manifest.json = {mb:.0f} MB; "
          f"SeaweedFS `weed mini` on loopback; {aws_version}; {args.rounds} rounds, tools alternating; "
          f"1-min load average {load_before:.1f} before, {load_after:.1f} after ({os.cpu_count()} cores)\n")
    print("| tool | per round (s) | median (s) | throughput (MB/s) | client CPU-s, median |")
    print("|---|---|---|---|---|")
    medians = {}
    for tool, ts in times.items():
        medians[tool] = statistics.median(ts)
        print(f"| {tool} | {', '.join(f'{t:.2f}' for t in ts)} | {medians[tool]:.2f} | {mb / medians[tool]:.0f} "
              f"| {statistics.median(cpu[tool]):.2f} |")
    print(f"\nPeak RSS of a process uploading the directory once with the store: {peak_rss_mb:.0f} MB")
    ratio = medians["aws s3 cp --recursive"] / medians["store.upload_dir"]
    print(f"\nThroughput ratio store.upload_dir / aws s3 cp: {ratio:.2f} (target >= 1.0)")


if __name__ == "__main__":
    main()
