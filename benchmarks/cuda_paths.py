"""The trainer's CUDA-only paths, exercised on one GPU (no CPU run can show them).

    python3 benchmarks/cuda_paths.py --out $OUT/cuda_paths.json     # one lent H100

Each check is reported (ok / failed with the reason) and the next one runs regardless:

- checkpoint_resume: `torchrun --nproc-per-node 1 -m training` on CUDA (process group
  `cpu:gloo,cuda:nccl`, the model built on the meta device, bf16 autocast) saves at step 10 with
  `checkpoint.async_mode=process` (staging into pinned, shared memory with non-blocking copies,
  then the write in a writer process) and at its end; a second run resumes from the step-10
  checkpoint. Its losses for steps 11..20 are compared with the first run's, and the stall
  each save cost the loop is reported.
- init_from: a random Llama saved by `transformers`, loaded as `model.init_from` loads it
  (meta-device build, `parallelize` on cuda, `load_hf_weights`), gives `transformers`' logits
  on the same GPU in fp32 (TF32 off) within 1e-5.

Dependencies the GPU image lacks come as wheels, as for mfu_bench.py (scripts/gpu_wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import mfu_bench  # noqa: E402  (ensure_packages, token_dataset)


def say(message: str) -> None:
    print(f"[cuda-paths] {message}", flush=True)


def run_training(workdir: Path, run_id: str, dataset: Path, start, extra: list[str],
                 device: str) -> dict:
    from core.config import load_config
    from core.protocol import RunDir
    from goodput.runs import write_run_config
    from infra.torchrun import run_attempt
    from training.metrics import read_metrics

    config = load_config(None, [
        f"run.runs_dir={workdir / 'runs'}", f"run.run_id={run_id}", f"storage.uri={workdir / 'store'}",
        f"data.data_dir={workdir / 'data'}", "model.dim=256", "model.n_layers=4", "model.n_heads=8",
        "model.max_seq_len=256", "training.seq_len=256", "training.micro_batch_size=8",
        "training.max_steps=20", "training.warmup_steps=5", "training.log_every=1",
        "faults.spike_factor=null", f"parallelism.device={device}", "parallelism.nproc_per_node=1",
        "parallelism.compile=false", "checkpoint.every_steps=10", "checkpoint.async_mode=process",
        "checkpoint.save_at_end=true", "launch.kind=local", "launch.max_restarts=0", *extra])
    path = write_run_config(config)
    began = time.monotonic()
    outcome = run_attempt(config, path, dataset, "cuda", lambda line: print(f"  | {line}", flush=True),
                          start=start)
    records = read_metrics(config.run_dir)
    return {"class": outcome.failure_class, "reason": outcome.reason,
            "wall_s": time.monotonic() - began, "run_dir": RunDir(config.run_dir),
            "losses": {r["step"]: r["loss"] for r in records if "loss" in r},
            "checkpoint_s": {r["step"]: r.get("checkpoint_s") for r in records
                             if r.get("checkpoint_s")},
            "memory_gb": max((r.get("max_memory_allocated_gb", 0) for r in records), default=None)}


def check_checkpoint_resume(workdir: Path, device: str) -> dict:
    from core.protocol import ResumeSpec

    dataset = mfu_bench.token_dataset(workdir / "data" / "counting", 4096, 60 * 8 * 256)
    first = run_training(workdir, "cuda-first", dataset, ResumeSpec.scratch(), [], device)
    say(f"first run: {first['class']} in {first['wall_s']:.0f}s, steps {sorted(first['losses'])[-1:]}, "
        f"checkpoint stall by step {first['checkpoint_s']}")
    saved = first["run_dir"].checkpoint(10)
    out = {"first_run": first["class"], "first_reason": first["reason"],
           "checkpoint_stall_s": first["checkpoint_s"], "max_memory_allocated_gb": first["memory_gb"],
           "committed": [p.name for p in first["run_dir"].committed_checkpoints()]}
    if not saved.is_dir():
        return out | {"status": "failed", "error": f"no step-10 checkpoint ({first['reason']})"}
    second = run_training(workdir, "cuda-resumed", dataset, ResumeSpec.directory(saved), [], device)
    steps = [s for s in range(11, 21) if s in first["losses"] and s in second["losses"]]
    diffs = {s: abs(first["losses"][s] - second["losses"][s]) for s in steps}
    out |= {"resumed_run": second["class"], "resumed_reason": second["reason"],
            "resumed_steps": sorted(second["losses"]), "compared_steps": steps,
            "max_loss_diff": max(diffs.values(), default=None),
            "losses_first": {s: first["losses"][s] for s in steps},
            "losses_resumed": {s: second["losses"][s] for s in steps}}
    ok = first["class"] == second["class"] == "done" and len(steps) == 10 and min(second["losses"]) == 11
    out["status"] = "ok" if ok and out["max_loss_diff"] < 1e-3 else "failed"
    return out


def check_init_from(workdir: Path, device_name: str) -> dict:
    import torch
    import transformers

    from core.config import ParallelismConfig, load_config
    from core.layout import ParallelDims
    from tests.test_init_from import SEQ, VOCAB, save_llama, tokens
    from training.hf_weights import load_hf_weights
    from training.model import Transformer, model_args_from_config
    from training.parallelize import parallelize

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    out: dict = {"transformers": transformers.__version__}
    for tied in (True, False):
        directory = save_llama(workdir / f"hf-{'tied' if tied else 'untied'}", tied=tied,
                               max_shard_size=None if tied else "60KB")
        config = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
        with torch.device("meta"):
            model = Transformer(model_args_from_config(config.model, VOCAB))
        layout = parallelize(model, ParallelismConfig(device=device_name), ParallelDims(), device, None,
                             seed=None)
        load_hf_weights(layout.model_parts, directory, config.model.tie_embeddings)
        ours = layout.model_parts[0].eval()
        theirs = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
        x = tokens().to(device)
        with torch.no_grad():
            diff = (ours(x) - theirs(x).logits).abs().max().item()
        out[f"max_logit_diff_{'tied' if tied else 'untied_sharded'}"] = diff
        out["weights_on"] = str(ours.tok_embeddings.weight.device)
    worst = max(v for k, v in out.items() if k.startswith("max_logit_diff"))
    out["status"] = "ok" if worst <= 1e-5 else "failed"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run")
    parser.add_argument("--checks", nargs="+", default=["checkpoint_resume", "init_from"])
    args = parser.parse_args(argv)
    import os
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    mfu_bench.ensure_packages(mfu_bench.WHEELS)
    checks = {"checkpoint_resume": check_checkpoint_resume, "init_from": check_init_from}
    import torch
    report: dict = {"torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}
    with tempfile.TemporaryDirectory(prefix="goodput-cuda-paths-") as tmp:
        for name in args.checks:
            began = time.monotonic()
            try:
                report[name] = checks[name](Path(tmp), args.device)
            except Exception as e:  # noqa: BLE001 (reported)
                traceback.print_exc()
                report[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            report[name]["wall_s"] = round(time.monotonic() - began, 1)
            say(f"{name}: {json.dumps(report[name], default=str)}")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if all(report[n].get("status") == "ok" for n in args.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
