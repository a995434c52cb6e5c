"""Checkpoint stall inside the real trainer: `python -m training` under torchrun, the same
~100M-parameter model, data and steps, with `checkpoint.async_mode` sync, thread and process.

    python benchmarks/trainer_checkpoint_bench.py [--steps 16] [--every 4] [--layout ddp|fsdp]
        [--modes sync thread process] [--repeats 1]
    python benchmarks/trainer_checkpoint_bench.py --uploads [--steps 40] [--every 5]

Per mode: the training time blocked per save (what `metrics.jsonl` records as checkpoint_s:
starting the save, plus waiting for background staging before the next optimizer step),
the ratio of blocking to the synchronous save, and the median step time of steps begun
without and with a background save in flight (`save_in_flight`: writing, or rank 0 hashing
the files for the manifest), whose ratio is the slowdown a background save causes; also
the mean's ratio, the training time the overlapped steps lost per save (also over the saves
after the first, which alone allocates the staging buffers), and the slowdown by the step's
place after the save. Runs the modes one after another in one invocation (`--repeats`: in rounds, taking
turns); prints a markdown table for benchmarks/RESULTS.md.

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

from core.config import load_config  # noqa: E402
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


# The workers' environment as the launcher sets it (infra.torchrun.worker_env): one thread
# each. (The trainer keeps its allocator from returning memory to the OS between steps
# itself, training.allocator: without that, each step of this model faulted ~120k pages in
# again and took 1.25x as long.)
TRAINING_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_mode(root: Path, dataset: Path, mode: str, args, name: str | None = None) -> dict:
    config = bench_config(root, name or mode, mode, args)
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
    # manifest) shared the CPU with it; the others did not. Steps 1-2 warm up.
    began_saving = {r["step"] + 1 for r in records if r.get("save_in_flight")}
    quiet = [r["step_time_s"] for r in records if r["step"] > 2 and r["step"] not in began_saving]
    during = [r for r in records if r["step"] in began_saving]
    size = sum(f.stat().st_size for f in (config.run_dir / "checkpoints" / f"step-{args.every:08d}").iterdir())
    shutil.rmtree(config.run_dir / "checkpoints")
    quiet_s = statistics.median(quiet) if quiet else None
    result = {"stalls": stalls, "step_s": quiet_s, "steps_during": len(during), "bytes": size,
              "during_s": statistics.median([r["step_time_s"] for r in during]) if during else None}
    if during and quiet_s:
        extra = sum(r["step_time_s"] - quiet_s for r in during)
        result.update(
            slowdown=result["during_s"] / quiet_s,
            mean_slowdown=statistics.mean(r["step_time_s"] for r in during) / quiet_s,
            # What a save costs training beyond its stall: the steps it overlapped took this
            # much longer than quiet steps, per save.
            lost_per_save_s=extra / len(saves),
            # The k-th step after a save, over the quiet median: where in the write the cost is.
            by_position={k: statistics.median(by_step[s + k]["step_time_s"] for s in saves
                                              if s + k in began_saving) / quiet_s
                         for k in range(1, args.every + 1)
                         if any(s + k in began_saving for s in saves)})
        # The same without the run's first save, which also allocates (and the machine first
        # backs) the staging buffers every later save reuses: what each save of a long run costs.
        later = [r for r in during if r["step"] > saves[0] + args.every]
        if later:
            result.update(later_mean_slowdown=statistics.mean(r["step_time_s"] for r in later) / quiet_s,
                          later_lost_per_save_s=sum(r["step_time_s"] - quiet_s for r in later)
                          / (len(saves) - 1))
    return result


def spread(values: list[float], fmt: str, unit: str = "") -> str:
    """`median [min–max]` of per-run figures (the single figure for one run)."""
    if not values:
        return "–"
    median, low, high = (format(v, fmt) + unit for v in (statistics.median(values), min(values), max(values)))
    return median if len(values) == 1 else f"{median} [{low}–{high}]"


def modes_table(runs: dict[str, list[dict]]) -> str:
    """Per mode, over its runs: stalls against the synchronous save's, and the slowdown of
    the steps a background save overlapped against the same run's quiet steps."""
    base = statistics.median(s for r in runs["sync"] for s in r["stalls"]) if "sync" in runs else None
    lines = ["| checkpoint.async_mode | runs | median stall (s) | vs sync | step time without save (s) "
             "| steps begun during a save, per run | slowdown, median step | slowdown, mean step "
             "| training time lost per save beyond the stall (s) | saves after the first: slowdown, "
             "mean step; lost per save (s) | k-th step after the save / quiet |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, rs in runs.items():
        stall = statistics.median(s for r in rs for s in r["stalls"])
        timed = [r for r in rs if "slowdown" in r]
        cells = [mode, str(len(rs)), f"{stall:.3f}", "–" if base is None else f"{stall / base:.3f}",
                 spread([r["step_s"] for r in rs if r["step_s"]], ".3f"),
                 spread([r["steps_during"] for r in rs], "g")]
        if timed:
            positions = sorted({k for r in timed for k in r["by_position"]})
            cells += [spread([r["slowdown"] for r in timed], ".2f", "x"),
                      spread([r["mean_slowdown"] for r in timed], ".2f", "x"),
                      spread([r["lost_per_save_s"] for r in timed], ".2f"),
                      spread([r["later_mean_slowdown"] for r in timed if "later_mean_slowdown" in r],
                             ".2f", "x") + "; " +
                      spread([r["later_lost_per_save_s"] for r in timed if "later_lost_per_save_s" in r],
                             ".2f"),
                      ", ".join(f"{k}: {statistics.median(r['by_position'][k] for r in timed if k in r['by_position']):.2f}"
                                for k in positions)]
        else:
            cells += ["–"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        "\n\nPer run: the slowdown is the median (or mean) step time of the steps begun with a save "
        "in flight over the median of that run's other steps; a cell with several runs gives "
        "the median over runs [lowest–highest]. The last column is the median over runs. The "
        "run's first save also allocates the staging buffers that later saves reuse.")


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
    process's session (the local launcher does not: see core.cpu_priority on autogroups).
    Returns, per arm, the step times of the steps that ran during an upload (a step counts
    as during an upload when the middle of its compute falls inside it; all steps for the
    arm without uploads) and the uploads' durations."""
    from benchmarks.upload_bench import ACCESS_KEY, BUCKET, SECRET_KEY
    from core.cpu_priority import BACKGROUND_NICE
    from infra.seaweedfs import REGION, SeaweedFS

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
    from core.cpu_priority import at_background_priority
    from infra.seaweedfs import REGION
    from storage.manifests import CheckpointManifest
    from storage.store import open_store

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
                for path in config.run_dir.committed_checkpoints():
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
    parser.add_argument("--modes", nargs="+", choices=("sync", "thread", "process"),
                        default=["sync", "thread", "process"])
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the modes, taking turns (report median and range over rounds)")
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
    # The modes take turns, each round starting one later, so that a drift in the machine's
    # load spreads over them instead of falling on one.
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for round_ in range(args.repeats):
        for i in range(len(args.modes)):
            mode = args.modes[(round_ + i) % len(args.modes)]
            runs[mode].append(run_mode(root, dataset, mode, args, name=f"{mode}-{round_}"))
            print(f"[bench] round {round_ + 1}/{args.repeats}: {mode} done; load "
                  f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    size = next(iter(runs.values()))[0]["bytes"]
    print(f"\n{device}, {args.nproc} worker(s), layout {args.layout}, {args.steps} steps, a save every "
          f"{args.every}; checkpoint {size / 1e9:.2f} GB; {args.repeats} round(s); load "
          f"{os.getloadavg()[0]:.1f}\n")
    print(json.dumps(runs), file=sys.stderr)  # first: an error in the table loses no run
    print(modes_table(runs))


if __name__ == "__main__":
    main()
