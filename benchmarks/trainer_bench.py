"""Trainer throughput: `python -m training` against a bare PyTorch loop, and per layout.

    python benchmarks/trainer_bench.py [--rounds 6] [--steps 30] [--profile 20] [--layouts]
                                       [--device cpu|cuda] [--no-torchrun]

1. One process, the same model, batch, data order, optimizer and LR schedule: tokens/s of
   the trainer (training/train.py's loop as `python -m training` runs it, and the same under
   `torchrun --nproc-per-node 1`, which is how the launch task starts it) over tokens/s of
   a bare loop (forward, backward, clip, AdamW, read the loss). Each runs in a fresh process
   with the same environment. Both are timed the same way: wall-clock between the ends of
   consecutive steps (for the trainer, the timestamps of its own metrics lines, so
   everything the loop does per step counts: metrics, heartbeat, loss guard, preemption
   check), median over the steady steps (the first `--skip` steps and the last, which
   writes the final checkpoint, are left out). Rounds run the variants in turn, the order
   reversed every other round, and the ratio is taken within each round, so machine load
   hits both alike. Target: trainer / bare >= 0.97. The loss of every step must agree
   between the two (same computation), which the table reports, with each variant's
   CPU time and minor page faults (getrusage of the child processes). --profile N adds a
   cProfile of one trainer run: the repository's functions called every step, ms per step.
2. With --layouts: tokens/s per parallelism layout on 2 and 4 processes (torchrun), at one
   global batch (`--global-batch` sequences per step, split over the data-parallel ranks),
   so every row does the same work per step; each worker gets cores / processes threads.

Prints markdown tables; the results belong in benchmarks/RESULTS.md with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 4096
RUN = ["training.warmup_steps=2", "training.log_every=1", "checkpoint.every_steps=100000",
       "checkpoint.async_mode=sync"]


def model_overrides(args) -> list[str]:
    return [f"tokenizer.vocab_size={VOCAB}", f"model.dim={args.dim}", f"model.n_layers={args.layers}",
            f"model.n_heads={args.heads}", f"model.max_seq_len={args.seq}",
            f"training.seq_len={args.seq}"]

# Per world size: name -> parallelism overrides. micro_batch_size is derived from the global
# batch and the data-parallel degree.
LAYOUTS: dict[int, dict[str, list[str]]] = {
    1: {"single": []},
    2: {"ddp": ["dp_replicate=2"],
        "fsdp": ["dp_replicate=1", "dp_shard=2"],
        "tp": ["dp_replicate=1", "tp=2"],
        "pp gpipe": ["dp_replicate=1", "pp=2", "pp_schedule=gpipe"],
        "pp 1f1b": ["dp_replicate=1", "pp=2", "pp_schedule=1f1b"],
        "pp interleaved-1f1b": ["dp_replicate=1", "pp=2", "pp_schedule=interleaved-1f1b"]},
    4: {"ddp": ["dp_replicate=4"],
        "fsdp": ["dp_replicate=1", "dp_shard=4"],
        "hsdp 2x2": ["dp_replicate=2", "dp_shard=2"],
        "tp": ["dp_replicate=1", "tp=4"],
        "fsdp x tp": ["dp_replicate=1", "dp_shard=2", "tp=2"],
        "pp 1f1b": ["dp_replicate=1", "pp=4", "pp_schedule=1f1b"],
        "pp x fsdp": ["dp_replicate=1", "dp_shard=2", "pp=2"],
        "pp x tp": ["dp_replicate=1", "tp=2", "pp=2"]},
}


# -- the measured processes ------------------------------------------------------------------

def write_config(workdir: Path, name: str, *overrides: str):
    """A RunConfig of its own run id (a fresh run directory) written next to it."""
    from core.config import load_config
    from goodput.runs import write_run_config

    config = load_config(None, [f"run.runs_dir={workdir / 'runs'}", f"run.run_id={name}",
                                f"storage.uri={workdir / 'store'}", *RUN, *overrides])
    return config, write_run_config(config)


def worker_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


USAGE: dict[str, list[tuple[float, float, int]]] = {}  # variant -> (user s, sys s, minor faults)


def run(cmd: list[str], env: dict[str, str], usage_key: str | None = None) -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if usage_key:  # whole process, start-up included: compare variants, not absolute values
        USAGE.setdefault(usage_key, []).append((after.ru_utime - before.ru_utime,
                                                after.ru_stime - before.ru_stime,
                                                after.ru_minflt - before.ru_minflt))


def run_trainer(config, config_path: Path, dataset: Path, nproc: int, threads: int,
                torchrun: bool, usage_key: str | None = None) -> list[tuple[float, float]]:
    """(time, loss) per step from the trainer's own metrics lines."""
    from infra.torchrun import free_port
    from training.metrics import read_metrics

    args = ["-m", "training", "--config", str(config_path), "--dataset", str(dataset),
            "--resume", "none"]
    cmd = [sys.executable, *args] if not torchrun else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    run(cmd, worker_env(threads), usage_key)
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == list(range(1, config.training.max_steps + 1)), \
        "expected one metrics line per step"
    return [(r["time"], r["loss"]) for r in records]


