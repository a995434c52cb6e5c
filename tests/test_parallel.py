"""Every layout trains the single-process loss curve (fp32, CPU, same global batch).

Each case is a real torchrun job; the reference is `python -m training` in one process.
Two-process layouts run 20 steps; four (and eight) processes share 2 cores in CI and run 12,
against a 12-step reference (the LR schedule depends on max_steps, so the first 12 steps of
a 20-step run are not the same curve). Checkpoints saved under one layout resume under
another.
"""

import json
import os
import subprocess
import sys

import pytest

from core.protocol import RunDir
from goodput.runs import write_run_config
from infra.torchrun import free_port
from tests.helpers import REPO, losses_by_step, small_config, synthetic_dataset

STEPS = 20  # two processes
STEPS_4 = 12  # four or more processes on 2 cores
RTOL = 1e-5
BF16_RTOL = 2e-3  # measured 1.2e-4 (pp-1f1b vs one process, both bf16; either vs fp32: 3.4e-4)
# Global batch: 8 samples of 64 tokens = micro_batch_size x grad_accum x dp_size.
BASE = ("model.n_layers=4", "training.warmup_steps=2", "training.grad_accum_steps=2")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("parallel") / "dataset")


def run_training(tmp_path, dataset, nproc: int, *overrides: str, steps: int, resume: str = "auto",
                 run_id: str = "layout") -> dict[int, float]:
    """Train `steps` steps (two checkpoints on the way) under a layout; loss per step."""
    config = small_config(tmp_path, f"run.run_id={run_id}", *BASE, f"training.max_steps={steps}",
                          f"checkpoint.every_steps={steps // 2}",
                          f"parallelism.nproc_per_node={nproc}", *overrides)
    config_path = write_run_config(config)
    module = ["-m", "training", "--config", str(config_path), "--dataset", str(dataset),
              "--resume", resume]
    if nproc == 1:
        cmd = [sys.executable, *module]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *module]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return losses_by_step(config.run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """reference(steps): the loss curve of one process, the whole model, 4 samples x 2
    accumulation steps, trained for `steps` steps (each length run once per module)."""
    curves: dict[int, dict[int, float]] = {}

    def curve(steps: int) -> dict[int, float]:
        if steps not in curves:
            curves[steps] = run_training(tmp_path_factory.mktemp(f"reference-{steps}"), dataset, 1,
                                         "training.micro_batch_size=4", steps=steps)
        return curves[steps]

    return curve


def assert_same_curve(losses, reference):
    assert sorted(losses) == sorted(reference)
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, loss, reference[step])


LAYOUTS_2 = {
    "ddp": ("parallelism.dp_replicate=2", "training.micro_batch_size=2"),
    "fsdp": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "training.micro_batch_size=2"),
    "fsdp-zero2": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                   "parallelism.reshard_after_forward=false", "training.micro_batch_size=2"),
    "tp": ("parallelism.dp_replicate=1", "parallelism.tp=2", "training.micro_batch_size=4"),
    "pp-gpipe": ("parallelism.dp_replicate=1", "parallelism.pp=2", "parallelism.pp_schedule=gpipe",
                 "training.micro_batch_size=4"),
    "pp-1f1b": ("parallelism.dp_replicate=1", "parallelism.pp=2", "parallelism.pp_schedule=1f1b",
                "training.micro_batch_size=4"),
    "pp-interleaved": ("parallelism.dp_replicate=1", "parallelism.pp=2",
                       "parallelism.pp_schedule=interleaved-1f1b", "training.micro_batch_size=4"),
    # Uneven stages (parallelism.pp_layers_per_stage): one layer on the first, three on the last.
    "pp-uneven": ("parallelism.dp_replicate=1", "parallelism.pp=2", "parallelism.pp_layers_per_stage=[1,3]",
                  "training.micro_batch_size=4"),
    # The last stage lighter by the weight of the output layer and loss
    # (parallelism.pp_last_stage_less_layers=2: 4 + 2 layers evenly, less 2 at the end): [3, 1].
    "pp-lighter-last": ("parallelism.dp_replicate=1", "parallelism.pp=2",
                        "parallelism.pp_last_stage_less_layers=2", "training.micro_batch_size=4"),
    "fsdp-ac": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "training.micro_batch_size=2",
                "parallelism.activation_checkpointing=full"),
    # The output layer and loss 48 tokens at a time (micro-batches of 128: two chunks and a
    # part), through FSDP's gathered weights.
    "fsdp-chunked-loss": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                          "training.micro_batch_size=2", "parallelism.loss_chunk_tokens=48"),
    # Both in one run: recomputed blocks, then the loss in chunks (CI's one run of each).
    "fsdp-ac-chunked-loss": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                             "training.micro_batch_size=2", "parallelism.activation_checkpointing=full",
                             "parallelism.loss_chunk_tokens=48"),
}


