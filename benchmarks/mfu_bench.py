"""MFU of the real trainer on one GPU (issue 3): a GPT-2-124M-sized and a ~1B model.

    python benchmarks/mfu_bench.py --sizes gpt2-124m 1b --out $OUT/mfu.json      # one H100
    python benchmarks/mfu_bench.py --sizes tiny --device cpu --no-compile --steps 4   # CPU smoke

For each size: a synthetic dataset in the trainer's on-disk format (tests.helpers'
counting sequences, so no tokenizer is trained or downloaded),
a RunConfig, and one training attempt started exactly as the train task starts one
(infra.torchrun.run_attempt: `torchrun --nproc-per-node 1 -m training`, supervised, its exit
classified), then the run's metrics.jsonl is read back. Reported per size:

- tokens/s: tokens per step / the median wall-clock interval between consecutive steps'
  metrics records, over the steps after --warmup-steps (the first includes compilation).
  Each interval is a whole loop iteration (everything the trainer does per step counts).
  The trainer's own figure (its step timer, which leaves out the few host operations
  between two steps) is reported beside it as trainer_tokens_per_s.
- MFU = (6 x N_non_embedding + 12 x layers x heads x head_dim x seq) x tokens/s / peak, the
  formula of issue 3; N_non_embedding is every parameter but the input embedding table
  (the output projection is a matmul and counts), as in Transformer.flops_per_token,
  which the bench checks against the formula. peak = 989e12 FLOP/s (H100 SXM, dense bf16,
  as issue 3 sets; --peak-flops to change), whatever the device.
- peak GPU memory (torch.cuda.max_memory_allocated, logged by the trainer on CUDA), step
  time, first and last loss.
- which kernel scaled_dot_product_attention picks for the model's attention at the run's
  shapes and dtype (the aten op seen by the profiler), and whether the model's attention
  call runs with only the flash backend allowed: a low MFU can then be told apart from a
  fallback to the math kernel.

A size that fails (out of memory, a bad option, a crash, the time budget) is reported with
its failure class and reason, and the bench goes on with the next. Out of memory at a
size's default micro-batch is retried once at half of it. The JSON is rewritten after each
size, and progress is printed as it happens, so a run cut short still says what it got.

On a machine whose Python lacks the trainer's dependencies (the lent GPU machines have no
pydantic nor boto3), wheels found in .goodput/wheels (scripts/gpu_wheels.sh) are installed
into a temporary folder first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H100_PEAK = 989e12  # dense bf16 FLOP/s, H100 SXM: the peak issue 3 divides by
# The trainer's imports beyond torch (storage/ imports boto3 when imported).
NEEDED = ("numpy", "pyarrow", "yaml", "pydantic", "boto3")
WHEELS = REPO / ".goodput" / "wheels"


@dataclass(frozen=True)
class Size:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    seq_len: int
    micro_batch: int  # default sequences per step; --micro-batch overrides
    ffn_multiple_of: int = 256  # Llama's rounding of the SwiGLU width


SIZES = {
    # GPT-2 small's shape: 12 x 768, 12 heads, its vocabulary padded to a multiple of 64.
    # SwiGLU at 2/3 x 4 x 768 = 2048 wide has as many weights as GPT-2's 4 x 768 MLP.
    # Micro-batch 64 (as llm.c's runs): on an H200, 44.7% MFU against 40.6% at 32, the
    # step's fixed host work spread over twice the tokens; 34 GiB (RESULTS, 30 Nov).
    "gpt2-124m": Size(dim=768, n_layers=12, n_heads=12, vocab_size=50304, seq_len=1024,
                      micro_batch=64),
    # Llama-style ~1B: 18 x 2048, 16 heads of 128, SwiGLU 5632, Llama 2's vocabulary.
    "1b": Size(dim=2048, n_layers=18, n_heads=16, vocab_size=32000, seq_len=2048, micro_batch=8),
    # For the CPU smoke test.
    "tiny": Size(dim=64, n_layers=2, n_heads=4, vocab_size=512, seq_len=64, micro_batch=4,
                 ffn_multiple_of=32),
}


def say(message: str) -> None:
    print(f"[mfu-bench] {message}", flush=True)


# -- this machine's Python --------------------------------------------------------------------

def ensure_packages(wheels: Path) -> None:
    """Make the trainer's dependencies importable here and in the workers it starts."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if not missing:
        return
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        sys.exit(f"[mfu-bench] this Python ({sys.executable}) lacks {', '.join(missing)}, which "
                 f"the trainer imports, and {wheels} holds no wheels. Where PyPI is reachable run "
                 "`bash scripts/gpu_wheels.sh` and bring .goodput/wheels along (device: carry it).")
    site = Path(tempfile.gettempdir()) / f"goodput-site-py{sys.version_info[0]}{sys.version_info[1]}"
    say(f"this Python lacks {', '.join(missing)}: installing {len(found)} wheels from {wheels} "
        f"into {site}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-compile", "--disable-pip-version-check", "--upgrade", "--target", str(site),
                    *map(str, found)], check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH"))
                                               if p)  # for the workers
    importlib.invalidate_caches()
    still = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if still:
        sys.exit(f"[mfu-bench] still missing after installing the wheels: {', '.join(still)}")