def run_bare(config_path: Path, dataset: Path, threads: int, out: Path, variant: str = "bare"
             ) -> list[tuple[float, float]]:
    env = worker_env(threads)
    if "malloc" in variant:  # glibc's thresholds fixed from the start, as the trainer fixes them
        from training.allocator import THRESHOLD_ENV

        env.update(THRESHOLD_ENV)
    run([sys.executable, __file__, "--bare-worker", str(config_path), str(dataset), str(out)],
        env, variant)
    return [tuple(x) for x in json.loads(out.read_text())]


def bare_worker(config_path: str, dataset_dir: str, out: str) -> None:
    """The loop a user would write around the same model, data, optimizer and schedule."""
    import torch

    from core.config import load_config
    from storage.manifests import DatasetManifest
    from training.data import DistributedSampleLoader, TokenStream
    from training.model import Transformer, model_args_from_config
    from training.train import build_optimizer, lr_at

    config = load_config(config_path)
    tcfg, dataset = config.training, Path(dataset_dir)
    device = torch.device("cuda" if config.parallelism.device == "cuda" or (
        config.parallelism.device == "auto" and torch.cuda.is_available()) else "cpu")
    manifest = DatasetManifest.load(dataset)
    torch.manual_seed(tcfg.seed)
    with torch.device(device):  # the trainer's initial weights, drawn where they live
        model = Transformer(model_args_from_config(config.model, manifest.vocab_size), tcfg.seed)
    optimizer = build_optimizer(model, tcfg, device)
    loader = DistributedSampleLoader(TokenStream(dataset, manifest, "train"), tcfg.seq_len,
                                     tcfg.micro_batch_size, 0, 1, tcfg.seed)
    steps = []
    for step in range(1, tcfg.max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tcfg)
        inputs, targets = (t.to(device, non_blocking=True) for t in loader.next_batch())
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append((time.time(), loss.item()))  # a loop logs its loss too
    Path(out).write_text(json.dumps(steps))


def steady_rate(steps: list[tuple[float, float]], tokens_per_step: int, skip: int) -> float:
    """tokens/s of the median step among steps skip+1 .. N-1 (step N writes a checkpoint)."""
    times = [t for t, _ in steps]
    intervals = [b - a for a, b in zip(times[skip - 1:-2], times[skip:-1])]
    return tokens_per_step / statistics.median(intervals)


# -- the two comparisons ---------------------------------------------------------------------