# CI's bounded set leaves out the schedules and splits another layout already covers:
# fsdp and tp train under clipping (test_with_clipping_active_...), 1f1b is pp-uneven's
# schedule, interleaved-1f1b runs at three stages per rank (test_interleaved_...), activation
# checkpointing and the chunked loss run together.
SLOW_2 = {"pp-gpipe", "pp-lighter-last", "fsdp", "tp", "pp-1f1b", "pp-interleaved", "fsdp-ac",
          "fsdp-chunked-loss"}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_2
                                    else name for name in LAYOUTS_2])
def test_two_process_layouts_match_single_process(layout, tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 2, *LAYOUTS_2[layout], steps=STEPS),
                      reference(STEPS))


def test_interleaved_pipeline_with_three_stages_per_rank_matches_single_process(tmp_path, dataset):
    """parallelism.pp_virtual_stages=3: six layers on 2 pipeline ranks x 3 stages, rank r
    holding stages r, r + 2 and r + 4 (training.parallelize and ScheduleInterleaved1F1B take
    the layout's stages per rank): the single-process curve of the same six-layer model."""
    six = ("model.n_layers=6",)
    single = run_training(tmp_path / "single", dataset, 1, "training.micro_batch_size=4", *six,
                          steps=STEPS_4)
    interleaved = run_training(tmp_path / "pp", dataset, 2, "parallelism.dp_replicate=1",
                               "parallelism.pp=2", "parallelism.pp_schedule=interleaved-1f1b",
                               "parallelism.pp_virtual_stages=3", "training.micro_batch_size=4",
                               *six, steps=STEPS_4)
    assert_same_curve(interleaved, single)


HSDP = ("parallelism.dp_replicate=2", "parallelism.dp_shard=2", "training.micro_batch_size=1")
LAYOUTS_4 = {  # HSDP: test_hsdp_matches_single_process_and_its_background_saves_resume_whole
    "fsdp-tp": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.tp=2",
                "training.micro_batch_size=2"),
    "pp-fsdp": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.pp=2",
                "training.micro_batch_size=2", "parallelism.microbatches=2"),
}


def test_with_clipping_active_fsdp_and_tp_train_the_single_process_curve(tmp_path, dataset):
    """training.grad_clip below every step's gradient norm: the clip factor is the norm's,
    so a norm that depends on how the gradients are sharded (float32 on the CPU: about 4e-6
    relative on the embedding's) made the curves part, 2.5e-4 relative by step 15."""
    clipped = "training.grad_clip=0.05"
    single = run_training(tmp_path / "single", dataset, 1, clipped, "training.micro_batch_size=4",
                          steps=12)
    config = small_config(tmp_path / "single", "run.run_id=layout")
    norms = [json.loads(line).get("grad_norm") for line in
             (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert min(n for n in norms if n is not None) > 0.05  # clipped at every step
    for name in ("fsdp", "tp"):
        assert_same_curve(run_training(tmp_path / name, dataset, 2, clipped, *LAYOUTS_2[name],
                                       steps=12), single)


# FSDP x TP on four processes is the first leg of test_checkpoints_reshard_across_layouts.
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name == "fsdp-tp"
                                    else name for name in LAYOUTS_4])
def test_four_process_layouts_match_single_process(layout, tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 4, *LAYOUTS_4[layout], steps=STEPS_4),
                      reference(STEPS_4))