# -- model arithmetic -------------------------------------------------------------------------

def model_facts(model_cfg, vocab_size: int, seq_len: int) -> dict:
    """Parameter counts and training FLOPs per token of the model a config trains: by issue
    3's formula and by the model's own flops_per_token (built on the meta device: nothing is
    allocated)."""
    import torch

    from training.model import Transformer, model_args_from_config

    args = model_args_from_config(model_cfg, vocab_size)
    with torch.device("meta"):
        model = Transformer(args)
    non_embedding = model.num_params()
    formula = 6 * non_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
            "head_dim": args.head_dim, "ffn_hidden": args.ffn_hidden, "vocab_size": args.vocab_size,
            "seq_len": seq_len, "params_total": model.num_params(non_embedding=False),
            "params_non_embedding": non_embedding, "flops_per_token": formula,
            "model_flops_per_token": model.flops_per_token(seq_len),
            "formula_matches_model": formula == model.flops_per_token(seq_len)}


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    return flops_per_token * tokens_per_s / peak


# -- data -------------------------------------------------------------------------------------

def token_dataset(directory: Path, vocab_size: int, n_tokens: int) -> Path:
    """A prepared dataset with at least `n_tokens` training tokens, no tokenizer needed: the
    tests' synthetic one (counting sequences of 40-120 ids over the vocabulary, two train
    shards, uint16 ids: vocabularies up to 65,536), sized for the run. The ids' values cost the model nothing: throughput is what
    is measured."""
    from storage.manifests import DATASET_MANIFEST
    from tests.helpers import synthetic_dataset

    if (directory / DATASET_MANIFEST).is_file():
        return directory
    return synthetic_dataset(directory, vocab_size, docs_per_shard=math.ceil(n_tokens / 2 / 40))


# -- attention kernel -------------------------------------------------------------------------