def single_process(workdir: Path, dataset: Path, args) -> None:
    threads = args.threads or os.cpu_count() or 1
    overrides = [*model_overrides(args), f"training.max_steps={args.steps}",
                 f"training.micro_batch_size={args.batch}",
                 f"parallelism.device={args.device}", "parallelism.nproc_per_node=1"]
    variants = (["bare", "trainer"] + ([] if args.no_torchrun else ["trainer (torchrun)"])
                + (["bare (malloc thresholds fixed)"] if args.malloc_variant else []))
    rates: dict[str, list[float]] = {v: [] for v in variants}
    max_loss_diff = 0.0
    tokens = args.batch * args.seq
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        losses = {}
        for v in order:
            config, path = write_config(workdir, f"single-{r}-{v.split()[-1].strip('()')}",
                                        *overrides)
            if v.startswith("bare"):
                steps = run_bare(path, dataset, threads, workdir / f"bare-{r}-{len(v)}.json", v)
            else:
                steps = run_trainer(config, path, dataset, 1, threads, torchrun="torchrun" in v,
                                    usage_key=v)
            rates[v].append(steady_rate(steps, tokens, args.skip))
            losses[v] = [loss for _, loss in steps]
        for v in variants[1:]:
            max_loss_diff = max(max_loss_diff, max(abs(a - b) for a, b in zip(losses["bare"], losses[v])))
        print(f"round {r + 1}: " + ", ".join(f"{v} {rates[v][-1]:,.0f}" for v in variants),
              file=sys.stderr, flush=True)

    print(f"\n### One process: trainer vs bare loop ({args.device}, {threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps, {tokens} tokens/step, {model_text(args)})\n")
    print("| round | bare tok/s | " + " | ".join(f"{v} tok/s | ratio" for v in variants[1:]) + " |")
    print("|---" * (2 * len(variants)) + "|")
    ratios = {v: [t / b for t, b in zip(rates[v], rates["bare"])] for v in variants[1:]}
    for i in range(args.rounds):
        print(f"| {i + 1} | {rates['bare'][i]:,.0f} | " + " | ".join(
            f"{rates[v][i]:,.0f} | {ratios[v][i]:.3f}" for v in variants[1:]) + " |")
    print(f"| median | {statistics.median(rates['bare']):,.0f} | " + " | ".join(
        f"{statistics.median(rates[v]):,.0f} | **{statistics.median(ratios[v]):.3f}**"
        for v in variants[1:]) + " |")
    print(f"\nLargest difference of a step's loss between trainer and bare loop: {max_loss_diff:.2e}")
    print("\nWhole process (start-up included), median per run: "
          + "; ".join(f"{v}: user {statistics.median(u for u, _, _ in USAGE[v]):.1f} s, "
                      f"sys {statistics.median(s for _, s, _ in USAGE[v]):.1f} s, "
                      f"{statistics.median(f for _, _, f in USAGE[v]) / args.steps:,.0f} minor "
                      "page faults/step" for v in variants))


def profile(workdir: Path, dataset: Path, args) -> None:
    """Where the trainer's loop spends its time: cProfile of one single-process run, the
    repository's own functions by cumulative time per step (cProfile inflates Python-heavy
    calls, so read it for what the loop does besides compute, not for exact shares). Only
    functions called at least once per step are shown."""
    import pstats

    threads = args.threads or os.cpu_count() or 1
    config, path = write_config(workdir, "profile", *model_overrides(args),
                                f"training.max_steps={args.steps}",
                                f"training.micro_batch_size={args.batch}",
                                f"parallelism.device={args.device}", "parallelism.nproc_per_node=1")
    out = workdir / "trainer.prof"
    run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "training", "--config", str(path),
         "--dataset", str(dataset), "--resume", "none"], worker_env(threads))
    stats = pstats.Stats(str(out)).stats
    rows = [(cum, calls, f"{Path(file).relative_to(REPO)}:{line} {name}")
            for (file, line, name), (_, calls, _, cum, _) in stats.items()
            if file.startswith(str(REPO)) and "site-packages" not in file and calls >= args.steps]
    print(f"\n### Trainer profile ({args.device}, {args.steps} steps; ms per step, cumulative)\n")
    print("| function | calls/step | ms/step |\n|---|---|---|")
    for cum, calls, where in sorted(rows, reverse=True)[:args.profile]:
        print(f"| `{where}` | {calls / args.steps:.1f} | {1000 * cum / args.steps:.2f} |")