def test_hsdp_matches_single_process_and_its_background_saves_resume_whole(tmp_path, dataset,
                                                                         reference):
    """HSDP with background saves: each replicate pair holds the same chunks and stages and
    writes half of them (training.checkpoint.my_share); the checkpoint is still whole: one
    process resumes from it on the same curve."""
    first = run_training(tmp_path, dataset, 4, *HSDP, "checkpoint.async_mode=thread", steps=STEPS_4)
    assert_same_curve(first, reference(STEPS_4))
    run_dir = small_config(tmp_path, "run.run_id=layout").run_dir
    (run_dir / "metrics.jsonl").unlink()
    resumed = run_training(tmp_path, dataset, 1, "training.micro_batch_size=4", steps=STEPS_4,
                           resume=str(RunDir.of(run_dir).checkpoint(STEPS_4 // 2)))
    assert sorted(resumed) == list(range(STEPS_4 // 2 + 1, STEPS_4 + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference(STEPS_4)[step], rel=RTOL), (step, loss)


@pytest.mark.slow  # four processes; CI keeps FSDP x TP untied (LAYOUTS_4)
def test_tied_embeddings_train_the_single_process_curve_under_fsdp_tp(tmp_path, dataset):
    """model.tie_embeddings: the output layer shares the embedding's parameter, also after TP
    gives each module a distributed copy (training.parallelize re-ties them) and FSDP shards
    the one matrix; the checkpoint holds it under both names with equal values."""
    import torch

    from training.checkpoint.reader import load_all_tensors, model_state_from

    tied = "model.tie_embeddings=true"
    single = run_training(tmp_path / "single", dataset, 1, "training.micro_batch_size=4", tied,
                          steps=STEPS_4)
    layout = run_training(tmp_path / "fsdp-tp", dataset, 4, *LAYOUTS_4["fsdp-tp"], tied, steps=STEPS_4)
    assert_same_curve(layout, single)
    run_dir = small_config(tmp_path / "fsdp-tp", "run.run_id=layout").run_dir
    state = model_state_from(load_all_tensors(RunDir.of(run_dir).checkpoint(STEPS_4), prefix="model."))
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


@pytest.mark.slow
def test_eight_process_pp_tp_fsdp(tmp_path, dataset, reference):
    losses = run_training(tmp_path, dataset, 8, "parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                          "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=2",
                          "training.micro_batch_size=2", steps=STEPS_4)
    assert_same_curve(losses, reference(STEPS_4))


def test_checkpoints_reshard_across_layouts(tmp_path, dataset, reference):
    """FSDPxTP on 4 processes -> DDP on 2 -> one process: the same curve, no sample skipped."""
    expected = reference(12)  # STEPS_4: the four-process layouts' reference
    first = run_training(tmp_path, dataset, 4, *LAYOUTS_4["fsdp-tp"], "checkpoint.every_steps=4",
                         steps=12)
    config = small_config(tmp_path, "run.run_id=layout")
    run_dir = config.run_dir
    # Resume from step 4 under DDP on 2 processes, then from step 8 on one process.
    (run_dir / "metrics.jsonl").unlink()
    second = run_training(tmp_path, dataset, 2, *LAYOUTS_2["ddp"], "checkpoint.every_steps=4",
                          steps=12, resume=str(RunDir.of(run_dir).checkpoint(4)))
    (run_dir / "metrics.jsonl").unlink()
    third = run_training(tmp_path, dataset, 1, "training.micro_batch_size=4",
                         "checkpoint.every_steps=4", steps=12,
                         resume=str(RunDir.of(run_dir).checkpoint(8)))
    for losses, steps in ((first, range(1, 13)), (second, range(5, 13)), (third, range(9, 13))):
        assert sorted(losses) == list(steps)
        for step in steps:
            assert losses[step] == pytest.approx(expected[step], rel=RTOL), (step, losses[step])


# -- building on the meta device -----------------------------------------------------------------

def test_a_model_built_on_meta_and_laid_out_starts_from_the_whole_models_weights():
    """The trainer builds on the meta device and parallelize materializes what the rank holds:
    in one process (activation checkpointing wraps the blocks) the weights are those of the
    model built whole with the same seed, and another seed gives other weights."""
    import torch

    from core.config import ParallelismConfig
    from core.layout import ParallelDims
    from training.model import ModelArgs, Transformer
    from training.parallelize import parallelize

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        model = Transformer(args)
    par_cfg = ParallelismConfig(activation_checkpointing="full", device="cpu")
    layout = parallelize(model, par_cfg, ParallelDims(), torch.device("cpu"), None, seed=7)
    laid_out = layout.model_parts[0].state_dict()
    whole = Transformer(args, seed=7).state_dict()
    assert laid_out.keys() == whole.keys()
    assert all(torch.equal(laid_out[k], whole[k]) for k in whole)
    other = Transformer(args, seed=8).state_dict()
    assert not torch.equal(other["layers.1.attention.wo.weight"], whole["layers.1.attention.wo.weight"])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(layout.model_parts[0](tokens), Transformer(args, seed=7)(tokens))


def test_a_model_given_its_weights_draws_no_initial_values_and_computes_the_same():
    import torch

    from training.model import ModelArgs, Transformer

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4)
    trained = Transformer(args, seed=1)
    loaded = Transformer.with_weights(args, trained.state_dict())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(tokens), trained(tokens))
    with pytest.raises(RuntimeError, match="size mismatch"):
        Transformer.with_weights(ModelArgs(vocab_size=128, dim=32, n_layers=2, n_heads=4),
                                 trained.state_dict())


def test_compile_mode_reaches_every_block_and_the_loss_keeps_the_default(monkeypatch, tmp_path):
    # parallelism.compile_mode=reduce-overhead: each block a CUDA graph on a GPU. The loss
    # stays in the default mode (a graph would copy the whole logits into its own buffer).
    import torch

    from core.layout import ParallelDims
    from training.model import Transformer, model_args_from_config
    from training.parallelize import Layout, _checkpoint_and_compile, _precision_and_loss

    modes = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: modes.append(kwargs.get("mode")))
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs) or fn)
    config = small_config(tmp_path, "parallelism.compile=true", "parallelism.compile_mode=reduce-overhead")
    model = Transformer(model_args_from_config(config.model, 512))
    _checkpoint_and_compile(model, config.parallelism)
    assert modes == ["reduce-overhead"] * config.model.n_layers
    _precision_and_loss(Layout(None, ParallelDims(), [model]), config.parallelism, torch.device("cpu"))
    assert compiled == [{}]
    modes.clear()
    _checkpoint_and_compile(model, small_config(tmp_path, "parallelism.compile=true").parallelism)
    assert modes == [None] * config.model.n_layers  # torch.compile's own default


