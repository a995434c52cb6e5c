"""benchmarks/mfu_bench.py end to end on CPU: the real trainer under torchrun, the MFU
arithmetic against a hand count of the tiny model, and failures reported per size.

The CUDA figures themselves (issue 3) need a GPU; what is checked here is everything else."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from core.protocol import RunDir
from tests.helpers import REPO
from training.metrics import read_metrics

BENCH = REPO / "benchmarks" / "mfu_bench.py"
PEAK = 989e12
WARMUP, STEPS = 2, 3


def run_bench(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "mfu.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--out", str(out), "--workdir",
                           str(tmp_path / "work"), "--steps", str(STEPS), "--warmup-steps",
                           str(WARMUP), *args], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=None if env is None else {**os.environ, **env})
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_tiny_on_cpu_measures_and_an_unknown_size_is_reported(tmp_path):
    proc, report = run_bench(tmp_path, "--sizes", "tiny", "no-such-size", "--device", "cpu",
                             "--no-compile", "--profile", "2")
    assert proc.returncode == 1, proc.stdout[-3000:]  # one size failed; the bench went on
    tiny, unknown = report["sizes"]
    # (the row whole is too long for pytest's message: its reason first)
    assert tiny["status"] == "ok", (tiny.get("failure_class"), tiny.get("error"),
                                    proc.stdout[-2000:], proc.stderr[-2000:])
    assert report["peak_flops"] == PEAK

    # The tiny model by hand: dim 64, 2 layers, 4 heads of 16, vocabulary 512, seq 64; SwiGLU
    # width 2/3 x 4 x 64 = 170, rounded up to a multiple of 32: 192.
    dim, layers, heads, head_dim, vocab, seq, ffn = 64, 2, 4, 16, 512, 64, 192
    block = 4 * dim * dim + 3 * dim * ffn + 2 * dim  # wq wk wv wo, w1 w2 w3, two norms
    non_embedding = layers * block + dim + vocab * dim  # final norm, output projection
    flops_per_token = 6 * non_embedding + 12 * layers * heads * head_dim * seq
    model = tiny["model"]
    assert model["params_non_embedding"] == non_embedding == 139_584
    assert model["params_total"] == non_embedding + vocab * dim
    assert model["flops_per_token"] == model["model_flops_per_token"] == flops_per_token
    assert model["formula_matches_model"] is True

    # tokens/s from the trainer's own records: median interval between consecutive steps
    # after the warm-up; MFU by issue 3's formula. The profiled steps come after them (a
    # step warms the profiler up, two are recorded) and are left out.
    records = {r["step"]: r for r in read_metrics(tiny["run_dir"])}
    assert sorted(records) == list(range(1, WARMUP + STEPS + 1 + 3))
    step_s = statistics.median(records[s]["time"] - records[s - 1]["time"]
                               for s in range(WARMUP + 1, WARMUP + STEPS + 1))
    assert tiny["steps_measured"] == STEPS
    assert tiny["tokens_per_step"] == 4 * seq
    assert tiny["step_time_s"] == pytest.approx(step_s)
    assert tiny["tokens_per_s"] > 0
    assert tiny["tokens_per_s"] == pytest.approx(tiny["tokens_per_step"] / step_s)
    assert tiny["mfu"] == pytest.approx(flops_per_token * tiny["tokens_per_s"] / PEAK)
    assert tiny["trainer_tokens_per_s"] > 0
    assert tiny["max_memory_allocated_gb"] is None  # logged on CUDA only
    assert "max_memory_allocated_gb" not in records[1]
    assert not RunDir.of(tiny["run_dir"]).committed_checkpoints()  # checkpoint.save_at_end=false

    # The model's attention runs with the flash backend alone (on CPU, its CPU kernel).
    assert tiny["attention"]["flash"] == "ok", tiny["attention"]
    assert tiny["attention"]["default_backend"] == "flash"

    # --profile 2: rank 0's top operators and its trace, brought beside --out.
    profile = tiny["profile"]
    first = WARMUP + STEPS + 2
    assert profile["steps"] == [first, first + 1] and profile["time"] == "host"
    assert any(row["name"] in ("aten::mm", "aten::addmm") for row in profile["top"]), profile
    assert profile["trace"] == str(tmp_path / "mfu-tiny-rank0.trace.json.gz")
    assert (tmp_path / "mfu-tiny-rank0.trace.json.gz").stat().st_size > 0
    assert f"tiny: profile of steps {first}-{first + 1}, by self host time: " in proc.stdout

    assert unknown["status"] == "failed" and unknown["failure_class"] == "config"
    assert "unknown size 'no-such-size'" in unknown["error"]
    assert "| tiny |" in proc.stdout and "| no-such-size |" in proc.stdout


def test_a_size_the_trainer_cannot_run_is_reported(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where --device cuda must fail")
    proc, report = run_bench(tmp_path, "--sizes", "tiny", "--device", "cuda", "--no-compile")
    assert proc.returncode == 1
    [tiny] = report["sizes"]
    assert tiny["status"] == "failed"
    assert tiny["failure_class"] == "retryable"  # the worker's exit record, read by the launcher
    assert tiny["error"] and tiny["steps_logged"] == 0
    assert "error" in tiny["attention"]
    assert report["environment"]["device_name"].startswith("unavailable")


def test_summary_leaves_out_the_warm_up():
    from benchmarks.mfu_bench import summarize

    # Step 1 (compilation) is slow; steps 3..5 take 0.5, 0.25 and 0.5 s.
    times = {1: 10.0, 2: 10.1, 3: 10.6, 4: 10.85, 5: 11.35}
    records = [{"step": s, "time": t, "loss": 5.0, "tokens_per_s": 1000.0, "step_time_s": 0.4}
               for s, t in times.items()]
    summary = summarize(records, warmup=2, tokens_per_step=100, flops_per_token=1e9, peak=1e12)
    assert summary["steps_measured"] == 3
    # Steps after `last` (profiled ones) are left out too.
    assert summarize(records, warmup=2, tokens_per_step=100, flops_per_token=1e9, peak=1e12,
                     last=4)["step_time_s"] == pytest.approx(0.375)
    assert summary["step_time_s"] == pytest.approx(0.5)
    assert summary["tokens_per_s"] == pytest.approx(200)
    assert summary["mfu"] == pytest.approx(1e9 * 200 / 1e12)
    assert summary["trainer_mfu"] == pytest.approx(1e9 * 1000 / 1e12)


@pytest.mark.slow  # torch.compile on CPU: minutes on 2 cores
def test_a_size_that_fails_to_compile_is_measured_eagerly_and_says_so(tmp_path):
    # No C++ compiler for inductor (on the GPUs: none for Triton's launcher) fails compilation.
    proc, report = run_bench(tmp_path, "--sizes", "tiny", "--device", "cpu", "--no-attention-check",
                             env={"CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    [tiny] = report["sizes"]
    assert tiny["status"] == "ok" and tiny["compile"] is False and tiny["mfu"] > 0
    assert "compiler" in tiny["failed_with_compile"].lower(), tiny["failed_with_compile"]
    assert "(eager: failed with compile)" in proc.stdout


@pytest.mark.parametrize("check", ["init_from", pytest.param("checkpoint_resume", marks=pytest.mark.slow)])
def test_the_cuda_paths_script_runs_its_checks_on_cpu(tmp_path, check):
    """benchmarks/cuda_paths.py is run on lent GPUs only; on CPU its checks run the same code
    so that the script does not rot between leases."""
    out = tmp_path / "cuda_paths.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cuda_paths.py"), "--device",
                           "cpu", "--checks", check, "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())[check]
    assert result["status"] == "ok", result
    if check == "init_from":
        assert result["max_logit_diff_tied"] <= 1e-5 and result["max_logit_diff_untied_sharded"] <= 1e-5
    else:
        assert result["max_loss_diff"] < 1e-3 and result["resumed_steps"][0] == 11


def test_a_layout_benchmarks_workers_get_its_arguments_less_nproc():
    """torchrun's own parser refuses --nproc even after the script's name (ambiguous with
    --nproc-per-node): the workers, which need no process count, do not get it."""
    from benchmarks.torchrun_arm import _without_nproc

    assert _without_nproc(["--device", "cuda", "--nproc", "1", "--arms", "fsdp", "--nproc=2",
                           "--steps", "5"]) == ["--device", "cuda", "--arms", "fsdp", "--steps", "5"]


@pytest.mark.slow  # every part of the device session on this CPU: about 3 minutes on 2 cores
def test_the_device_session_runs_every_part_at_its_smallest_on_cpu(tmp_path):
    """benchmarks/device_session.sh --smoke: each part ran and wrote its results, within the
    session's time, as the lent GPU's single call will (8 files at most: the device's limit)."""
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "device_session.sh"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for part in ("mfu", "prepare", "eval", "moe", "moe_kernels", "mfu_1b"):
        assert f"=== {part}: exit 0 after" in proc.stdout, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval.json", "mfu-tiny-rank0.trace.json.gz", "mfu.json", "mfu_1b.json", "moe.json",
        "prepare.json", "session.log"]
    mfu = json.loads((tmp_path / "mfu.json").read_text())["sizes"][0]
    assert mfu["status"] == "ok" and mfu["profile"]["top"], mfu
    assert json.loads((tmp_path / "mfu_1b.json").read_text())["sizes"][0]["status"] == "ok"
    evaluation = json.loads((tmp_path / "eval.json").read_text())["backends"]
    assert evaluation["device"] == "cpu" and set(evaluation["tasks"]) == {"piqa", "lambada", "all"}
    assert json.loads((tmp_path / "moe.json").read_text())["rounds"]["fsdp"][0]["tokens_per_s"] > 0
    prepare = json.loads((tmp_path / "prepare.json").read_text())[0]
    assert prepare["unit_timeline"]["units"] >= 1 and prepare["unit_timeline"]["first_unit_start_s"] >= 0
    log = (tmp_path / "session.log").read_text()
    assert '"grouped_mm_path": "grouped_mm"' in log  # moe_kernels: torch's kernel on this CPU