def model_text(args) -> str:
    from training.model import ModelArgs, Transformer

    n = sum(p.numel() for p in Transformer(ModelArgs(VOCAB, args.dim, args.layers, args.heads,
                                                     max_seq_len=args.seq)).parameters())
    return f"dim {args.dim}, {args.layers} layers, {args.heads} heads, seq {args.seq}: {n / 1e6:.1f}M parameters"


def layouts(workdir: Path, dataset: Path, args) -> None:
    from core.config import ConfigError, ParallelismConfig, parse_override

    cores = os.cpu_count() or 1
    print(f"\n### Layouts (cpu, gloo; global batch {args.global_batch} x {args.seq} tokens; "
          f"{args.layout_steps} steps, median of steps {args.skip + 1}..{args.layout_steps - 1}; "
          f"{model_text(args)})\n")
    print("| processes | layout | threads/worker | tokens/s | vs 1 process | loss at last step |")
    print("|---|---|---|---|---|---|")
    reference = None
    for nproc, named in LAYOUTS.items():
        if nproc not in args.world_sizes:
            continue
        threads = max(1, cores // nproc)
        for name, par in named.items():
            if args.layout_names and name not in args.layout_names and nproc > 1:
                continue
            fields = {path[0]: value for path, value in map(parse_override, par)}
            degrees = ParallelismConfig(nproc_per_node=nproc, **fields).degrees()
            dp = degrees["dp_replicate"] * degrees["dp_shard"]
            batch = args.global_batch // dp
            try:
                config, path = write_config(
                    workdir, f"layout-{nproc}-{name.replace(' ', '-')}",
                    *model_overrides(args), f"training.max_steps={args.layout_steps}",
                    f"training.micro_batch_size={batch}",
                    "parallelism.device=cpu", f"parallelism.nproc_per_node={nproc}",
                    *(f"parallelism.{p}" for p in par))
            except ConfigError as e:
                print(f"| {nproc} | {name} | {threads} | not valid for this model | | |")
                print(e, file=sys.stderr)
                continue
            try:
                steps = run_trainer(config, path, dataset, nproc, threads, torchrun=nproc > 1)
            except RuntimeError as e:
                print(f"| {nproc} | {name} | {threads} | failed | | |")
                print(e, file=sys.stderr)
                continue
            rate = steady_rate(steps, args.global_batch * args.seq, args.skip)
            reference = reference or rate
            print(f"| {nproc} | {name} | {threads} | {rate:,.0f} | {rate / reference:.2f} | "
                  f"{steps[-1][1]:.4f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (one process)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (one process)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (one process)")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the one-process runs (default: all cores)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="device of the one-process comparison")
    parser.add_argument("--layouts", action="store_true", help="also measure every layout")
    parser.add_argument("--only-layouts", action="store_true", help="skip the one-process comparison")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layout-steps", type=int, default=20)
    parser.add_argument("--layout-names", nargs="+", help="only these layouts (and the 1-process reference)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step (layouts)")
    parser.add_argument("--malloc-variant", action="store_true",
                        help="also the bare loop with glibc's malloc thresholds fixed (the trainer's setting)")
    parser.add_argument("--no-torchrun", action="store_true",
                        help="leave out the trainer under torchrun (one process)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one trainer run and show its N costliest functions")
    parser.add_argument("--bare-worker", nargs=3, metavar=("CONFIG", "DATASET", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_worker:
        bare_worker(*args.bare_worker)
        return
    import torch

    from tests.helpers import synthetic_dataset

    workdir = Path(tempfile.mkdtemp(prefix="goodput-trainer-bench-"))
    dataset = synthetic_dataset(workdir / "dataset", vocab_size=VOCAB, docs_per_shard=2000)
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} cores"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
          + f"; 1-min load before: {os.getloadavg()[0]:.1f}")
    started = time.time()
    try:
        if not args.only_layouts:
            single_process(workdir, dataset, args)
        if args.profile:
            profile(workdir, dataset, args)
        if args.layouts or args.only_layouts:
            layouts(workdir, dataset, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n1-min load after: {os.getloadavg()[0]:.1f}; {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
