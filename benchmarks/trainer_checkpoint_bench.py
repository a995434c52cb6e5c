"""Checkpoint stall inside the real trainer: `python -m training` under torchrun, the same
~100M-parameter model, data and steps, with `checkpoint.async_mode` sync, thread and process.

    python benchmarks/trainer_checkpoint_bench.py [--steps 16] [--every 4] [--layout ddp|fsdp]
    python benchmarks/trainer_checkpoint_bench.py --uploads [--steps 40] [--every 5]

Per mode: the training time blocked per save (what `metrics.jsonl` records as checkpoint_s:
starting the save, plus waiting for background staging before the next optimizer step),
the ratio of blocking to the synchronous save, and the median step time of steps begun
without and with a background save in flight (`save_in_flight`: writing, or rank 0 hashing
the files for the manifest), whose ratio is the slowdown a background save causes. Runs the
modes one after another in one invocation; prints a markdown table for benchmarks/RESULTS.md.

`--uploads`: the step-time slowdown while checkpoints upload to S3 (SeaweedFS): a training
run without uploads, one uploading at background priority and one at normal priority, in
one invocation (see run_with_uploads).
A benchmark, not a test: nothing here asserts a target.
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
import time
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


def bench_config(root: Path, name: str, mode: str, args):
    return load_config(None, [
        f"run.runs_dir={root / 'runs'}", f"run.run_id=bench-{name}", f"storage.uri={root / 'store'}",
        # ~100M parameters, as in checkpoint_bench.py: 12 layers of width 640, 32k vocabulary.
        "model.dim=640", "model.n_layers=12", "model.n_heads=10", "model.max_seq_len=128",
        "training.seq_len=128", f"training.max_steps={args.steps}",
        "training.warmup_steps=2", f"checkpoint.every_steps={args.every}",
        f"checkpoint.async_mode={mode}", f"parallelism.nproc_per_node={args.nproc}",
        f"training.micro_batch_size={args.micro_batch}", *LAYOUTS[args.layout]])


def training_command(config, dataset: Path, args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "training",
            "--config", str(write_run_config(config)), "--dataset", str(dataset), "--resume", "none"]


TRAINING_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_mode(root: Path, dataset: Path, mode: str, args) -> dict:
    config = bench_config(root, mode, mode, args)
    proc = subprocess.run(training_command(config, dataset, args), capture_output=True, text=True,
                          cwd=REPO, env=TRAINING_ENV)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = read_metrics(config.run_dir)
    saves = [r["step"] for r in records if r["step"] % args.every == 0 and r["step"] < args.steps]
    # A save's stall: its own step's checkpoint_s plus the staging wait the step after records.
    by_step = {r["step"]: r for r in records}
    stalls = [by_step[s]["checkpoint_s"] + by_step.get(s + 1, {}).get("checkpoint_s", 0.0)
              for s in saves]
    # A step that began with a background save in flight (writing, or rank 0 hashing for the
    # manifest) shared the CPU with it; the others did not.
    began_saving = {r["step"] + 1 for r in records if r.get("save_in_flight")}
    quiet = [r["step_time_s"] for r in records if r["step"] > 2 and r["step"] not in began_saving]
    during = [r["step_time_s"] for r in records if r["step"] in began_saving]
    size = sum(f.stat().st_size for f in (config.run_dir / "checkpoints" / f"step-{args.every:08d}").iterdir())
    shutil.rmtree(config.run_dir / "checkpoints")
    return {"stalls": stalls, "step_s": statistics.median(quiet) if quiet else None,
            "during_s": statistics.median(during) if during else None, "steps_during": len(during),
            "bytes": size}


UPLOAD_ARMS = {"none": None, "background (idle class, nice 19)": True, "normal (nice 0)": False}


def run_with_uploads(root: Path, dataset: Path, args) -> dict:
    """One training run per arm, with synchronous saves (nothing of the save runs beside
    training): without uploads, then with this process uploading each committed checkpoint
    to SeaweedFS as the train flow does (`upload_dir` with the manifest's digests, manifest
    last), at background priority (what goodput.checkpoints.upload_checkpoint does), then
    at normal priority. A run per arm, because an upload at background priority takes the
    idle cycles of many steps: within one run it leaves too few steps without an upload.

    SeaweedFS stands for a remote store, whose CPU is not the training node's: it runs at
    nice 19 (its threads and its autogroup) in every arm. Training is started in this
    process's session (the local launcher does not: see storage.background on autogroups).
    Returns, per arm, the step times of the steps that ran during an upload (a step counts
    as during an upload when the middle of its compute falls inside it; all steps for the
    arm without uploads) and the uploads' durations."""
    from benchmarks.upload_bench import ACCESS_KEY, BUCKET, SECRET_KEY
    from infra.seaweedfs import REGION, SeaweedFS
    from storage.background import BACKGROUND_NICE

    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                      AWS_DEFAULT_REGION=REGION)  # a throwaway server's own keys
    with SeaweedFS(root / "weed", bucket=BUCKET, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as server:
        # The server runs in a session of its own, so on a kernel with autogroups (this one)
        # its threads' nice values would not count against training's: the autogroup's does.
        autogroup = Path(f"/proc/{server.pid}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(BACKGROUND_NICE))
        for task in Path(f"/proc/{server.pid}/task").iterdir():
            os.setpriority(os.PRIO_PROCESS, int(task.name), BACKGROUND_NICE)
        return {arm: train_while_uploading(root, dataset, args, server, background)
                for arm, background in UPLOAD_ARMS.items()}


def train_while_uploading(root: Path, dataset: Path, args, server, background: bool | None) -> dict:
    """One training run; each checkpoint it commits is uploaded at once (`background`: at
    background priority; None: not uploaded)."""
    from benchmarks.upload_bench import BUCKET, store_upload
    from infra.seaweedfs import REGION
    from storage.background import at_background_priority
    from storage.manifests import CheckpointManifest
    from storage.store import open_store
    from training.checkpoint import committed_checkpoints

    name = {None: "none", True: "background", False: "normal"}[background]
    config = bench_config(root, f"uploads-{name}", "sync", args)
    uploads: list[dict] = []
    with open(root / f"uploads-{name}-training.log", "w") as log:
        proc = subprocess.Popen(training_command(config, dataset, args), stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO, env=TRAINING_ENV)
        uploaded: set[str] = set()
        try:
            while background is not None:
                running = proc.poll() is None
                for path in committed_checkpoints(config.run_dir):
                    if path.name in uploaded:
                        continue
                    uploaded.add(path.name)
                    run = at_background_priority if background else (lambda fn, *a, **k: fn(*a, **k))
                    # A store of its own per upload: its transfer threads start at the
                    # priority of the upload that first uses them.
                    store = open_store(f"s3://{BUCKET}", endpoint_url=server.endpoint_url, region=REGION)
                    start = time.time()
                    run(store_upload, store, path, f"up/{path.name}")
                    uploads.append({"start": start, "end": time.time(), "during_training": running,
                                    "bytes": sum(f.size for f in CheckpointManifest.load(path).files)})
                    store.delete_prefix(f"up/{path.name}")
                if not running:
                    break
                time.sleep(0.2)
            proc.wait()
        except BaseException:  # an upload that failed ends the benchmark, and training with it
            proc.terminate()  # torchrun passes SIGTERM on to its workers
            proc.wait()
            raise
    if proc.returncode != 0:
        raise SystemExit(f"training ({name}) failed; see {log.name}")
    steps = []
    for r in read_metrics(config.run_dir):
        if r["step"] <= 2:
            continue
        compute_end = r["time"] - r["checkpoint_s"]  # a synchronous save ends its step
        middle = compute_end - r["step_time_s"] / 2
        if background is None or any(u["start"] <= middle <= u["end"] for u in uploads):
            steps.append(r["step_time_s"])
    shutil.rmtree(config.run_dir / "checkpoints")
    return {"steps": steps, "uploads": uploads}


def upload_table(result: dict) -> str:
    quiet = result["none"]["steps"]
    lines = ["| upload priority (a training run each) | uploads (during training) | upload time (s) | "
             "MB/s | steps during uploads | their step time, median (s) | mean (s) | slowdown (mean) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in result.items():
        uploads, steps = r["uploads"], r["steps"]
        cells = [arm, "–", "–", "–"]
        if uploads:
            cells[1:] = [f"{len(uploads)} ({sum(u['during_training'] for u in uploads)})",
                         ", ".join(f"{u['end'] - u['start']:.1f}" for u in uploads),
                         f"{statistics.median([u['bytes'] / 1e6 / (u['end'] - u['start']) for u in uploads]):.0f}"]
        cells.append(str(len(steps)))
        cells += (["–", "–", "–"] if not steps else
                  [f"{statistics.median(steps):.3f}", f"{statistics.mean(steps):.3f}",
                   f"{statistics.mean(steps) / statistics.mean(quiet):.2f}x"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        "\n\nA step counts as during an upload when the middle of its compute falls inside it; "
        "in the run without uploads, every step counts. Steps 1-2 (warm-up) are left out.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ddp")
    parser.add_argument("--nproc", type=int, default=2, help="workers (1 per GPU on a GPU machine)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    parser.add_argument("--uploads", action="store_true",
                        help="only the upload runs: synchronous saves, each checkpoint uploaded to "
                             "SeaweedFS during training; no uploads, background and normal priority")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="trainer-ckpt-bench-"))
    dataset = synthetic_dataset(root / "dataset", vocab_size=32000, docs_per_shard=400)
    if args.uploads:
        result = run_with_uploads(root, dataset, args)
        print(f"\nCPU (gloo), {args.nproc} worker(s), layout {args.layout}, {args.steps} steps, a "
              f"save every {args.every}; load {os.getloadavg()[0]:.1f}\n")
        print(upload_table(result))
        print(json.dumps(result), file=sys.stderr)
        return
    results = {mode: run_mode(root, dataset, mode, args) for mode in ("sync", "thread", "process")}
    base = statistics.median(results["sync"]["stalls"])
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    print(f"\n{device}, {args.nproc} worker(s), layout {args.layout}, {args.steps} steps, a save every {args.every}; checkpoint "
          f"{results['sync']['bytes'] / 1e9:.2f} GB; load {os.getloadavg()[0]:.1f}\n")
    print("| checkpoint.async_mode | stall per save (s) | median stall (s) | vs sync | "
          "step time without save (s) | steps begun during a save | their step time (s) | slowdown |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        median = statistics.median(r["stalls"])
        step_s = "–" if r["step_s"] is None else f"{r['step_s']:.3f}"
        during = ("– | –" if r["during_s"] is None or r["step_s"] is None else
                  f"{r['during_s']:.3f} | {r['during_s'] / r['step_s']:.2f}x")
        print(f"| {mode} | {', '.join(f'{s:.3f}' for s in r['stalls'])} | {median:.3f} | "
              f"{median / base:.3f} | {step_s} | {r['steps_during']} | {during} |")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