@pytest.mark.parametrize("autocast", [False, True])
def test_the_loss_in_chunks_equals_the_loss_of_the_whole_logits(autocast):
    # training.model.linear_cross_entropy against cross_entropy(F.linear(...)): the loss and
    # both gradients, in fp32 and under bf16 autocast, with an ignored target, for chunks of
    # one token, of a part of the batch (the last one shorter) and of all of it.
    import torch
    import torch.nn.functional as F

    from training.model import IGNORE_INDEX, cross_entropy, linear_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 70, 32, generator=generator)
    weight = torch.randn(301, 32, generator=generator) * 0.1
    targets = torch.randint(0, 301, (3, 70), generator=generator)
    targets[0, :4] = IGNORE_INDEX
    targets[1, :64] = IGNORE_INDEX  # chunks of 64: the fourth counts for nothing at all

    def loss_and_grads(chunk):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (linear_cross_entropy(h, w, targets, chunk) if chunk
                    else cross_entropy(F.linear(h, w), targets))
        (loss / 2).backward()  # as the trainer divides by its accumulation steps
        return loss.detach(), h.grad, w.grad

    whole = loss_and_grads(0)
    assert whole[1].dtype == whole[2].dtype == torch.float32
    for chunk in (1, 64, 4096):
        loss, grad_hidden, grad_weight = loss_and_grads(chunk)
        assert grad_hidden.dtype == grad_weight.dtype == torch.float32
        assert loss.item() == pytest.approx(whole[0].item(), rel=1e-5)
        torch.testing.assert_close(grad_hidden, whole[1], rtol=1e-4, atol=1e-6)
        # bf16: each chunk's weight gradient is rounded to bf16 before the chunks are summed
        # in fp32; the whole batch's, once: equal within bf16's rounding of the largest values.
        tolerance = 8e-3 * whole[2].abs().max().item() if autocast else 1e-6
        torch.testing.assert_close(grad_weight, whole[2], rtol=1e-4, atol=tolerance)
    with torch.no_grad():  # evaluation: the loss alone, the same
        w = weight.clone().requires_grad_()  # a parameter, as in a model in eval
        loss = linear_cross_entropy(hidden, w, targets, 64)
        assert loss.grad_fn is None and loss.item() == pytest.approx(
            cross_entropy(F.linear(hidden, weight), targets).item(), rel=1e-5)
    # No target counted: the loss is NaN and the gradients zero, as F.cross_entropy's.
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, torch.full_like(targets, IGNORE_INDEX), 64)
    loss.backward()
    assert loss.isnan() and not h.grad.any() and not w.grad.any()