def attention_check(spec: dict) -> dict:
    """The model's attention call at the run's shapes, as the trainer runs it (bf16 autocast
    on CUDA): which SDPA kernel it gets by default, and whether flash alone can run it."""
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from training.model import Attention, ModelArgs, rope_cache

    device = torch.device(spec["device"])
    args = ModelArgs(vocab_size=2, dim=spec["dim"], n_heads=spec["n_heads"], n_layers=1,
                     n_kv_heads=spec["n_kv_heads"], max_seq_len=spec["seq_len"])
    attention = Attention(args).to(device)
    cos, sin = (t.to(device) for t in rope_cache(args.head_dim, spec["seq_len"], args.rope_theta))
    x = torch.randn(spec["batch"], spec["seq_len"], args.dim, device=device, requires_grad=True)

    def forward_backward():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=spec["autocast"]):
            out = attention(x, cos, sin)
        out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    forward_backward()  # warm-up
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward()
    ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::")
                  and ("scaled_dot_product" in e.name or "attention" in e.name)})
    kinds = [("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "mem-efficient"),
             ("math", "math")]
    default = next((name for key, name in kinds if any(key in op for op in ops)), "unknown")
    result = {"shape": [spec["batch"], args.n_heads, spec["seq_len"], args.head_dim],
              "autocast_bf16": spec["autocast"], "sdpa_ops": ops, "default_backend": default}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                forward_backward()
            result["flash"] = "ok"
        except RuntimeError as e:
            why = [str(w.message).splitlines()[0] for w in caught][:4]
            result["flash"] = f"failed: {str(e).splitlines()[0]}" + (f" ({'; '.join(why)})" if why else "")
    return result


def run_attention_check(spec: dict, timeout_s: float) -> dict:
    """attention_check in a process of its own (the bench itself never touches the GPU)."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--attention-worker", json.dumps(spec)],
                              capture_output=True, text=True, cwd=REPO, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"attention check timed out after {timeout_s:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("ATTENTION "):
            return json.loads(line.removeprefix("ATTENTION "))
    return {"error": f"attention check exited {proc.returncode}: "
                     f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}"}


# -- one size ---------------------------------------------------------------------------------

class BudgetExceeded(Exception):
    pass


def _on_alarm(signum, frame):
    raise BudgetExceeded()


def total_steps(args) -> int:
    """The warm-up and measured steps, then with --profile N a step to warm the profiler up
    and N profiled steps (after the measured ones: the profiler slows the steps it records)."""
    return args.warmup_steps + args.steps + (1 + args.profile if args.profile else 0)


def profiled_steps(args) -> tuple[int, int] | None:
    first = args.warmup_steps + args.steps + 2
    return (first, first + args.profile - 1) if args.profile else None


def config_overrides(run_id: str, size: Size, seq_len: int, micro_batch: int, args, workdir: Path,
                     startup_s: float) -> list[str]:
    max_steps = total_steps(args)
    profile = profiled_steps(args)
    return [
        f"run.runs_dir={workdir / 'runs'}", f"run.run_id={run_id}",
        f"storage.uri={workdir / 'store'}", f"data.data_dir={workdir / 'data'}",
        # The supervisor's allowances: compilation happens before the first step; a step
        # may recompile. The bench's own time budget bounds both.
        f"run.startup_timeout_s={max(1.0, startup_s)}", "run.hang_min_s=300",
        f"model.dim={size.dim}", f"model.n_layers={size.n_layers}", f"model.n_heads={size.n_heads}",
        f"model.ffn_multiple_of={size.ffn_multiple_of}", f"model.max_seq_len={seq_len}",
        f"training.seq_len={seq_len}", f"training.micro_batch_size={micro_batch}",
        f"training.max_steps={max_steps}", f"training.warmup_steps={min(10, max_steps - 1)}",
        "training.lr=3e-4", "training.log_every=1",  # a record per step: its time is the clock
        f"training.peak_flops_per_device={args.peak_flops}",
        "faults.spike_factor=null",  # no loss-spike rollbacks in a benchmark
        "faults.emergency_save_s=5",  # stopped by the time budget: no emergency checkpoint
        f"parallelism.device={args.device}", "parallelism.nnodes=1", "parallelism.nproc_per_node=1",
        f"parallelism.compile={str(args.compile).lower()}",
        f"parallelism.mixed_precision={args.mixed_precision}",
        "checkpoint.every_steps=1000000000", "checkpoint.save_at_end=false",
        "checkpoint.async_mode=sync", "launch.kind=local", "launch.max_restarts=0",
        *([f"profiling.steps={args.profile}", f"profiling.start_step={profile[0]}"] if profile else []),
        *args.set,
    ]


def summarize(records: list[dict], warmup: int, tokens_per_step: int, flops_per_token: float,
              peak: float, last: int | None = None) -> dict:
    """Figures over the steps after the warm-up, up to `last` (each needs the record of the
    step before)."""
    by_step = {r["step"]: r for r in records}
    measured = [s for s in sorted(by_step) if s > warmup and s - 1 in by_step
                and (last is None or s <= last)]
    out: dict = {"steps_logged": len(by_step), "steps_measured": len(measured)}
    if by_step:
        first, last = by_step[min(by_step)], by_step[max(by_step)]
        out |= {"loss_first": first["loss"], "loss_last": last["loss"]}
        memory = [r["max_memory_allocated_gb"] for r in records if "max_memory_allocated_gb" in r]
        out["max_memory_allocated_gb"] = max(memory) if memory else None
    if not measured:
        return out
    step_s = statistics.median(by_step[s]["time"] - by_step[s - 1]["time"] for s in measured)
    tokens_per_s = tokens_per_step / step_s
    trainer_tokens_per_s = statistics.median(by_step[s]["tokens_per_s"] for s in measured)
    return out | {
        "step_time_s": step_s, "tokens_per_s": tokens_per_s,
        "mfu": mfu(flops_per_token, tokens_per_s, peak),
        "trainer_step_time_s": statistics.median(by_step[s]["step_time_s"] for s in measured),
        "trainer_tokens_per_s": trainer_tokens_per_s,
        "trainer_mfu": mfu(flops_per_token, trainer_tokens_per_s, peak)}


def run_size(name: str, args, workdir: Path, deadline: float, index: int = 0,
             micro_batch: int | None = None) -> dict:
    """Measure one size (the index-th of the command line: its own run directory); never
    raises for a failure of the size itself."""
    from core.config import ConfigError, load_config
    from goodput.runs import write_run_config
    from training.metrics import read_metrics

    if name not in SIZES:
        return {"size": name, "status": "failed", "failure_class": "config",
                "error": f"unknown size {name!r}; known: {', '.join(SIZES)}"}
    size = SIZES[name]
    seq_len = args.seq_len or size.seq_len
    micro_batch = micro_batch or args.micro_batch or size.micro_batch
    row: dict = {"size": name, "status": "failed", "micro_batch": micro_batch,
                 "compile": args.compile, "device": args.device,
                 "warmup_steps": args.warmup_steps, "steps": args.steps}
    started = time.monotonic()
    if started > deadline - 5:
        return row | {"status": "skipped", "failure_class": "budget",
                      "error": f"the time budget (--budget-s {args.budget_s:.0f}) was used up "
                               "before this size"}
    try:
        run_id = f"mfu-{index}-{name}-mb{micro_batch}{'' if args.compile else '-eager'}"
        config = load_config(None, config_overrides(run_id, size, seq_len, micro_batch, args, workdir,
                                                    deadline - time.monotonic()))
    except (ConfigError, ValueError) as e:
        return row | {"failure_class": "config", "error": str(e)}
    # From the config, so that --set overrides count.
    tcfg, seq_len = config.training, config.training.seq_len
    row |= {"micro_batch": tcfg.micro_batch_size, "grad_accum_steps": tcfg.grad_accum_steps,
            "tokens_per_step": tcfg.tokens_per_rank_step}
    row["model"] = facts = model_facts(config.model, size.vocab_size, seq_len)
    row["mixed_precision"] = ("bf16 autocast" if args.device == "cuda"
                              and config.parallelism.mixed_precision != "fp32" else "fp32")
    say(f"{name}: {facts['params_non_embedding']:,} non-embedding parameters "
        f"({facts['params_total']:,} in all), seq {seq_len}, micro-batch {micro_batch}, "
        f"{facts['flops_per_token'] / 1e9:.3f} GFLOP/token, {row['tokens_per_step']:,} tokens/step, "
        f"compile {args.compile}, "
        f"{row['mixed_precision']}")

    if args.attention_check:
        row["attention"] = run_attention_check(
            {"device": args.device, "dim": config.model.dim, "n_heads": config.model.n_heads,
             "n_kv_heads": config.model.n_kv_heads, "seq_len": seq_len,
             "batch": tcfg.micro_batch_size, "autocast": row["mixed_precision"] != "fp32"},
            timeout_s=max(1.0, min(180.0, deadline - time.monotonic())))
        say(f"{name}: attention {json.dumps(row['attention'])}")

    max_steps = total_steps(args)
    dataset = token_dataset(workdir / "data" / run_id, size.vocab_size,
                            (max_steps + 1) * tcfg.tokens_per_rank_step + 1)
    config_path = write_run_config(config)
    if args.workdir is not None:  # otherwise removed at the end
        row["run_dir"] = str(config.run_dir)

    result = launch(config, config_path, dataset, args, deadline, name, max_steps)
    row["wall_s"] = time.monotonic() - started
    row |= summarize(read_metrics(config.run_dir), args.warmup_steps, row["tokens_per_step"],
                     facts["flops_per_token"], args.peak_flops,
                     last=args.warmup_steps + args.steps)
    if profiled_steps(args) is not None:
        row["profile"] = profile_summary(config.run_dir, *profiled_steps(args), name, args.out)
    if result["class"] == "done" and "mfu" in row:
        row["status"] = "ok"
    else:
        row |= {"failure_class": result["class"], "error": result["reason"]}
        if result["class"] == "done":
            row |= {"failure_class": "no_measure", "error": "no step after the warm-up was logged"}
    return row


def profile_summary(run_dir, first: int, last: int, name: str, out: Path | None) -> dict:
    """Rank 0's profile of steps first..last (training.profiling): its top operators by self
    time, and its trace copied beside --out (the device's $OUT brings it back)."""
    from training.profiling import read_top

    directory = run_dir.profile_dir(first, last)
    if not (directory / "rank0.top.json").is_file():
        return {"steps": [first, last], "error": f"no profile in {directory}: the run ended first"}
    top = read_top(directory)
    summary = {"steps": top["steps"], "time": top["time"], "top": top["operators"][:20]}
    trace = directory / "rank0.trace.json.gz"
    if out is not None:
        copy = out.parent / f"{out.stem}-{name}-rank0.trace.json.gz"
        shutil.copyfile(trace, copy)
        summary["trace"] = str(copy)
    say(f"{name}: profile of steps {first}-{last}, by self {top['time']} time: " + ", ".join(
        f"{row['name']} {row['self_share']:.1%}" for row in top["operators"][:8]))
    return summary


def guarded(measure, name: str, *args, **kwargs) -> dict:
    """A failure of the bench's own code for one size is that size's failure, not the end."""
    try:
        return measure(name, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 (reported in the results)
        import traceback

        traceback.print_exc()
        return {"size": name, "status": "failed", "failure_class": "bench",
                "error": f"{type(e).__name__}: {e}"}


def launch(config, config_path: Path, dataset: Path, args, deadline: float, name: str,
           max_steps: int) -> dict:
    """One training attempt as the train task runs it (or `python -m training` alone with
    --no-torchrun); returns its failure class and reason. The time budget cancels it."""
    from core.protocol import ResumeSpec
    from infra.torchrun import classify, run_attempt, worker_env

    last_said = [0.0]

    def log(line: str) -> None:
        print(f"  | {line}", flush=True)

    def progress(beat: dict) -> None:
        step = beat.get("step") or 0
        if step == 1 or step == max_steps or time.monotonic() - last_said[0] > 10:
            last_said[0] = time.monotonic()
            rate = beat.get("tokens_per_s")
            say(f"{name}: step {step}/{max_steps}, loss {beat.get('loss', float('nan')):.3f}"
                + (f", {rate:,.0f} tokens/s (trainer's timer)" if rate else ""))

    attempt = "bench"
    remaining = deadline - time.monotonic()
    if remaining < 1:
        return {"class": "budget", "reason": "the time budget was used up before this size"}
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(1, int(remaining)))
    start = time.monotonic()
    try:
        if args.no_torchrun:
            code = plain_run(config_path, dataset, log, worker_env(config, attempt))
            outcome = classify(config.run_dir, attempt, code, False, time.monotonic() - start)
        else:
            outcome = run_attempt(config, config_path, dataset, attempt, log,
                                  on_progress=progress, start=ResumeSpec.scratch())
    except BudgetExceeded:
        return {"class": "budget", "reason": f"stopped by the bench's time budget "
                                             f"(--budget-s {args.budget_s:.0f}) after {time.monotonic() - start:.0f}s"}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return {"class": outcome.failure_class, "reason": outcome.reason}


def plain_run(config_path: Path, dataset: Path, log, env: dict) -> int:
    """`python -m training` in one process, no process group (--no-torchrun)."""
    cmd = [sys.executable, "-m", "training", "--config", str(config_path), "--dataset", str(dataset),
           "--resume", "none"]
    log(" ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env={**os.environ, **env}, start_new_session=True)
    reader = threading.Thread(target=lambda: [log(line.rstrip()) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)


# -- report -----------------------------------------------------------------------------------

def table(rows: list[dict], peak: float) -> str:
    def num(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"MFU = (6 x N_non_embedding + 12 x layers x heads x head_dim x seq) x tokens/s / "
             f"{peak:.4g} FLOP/s", "",
             "| size | params without the input embedding (output layer included) | seq "
             "| micro-batch | tokens/s | step (ms) | MFU "
             "| trainer MFU | peak mem (GiB) | SDPA default | flash only | status |",
             "|---" * 12 + "|"]
    for r in rows:
        m, a = r.get("model", {}), r.get("attention", {})
        step_ms = 1000 * r["step_time_s"] if r.get("step_time_s") is not None else None
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"[:160]
        if r.get("failed_with_compile"):
            status += " (eager: failed with compile)"
        lines.append(
            f"| {r['size']} | {num(m.get('params_non_embedding'), ',')} | {m.get('seq_len', '-')} "
            f"| {r.get('micro_batch', '-')} | {num(r.get('tokens_per_s'), ',.0f')} "
            f"| {num(step_ms, '.1f')} | {num(r.get('mfu'), '.1%')} | {num(r.get('trainer_mfu'), '.1%')} "
            f"| {num(r.get('max_memory_allocated_gb'), '.1f')} | {a.get('default_backend', '-')} "
            f"| {a.get('flash', a.get('error', '-'))[:60]} | {status} |")
    return "\n".join(lines)


def write_json(path: Path | None, report: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


def environment(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "device": device}
    if device == "cuda":
        try:  # a subprocess: the bench itself keeps off the GPU
            out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                                 capture_output=True, text=True, timeout=120)
            info["device_name"] = (out.stdout.strip() if out.returncode == 0 else
                                   "unavailable: " + (out.stderr.strip().splitlines() or ["?"])[-1])
        except subprocess.TimeoutExpired:
            info["device_name"] = "unavailable: no answer in 120s"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["gpt2-124m", "1b"],
                        help=f"model sizes, in order ({', '.join(SIZES)})")
    parser.add_argument("--steps", type=int, default=30, help="measured steps, after the warm-up")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="first steps left out of the figures (compilation happens in step 1)")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default: per size)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: per size)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="parallelism.compile: torch.compile per block and the loss")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--mixed-precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="parallelism.mixed_precision ('auto': bf16 autocast on CUDA)")
    parser.add_argument("--peak-flops", type=float, default=H100_PEAK,
                        help="FLOP/s the MFU divides by (default: issue 3's 989e12, H100 dense bf16)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--budget-s", type=float, default=560.0,
                        help="stop starting or running sizes after this many seconds in all "
                             "(the device's commands end at 600 s)")
    parser.add_argument("--attention-check", action=argparse.BooleanOptionalAction, default=True,
                        help="check which SDPA kernel the model's attention gets")
    parser.add_argument("--no-torchrun", action="store_true",
                        help="run `python -m training` in one process instead of under torchrun")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config overrides for every size, e.g. "
                             "parallelism.activation_checkpointing=selective")
    parser.add_argument("--workdir", type=Path, help="keep datasets and runs here (default: a "
                                                     "temporary folder, removed at the end)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the measured steps, profile N more (training.profiling): "
                             "the top operators in the JSON, rank 0's trace beside --out")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help=argparse.SUPPRESS)
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--attention-worker":
        print("ATTENTION " + json.dumps(attention_check(json.loads(sys.argv[2]))), flush=True)
        return 0
    args = parser.parse_args(argv)
    if args.warmup_steps < 1 or args.steps < 1:
        parser.error("--warmup-steps and --steps must be at least 1 (the first step compiles)")
    if args.profile < 0:
        parser.error("--profile takes a number of steps (0: no profile)")
    began = time.monotonic()
    deadline = began + args.budget_s
    # The workers (`python -m training`) import the repository too, wherever the bench started.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                               if p)
    ensure_packages(args.wheels)
    try:
        import goodput.runs  # noqa: F401  (what the run needs)
        import infra.torchrun
        import training.train
    except ImportError as e:
        sys.exit(f"[mfu-bench] cannot import the trainer here: {e!r}; missing packages can come "
                 "as wheels (scripts/gpu_wheels.sh)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="goodput-mfu-bench-"))
    report = {"issue": 3, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "formula": "MFU = (6*N_non_embedding + 12*layers*heads*head_dim*seq) * tokens/s / peak",
              "peak_flops": args.peak_flops,
              "peak_flops_source": ("issue 3: H100 SXM dense bf16 (989e12)" if args.peak_flops == H100_PEAK
                                    else "--peak-flops"),
              "tokens_per_s_definition": "tokens per step / median wall-clock interval between "
                                         "consecutive steps' metrics records after the warm-up",
              "environment": environment(args.device), "sizes": []}
    say(f"peak for MFU: {args.peak_flops:.4g} FLOP/s ({report['peak_flops_source']}); "
        f"environment {json.dumps(report['environment'])}; workdir {workdir}")
    try:
        for index, name in enumerate(args.sizes):
            say(f"{name}: starting ({time.monotonic() - began:.0f}s into the run)")
            row = guarded(run_size, name, args, workdir, deadline, index)
            out_of_memory = (row.get("failure_class") == "oom"  # also inside compilation:
                             or "out of memory" in str(row.get("error", "")).lower())
            if out_of_memory and args.micro_batch is None and name in SIZES and row["micro_batch"] > 1:
                say(f"{name}: out of memory at micro-batch {row['micro_batch']}; once more at "
                    f"{row['micro_batch'] // 2}")
                retry = guarded(run_size, name, args, workdir, deadline, index,
                                micro_batch=row["micro_batch"] // 2)
                row = retry | {"oom_at_micro_batch": row["micro_batch"]}
            if (row["status"] == "failed" and args.compile and name in SIZES
                    and row.get("failure_class") not in ("oom", "budget", "config")):
                # torch.compile needs a C compiler and Python's headers for Triton's launcher,
                # never checked on the lent GPUs: an eager figure beats none, marked as such.
                say(f"{name}: failed with compile on ({row.get('error')}); once more without")
                eager = argparse.Namespace(**{**vars(args), "compile": False})
                retry = guarded(run_size, name, eager, workdir, deadline, index,
                                micro_batch=row.get("micro_batch"))
                row = retry | {"failed_with_compile": row.get("error")}
            report["sizes"].append(row)
            write_json(args.out, report)
            if row["status"] == "ok":
                memory = row["max_memory_allocated_gb"]
                say(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, step {1000 * row['step_time_s']:.1f} "
                    f"ms, MFU {row['mfu']:.1%} (trainer's timer {row['trainer_mfu']:.1%}), peak memory "
                    f"{'n/a' if memory is None else f'{memory:.1f} GiB'}, {row['wall_s']:.0f}s wall")
            else:
                say(f"{name}: FAILED ({row.get('failure_class')}): {row.get('error')}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = time.monotonic() - began
    write_json(args.out, report)
    print("\n" + table(report["sizes"], args.peak_flops), flush=True)
    if args.out:
        say(f"results in {args.out}")
    return 0 if all(r["status"] == "ok" for r in report["sizes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