def test_the_loss_in_chunks_is_refused_where_the_output_layer_is_split():
    from core.config import ConfigError, load_config

    for layout in (["parallelism.tp=2", "parallelism.dp_replicate=1"],
                   ["parallelism.pp=2", "parallelism.dp_replicate=1"]):
        with pytest.raises(ConfigError, match="loss_chunk_tokens=256 needs tp=1 and pp=1"):
            load_config(None, ["parallelism.nproc_per_node=2", "parallelism.loss_chunk_tokens=256",
                               *layout])


def test_whole_model_names_drop_the_segments_wrappers_add():
    from training.parallelize import whole_model_name

    assert whole_model_name("module.layers.3._checkpoint_wrapped_module._orig_mod.attention.wq.weight") \
        == "layers.3.attention.wq.weight"
    assert whole_model_name("output.weight") == "output.weight"


@pytest.mark.slow  # two runs of 2 + 1 processes; CI keeps the fp32 pipeline layouts
def test_pipeline_stages_train_under_bf16_autocast(tmp_path, dataset, reference):
    """mixed_precision=bf16 (here on CPU; 'auto' gives it on GPUs): pipeline stages run
    forward under autocast like the single process does, and their curves agree to bf16
    rounding; both differ from the fp32 curve, so autocast was on."""
    bf16 = "parallelism.mixed_precision=bf16"
    single = run_training(tmp_path / "single", dataset, 1, "training.micro_batch_size=4", bf16,
                          steps=STEPS)
    pipelined = run_training(tmp_path / "pp", dataset, 2, *LAYOUTS_2["pp-1f1b"], bf16, steps=STEPS)
    fp32 = reference(STEPS)
    assert sorted(pipelined) == sorted(single) == sorted(fp32)
    for step in single:
        assert pipelined[step] == pytest.approx(single[step], rel=BF16_RTOL), (step, pipelined[step])
    assert any(single[s] != pytest.approx(fp32[s], rel=RTOL) for s in single)
    assert any(pipelined[s] != pytest.approx(fp32[s], rel=RTOL) for s in pipelined)


# -- context parallelism -------------------------------------------------------------------------

CP = ("parallelism.dp_replicate=1", "parallelism.cp=2")


def test_context_parallel_trains_the_single_process_curve_and_one_process_resumes_it(
        tmp_path, dataset, reference):
    """parallelism.cp=2: both ranks are handed the same 4 samples and each trains its two
    chunks of every sequence (i and 3-i of 4), attending over the whole of it: the
    single-process curve, tokens counted once, the in-loop validation loss of the same
    weights; one process resumes from its checkpoint (saved FSDP-sharded over the cp ranks)
    on the same curve."""
    every = ("eval.every_steps=10", "eval.in_loop_batches=2")
    first = run_training(tmp_path, dataset, 2, *CP, "training.micro_batch_size=4", *every,
                         steps=STEPS)
    assert_same_curve(first, reference(STEPS))
    run_dir = small_config(tmp_path, "run.run_id=layout").run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in records if "loss" in r] == [step * 8 * 64 for step in first]
    validated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(validated) == [10, 20]

    (run_dir / "metrics.jsonl").unlink()
    resumed = run_training(tmp_path, dataset, 1, "training.micro_batch_size=4", *every,
                           steps=STEPS, resume=str(RunDir.of(run_dir).checkpoint(STEPS // 2)))
    assert sorted(resumed) == list(range(STEPS // 2 + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference(STEPS)[step], rel=RTOL), (step, loss)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    again = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert again[20] == pytest.approx(validated[20], rel=RTOL)


@pytest.mark.parametrize("layout", [
    # CP x TP: each TP rank computes its heads of the cp rank's chunks, sequence parallelism
    # splits the chunks between the blocks
    ("parallelism.tp=2", "training.micro_batch_size=4"),
    # CP x FSDP: two data-parallel ranks of two samples each, each split over two cp ranks;
    # the weights sharded over all four
    pytest.param(("parallelism.dp_shard=2", "training.micro_batch_size=2"), marks=pytest.mark.slow),
], ids=["cp-tp", "cp-fsdp"])
def test_context_parallel_with_tp_or_fsdp_matches_single_process(layout, tmp_path, dataset, reference):
    assert_same_curve(run_training(tmp_path, dataset, 4, *CP, *layout, steps=STEPS_4),
                      reference(STEPS_4))
