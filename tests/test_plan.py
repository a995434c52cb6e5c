"""The layout planner: hand-computed arithmetic, rejections with their fixes, its memory
estimate against real training steps measured on CPU, and its estimates against the runs the
field has published (PUBLISHED: each layout fits where it ran, tokens/s within 20%).

Run as a module (`python -m tests.test_plan`, or under torchrun) this file is also the
measuring side: it trains a few steps of training.model.Transformer with AdamW under the
trainer's own layout code (training.parallelize) and reports what it held.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from goodput import planner
from tests.helpers import REPO, task_runs_of
from training.model import ModelArgs, Transformer

GB = 1e9

LLAMA2_7B = ("tokenizer.vocab_size=32000", "model.dim=4096", "model.n_layers=32",
             "model.n_heads=32", "model.ffn_multiple_of=256", "model.max_seq_len=4096",
             "training.seq_len=4096", "training.micro_batch_size=1")


def cluster(nodes=1, gpus=8, memory="80GiB", **kw) -> planner.Cluster:
    return planner.Cluster(nodes=nodes, gpus_per_node=gpus, gpu_memory=planner.parse_bytes(memory), **kw)


def layout(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1) -> dict[str, int]:
    return {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}


# -- arithmetic -------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_heads, tied, multiplier, qkv_bias", [
    (None, False, None, False), (2, False, None, False), (2, True, 1.3, False),
    (2, True, None, True)])  # Qwen2's q/k/v biases
def test_parameter_count_matches_the_model(kv_heads, tied, multiplier, qkv_bias):
    args = ModelArgs(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=kv_heads,
                     tie_embeddings=tied, ffn_dim_multiplier=multiplier, qkv_bias=qkv_bias)
    model = Transformer(args)
    count = planner.count_params(args)
    assert count.total == model.num_params(non_embedding=False)
    assert count.non_embedding == model.num_params()
    # The FLOPs of a token: a tied output layer is still a matmul (seq_len 0: no attention).
    assert 6 * count.matmul == model.flops_per_token(0)
    assert count.matmul == count.total - 512 * 64 + (512 * 64 if tied else 0)


@pytest.mark.parametrize("config, total, ffn_hidden", [
    ("configs/llama3.2-1b.yaml", 1_235_814_400, 8192),   # tied embeddings
    ("configs/llama3.1-8b.yaml", 8_030_261_248, 14336),
    ("configs/llama3.1-70b.yaml", 70_553_706_496, 28672),
    ("configs/llama2-7b.yaml", 6_738_415_616, 11008),
])
def test_llama_configs_have_the_published_parameter_counts(config, total, ffn_hidden):
    """Meta's published sizes, exactly: ffn_dim_multiplier and ffn_multiple_of give Llama 3's
    SwiGLU widths (Meta's and torchtitan's formula), the vocabulary is Llama 3's 128,256."""
    args = planner.model_args(load_config(config))
    assert args.ffn_hidden == ffn_hidden
    assert planner.count_params(args).total == total


def test_tied_embeddings_rule_out_pipeline_layouts():
    """The 1B config ties its embeddings: the planner ranks no layout with pp > 1, and says why."""
    plans = planner.search(load_config("configs/llama3.2-1b.yaml"), cluster())
    assert all(p.degrees["pp"] == 1 for p in plans if p.ok)
    pipelined = [p for p in plans if p.degrees["pp"] > 1]
    assert pipelined and all(any("tie_embeddings" in str(problem) for problem in p.problems)
                             for p in pipelined)
    with pytest.raises(ConfigError, match="model.tie_embeddings=true .* pp=2 .* set parallelism.pp=1"):
        load_config("configs/llama3.2-1b.yaml", ["parallelism.pp=2", "training.micro_batch_size=4"])


# The 405B config on its first 64 nodes with one stage per pipeline rank (1F1B).
LLAMA_405B_1F1B = ("parallelism.nnodes=64", "parallelism.pp_schedule=1f1b",
                   "parallelism.pp_virtual_stages=null", "parallelism.microbatches=32",
                   "training.micro_batch_size=32", "parallelism.activation_checkpointing=full",
                   "parallelism.compile=false")


def test_llama_3_1_405b_plans_on_16_uneven_pipeline_stages():
    """Meta's 405B layout: 126 layers on pp=16 (not divisible), the first and last stages one
    layer lighter; the planner counts Meta's published parameters and accepts the layout."""
    config = load_config("configs/llama3.1-405b.yaml", list(LLAMA_405B_1F1B))
    args = planner.model_args(config)
    assert args.ffn_hidden == 53248
    assert planner.count_params(args).total == 405_853_388_800
    [plan] = planner.plan(config, cluster(nodes=64))
    assert plan.ok, plan.problems
    assert plan.degrees == layout(dp_shard=4, tp=8, pp=16)
    assert plan.stage_layers == [7] + [8] * 14 + [7]
    # The last rank also computes the output layer: it, not the even ranks, sets the pace.
    assert 1.0 < plan.imbalance < 1.02
    # A split of one's own, e.g. all the unevenness on the first stage.
    own = [6] + [8] * 15
    config = load_config("configs/llama3.1-405b.yaml", [*LLAMA_405B_1F1B,
                                                         f"parallelism.pp_layers_per_stage={own}"])
    [plan] = planner.plan(config, cluster(nodes=64))
    assert plan.ok and plan.stage_layers == own


def test_one_stage_rule_for_the_config_the_planner_and_parallelize():
    """core.layout's stage rule is the only one: the config refuses what the planner refuses
    and what training.parallelize would refuse, in the same words; all split the same way."""
    from core.layout import LayoutError, ParallelDims, default_split
    from training.parallelize import split_pipeline

    assert default_split(126, 16) == [7] + [8] * 14 + [7]
    assert default_split(30, 4) == [7, 8, 8, 7]
    assert default_split(5, 4) == [1, 1, 2, 1]
    assert default_split(4, 2) == [2, 2]
    assert ParallelDims(pp=2, layers_per_stage=(1, 3)).stage_bounds(4) == [0, 1, 4]

    bad = ("parallelism.pp_layers_per_stage=[8,8,8,8]", "model.n_layers=30", "parallelism.pp=4",
           "parallelism.nproc_per_node=4", "parallelism.dp_replicate=1", "training.micro_batch_size=8")
    reason = ("parallelism.pp_layers_per_stage=[8, 8, 8, 8] must give every stage at least one "
              "layer and sum to model.n_layers=30 (it sums to 32)")
    fix = "list 4 counts of at least 1 summing to 30, e.g. [7, 8, 8, 7]"
    with pytest.raises(ConfigError) as config_error:
        load_config(None, list(bad))
    assert reason in str(config_error.value) and fix in str(config_error.value)
    valid = load_config(None, [o for o in bad if "pp_layers" not in o])
    unchecked = valid.model_copy(update={"parallelism": valid.parallelism.model_copy(
        update={"pp_layers_per_stage": [8, 8, 8, 8]})})
    result = planner.plan_layout(unchecked, cluster(gpus=4), layout(pp=4))
    assert [str(p) for p in result.problems] == [f"{reason}; fix: {fix}"]
    dims = unchecked.parallelism.dims()
    with pytest.raises(LayoutError):
        dims.stage_layers(30)
    with pytest.raises(ConfigError, match=re.escape(reason)):
        split_pipeline(Transformer(ModelArgs(vocab_size=64, dim=16, n_layers=30, n_heads=2)),
                       None, dims)
    with pytest.raises(ConfigError, match="lists 3 stages, but pp=2, interleaved-1f1b has 4 "
                                          r"\(2 per pipeline rank\); list 4 layer counts"):
        load_config(None, ["parallelism.pp=2", "parallelism.pp_schedule=interleaved-1f1b",
                           "parallelism.dp_replicate=1", "parallelism.pp_layers_per_stage=[1,2,1]",
                           "training.micro_batch_size=4"])


def test_virtual_stages_are_the_layouts_choice():
    """parallelism.pp_virtual_stages sets the stages per rank of interleaved-1f1b (default
    2): the split, the bubble and the stages each rank holds follow it; with another schedule
    or fewer than 2 it is refused, naming the field and the fix."""
    from core.layout import ParallelDims

    dims = ParallelDims(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3)
    assert dims.n_stages == 6 and dims.stages_of(1) == [1, 3, 5]
    assert dims.stage_layers(12) == [2] * 6
    assert dims.bubble == pytest.approx(1 / (3 * 4 + 1))
    assert ParallelDims(pp=2, pp_schedule="interleaved-1f1b").stages_per_rank == 2
    base = ["parallelism.pp=2", "parallelism.dp_replicate=1", "training.micro_batch_size=4"]
    with pytest.raises(ConfigError, match=re.escape(
            "parallelism.pp_virtual_stages=3 needs pp_schedule=interleaved-1f1b and pp > 1 (pp=2, "
            "1f1b); set parallelism.pp_schedule=interleaved-1f1b, or drop parallelism.pp_virtual_stages")):
        load_config(None, [*base, "parallelism.pp_virtual_stages=3"])
    with pytest.raises(ConfigError, match="pp_virtual_stages=1: interleaving needs at least 2"):
        load_config(None, [*base, "parallelism.pp_schedule=interleaved-1f1b",
                           "parallelism.pp_virtual_stages=1"])
    with pytest.raises(ConfigError, match=r"6 pipeline stages \(pp=2, interleaved-1f1b\) exceed n_layers=4"):
        load_config(None, [*base, "parallelism.pp_schedule=interleaved-1f1b",
                           "parallelism.pp_virtual_stages=3"])
    config = load_config(None, [*base, "model.n_layers=6", "parallelism.pp_schedule=interleaved-1f1b",
                                "parallelism.pp_virtual_stages=3"])
    plan = planner.plan_layout(config, planner.Cluster(1, 2, None, device="cpu"), layout(pp=2))
    assert plan.ok and plan.stage_layers == [1] * 6 and plan.bubble == pytest.approx(1 / 13)


class _PipelineRank:
    """The one thing split_pipeline asks of its mesh: this rank's place on the pp axis."""

    def __init__(self, rank: int):
        self.rank = rank

    def get_local_rank(self, dim: str) -> int:
        assert dim == "pp"
        return self.rank


def test_first_and_last_stages_lighter_by_the_weight_of_embedding_and_output():
    """parallelism.pp_first/last_stage_less_layers: n_layers + the two weights split as
    evenly as possible (the ends lighter when uneven), then the ends give up their weight.
    0 and 0 is the plain split, so existing layouts keep theirs."""
    from core.layout import ParallelDims, default_split
    from training.parallelize import split_pipeline

    for n_stages in range(1, 10):
        for n_layers in range(n_stages, 40):
            assert default_split(n_layers, n_stages, first_less=0, last_less=0) == \
                default_split(n_layers, n_stages)
            assert sum(default_split(n_layers, n_stages, first_less=2, last_less=3)) == n_layers
    # Llama 3.1 405B: 126 layers on 16 stages. A weight of one each is Meta's split (128
    # "layers" evenly, the ends one lighter), as the plain split already gives.
    assert default_split(126, 16, first_less=1, last_less=1) == [7] + [8] * 14 + [7]
    assert default_split(126, 16, first_less=0, last_less=2) == [8] * 15 + [6]
    assert default_split(126, 16, first_less=2, last_less=2) == [6] + [8] * 6 + [9, 9] + [8] * 6 + [6]
    dims = ParallelDims(pp=16, first_stage_less_layers=2, last_stage_less_layers=2)
    assert dims.stage_layers(126) == [6] + [8] * 6 + [9, 9] + [8] * 6 + [6]
    assert dims.stage_bounds(126)[:3] == [0, 6, 14] and dims.stage_bounds(126)[-2:] == [120, 126]
    # One stage holds everything: the weights change nothing.
    assert ParallelDims(pp=1, first_stage_less_layers=3, last_stage_less_layers=3).stage_layers(4) == [4]
    # Interleaved 1F1B: 2 x pp virtual stages; the ends are stage 0 (on pipeline rank 0) and
    # stage 2pp-1 (on the last rank); the middle stages take the layers the ends give up.
    inter = ParallelDims(pp=2, pp_schedule="interleaved-1f1b", first_stage_less_layers=1,
                         last_stage_less_layers=1)
    assert inter.stage_layers(10) == [2, 3, 3, 2]
    assert [inter.stages_of(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [r.layers for r in planner._pipeline_ranks(10, inter)] == [(2, 3), (3, 2)]

    # training.parallelize cuts the model the same way: the first stage keeps the embedding
    # and one layer, the last the other three with the norm, the output layer and the loss.
    model = Transformer(ModelArgs(vocab_size=64, dim=16, n_layers=4, n_heads=2))
    dims = ParallelDims(pp=2, first_stage_less_layers=2)
    assert dims.stage_layers(4) == [1, 3]
    [(first_ids, [first])] = [split_pipeline(model, _PipelineRank(0), dims)]
    [(last_ids, [last])] = [split_pipeline(model, _PipelineRank(1), dims)]
    assert first_ids == [0] and last_ids == [1]
    assert list(first.layers.keys()) == ["0"] and first.tok_embeddings is not None
    assert first.output is None and first.norm is None
    assert list(last.layers.keys()) == ["1", "2", "3"] and last.tok_embeddings is None
    assert last.output is not None and last.norm is not None


def test_stage_weights_that_empty_a_stage_or_clash_with_an_explicit_split_are_refused():
    """The config, the planner and training.parallelize refuse the same weights in the same
    words: a stage left without a layer (with the largest weights that fit), and weights
    beside an explicit parallelism.pp_layers_per_stage (naming both fields)."""
    from core.layout import LayoutError, ParallelDims
    from training.parallelize import split_pipeline

    pp4 = ("model.n_layers=8", "parallelism.pp=4", "parallelism.nproc_per_node=4",
           "parallelism.dp_replicate=1", "training.micro_batch_size=8")
    reason = ("parallelism.pp_last_stage_less_layers=5 leaves the last pipeline stage without a "
              "layer: model.n_layers=8 on 4 stages (pp=4, 1f1b) would split [3, 3, 4, -2]")
    fix = "set parallelism.pp_last_stage_less_layers=1 or less (split [2, 2, 3, 1]), or lower parallelism.pp"
    with pytest.raises(ConfigError) as error:
        load_config(None, [*pp4, "parallelism.pp_last_stage_less_layers=5"])
    assert f"{reason}; {fix}" in str(error.value)
    valid = load_config(None, list(pp4))
    unchecked = valid.model_copy(update={"parallelism": valid.parallelism.model_copy(
        update={"pp_last_stage_less_layers": 5})})
    result = planner.plan_layout(unchecked, cluster(gpus=4), layout(pp=4))
    assert [str(p) for p in result.problems] == [f"{reason}; fix: {fix}"]
    with pytest.raises(ConfigError, match=re.escape(reason)):
        split_pipeline(Transformer(ModelArgs(vocab_size=64, dim=16, n_layers=8, n_heads=2)),
                       _PipelineRank(0), unchecked.parallelism.dims())
    # Weights larger than the layers: both ends run dry; the fix lowers both.
    with pytest.raises(ConfigError, match=re.escape(
            "parallelism.pp_first_stage_less_layers=9 and parallelism.pp_last_stage_less_layers=5 "
            "leave the first and the last pipeline stage without a layer") + ".*" + re.escape(
            "set parallelism.pp_first_stage_less_layers=2 and parallelism.pp_last_stage_less_layers=2"
            " or less (split [1, 3, 3, 1])")):
        load_config(None, [*pp4, "parallelism.pp_first_stage_less_layers=9",
                           "parallelism.pp_last_stage_less_layers=5"])
    # Interleaved: 4 layers on 2 x 2 stages leave no room for a weight.
    with pytest.raises(ConfigError, match=re.escape(
            "parallelism.pp_first_stage_less_layers=1 leaves the first pipeline stage without a "
            "layer: model.n_layers=4 on 4 stages (pp=2, interleaved-1f1b) would split [0, 1, 2, 1]")):
        load_config(None, ["model.n_layers=4", "parallelism.pp=2", "parallelism.dp_replicate=1",
                           "parallelism.pp_schedule=interleaved-1f1b", "training.micro_batch_size=4",
                           "parallelism.pp_first_stage_less_layers=1"])
    with pytest.raises(ConfigError, match="greater than or equal to 0"):
        load_config(None, [*pp4, "parallelism.pp_first_stage_less_layers=-1"])
    with pytest.raises(LayoutError, match="must not be negative"):
        ParallelDims(pp=2, first_stage_less_layers=-1).stage_layers(4)
    # The explicit list and the weights are two ways to set one split: one at a time.
    clash = ("parallelism.pp_layers_per_stage=[2, 2, 2, 2] and parallelism.pp_first_stage_less_layers=1"
             " both set the pipeline split")
    clash_fix = ("keep one: drop parallelism.pp_layers_per_stage, or set "
                 "parallelism.pp_first_stage_less_layers=0")
    with pytest.raises(ConfigError) as error:
        load_config(None, [*pp4, "parallelism.pp_layers_per_stage=[2,2,2,2]",
                           "parallelism.pp_first_stage_less_layers=1"])
    assert clash in str(error.value) and clash_fix in str(error.value)
    unchecked = valid.model_copy(update={"parallelism": valid.parallelism.model_copy(
        update={"pp_layers_per_stage": [2, 2, 2, 2], "pp_first_stage_less_layers": 1})})
    [problem] = planner.plan_layout(unchecked, cluster(gpus=4), layout(pp=4)).problems
    assert clash in str(problem) and clash_fix in str(problem)


def test_planner_accounts_for_lighter_end_stages():
    """A small model with a large vocabulary (Llama 3.2 1B's shape, untied): its output layer
    computes as much as 2.8 blocks, so 16 layers evenly on pp=4 leave the last rank the
    slowest. The planner says so and names the weight that evens the pace; with it set, the
    split, each rank's memory and the step time follow."""
    base = ["model.tie_embeddings=false", "parallelism.pp=4", "parallelism.dp_replicate=1",
            "parallelism.dp_shard=2", "training.micro_batch_size=8"]
    [even] = planner.plan(load_config("configs/llama3.2-1b.yaml", base), cluster())
    assert even.ok and even.stage_layers == [4, 4, 4, 4]
    assert even.output_blocks == pytest.approx(2.79, abs=0.01)
    assert even.imbalance == pytest.approx((4 + 2.79) / ((16 + 2.79) / 4), rel=1e-3)
    weight, split, imbalance = even.balancing
    assert (weight, split) == (3, [4, 5, 5, 2]) and imbalance < 1.07
    text = planner.explain(even, cluster())
    assert "the output layer and loss compute as much as 2.8 blocks" in text
    assert "parallelism.pp_last_stage_less_layers=3 would split [4, 5, 5, 2]" in text

    config = load_config("configs/llama3.2-1b.yaml", [*base, "parallelism.pp_last_stage_less_layers=3"])
    [lighter] = planner.plan(config, cluster())
    assert lighter.ok and lighter.stage_layers == [4, 5, 5, 2]
    assert lighter.imbalance == pytest.approx(imbalance) and lighter.balancing is None
    assert lighter.step_time_s < even.step_time_s * 0.8
    # Memory per rank follows the split: the last rank holds 2 blocks, not 4; the second
    # (5 blocks, 3 micro-batches in flight) now weighs more than before.
    s = planner._setup(config, cluster())
    ranks = {name: planner._pipeline_ranks(16, plan_dims)
             for name, plan_dims in (("even", config.parallelism.model_copy(
                 update={"pp_last_stage_less_layers": 0}).dims(8)), ("lighter", config.parallelism.dims(8)))}
    assert [r.layers for r in ranks["lighter"]] == [(4,), (5,), (5,), (2,)]
    memory = {name: [planner._rank_memory(s, config.parallelism.dims(8), "none", r) for r in rs]
              for name, rs in ranks.items()}
    assert memory["lighter"][3].weights < memory["even"][3].weights
    assert memory["lighter"][3].activations < memory["even"][3].activations
    assert memory["lighter"][1].activations > memory["even"][1].activations
    # Meta's 405B: the output layer weighs 0.6 of a block; the plain split is already the best.
    [big] = planner.plan(load_config("configs/llama3.1-405b.yaml", list(LLAMA_405B_1F1B)),
                         cluster(nodes=64))
    assert big.output_blocks == pytest.approx(0.61, abs=0.01) and big.balancing is None
    config = load_config("configs/llama3.1-405b.yaml", [*LLAMA_405B_1F1B,
                                                         "parallelism.pp_first_stage_less_layers=1",
                                                         "parallelism.pp_last_stage_less_layers=1"])
    [weighted] = planner.plan(config, cluster(nodes=64))
    assert weighted.ok and weighted.stage_layers == [7] + [8] * 14 + [7]


def test_few_microbatches_warn_with_their_bubble_unless_strict():
    """microbatches < 2*pp runs (the config accepts it): the planner warns with the bubble it
    costs, and refuses only when asked to be strict. What torch cannot run stays refused."""
    config = load_config(None, list(LLAMA2_7B) + ["parallelism.microbatches=4",
                                                   "training.micro_batch_size=4"])
    plan = planner.plan_layout(config, cluster(nodes=2), layout(dp_shard=4, pp=4))
    assert plan.ok
    [warning] = plan.warnings
    assert "microbatches=4 < 2*pp=8: the pipeline bubble (pp-1)/(microbatches+pp-1) = 42.9% " \
           "of the step" in str(warning)
    assert "set parallelism.microbatches=8" in str(warning) and "(bubble 27.3%)" in str(warning)
    assert "warning: microbatches=4 < 2*pp=8" in planner.explain(plan, cluster(nodes=2))
    strict = planner.plan_layout(config, cluster(nodes=2), layout(dp_shard=4, pp=4), strict=True)
    assert not strict.ok and strict.problems == [warning] and not strict.warnings
    by_config = config.model_copy(update={"parallelism": config.parallelism.model_copy(
        update={"strict_layout": True})})
    assert not planner.plan_layout(by_config, cluster(nodes=2), layout(dp_shard=4, pp=4)).ok
    # GPipe runs any number of micro-batches; 1F1B (torch's Schedule1F1B) needs pp of them.
    gpipe = load_config(None, list(LLAMA2_7B) + ["parallelism.microbatches=2", "parallelism.pp_schedule=gpipe",
                                                  "training.micro_batch_size=2"])
    assert planner.plan_layout(gpipe, cluster(nodes=2), layout(dp_shard=4, pp=4)).ok


def test_cli_warns_about_few_microbatches_and_refuses_them_when_strict(capsys):
    from flows.cli import main

    args = ["plan", "--config", str(REPO / "configs/llama2-7b.yaml"), "--nodes", "2",
            "parallelism.nnodes=2", "parallelism.dp_replicate=1", "parallelism.dp_shard=4",
            "parallelism.pp=4", "parallelism.microbatches=4", "training.micro_batch_size=4"]
    assert main(args) == 0
    out, _ = capsys.readouterr()
    assert "warning: microbatches=4 < 2*pp=8" in out and "42.9%" in out
    assert main([*args, "--strict"]) == 2
    _, err = capsys.readouterr()
    assert "microbatches=4 < 2*pp=8" in err and "set parallelism.microbatches=8" in err


# -- the published runs ------------------------------------------------------------------------
#
# Each run as its authors published it: model, layout, batch, hardware, what their software
# did (planner.Recipe) and what they measured. The planner must accept each layout on the
# memory it ran on and plan its tokens/s per GPU within 20% of the published figure, with
# goodput/planner.py's one set of constants (no per-run factor). `python
# benchmarks/plan_vs_published.py` prints this table against the planner (benchmarks/RESULTS.md).

GIB = 2**30


@dataclass(frozen=True)
class PublishedRun:
    source: str  # where the figures were read
    config: str | None  # a configs/ file, or None: the defaults
    overrides: tuple[str, ...]
    cluster: planner.Cluster
    recipe: planner.Recipe
    tokens_per_s_per_gpu: float | None = None  # as published; or from `mfu`:
    mfu: float | None = None  # as published, of cluster.gpu_flops
    memory_gib: float | None = None  # the peak they report, for the record
    skip: str | None = None  # why it cannot be planned yet
    layout: str | None = None  # the published layout, where the degrees cannot say it (CP)
    # Context parallelism: a degree of the layout, not of the config (parallelism.cp, which
    # the config refuses beside pp, as this trainer's pipeline does not carry it).
    cp: int = 1

    def load(self):
        return load_config(self.config, list(self.overrides))

    def plan(self) -> planner.LayoutPlan:
        config = self.load()
        # With CP the config's -1 degree fills the GPUs left beside the cp ranks.
        degrees = ({**planner.configured_degrees(config), "cp": self.cp} if self.cp > 1
                   else config.parallelism.degrees())
        return planner.plan_layout(config, self.cluster, degrees, strict=False,
                                   recipe=self.recipe, suggest=False)

    def published_per_gpu(self) -> float:
        """Tokens/s per GPU: as published, or the published MFU turned into tokens with the
        model's training FLOPs per token (6 x matmul parameters + 12 x layers x dim x seq)."""
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens_per_s_per_gpu
        config = self.load()
        flops = planner.model_flops_per_token(planner.model_args(config), config.training.seq_len)
        return self.mfu * self.cluster.gpu_flops / flops


# torchtitan's Llama 3.1 benchmarks: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md
# (December 2024; torch 1963fc8, torchtitan 9dec370). Grand Teton hosts: 8 H100 SXM with 96 GB
# of HBM2e at 2.4 TB/s, NVLink inside a host, 400 Gb/s RDMA per GPU between hosts, run at the
# default 500 W power limit; "the actual peak TFLOPs number is between SXM and NVL" (989 and
# 835 dense bf16): taken here as their midpoint, 912. Sequences of 8,192 tokens. Their
# software (torchtitan at 9dec370): FSDP2 with bf16 parameters and fp32 reduction (as goodput),
# selective checkpointing per op ("Saves output of all compute ops, except every second mm"),
# loss_parallel under TP, torch.compile per block (the loss stays eager), float8 via torchao on
# the linear layers, pipeline micro-batches = pp by default (pipeline_llama.py) and 2 stages per
# rank for interleaved schedules (pipelining_utils.py), no reshard after forward under PP.
TORCHTITAN_H100 = {"gpu_flops": 912e12, "memory_bandwidth": 2.4e12}
TORCHTITAN = planner.Recipe("torchtitan", selective="ops", vocab_parallel_loss=True,
                            compiled_loss=False)
TORCHTITAN_8B = ("parallelism.nproc_per_node=8", "parallelism.dp_replicate=1",
                 "parallelism.dp_shard=-1", "training.seq_len=8192", "training.micro_batch_size=2",
                 "training.grad_accum_steps=1", "parallelism.activation_checkpointing=selective",
                 "parallelism.mixed_precision=bf16")
TORCHTITAN_70B = ("parallelism.nnodes=32", "parallelism.dp_replicate=1", "parallelism.dp_shard=-1",
                  "parallelism.tp=8", "training.micro_batch_size=16", "training.grad_accum_steps=1",
                  "parallelism.activation_checkpointing=full", "parallelism.compile=true",
                  "parallelism.mixed_precision=bf16")
TORCHTITAN_405B = ("parallelism.nnodes=64", "parallelism.dp_replicate=1", "parallelism.dp_shard=-1",
                   "parallelism.tp=8", "parallelism.pp=8", "training.micro_batch_size=32",
                   "parallelism.microbatches=8", "parallelism.reshard_after_forward=false",
                   "parallelism.pp_virtual_stages=null",
                   "parallelism.activation_checkpointing=full", "parallelism.compile=true",
                   "parallelism.mixed_precision=bf16")
FLOAT8 = replace(TORCHTITAN, float8=True)
ASYNC_TP = replace(FLOAT8, tp_overlap=planner.ASYNC_TP_OVERLAP)


def torchtitan_8b(nodes: int, *extra: str) -> tuple:
    return ("configs/llama3.1-8b.yaml", (f"parallelism.nnodes={nodes}", *TORCHTITAN_8B, *extra),
            planner.Cluster(nodes, 8, 96 * GIB, **TORCHTITAN_H100))


# Meta's Llama 3 405B: "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4 ("Scaling
# configurations and MFU for each stage of Llama 3 405B pre-training"): TP 8, PP 16, sequences
# of 8,192 tokens, 16M tokens per batch; 8,192 GPUs: DP 64, 32 sequences per DP rank, 430
# TFLOP/s per GPU, 43% BF16 MFU; 16,384 GPUs: DP 128, 16 per DP rank, 400 TFLOP/s, 41%; with
# CP 16 at 131,072 tokens: DP 8 (8 x 16 x 16 x 8 = 16,384), 380 TFLOP/s, 38%. H100 80GB HBM3
# at 700 W (section 3.3.1). Section 3.3.2: CP by all-gather of K and V before attention,
# exposed on the critical path (planner._kv_bytes_per_microbatch), beside pipeline stages
# (Recipe.pipelined_context: this trainer refuses cp with pp).
# Section 3.3.2: FSDP that shards the optimizer state and gradients but keeps the weights
# after forward, interleaved pipeline stages with the first and last lighter by a layer,
# asynchronous point-to-point sends, gradients accumulated and reduce-scattered in fp32. Not
# published: the recomputation and the stages per rank; planned with the lightest of
# none / selective (half the blocks of each stage, Megatron's --recompute-method block) /
# full that fits 80 GB, and the stages per rank that give the shortest step (4).
META = planner.Recipe("meta", sharded_saves=True, fused_kernels=True, bf16_weights=True,
                      pp_overlap=True, pipelined_context=True)


def meta_405b(nodes: int, per_dp_rank: int, *extra: str) -> tuple:
    return ("configs/llama3.1-405b.yaml",
            (f"parallelism.nnodes={nodes}", f"training.micro_batch_size={per_dp_rank}",
             f"parallelism.microbatches={per_dp_rank}", "parallelism.compile=false",
             "parallelism.activation_checkpointing=selective", "parallelism.pp_virtual_stages=4",
             *extra),
            planner.Cluster(nodes, 8, 80 * GIB))


# MegaScale (ByteDance, NSDI 2024, arXiv 2402.15627): a 175B model on 12,288 Ampere GPUs at
# 55.2% MFU (the abstract). GPT-3 175B's shape (Brown et al. 2020, Table 2.1): 96 layers,
# dim 12,288, 96 heads, 2,048-token sequences; its 4 x dim GELU MLP has the weights of a
# SwiGLU 32,768 wide. NOT read here (the paper's full text was out of reach of this
# machine's search): the layout and batch, taken as Megatron-LM's for this model, TP 8 x PP 8
# (DP 192), 6,144 sequences per batch (32 per DP rank), no recomputation (it fits), 12 stages
# per rank (the planner's choice). The techniques are the paper's: parallel transformer
# blocks, TP, PP and DP communication overlapped with compute, fused kernels (Megatron).
# A100 SXM 80GB: 312 TFLOP/s, 2.04 TB/s, NVLink 300 GB/s, 200 Gb/s per GPU between hosts.
MEGASCALE = planner.Recipe("megascale", sharded_saves=True, fused_kernels=True, bf16_weights=True,
                           pp_overlap=True, tp_overlap=1.0, parallel_blocks=True)
GPT3_175B = ("tokenizer.vocab_size=50257", "model.dim=12288", "model.n_layers=96", "model.n_heads=96",
             "model.ffn_hidden_dim=32768", "model.max_seq_len=2048", "training.seq_len=2048",
             "parallelism.nnodes=1536", "parallelism.nproc_per_node=8", "parallelism.dp_replicate=1",
             "parallelism.dp_shard=-1", "parallelism.tp=8", "parallelism.pp=8",
             "training.micro_batch_size=32", "parallelism.microbatches=32",
             "parallelism.pp_schedule=interleaved-1f1b", "parallelism.pp_virtual_stages=12",
             "parallelism.activation_checkpointing=none", "parallelism.mixed_precision=bf16")
A100 = {"gpu_flops": planner.A100_FLOPS, "memory_bandwidth": planner.A100_HBM,
        "intra_node_bandwidth": 300e9}

# llm.c's GPT-2 124M (karpathy/llm.c, scripts/run_gpt2_124M.sh; discussion 481, May 2024):
# 8 x A100 80GB SXM, 64 x 1,024 tokens per GPU, no recomputation, bf16, ZeRO-1 (all-reduce
# volume: DDP's here), hand-fused CUDA kernels; 524,288 tokens per ~300 ms step, "~60% MFU".
# GPT-2's 4x GELU MLP has the weights of a SwiGLU 2,048 wide; tied embeddings, its 50,257
# tokens padded to 50,304; no learned positions (0.8M parameters, no matmul).
LLM_C = ("tokenizer.vocab_size=50257", "model.dim=768", "model.n_layers=12", "model.n_heads=12",
         "model.ffn_hidden_dim=2048", "model.tie_embeddings=true", "model.max_seq_len=1024",
         "training.seq_len=1024", "training.micro_batch_size=64", "training.grad_accum_steps=1",
         "parallelism.nproc_per_node=8", "parallelism.dp_replicate=8", "parallelism.mixed_precision=bf16")


# This trainer on one H100 SXM 80GB (benchmarks/RESULTS.md, "MFU on one GPU", 2026-11-26;
# benchmarks/mfu_bench.py's sizes): compiled, bf16 autocast, fused AdamW.
def goodput_h100(dim: int, n_layers: int, n_heads: int, vocab: int, seq: int, batch: int) -> tuple:
    return (None, (f"tokenizer.vocab_size={vocab}", f"model.dim={dim}", f"model.n_layers={n_layers}",
                   f"model.n_heads={n_heads}", f"model.max_seq_len={seq}", f"training.seq_len={seq}",
                   f"training.micro_batch_size={batch}", "parallelism.nproc_per_node=1",
                   "parallelism.compile=true"),
            planner.Cluster(1, 1, 80 * GIB))


def _run(where: tuple, source: str, recipe: planner.Recipe, **figures) -> PublishedRun:
    config, overrides, on = where
    return PublishedRun(source, config, overrides, on, recipe, **figures)


TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
LLAMA3 = "Llama 3 paper, Table 4"
PUBLISHED = {
    # Table 1: 8B, 8 GPUs, FSDP, local batch 2, selective checkpointing: TPS/GPU, memory GiB.
    "torchtitan-8b-8gpu": _run(torchtitan_8b(1), f"{TT}, Table 1", TORCHTITAN,
                               tokens_per_s_per_gpu=5_762, memory_gib=82.4),
    "torchtitan-8b-8gpu-compile": _run(torchtitan_8b(1, "parallelism.compile=true"),
                                       f"{TT}, Table 1", TORCHTITAN,
                                       tokens_per_s_per_gpu=6_667, memory_gib=77.0),
    "torchtitan-8b-8gpu-compile-float8": _run(torchtitan_8b(1, "parallelism.compile=true"),
                                              f"{TT}, Table 1", FLOAT8,
                                              tokens_per_s_per_gpu=8_532, memory_gib=76.8),
    # Table 3: the same on 128 GPUs (16 hosts).
    "torchtitan-8b-128gpu": _run(torchtitan_8b(16), f"{TT}, Table 3", TORCHTITAN,
                                 tokens_per_s_per_gpu=5_605, memory_gib=67.0),
    "torchtitan-8b-128gpu-compile": _run(torchtitan_8b(16, "parallelism.compile=true"),
                                         f"{TT}, Table 3", TORCHTITAN,
                                         tokens_per_s_per_gpu=6_514, memory_gib=62.0),
    "torchtitan-8b-128gpu-compile-float8": _run(torchtitan_8b(16, "parallelism.compile=true"),
                                                f"{TT}, Table 3", FLOAT8,
                                                tokens_per_s_per_gpu=8_380, memory_gib=61.8),
    # Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, compile + float8, local batch 16, full checkpointing.
    "torchtitan-70b-256gpu": _run(("configs/llama3.1-70b.yaml", TORCHTITAN_70B,
                                   planner.Cluster(32, 8, 96 * GIB, **TORCHTITAN_H100)),
                                  f"{TT}, Table 4", FLOAT8, tokens_per_s_per_gpu=829,
                                  memory_gib=71.9),
    "torchtitan-70b-256gpu-asynctp": _run(("configs/llama3.1-70b.yaml", TORCHTITAN_70B,
                                           planner.Cluster(32, 8, 96 * GIB, **TORCHTITAN_H100)),
                                          f"{TT}, Table 4", ASYNC_TP, tokens_per_s_per_gpu=876,
                                          memory_gib=67.6),
    # Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, compile + float8 + AsyncTP, local batch 32.
    "torchtitan-405b-512gpu-1f1b": _run(("configs/llama3.1-405b.yaml",
                                         (*TORCHTITAN_405B, "parallelism.pp_schedule=1f1b"),
                                         planner.Cluster(64, 8, 96 * GIB, **TORCHTITAN_H100)),
                                        f"{TT}, Table 5", ASYNC_TP, tokens_per_s_per_gpu=100,
                                        memory_gib=82.5),
    "torchtitan-405b-512gpu-interleaved": _run(("configs/llama3.1-405b.yaml",
                                                (*TORCHTITAN_405B, "parallelism.pp_virtual_stages=2",
                                                 "parallelism.pp_schedule=interleaved-1f1b"),
                                                planner.Cluster(64, 8, 96 * GIB, **TORCHTITAN_H100)),
                                               f"{TT}, Table 5", ASYNC_TP,
                                               tokens_per_s_per_gpu=128, memory_gib=72.7),
    "llama3-405b-8192gpu": _run(meta_405b(1024, 32), LLAMA3, META, mfu=0.43),
    "llama3-405b-16384gpu": _run(meta_405b(2048, 16), LLAMA3, META, mfu=0.41),
    "llama3-405b-16384gpu-cp16": _run(meta_405b(2048, 16, "training.seq_len=131072",
                                                "model.max_seq_len=131072"), LLAMA3, META,
                                      mfu=0.38, layout="dp 8 x cp 16 x tp 8 x pp 16", cp=16),
    "megascale-175b-12288gpu": _run((None, GPT3_175B, planner.Cluster(1536, 8, 80 * GIB,
                                                                      inter_node_bandwidth=25e9,
                                                                      **A100)),
                                    "MegaScale, arXiv 2402.15627 (abstract)", MEGASCALE, mfu=0.552),
    "llm.c-gpt2-124m-8xA100": _run((None, LLM_C, planner.Cluster(1, 8, 80 * GIB, **A100)),
                                   "karpathy/llm.c scripts/run_gpt2_124M.sh, discussion 481",
                                   planner.Recipe("llm.c", fused_kernels=True),
                                   tokens_per_s_per_gpu=524_288 / 0.300 / 8),
    "goodput-gpt2-124m-1xH100": _run(goodput_h100(768, 12, 12, 50304, 1024, 32),
                                     "benchmarks/RESULTS.md, MFU on one GPU", planner.GOODPUT,
                                     tokens_per_s_per_gpu=444_280, memory_gib=18.1),
    "goodput-1b-1xH100": _run(goodput_h100(2048, 18, 16, 32000, 2048, 8),
                              "benchmarks/RESULTS.md, MFU on one GPU", planner.GOODPUT,
                              tokens_per_s_per_gpu=75_564, memory_gib=35.4),
}


def _published_params():
    return [pytest.param(name, marks=pytest.mark.skip(reason=run.skip)) if run.skip else name
            for name, run in PUBLISHED.items()]


@pytest.mark.parametrize("name", _published_params())
def test_the_planner_reproduces_published_runs(name):
    """Each published layout fits the memory it ran on, and the planned tokens/s per GPU is
    within 20% of the published figure."""
    run = PUBLISHED[name]
    plan = run.plan()
    assert plan.ok, plan.problems
    assert plan.memory.peak <= run.cluster.gpu_memory
    ratio = plan.tokens_per_s / run.cluster.world_size / run.published_per_gpu()
    assert 0.8 <= ratio <= 1.2, ratio


def test_llama3_405b_config_is_metas_layout_and_plans_its_mfu():
    """configs/llama3.1-405b.yaml holds Table 4's 16,384-GPU layout: this trainer's own
    execution of it is accepted on 80 GB H100s and plans 41% +- 8 points MFU; the planner
    suggests the interleaved stages the config sets."""
    from core.layout import default_split

    config = load_config("configs/llama3.1-405b.yaml")
    [plan] = planner.plan(config, planner.Cluster(2048, 8, 80 * GIB))
    assert plan.ok, plan.problems
    assert plan.degrees == layout(dp_shard=128, tp=8, pp=16)
    assert plan.stage_layers == default_split(126, 16 * 7)
    assert plan.mfu == pytest.approx(0.41, abs=0.08)
    assert plan.best_virtual_stages[0] == config.parallelism.pp_virtual_stages == 7


def test_meta_s_published_mfu_is_the_models_own_flop_count():
    """400 TFLOP/s per GPU is 40.4% of an H100's 989 (Meta rounds to 41%), and the tokens/s
    it stands for follow from the planner's (and the trainer's) FLOPs per token."""
    run = PUBLISHED["llama3-405b-16384gpu"]
    assert 400e12 / planner.H100_FLOPS == pytest.approx(0.41, abs=0.01)
    args = planner.model_args(run.load())
    assert run.published_per_gpu() == pytest.approx(0.41 * planner.H100_FLOPS
                                                     / planner.model_flops_per_token(args, 8192))


def test_the_published_runs_mfu_matches_the_models_own_flop_count():
    """The planner's FLOPs per token are the trainer's (the MFU it logs): torchtitan's 8B run
    at 5,762 tokens/s is 33.7% MFU of an H100's 989 TFLOP/s, as torchtitan reports (33%);
    llm.c's 124M at 218,453 tokens/s is 60% of an A100's 312 (Karpathy: ~60%)."""
    import torch

    args = planner.model_args(PUBLISHED["torchtitan-8b-8gpu"].load())
    with torch.device("meta"):
        assert planner.model_flops_per_token(args, 8192) == Transformer(args).flops_per_token(8192)
    assert 5_762 * planner.model_flops_per_token(args, 8192) / planner.H100_FLOPS == pytest.approx(0.337, abs=0.001)
    args = planner.model_args(PUBLISHED["llm.c-gpt2-124m-8xA100"].load())
    assert 524_288 / 0.3 / 8 * planner.model_flops_per_token(args, 1024) / planner.A100_FLOPS \
        == pytest.approx(0.60, abs=0.005)


@pytest.mark.parametrize("name", ["goodput-gpt2-124m-1xH100", "goodput-1b-1xH100"])
def test_compiled_memory_matches_the_h100_peaks(name):
    """parallelism.compile changes what a step holds (the fused loss keeps bf16 logits, not
    fp32 log-probabilities; each compiled block recomputes its pointwise ops): the estimate
    is within 15% of the peaks measured on the H100 (max_memory_allocated), where the eager
    estimate is 1.9x and 1.3x of them (2x and 1.45x before RMSNorm became torch's fused
    kernel, which on CUDA keeps only its input and inverse RMS)."""
    run = PUBLISHED[name]
    compiled = run.plan().memory.peak / GIB
    assert compiled == pytest.approx(run.memory_gib, rel=0.15), compiled
    eager = replace(run, overrides=(*run.overrides, "parallelism.compile=false"))
    assert eager.plan().memory.peak / GIB > 1.25 * run.memory_gib


def test_explain_shows_the_arithmetic_of_the_step():
    """goodput plan --explain: every figure with the numbers it comes from, as a table a
    reviewer can check by hand; the rows' times add up to the step."""
    run = PUBLISHED["llama3-405b-16384gpu"]
    plan = run.plan()
    table = planner.explain_table(plan, run.cluster, run.load(), run.recipe)
    assert "| FLOPs per token" in table and "| bubble |" in table
    assert "| step |" in table and f"{plan.step_time_s:.3f} s" in table
    for kind in ("matmuls", "attention", "memory-bound", "tp exposed"):
        assert f"| {kind} |" in table
    parts = sum(plan.work.seconds.values()) / (1 - plan.bubble) + plan.exposed_comm_s
    assert parts == pytest.approx(plan.step_time_s)


def test_cli_explains_the_405b_config(capsys):
    from flows.cli import main

    assert main(["plan", "--config", str(REPO / "configs/llama3.1-405b.yaml"), "--explain"]) == 0
    out, _ = capsys.readouterr()
    assert "| quantity | how | value |" in out and "| MFU |" in out
    assert "parallelism.pp_virtual_stages=7 gives the shortest step" in out


# -- mixture of experts and context parallelism ----------------------------------------------

MOE_SMALL = dict(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                 moe={"num_experts": 8, "top_k": 2, "expert_dim": 48, "shared_experts": 1,
                      "first_dense_layers": 1})


@pytest.mark.parametrize("args", [
    ModelArgs(**MOE_SMALL),
    ModelArgs(**{**MOE_SMALL, "head_dim": 32, "qk_norm": True, "tie_embeddings": True}),  # Qwen3's
    ModelArgs(**{**MOE_SMALL, "head_dim": 32, "qk_norm": True, "moe": None}),  # dense, wide queries
])
def test_moe_parameters_and_active_flops_match_the_model(args):
    """The planner counts training/model.py's parameters exactly, MoE blocks (router, routed
    and shared experts, dense first blocks) and Qwen3's head_dim and q/k norms included, and
    its FLOPs per token are the trainer's MFU numerator: the active parameters (a token's
    top_k experts, not the others) and attention over n_heads x head_dim."""
    model = Transformer(args)
    count = planner.count_params(args)
    assert count.total == model.num_params(non_embedding=False)
    assert count.non_embedding == model.num_params()
    assert count.inactive == model.inactive_params()
    assert planner.model_flops_per_token(args, 64) == model.flops_per_token(64)


def test_tiny_moe_counts_every_parameter():
    """configs/tiny-moe.yaml's model has 3,072,128 parameters (the planner once counted the
    dense model's 1.85M), of which a token uses 2 of 8 experts in the 3 MoE blocks."""
    count = planner.count_params(planner.model_args(load_config("configs/tiny-moe.yaml")))
    expert = 3 * 128 * 176
    attention_and_norms = 4 * 128 * 128 + 2 * 128
    assert count.total == (4096 * 128 + 4096 * 128 + 128  # embedding, output, final norm
                           + 4 * attention_and_norms + 3 * 128 * 352  # the dense first block
                           + 3 * (128 * 8 + 8 * expert)) == 3_072_128  # router, 8 experts
    assert count.inactive == 3 * (8 - 2) * expert


def test_moe_configs_have_the_published_sizes():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (Qwen's model card); DeepSeek-V3: 671B,
    37B active (its technical report), with MLA planned as grouped-query attention of the
    same parameters (configs/deepseek-v3.yaml says so)."""
    qwen = planner.count_params(planner.model_args(load_config("configs/qwen3-30b-a3b.yaml")))
    assert qwen.total == 30_532_122_624 and qwen.active == pytest.approx(3.3e9, rel=0.02)
    deepseek = planner.count_params(planner.model_args(load_config("configs/deepseek-v3.yaml")))
    assert deepseek.total == pytest.approx(671e9, rel=0.001)
    assert deepseek.active == pytest.approx(37e9, rel=0.02)
    # MLA's parameters per layer (q_a 7168x1536 and its norm, q_b 1536x128x192, kv_a
    # 7168x576 and its norm, kv_b 512x128x256, o 16384x7168) against the stand-in's.
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert deepseek.moe.matrix == pytest.approx(mla, rel=0.001)


H800 = {"intra_node_bandwidth": 160e9, "inter_node_bandwidth": 50e9}  # DeepSeek-V3, section 3.2.2


def test_moe_configs_plan_on_their_hardware(capsys):
    """goodput plan accepts each MoE config's published layout on its hardware, and
    explains the MoE rows: active parameters, the experts' shards, the all-to-all."""
    from flows.cli import main

    assert main(["plan", "--config", str(REPO / "configs/qwen3-30b-a3b.yaml"), "--explain"]) == 0
    out, _ = capsys.readouterr()
    assert "x ep=2" in out and "| active parameters |" in out and "| ep communication |" in out
    assert "| efsdp communication |" in out and "experts / 4)" in out
    assert main(["plan", "--config", str(REPO / "configs/deepseek-v3.yaml"),
                 "--intra-node-gbps", "160", "--inter-node-gbps", "50"]) == 0
    out, _ = capsys.readouterr()
    assert "dp_shard=128 x cp=1 x tp=1 x pp=16 x ep=64" in out and "communication ep:" in out
    config = load_config("configs/deepseek-v3.yaml")
    [plan] = planner.plan(config, planner.Cluster(256, 8, 80 * GIB, **H800))
    assert plan.ok and plan.memory.peak < 80 * GIB
    # 4 of each MoE layer's 256 experts per GPU, their states sharded over the 2 such GPUs;
    # the rank that needs the most is the last (3 MoE blocks beside the output layer).
    assert plan.stage_layers[-1] == 3
    assert plan.memory.expert_shard == 2 and plan.memory.state_shard == 128
    assert plan.memory.expert_params == 3 * 4 * 3 * 7168 * 2048


def test_search_of_a_moe_config_ranks_the_layouts_its_ep_fits_on_any_cluster(capsys):
    """`goodput plan --search` of qwen3-30b-a3b (ep=2, its degrees for one 8-GPU node):
    layouts whose dp_shard x tp its ep does not divide are listed as unable to run (they
    raised ZeroDivisionError), and flags for another cluster re-plan its degrees instead of
    refusing them as not filling it."""
    from flows.cli import main

    config = load_config("configs/qwen3-30b-a3b.yaml")
    plans = planner.search(config, planner.Cluster(1, 8, 96 * GIB))
    split = [p for p in plans if p.degrees["dp_shard"] * p.degrees["tp"] % 2]
    assert split and all(not p.ok and "parallelism.ep=2 does not divide" in str(p.problems) for p in split)
    assert plans[0].ok
    assert main(["plan", "--config", str(REPO / "configs/qwen3-30b-a3b.yaml"), "--nodes", "2",
                 "--search", "--top", "3"]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[1].split()[0] == "1"  # a ranked layout of the 16 GPUs


@pytest.mark.parametrize("overrides, message", [
    # 96 of the 2,048 GPUs' ... : ep divides dp_shard but not the 256 experts.
    (["parallelism.nnodes=192", "parallelism.ep=96"],
     "parallelism.ep=96 does not divide model.moe.num_experts=256"),
    (["parallelism.ep=256"], "parallelism.ep=256 does not divide parallelism.dp_shard=128"),
    (["model.moe=null"], "parallelism.ep=64 splits the experts of a mixture-of-experts model, "
                         "and this model has none"),
])
def test_impossible_moe_layouts_are_refused_naming_the_field(overrides, message, capsys):
    from flows.cli import main

    assert main(["plan", "--config", str(REPO / "configs/deepseek-v3.yaml"), *overrides]) == 2
    _, err = capsys.readouterr()
    assert message in err


def test_experts_without_ep_do_not_fit_and_the_plan_says_so():
    """Qwen3-30B-A3B with every expert on every GPU under TP (ep=1: the trainer replicates
    the experts over TP) needs more than its 96 GiB; with ep=8 the experts split 8 ways."""
    config = load_config("configs/qwen3-30b-a3b.yaml", ["parallelism.dp_shard=2", "parallelism.tp=4",
                                                         "parallelism.ep=1"])
    [plan] = planner.plan(config, cluster(memory="96GiB"))
    assert not plan.ok and "needs" in str(plan.problems[0])
    assert "set parallelism.ep=2 (each MoE layer's experts split 2 ways)" in str(plan.problems[0])
    split = load_config("configs/qwen3-30b-a3b.yaml", ["parallelism.dp_shard=2", "parallelism.tp=4",
                                                        "parallelism.ep=8"])
    [plan] = planner.plan(split, cluster(memory="96GiB"))
    assert plan.ok and plan.memory.expert_shard == 1
    assert plan.memory.expert_params == 48 * 128 * 3 * 2048 * 768 / 8


def test_expert_memory_and_all_to_all_by_hand():
    """configs/tiny-moe.yaml (2 workers, FSDP over both, ep=2), fp32 on CPU: each worker holds
    4 of each MoE layer's 8 experts whole (efsdp = dp_shard x tp / ep = 1) and half of every
    other weight; each step every MoE block sends (ep-1)/ep of its top_k rows out and back,
    forward and backward."""
    config = load_config("configs/tiny-moe.yaml")
    plan = planner.plan_layout(config, planner.Cluster(1, 2, None, device="cpu"),
                               planner.configured_degrees(config))
    assert plan.ok and plan.ep == 2
    expert = 3 * 128 * 176
    experts = 3 * 4 * expert  # 3 MoE blocks x 4 experts
    rest = 3_072_128 - 3 * 8 * expert
    assert plan.memory.expert_params == experts and plan.memory.expert_shard == 1
    assert plan.memory.weights == 4 * (rest / 2 + experts)
    assert plan.memory.optimizer == 8 * (rest / 2 + experts)
    tokens = 8 * 128  # micro_batch_size x seq_len per worker
    assert plan.comm["ep"] == 3 * 4 * tokens * 2 * 128 * 4 * (1 / 2)
    assert plan.name.endswith("x ep=2")


def test_context_parallelism_cuts_activations_and_sends_kv_by_hand():
    """CP=2 (the layout's cp degree, parallelism.cp): each
    rank computes half of every sequence, keeping half the activations but the whole
    sequence's keys and values, which it all-gathers in forward and reduce-scatters in
    backward."""
    config = load_config(None, ["model.dim=256", "model.n_layers=4", "model.n_heads=8",
                                "model.n_kv_heads=2", "model.max_seq_len=4096",
                                "training.seq_len=4096", "training.micro_batch_size=1",
                                "parallelism.nproc_per_node=2", "parallelism.dp_replicate=1",
                                "parallelism.dp_shard=2", "parallelism.mixed_precision=fp32"])
    on = planner.Cluster(1, 2, None, device="cpu")
    whole = planner.plan_layout(config, on, layout(dp_shard=2))
    split = planner.plan_layout(config, on, layout(dp_shard=1, cp=2))
    assert whole.ok and split.ok and split.name == "dp_replicate=1 x dp_shard=1 x cp=2 x tp=1 x pp=1"
    kv = 2 * 2 * 32  # K and V of 2 kv heads of 32
    assert split.comm["cp"] == 4 * 2 * kv * 4096 * 4 * (1 / 2)  # 4 blocks, forward + backward
    # Per block, in place of its own tokens' K and V repeated to 8 heads of 32 (as one process
    # keeps them), the whole sequence's K and V of the 2 kv heads, as gathered.
    kv_saved = 4 * 2 * (2 * 32 * 4096 - 8 * 32 * 2048)
    assert split.memory.stage_bytes == pytest.approx(whole.memory.stage_bytes / 2 + 4 * kv_saved)
    head = whole.memory.activations - whole.memory.stage_bytes  # the output layer and loss
    assert split.memory.activations == pytest.approx(split.memory.stage_bytes + head / 2)
    assert split.memory.activations < 0.6 * whole.memory.activations
    # Each sequence's 2 x cp chunks must split evenly, also over TP.
    odd = load_config(None, ["training.seq_len=130", "model.max_seq_len=256"])
    [problem] = planner.plan_layout(odd, on, layout(dp_shard=1, cp=2)).problems
    assert "training.seq_len=130 does not split into 2 x cp = 4 equal chunks" in str(problem)
    assert "set training.seq_len to a multiple of 4, e.g. 132" in str(problem)


def test_explain_shows_context_parallel_rows():
    run = PUBLISHED["llama3-405b-16384gpu-cp16"]
    plan = run.plan()
    table = planner.explain_table(plan, run.cluster, run.load(), run.recipe)
    assert "| cp communication |" in table and "K/V all-gathers whole" in table
    assert plan.degrees["cp"] == 16 and plan.degrees["dp_shard"] == 8
    # Meta's framework ran CP beside pipeline stages (Recipe.pipelined_context); this trainer
    # does not, and its own plan of the layout says so (core.layout's rule).
    own = planner.plan_layout(run.load(), run.cluster, plan.degrees, strict=False)
    assert not own.ok and "parallelism.cp=16 with pp=16 is not supported" in str(own.problems[0])


def test_recipes_keep_what_their_frameworks_keep_by_hand():
    """The techniques published runs used, counted by hand for one small Llama block (dim 64,
    kv 32, ffn 192, 4 heads; 10 tokens, tp 2, bf16): Megatron's sequence-parallel shards,
    its selective recomputation (the core attention's output not kept), torchtitan's
    op-level selection, and Megatron's bf16 weights beside a sharded fp32 optimizer."""
    args = ModelArgs(vocab_size=64, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192)
    assert (args.kv_heads * args.head_dim, args.ffn_hidden) == (32, 192)
    # Norm and column-parallel inputs (4 x 64), q/k/v (64 + 2 x 32), output (64), w1/w3/w2 in
    # (3 x 192): 2 bytes each, + fp32 lse per head, all over tp.
    kept = 2 * (4 * 64 + 64 + 2 * 32 + 64 + 3 * 192) + 4 * 4
    assert planner.sharded_block_activation_bytes(args, 10, 2, 2) == 10 * kept / 2
    assert planner.sharded_block_activation_bytes(args, 10, 2, 2, recompute_attention=True) \
        == 10 * (kept - 2 * 64 - 4 * 4) / 2
    # torchtitan: the input (bf16 residual), wq's, wv's, SDPA's, w1's and w2's outputs, lse.
    assert planner.op_checkpointed_block_bytes(args, 10, 2, 2, 2) \
        == 10 * (2 * 64 + 2 * (64 + 32 + 64 + 192 + 64) + 4 * 4) / 2
    # Megatron/Meta: 2 + 4 bytes per parameter whole, 12 sharded over the data-parallel ranks.
    config = load_config(None, ["tokenizer.vocab_size=512", "model.dim=64", "model.n_layers=2",
                                "model.n_heads=4", "parallelism.nproc_per_node=8",
                                "parallelism.dp_replicate=4", "parallelism.tp=2",
                                "parallelism.mixed_precision=bf16"])
    megatron = planner.Recipe("megatron", sharded_saves=True, fused_kernels=True, bf16_weights=True)
    plan = planner.plan_layout(config, cluster(gpus=8), layout(dp_replicate=4, tp=2), recipe=megatron)
    local = plan.memory.local_params
    memory = plan.memory
    assert (memory.weights, memory.gradients, memory.optimizer) == (2 * local, 4 * local,
                                                                    12 * local / 4)
    # Its distributed optimizer moves 6 bytes per parameter per step over the data-parallel ranks.
    assert plan.comm["dp_replicate"] == pytest.approx(3 / 4 * 6 * local)


def test_the_planner_suggests_the_interleaved_stages_with_the_shortest_step():
    """More stages per rank shrink the bubble and multiply the pipeline's sends: across
    slow links (here 1 GB/s between nodes) the sends win and fewer stages are best; on
    fast ones the bubble wins. The suggestion is the v whose planned step is shortest."""
    base = ("configs/llama3.1-70b.yaml", ["parallelism.nnodes=4", "parallelism.dp_replicate=1",
                                          "parallelism.dp_shard=1", "parallelism.tp=8",
                                          "parallelism.pp=4", "training.micro_batch_size=4",
                                          "parallelism.microbatches=4",
                                          "parallelism.pp_schedule=interleaved-1f1b"])
    config = load_config(*base)
    fast = planner.Cluster(4, 8, 1024 * GIB)
    slow = replace(fast, inter_node_bandwidth=1e9)
    suggested = {}
    for name, on in (("fast", fast), ("slow", slow)):
        v, step = planner.plan_layout(config, on, config.parallelism.degrees()).best_virtual_stages
        steps = {}
        for w in range(2, 21):
            with_w = load_config(base[0], [*base[1], f"parallelism.pp_virtual_stages={w}"])
            steps[w] = planner.plan_layout(with_w, on, config.parallelism.degrees()).step_time_s
        assert step == min(steps.values()) == steps[v]
        suggested[name] = v
    assert suggested["slow"] < suggested["fast"]
    text = planner.explain(planner.plan_layout(config, fast, config.parallelism.degrees()), fast)
    assert f"parallelism.pp_virtual_stages={suggested['fast']}" in text


def train_briefly(tmp_path, run_id: str, *overrides: str) -> Path:
    """A real single-process training run of a few steps; its run directory."""
    from goodput.runs import write_run_config
    from tests.helpers import small_config, synthetic_dataset

    dataset = synthetic_dataset(tmp_path / "dataset")
    config = small_config(tmp_path, f"run.run_id={run_id}", "parallelism.device=cpu",
                          "parallelism.nproc_per_node=1", "training.max_steps=6",
                          "training.log_every=2", "checkpoint.every_steps=6", *overrides)
    cmd = [sys.executable, "-m", "training", "--config", str(write_run_config(config)),
           "--dataset", str(dataset)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return config.run_dir.path


def test_plan_takes_the_compute_efficiency_from_a_runs_measured_mfu(tmp_path, capsys):
    """--from-run: the efficiency at which the planner's estimate of the run's own config
    gives the MFU the run logged; planning that config again reproduces the MFU. (On CPU
    the run logs an MFU only against a stated peak: training.peak_flops_per_device.)"""
    from flows.cli import main

    peak = 2e11
    run_dir = train_briefly(tmp_path, "measured", f"training.peak_flops_per_device={peak}")
    mfu, records = planner.measured_mfu(run_dir)
    assert 0 < mfu < 1 and records == 2  # steps 2, 4, 6 logged; the first (warm-up) left out
    on = planner.Cluster(1, 1, None, gpu_flops=peak, device="cpu")
    measured = planner.efficiency_from_run(run_dir, on)
    assert measured.compute_efficiency != planner.COMPUTE_EFFICIENCY
    assert measured.efficiency_source.startswith(f"measured: run measured logged MFU {mfu:.1%}")
    run_config = load_config(str(run_dir / "config.yaml"))
    again = planner.plan_layout(run_config, measured, run_config.parallelism.degrees())
    assert again.mfu == pytest.approx(mfu, rel=1e-4)

    code = main(["plan", "--config", str(run_dir / "config.yaml"), "--from-run", str(run_dir),
                 "--gpu-tflops", str(peak / 1e12), "--gpu-memory", "64GiB"])
    out, _ = capsys.readouterr()
    assert code == 0 and f"logged MFU {mfu:.1%}" in out and f"MFU {mfu:.1%}" in out


def test_plan_from_a_run_without_an_mfu_says_why(tmp_path, capsys):
    from flows.cli import main

    run_dir = train_briefly(tmp_path, "cpu-only")  # CPU, no peak FLOP/s: no MFU logged
    code = main(["plan", "--config", "configs/llama3.1-8b.yaml", "--from-run", str(run_dir)])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"--from-run {run_dir}: {run_dir / 'metrics.jsonl'} records no MFU: a run on CPU" in err
    assert "training.peak_flops_per_device" in err and "--compute-efficiency" in err
    code = main(["plan", "--config", "configs/llama3.1-8b.yaml", "--from-run", str(tmp_path / "none")])
    assert code == 2 and "no metrics.jsonl there" in capsys.readouterr().err


def test_llama2_7b_parameters_and_16_bytes_per_parameter():
    config = load_config(None, list(LLAMA2_7B))
    assert planner.count_params(planner.model_args(config)).total == 6_738_415_616  # Llama 2 7B
    # One GPU holding everything: fp32 master weights + fp32 grads + Adam moments = 16 B/param,
    # so an even 7e9 parameters would be 112 GB; this "7B" is 6.74e9 -> 107.8 GB.
    whole = planner.plan_layout(config, cluster(gpus=1, memory="1TiB"), layout())
    states = whole.memory.weights + whole.memory.gradients + whole.memory.optimizer
    assert states == 16 * 6_738_415_616
    assert states / GB == pytest.approx(107.8, abs=0.05)
    # FSDP over 8 GPUs shards all three: 14 GB for 7e9 parameters, 13.5 GB here.
    sharded = planner.plan_layout(config, cluster(), layout(dp_shard=8))
    states = sharded.memory.weights + sharded.memory.gradients + sharded.memory.optimizer
    assert states == 16 * 6_738_415_616 / 8
    # TP splits the matrices but replicates the norm weights (65 x 4096 of them).
    tp = planner.plan_layout(config, cluster(), layout(tp=8))
    norms = (2 * 32 + 1) * 4096
    assert tp.memory.weights == 4 * ((6_738_415_616 - norms) / 8 + norms)


@pytest.mark.parametrize("pp, m, v, expected", [
    (1, 1, 1, 0.0), (2, 4, 1, 1 / 5), (4, 8, 1, 3 / 11), (8, 16, 1, 7 / 23), (4, 8, 2, 3 / 19)])
def test_pipeline_bubble(pp, m, v, expected):
    assert planner.pipeline_bubble(pp, m, v) == pytest.approx(expected)


def test_plan_reports_the_bubble_of_its_schedule():
    config = load_config(None, list(LLAMA2_7B) + ["training.micro_batch_size=8"])
    assert planner.plan_layout(config, cluster(), layout(dp_shard=2, pp=4)).bubble == pytest.approx(3 / 11)
    interleaved = config.model_copy(update={"parallelism": config.parallelism.model_copy(
        update={"pp_schedule": "interleaved-1f1b"})})
    assert planner.plan_layout(interleaved, cluster(), layout(dp_shard=2, pp=4)).bubble == pytest.approx(3 / 19)


def test_communication_volumes_by_hand():
    config = load_config(None, list(LLAMA2_7B))
    P = 6_738_415_616
    ddp = planner.plan_layout(config, cluster(gpus=8, memory="1TiB"), layout(dp_replicate=8))
    assert ddp.comm == {"dp_replicate": pytest.approx(2 * 7 / 8 * 4 * P)}  # fp32 grad all-reduce
    # FSDP, bf16 all-gather of every block twice (forward, and again for backward) and of the
    # root once, fp32 reduce-scatter once.
    fsdp = planner.plan_layout(config, cluster(), layout(dp_shard=8))
    root = 2 * 32000 * 4096 + 4096
    assert fsdp.comm == {"dp_shard": pytest.approx(7 / 8 * (2 * (2 * (P - root) + root) + 4 * P))}
    # TP with sequence parallelism: 8 collectives of (b*s*h) per block per micro-batch, half
    # of norm outputs and their gradients (the residual stream: fp32 under autocast), half of
    # bf16 matmul outputs and theirs; 2 at the embedding and 2 at the head (fp32), plus the
    # bf16 logits all-gather.
    tp = planner.plan_layout(config, cluster(), layout(tp=8))
    bsh = 4096 * 4096 * 7 / 8
    assert tp.comm == {"tp": pytest.approx(32 * (4 * 4 + 4 * 2) * bsh + 4 * 4 * bsh
                                           + 4096 * 32000 * 2 * 7 / 8)}
    assert tp.crosses_nodes == {"tp": False}
    # PP: each micro-batch's activations forward and their gradients backward, per stage; in
    # bf16 where FSDP casts the parameters, in fp32 under autocast (no FSDP).
    pp_cfg = load_config(None, list(LLAMA2_7B) + ["training.micro_batch_size=8"])
    pp = planner.plan_layout(pp_cfg, cluster(nodes=4, gpus=2), layout(pp=4, dp_shard=2))
    assert pp.comm["pp"] == pytest.approx(8 * 2 * 1 * 4096 * 4096 * 2)
    pp_only = planner.plan_layout(pp_cfg, cluster(nodes=4, gpus=1, memory="1TiB"), layout(pp=4))
    assert pp_only.comm["pp"] == pytest.approx(8 * 2 * 1 * 4096 * 4096 * 4)
    # Accumulating 2 micro-steps doubles the all-gathers; FSDP reduce-scatters once per step,
    # but under a pipeline schedule at the end of each micro-step (schedule step).
    accum = load_config(None, list(LLAMA2_7B) + ["training.micro_batch_size=8",
                                                 "training.grad_accum_steps=2"])
    for degrees, ratio in ((layout(pp=4, dp_shard=2), 2.0), (layout(dp_shard=8), None)):
        one = planner.plan_layout(pp_cfg, cluster(nodes=4, gpus=2), degrees).comm["dp_shard"]
        two = planner.plan_layout(accum, cluster(nodes=4, gpus=2), degrees).comm["dp_shard"]
        assert (two / one == pytest.approx(2.0)) == (ratio == 2.0), degrees
    assert pp.crosses_nodes == {"pp": True, "dp_shard": False}


def test_activation_bytes_by_hand():
    # fp32, batch 2 x seq 8, dim 16, 4 heads of 4, ffn 64: norms 2 x (3*256 + 16) floats (on
    # CPU: input, normalised tensor, matmul input; inverse RMS), RoPE's two signed sin tables
    # 2 x 8*4, attention 4*256 + 4*16, SwiGLU 4*1024 floats.
    args = ModelArgs(vocab_size=32, dim=16, n_heads=4, ffn_multiple_of=64)
    assert args.ffn_hidden == 64
    floats = 2 * (3 * 256 + 16) + 2 * 8 * 4 + (4 * 256 + 64) + 4 * 1024
    assert planner.block_activation_bytes(args, 2, 8, 1, 4) == 4 * floats
    # TP=2 halves all but the two all-gathered matmul inputs (2 x 256 floats) and the tables.
    whole = 2 * 256 + 2 * 8 * 4
    assert planner.block_activation_bytes(args, 2, 8, 2, 4) == 4 * (whole + (floats - whole) / 2)
    # CUDA's fused RMSNorm keeps no normalised tensor: 256 floats less per norm.
    assert planner.block_activation_bytes(args, 2, 8, 1, 4, fused_norm=True) == 4 * (floats - 2 * 256)


def test_parse_bytes():
    assert planner.parse_bytes("80GiB") == 80 * 2**30
    assert planner.parse_bytes("40GB") == 40 * 10**9
    assert planner.parse_bytes("512") == 512
    with pytest.raises(ConfigError, match="80GiB"):
        planner.parse_bytes("lots")


# -- rejections with fixes ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, degrees, reason, fix", [
    ((), layout(tp=16), "tp=16 does not fit inside a node of 8 GPUs", "choose tp in [1, 2, 4, 8]"),
    (("model.n_kv_heads=8",), layout(dp_shard=1, tp=16), "parallelism.tp=16 does not divide model.n_kv_heads=8",
     "choose parallelism.tp in [1, 2, 4, 8]"),
    (("model.n_heads=12", "model.dim=4080"), layout(dp_shard=2, tp=8),
     "parallelism.tp=8 does not divide model.n_heads=12", "choose parallelism.tp in [1, 2, 3, 4, 6]"),
    (("tokenizer.vocab_size=32001", "model.vocab_multiple_of=1"), layout(dp_shard=8, tp=2),
     "does not divide the vocabulary (32001)", "choose tp in [1], or a model.vocab_multiple_of divisible by 2"),
    (("parallelism.microbatches=2", "training.micro_batch_size=2"), layout(dp_shard=4, pp=4),
     "pp_schedule=1f1b needs at least as many micro-batches as stages: microbatches=2 < pp=4",
     "set parallelism.microbatches=4 or more"),
    (("training.micro_batch_size=12",), layout(dp_shard=4, pp=4),
     "micro_batch_size=12 does not split into 8 pipeline micro-batches", "a multiple of 8"),
    (("training.micro_batch_size=4",), layout(dp_shard=16), "more than the 80 GiB it has",
     "set parallelism.activation_checkpointing=full"),
    ((), layout(dp_replicate=16), "more than the 80 GiB it has",
     "shard instead of replicating: dp_shard=16, dp_replicate=1"),
    (("training.micro_batch_size=64",), layout(dp_shard=16), "more than the 80 GiB it has",
     "lower training.micro_batch_size"),
    ((), layout(dp_shard=3), "does not match the cluster's 16 GPUs", "set one degree to -1"),
    (("training.seq_len=4090",), layout(dp_shard=2, tp=8), "tp=8 does not divide training.seq_len=4090",
     "choose tp in [1, 2], or a seq_len divisible by 8"),
    (("parallelism.pp_schedule=interleaved-1f1b", "parallelism.microbatches=9",
      "training.micro_batch_size=9"), layout(dp_shard=4, pp=4),
     "microbatches=9 do not split into equal rounds of interleaved-1f1b over pp=4",
     "a multiple of 4"),
])
def test_invalid_layouts_say_why_and_how_to_fix(overrides, degrees, reason, fix):
    config = load_config(None, list(LLAMA2_7B) + list(overrides))
    result = planner.plan_layout(config, cluster(nodes=2, gpus=8, memory="80GiB"), degrees)
    assert not result.ok
    text = "\n".join(str(p) for p in result.problems)
    assert reason in text and fix in text, text


def test_the_vocabulary_is_padded_so_tensor_parallelism_can_split_it():
    # GPT-2's tokenizer (50,257 ids, 29 x 1,733) rules out any TP unless padded, to 50,304.
    gpt2 = list(LLAMA2_7B) + ["tokenizer.vocab_size=50257"]
    assert planner.model_args(load_config(None, gpt2)).vocab_size == 50304
    assert planner.plan_layout(load_config(None, gpt2), cluster(nodes=2), layout(dp_shard=2, tp=8)).ok
    unpadded = load_config(None, gpt2 + ["model.vocab_multiple_of=1"])
    assert planner.model_args(unpadded).vocab_size == 50257
    assert not planner.plan_layout(unpadded, cluster(nodes=2), layout(dp_shard=2, tp=8)).ok

    # The padded ids are never sampled: with their logits made the largest, generation
    # given the tokenizer's size still skips them.
    import torch

    class PreferPadding(torch.nn.Module):
        def __init__(self, output):
            super().__init__()
            self.output = output

        def forward(self, hidden):
            logits = self.output(hidden)
            logits[..., 50:] = 1e4
            return logits

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)).eval()
    model.output = PreferPadding(model.output)
    prompt = torch.ones(1, 4, dtype=torch.long)
    assert (model.generate(prompt, 8, temperature=0)[0, 4:] >= 50).all()  # what it would pick
    for temperature in (0, 1.0):
        out = model.generate(prompt, 8, temperature=temperature, n_tokens=50,
                             generator=torch.Generator().manual_seed(1))
        assert (out[0, 4:] < 50).all(), out


@pytest.mark.parametrize("shape", [{}, {"n_kv_heads": 1, "qk_norm": True, "qkv_bias": True},
                                   {"moe": {"num_experts": 4, "top_k": 2}}],
                         ids=["llama", "gqa-qwen", "moe"])
def test_generation_keeps_keys_and_values_and_picks_what_the_whole_window_picks(shape):
    """Transformer.stream runs each new token alone against the kept keys and values; its
    logits equal those of the whole sequence run again, and past max_seq_len (the window
    slides) it picks what running the window's last max_seq_len tokens picks."""
    import torch

    from training.model import KVCache

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=12,
                                  **shape), seed=3).eval()
    prompt = torch.randint(0, 64, (2, 5))
    cache, tokens = KVCache(), prompt
    with torch.no_grad():
        step = model(prompt, cache=cache)
        for _ in range(4):
            whole = model(tokens)
            assert torch.allclose(step[:, -1], whole[:, -1], atol=1e-5), (step[:, -1] - whole[:, -1]).abs().max()
            tokens = torch.cat([tokens, whole[:, -1].argmax(-1, keepdim=True)], dim=1)
            step = model(tokens[:, -1:], cache=cache)
        assert cache.length == tokens.shape[1]

        expected = prompt  # 20 new tokens: the window slides from the 8th on
        for _ in range(20):
            logits = model(expected[:, -12:])[:, -1]
            expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, 20, temperature=0), expected)


def test_check_raises_a_config_error_naming_the_fixes():
    config = load_config(None, list(LLAMA2_7B) + ["parallelism.nproc_per_node=8",
                                                   "parallelism.dp_replicate=8"])
    with pytest.raises(ConfigError, match=r"(?s)needs .* GiB per GPU.*fix: shard instead of replicating"):
        planner.check(config, cluster(memory="40GiB"))
    assert planner.check(config, cluster(memory="192GB")).ok


def test_search_ranks_valid_layouts_first_and_explains_the_rest():
    config = load_config(None, list(LLAMA2_7B))
    assert planner.layout_is_default(config)
    plans = planner.plan(config, cluster(nodes=4, gpus=8))
    assert len(plans) == len(planner.factorisations(32)) == 56
    valid = [p for p in plans if p.ok]
    assert valid and plans[:len(valid)] == valid
    # DESIGN's defaults first (shard when data-parallel, PP across nodes), highest throughput
    # first (not shortest step: the batch is per data-parallel rank).
    order = [(bool(p.departures), -p.tokens_per_s) for p in valid]
    assert order == sorted(order) and not valid[0].departures
    replicated = next(p for p in valid if p.degrees == layout(dp_replicate=4, tp=8))
    assert replicated.departures == [
        "optimizer state replicated, not sharded: set parallelism.dp_shard > 1 to shard it"]
    assert all(p.memory.peak <= 80 * 2**30 for p in valid)
    assert all(p.degrees["tp"] <= 8 for p in valid)
    assert all(p.problems for p in plans[len(valid):])
    # An explicit layout is planned alone.
    config = load_config(None, list(LLAMA2_7B) + ["parallelism.nproc_per_node=8", "parallelism.tp=8"])
    [only] = planner.plan(config, cluster(nodes=4, gpus=8))
    assert only.degrees == layout(dp_replicate=4, tp=8)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "plan", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def test_cli_plans_llama_3_2_1b_with_its_published_size():
    proc = run_cli("--config", "configs/llama3.2-1b.yaml", "--top", "3")
    assert proc.returncode == 0, proc.stderr
    assert "1,235,814,400 total" in proc.stdout


def test_cli_prints_a_ranked_table():
    proc = run_cli("--config", "configs/llama2-7b.yaml", "--nodes", "2", "--gpus-per-node", "8",
                   "--gpu-memory", "80GiB", "--top", "5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:6] == ["rank", "dp_rep", "dp_shard", "cp", "tp", "pp"]
    assert [line.split()[0] for line in lines[1:6]] == ["1", "2", "3", "4", "5"]
    assert "6,738,415,616 total" in proc.stdout  # the best layout explained below the table


def test_cli_rejects_an_invalid_layout_with_exit_2():
    proc = run_cli("--config", "configs/llama2-7b.yaml", "--nodes", "2", "--gpus-per-node", "8",
                   "--gpu-memory", "80GiB", "parallelism.nnodes=2", "parallelism.nproc_per_node=8",
                   "parallelism.tp=16")
    assert proc.returncode == 2
    assert "tp=16 does not fit inside a node of 8 GPUs" in proc.stderr
    assert "choose tp in [1, 2, 4, 8]" in proc.stderr


def test_cli_takes_the_cluster_from_the_config_and_flags_override_it(capsys):
    from flows.cli import main

    def plan(*args: str) -> tuple[int, str, str]:
        code = main(["plan", "--config", str(REPO / "configs/llama2-7b.yaml"), "--top", "3", *args])
        out, err = capsys.readouterr()
        return code, out, err

    # configs/llama2-7b.yaml names its cluster: 4 nodes x 8 GPUs of 80GiB. No flags needed.
    code, from_config, _ = plan()
    assert code == 0 and "on 4 node(s) x 8 GPUs (80.00 GiB each)" in from_config
    code, from_flags, _ = plan("--nodes", "4", "--gpus-per-node", "8", "--gpu-memory", "80GiB")
    assert code == 0 and from_flags == from_config
    # Another GPU count per node: the Slurm section's GPUs follow (they are the workers').
    code, out, err = plan("--gpus-per-node", "4", "parallelism.tp=4")
    assert code == 0 and "on 4 node(s) x 4 GPUs (80.00 GiB each)" in out, err
    # Flags win over the config (and over overrides of the same fields).
    code, out, _ = plan("--nodes", "2", "--gpu-memory", "40GiB", "parallelism.nnodes=3",
                        "parallelism.device_memory=80GiB")
    assert code == 0 and "on 2 node(s) x 8 GPUs (40.00 GiB each)" in out
    # Neither says how much memory a GPU has: the error names both places to say it.
    code, out, err = plan("parallelism.device_memory=null")
    assert code == 2 and out == ""
    assert "--gpu-memory" in err and "parallelism.device_memory" in err


@pytest.mark.parametrize("flags, message", [
    (["--gpu-tflops", "0"], "argument --gpu-tflops: 0 must be above 0"),
    (["--inter-node-gbps", "-1", "--nodes", "2"], "argument --inter-node-gbps: -1 must be above 0"),
    (["--intra-node-gbps", "0"], "argument --intra-node-gbps: 0 must be above 0"),
    (["--nodes", "0"], "argument --nodes: 0 must be above 0"),
    (["--gpu-memory", "0"], "--gpu-memory 0: give the memory of one GPU"),
])
def test_cli_refuses_hardware_figures_of_zero_or_less(flags, message, capsys):
    from flows.cli import main

    try:
        code = main(["plan", "--config", str(REPO / "configs/llama3.2-1b.yaml"), *flags])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


def test_cli_plans_what_the_train_flow_checks(tmp_path, capsys):
    """parallelism.device=cpu plans CPU workers, with the same estimate as check_run (the
    train flow's check), and no step time without a FLOP/s figure."""
    from flows.cli import main

    overrides = ["parallelism.device=cpu", "parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                 "parallelism.device_memory=100MiB", f"run.runs_dir={tmp_path}"]
    code = main(["plan", "--config", str(REPO / "configs/tiny.yaml"), *overrides])
    out, err = capsys.readouterr()
    flow_plan, _, _ = planner.check_run(load_config(str(REPO / "configs/tiny.yaml"), overrides))
    need = f"needs {flow_plan.memory.peak / 2**20:.1f} MiB per CPU worker"
    assert code == 2 and need in out and need in err and not flow_plan.ok
    assert "estimated step time" not in out


def test_when_no_layout_fits_the_one_explained_is_the_nearest_with_the_changes_it_takes():
    """1B on 8 GPUs of 12 GiB: no layout fits as configured. The one explained is not a layout
    ruled out by its structure (pp with tied embeddings) but the one that fits with
    activation checkpointing and the loss in chunks together, which its fix names; where
    nothing would, the fix does not offer a smaller micro-batch than 1."""
    config = load_config(str(REPO / "configs/llama3.2-1b.yaml"))
    plans = planner.search(config, planner.Cluster(1, 8, 12 * 2**30))
    assert not any(p.ok for p in plans)
    nearest = plans[0]
    assert nearest.degrees["dp_shard"] == 8 and len(nearest.problems) == 1
    assert str(nearest.problems[0]).endswith(
        "fix: set parallelism.activation_checkpointing=full and parallelism.loss_chunk_tokens=1024 "
        "(10.7 GiB)")
    hopeless = planner.search(config, planner.Cluster(1, 8, 4 * 2**30))[0]
    assert str(hopeless.problems[0]).endswith(
        "fix: split the model over more tp or pp ranks, or use more GPUs")
    # Layouts with no memory estimate at all (pp=8 over 4 layers) rank after the others.
    tiny = load_config(str(REPO / "configs/tiny.yaml"))
    for memory in (80 * 2**30, 2**20):
        ranked = planner.search(tiny, planner.Cluster(1, 8, memory))
        assert ranked[-1].memory is None and ranked[0].memory is not None


def test_a_gpu_memory_figure_does_not_pass_cpu_workers_that_share_this_machine(tmp_path):
    """configs/llama3.2-1b.yaml states 80GiB per device (an H100's). Launched here, on CPU, its
    8 workers share this machine's memory: that is what the check counts (else the kernel's
    OOM killer is the check); a smaller stated figure still counts as stated."""
    overrides = ["parallelism.device=cpu", f"run.runs_dir={tmp_path}"]
    config = load_config(str(REPO / "configs/llama3.2-1b.yaml"), overrides)
    plan, cluster, source = planner.check_run(config)
    here, _ = planner.local_device_memory("cpu", config.parallelism.world_size)
    assert cluster.gpu_memory == min(here, 80 * 2**30)
    if here < 80 * 2**30:
        assert "parallelism.device_memory=80GiB is more than a CPU worker has here" in source
        assert not plan.ok  # 61 GiB per worker
    small = load_config(str(REPO / "configs/tiny.yaml"), [*overrides, "parallelism.device_memory=1MiB"])
    assert planner.check_run(small)[2] == "parallelism.device_memory=1MiB"


# -- the train flow checks the run's layout before it launches ----------------------------------

def layout_artifact(flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    [artifact] = [a for a in found if a.key]  # Prefect adds an unnamed one for a failed result
    assert artifact.key.startswith("layout-plan-") and artifact.type == "markdown"
    return artifact.data


def test_train_flow_fails_an_out_of_memory_layout_before_launch(prefect_api, tmp_path):
    from flows.train import train
    from tests.helpers import small_config

    replicated = ("run.run_id=oom", "parallelism.device=cpu", "parallelism.dp_replicate=2",
                  "parallelism.activation_checkpointing=full")
    # Device memory between the two estimates: replicated (DDP) does not fit, sharded would.
    config = small_config(tmp_path, *replicated)
    cpu = planner.Cluster(1, 2, None, device="cpu")
    ddp = planner.plan_layout(config, cpu, layout(dp_replicate=2)).memory.peak
    fsdp = planner.plan_layout(config, cpu, layout(dp_shard=2)).memory.peak
    assert fsdp < ddp
    config = small_config(tmp_path, *replicated,
                          f"parallelism.device_memory={(ddp + fsdp) / 2 / 2**20:.3f}MiB")

    state = train(config, return_state=True)  # no dataset needed: it stops before that
    assert state.is_failed()
    with pytest.raises(ConfigError) as failure:
        state.result()
    message = str(failure.value)
    assert "layout dp_replicate=2 x dp_shard=1 x cp=1 x tp=1 x pp=1 cannot run" in message
    assert "(device memory: parallelism.device_memory=" in message and "MiB per CPU worker" in message
    assert "fix: shard instead of replicating: dp_shard=2, dp_replicate=1" in message

    # Nothing launched: the check was the last task, tried once (never retried), and no
    # worker left a trace in the run directory.
    runs = task_runs_of(state.state_details.flow_run_id, "resolve-config", "check-layout")
    assert set(runs) == {"resolve-config", "check-layout"}
    assert runs["check-layout"].state.is_failed() and runs["check-layout"].run_count == 1
    assert not config.run_dir.path.exists()
    report = layout_artifact(state.state_details.flow_run_id)
    assert "cannot run" in report and "**Fix:** shard instead of replicating" in report


def test_pipeline_fails_an_invalid_layout_before_preparing_the_dataset(prefect_api, tmp_path):
    from flows.pipeline import pipeline
    from tests.helpers import small_config

    config = small_config(tmp_path, "run.run_id=oom-pipeline", "parallelism.device=cpu",
                          "parallelism.device_memory=1MiB")
    state = pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match=r"(?s)cannot run.*more than the 1 MiB it has"):
        state.result()
    # The check ran first, and nothing after it: no prepare (or train) subflow, no dataset.
    runs = task_runs_of(state.state_details.flow_run_id, "resolve-config", "check-layout")
    assert set(runs) == {"resolve-config", "check-layout"}
    assert runs["check-layout"].state.is_failed() and runs["check-layout"].run_count == 1
    assert not (tmp_path / "data").exists() and not config.run_dir.path.exists()


def test_check_layout_passes_a_layout_that_fits_and_publishes_its_plan(prefect_api, tmp_path):
    from prefect import flow

    from tasks.layout import check_layout
    from tests.helpers import small_config

    @flow(name="check-layout-only")
    def check(config):
        return check_layout(config)

    config = small_config(tmp_path, "run.run_id=fits", "parallelism.device=cpu",
                          "parallelism.dp_replicate=1", "parallelism.dp_shard=2")
    state = check(config, return_state=True)
    assert state.is_completed()
    result = state.result()
    assert result["layout"] == layout(dp_shard=2) and result["device"] == "cpu"
    # No device_memory in the config: this machine's memory over its 2 workers.
    assert result["memory_source"].startswith("this machine's memory")
    assert 0 < result["peak_bytes"] < result["device_memory_bytes"]
    report = layout_artifact(state.state_details.flow_run_id)
    assert "fits" in report and "| **peak** |" in report and "communication dp_shard" in report


def test_check_run_plans_on_the_run_s_own_hardware(tmp_path):
    # Structural problems the config's own validation cannot see: TP across nodes.
    config = load_config(None, ["parallelism.nnodes=2", "parallelism.nproc_per_node=2",
                                "parallelism.tp=4", "parallelism.dp_replicate=1",
                                "parallelism.device=cuda", "parallelism.device_memory=80GiB"])
    result, cluster, source = planner.check_run(config)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu_memory) == (2, 2, 80 * 2**30)
    assert source == "parallelism.device_memory=80GiB" and not result.ok
    assert "choose tp in [1, 2]" in planner.failure_message(result, cluster, source)
    # Nodes elsewhere and no device_memory: structure is checked, memory cannot be.
    remote = load_config(None, ["launch.kind=slurm", "launch.slurm.gpus_per_node=2"])
    result, cluster, source = planner.check_run(remote)
    assert result.ok and cluster.gpu_memory is None and cluster.device == "cuda"
    assert "set parallelism.device_memory" in source
    # An existing tokenizer's vocabulary, not tokenizer.vocab_size, sizes the embeddings.
    from training.tokenizer import train_tokenizer

    path = tmp_path / "tokenizer.json"
    tokenizer = train_tokenizer(["some text to learn from"] * 10, vocab_size=300, min_frequency=1)
    tokenizer.save(str(path))
    config = load_config(None, [f"tokenizer.path={path}"])
    assert planner.run_vocab_size(config) == tokenizer.get_vocab_size() != config.tokenizer.vocab_size


def test_a_layout_out_of_memory_for_its_logits_is_told_to_compute_the_loss_in_chunks():
    # A small model with GPT-2's vocabulary at 16 x 1024 tokens: the eager loss's fp32
    # log-probabilities and their gradients are most of the step. The first fix named is the
    # one that recomputes nothing, with the peak it gives, which the chunked config plans.
    shape = ["tokenizer.vocab_size=50304", "model.dim=256", "model.n_layers=2", "model.n_heads=4",
             "model.max_seq_len=1024", "training.seq_len=1024", "training.micro_batch_size=16",
             "parallelism.device=cuda", "parallelism.device_memory=4GiB",
             "parallelism.nproc_per_node=1", "parallelism.dp_replicate=1"]
    plan, cluster, source = planner.check_run(load_config(None, shape))
    assert not plan.ok and plan.memory.peak > 8 * 2**30
    message = planner.failure_message(plan, cluster, source)
    assert "fix: set parallelism.loss_chunk_tokens=1024" in message
    chunked, _, _ = planner.check_run(load_config(None, [*shape, "parallelism.loss_chunk_tokens=1024"]))
    assert chunked.ok and f"({planner._amount(chunked.memory.peak)})" in message
    # Already in chunks, or split by TP: it is not offered.
    with_tp = [*shape[:-2], "parallelism.nproc_per_node=2", "parallelism.dp_replicate=1",
               "parallelism.tp=2", "parallelism.device_memory=1GiB"]
    plan, cluster, source = planner.check_run(load_config(None, with_tp))
    assert not plan.ok and "loss_chunk_tokens" not in planner.failure_message(plan, cluster, source)


# Llama 2 7B with FSDP x TP=8, elastic over 2 to 4 nodes: losing two shrinks dp_shard from 4
# to 2, so each GPU holds twice the weights, gradients and optimizer state (accumulation
# doubles to keep the global batch).
ELASTIC_7B = ("parallelism.nnodes=2:4", "training.grad_accum_steps=6", "parallelism.dp_replicate=1",
              "parallelism.dp_shard=-1", "parallelism.tp=8")


def llama2_7b(*overrides: str):
    return load_config(str(REPO / "configs/llama2-7b.yaml"), list(overrides))


def planned(config, nodes: int, memory: str, degrees=None) -> planner.LayoutPlan:
    return planner.plan_layout(config, cluster(nodes=nodes, memory=memory),
                               degrees or planner.configured_degrees(config))


def test_an_elastic_range_is_planned_at_the_node_count_that_needs_the_most_memory():
    config = llama2_7b(*ELASTIC_7B)
    two = planned(llama2_7b(*ELASTIC_7B[2:], "parallelism.nnodes=2", "training.grad_accum_steps=12"),
                  2, "12.5GiB")
    plan = planned(config, 4, "12.5GiB")
    # The full count fits (its estimate is the one shown); two nodes, as planned on their own,
    # do not, and the fix names what fits there or a minimum that never goes there.
    assert plan.memory.peak < 12.5 * 2**30 < two.memory.peak and not plan.ok
    assert [str(p) for p in plan.problems] == [
        f"at 2 of 2-4 nodes (after losing 2) it {two.problems[0]}, or do not shrink: "
        "parallelism.nnodes=4"]
    assert str(plan.problems[0]) == (
        "at 2 of 2-4 nodes (after losing 2) it needs 15.3 GiB per GPU, more than the 12.5 GiB "
        "it has; fix: set parallelism.activation_checkpointing=full (11.2 GiB), or do not "
        "shrink: parallelism.nnodes=4")
    # Three nodes fit in 13.5 GiB: the range can keep them.
    assert str(planned(config, 4, "13.5GiB").problems[0]).endswith(
        "or raise the minimum to 3 nodes (parallelism.nnodes=3:4)")
    assert planned(config, 4, "16GiB").ok
    # Not elastic: the full count alone, as before.
    assert planned(llama2_7b(*ELASTIC_7B[1:], "parallelism.nnodes=4"), 4, "12.5GiB").ok
    # A layout of the search that cannot follow a smaller world is ruled out there.
    hsdp = planned(config, 4, "80GiB", layout(dp_replicate=2, dp_shard=16))
    assert [str(p) for p in hsdp.problems] == [
        "at 3 of 2-4 nodes (after losing 1) 3 node(s) x 8 workers gives a data-parallel degree "
        "of 24, which HSDP's dp_shard=16 does not divide (dp_shard stays; dp_replicate changes); "
        "fix: choose nodes whose data-parallel degree is a multiple of dp_shard"]


def test_the_pre_launch_check_fails_an_elastic_run_that_would_not_fit_after_a_shrink():
    """check_run is what the check-layout task runs and fails the flow on."""
    config = llama2_7b(*ELASTIC_7B, "parallelism.device=cuda", "parallelism.device_memory=12.5GiB")
    plan, on, source = planner.check_run(config)
    assert not plan.ok and on.nodes == 4
    assert ("at 2 of 2-4 nodes (after losing 2) it needs 15.3 GiB per GPU"
            in planner.failure_message(plan, on, source))

def test_the_local_device_is_decided_as_torch_would_without_importing_a_cpu_build(tmp_path):
    # The flow's process plans every run: on a CPU build of torch it learns "cpu" from
    # torch's version.py, as torch.cuda.is_available() would answer, and never imports torch.
    probe = ("import sys\nfrom core.config import load_config\nfrom goodput import planner\n"
             "plan, cluster, source = planner.check_run(load_config(None, []))\n"
             "print(cluster.device, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    import torch

    cpu_build = torch.version.cuda is None and torch.version.hip is None
    assert planner.torch_build_has_gpu_support() is not cpu_build
    assert out[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert out[1] == str(not cpu_build)  # a CUDA/ROCm build: torch asked, as before
    # What version.py says, both ways; a file that does not say leaves it to torch.
    version_py = tmp_path / "version.py"
    for text, gpu in [("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
                      ("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", True),
                      ("cuda = None\nhip = '6.4.43484'\n", True),
                      ("cuda = None\n", True), ("cuda = (\n", True)]:
        version_py.write_text(text)
        assert planner.gpu_build_in(version_py) is gpu, text
    assert planner.gpu_build_in(tmp_path / "missing.py") is True


def test_device_memory_must_be_a_size():
    with pytest.raises(ConfigError, match=r"parallelism: device_memory: 'lots' is not a memory size"):
        load_config(None, ["parallelism.device_memory=lots"])
    assert planner.parse_bytes(load_config(None, ["parallelism.device_memory=1.5GiB"]
                                           ).parallelism.device_memory) == int(1.5 * 2**30)


# -- estimate vs measurement -------------------------------------------------------------------

# CPU runs in fp32 (the trainer's "auto" precision on CPU); mixed_precision=bf16 gives the
# GPUs' bf16 paths on CPU too: autocast (its fp32 residual stream, a bf16 copy of a matmul's
# input per matmul) and FSDP2's bf16 parameters. Model and batch sizes are chosen so that
# each case is dominated by something different.
COMMON = ("tokenizer.vocab_size=4096", "model.n_heads=4", "model.n_layers=4",
          "model.max_seq_len=256", "training.seq_len=256", "parallelism.device=cpu")
ACTIVATIONS = ("model.dim=128", "training.micro_batch_size=8")
SINGLE = {
    "activations": ACTIVATIONS,
    "weights": ("model.dim=512", "training.micro_batch_size=1"),
    "checkpointed": ACTIVATIONS + ("parallelism.activation_checkpointing=full",),
    "accumulating": ("model.dim=256", "training.micro_batch_size=4", "training.grad_accum_steps=2"),
    "autocast": ACTIVATIONS + ("parallelism.mixed_precision=bf16",),
    # The loss 256 tokens at a time (of 2,048): the fp32 logits of the whole micro-batch,
    # this model's largest activation, are never held.
    "chunked-loss": ACTIVATIONS + ("parallelism.loss_chunk_tokens=256",),
    "chunked-loss-autocast": ACTIVATIONS + ("parallelism.loss_chunk_tokens=256",
                                            "parallelism.mixed_precision=bf16"),
}
TWO_PROCESSES = {
    "ddp": ACTIVATIONS + ("parallelism.dp_replicate=2",),
    "fsdp": ACTIVATIONS + ("parallelism.dp_replicate=1", "parallelism.dp_shard=2"),
    "fsdp-bf16": ACTIVATIONS + ("parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                                "parallelism.mixed_precision=bf16"),
    "fsdp-bf16-chunked-loss": ACTIVATIONS + ("parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                                             "parallelism.mixed_precision=bf16",
                                             "parallelism.loss_chunk_tokens=256"),
}
# The tiny MoE (configs/tiny-moe.yaml's experts) with FSDP, and with FSDP x EP: the experts'
# weights, gradients and optimizer state split by EP exactly; what a rank's MoE layers save
# follows the rows the router sent its experts, which vary a little from rank to rank under
# EP (measured 0.98-1.03x the even-routing estimate; 0.997x without EP).
MOE = ("model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.expert_dim=176",
       "model.moe.first_dense_layers=1")
MOE_PROCESSES = {
    "moe-fsdp": ACTIVATIONS + MOE + ("parallelism.dp_replicate=1", "parallelism.dp_shard=2"),
    "moe-fsdp-ep": ACTIVATIONS + MOE + ("parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                                        "parallelism.ep=2"),
}
ROUTING_RTOL = 0.05
# The peak follows: under EP, rank 1's experts get fewer rows than even routing gives them,
# and its peak measured 0.952-0.955x the estimate on a quiet machine, 0.948x in a CI run.
ROUTING_PEAK_RTOL = 0.07
# Tensor accounting is exact (to AdamW's scalar step counters); the resident-set peak also
# holds kernels' scratch space and the allocator's slack: measured within 2% (0.986-1.020x).
TENSOR_RTOL = 0.01
PEAK_RTOL = 0.05
# In bf16 the CPU's kernels also hold fp32 scratch copies of their bf16 operands, which a
# GPU does not: measured 1.052x (autocast) and 1.054x (FSDP2 bf16) the estimate.
PEAK_RTOL_BF16 = 0.08


def case_overrides(case: tuple[str, ...], nproc: int) -> list[str]:
    return [*COMMON, *case, f"parallelism.nproc_per_node={nproc}"]


def measure(nproc: int, cases: dict[str, tuple[str, ...]], out: Path) -> dict[str, list[dict]]:
    """Run the probe below over `cases` in one process (or one torchrun of `nproc`); each
    rank writes its records to a file of its own in `out` (ranks sharing one stdout pipe
    could interleave their lines)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_OUT": str(out),
           # Every allocation above 64 KiB gets its own mapping and is returned on free, so
           # the resident-set peak follows the tensors alive at once.
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    probe_cmd = ["-m", "tests.test_plan", json.dumps({name: case_overrides(case, nproc)
                                                      for name, case in cases.items()})]
    if nproc == 1:
        cmd = [sys.executable, *probe_cmd]
    else:
        from infra.torchrun import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *probe_cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            results[record["case"]].append(record)
    return results


@pytest.fixture(scope="module")
def measured_single(tmp_path_factory):
    return measure(1, SINGLE, tmp_path_factory.mktemp("measured-single"))


@pytest.fixture(scope="module")
def measured_two(tmp_path_factory):
    return measure(2, {**TWO_PROCESSES, **MOE_PROCESSES}, tmp_path_factory.mktemp("measured-two"))


def assert_estimate_matches(case: tuple[str, ...], nproc: int, records: list[dict],
                            activations_rtol: float = TENSOR_RTOL,
                            peak_rtol: float | None = None) -> None:
    config = load_config(None, case_overrides(case, nproc))
    estimate = planner.plan_layout(config, planner.Cluster(1, nproc, 2**40, device="cpu"),
                                   config.parallelism.degrees()).memory
    assert len(records) == nproc
    for measured in records:
        for key in ("weights", "gradients", "optimizer"):
            assert measured[key] == pytest.approx(getattr(estimate, key), rel=TENSOR_RTOL), key
        assert measured["activations"] == pytest.approx(estimate.activations, rel=activations_rtol)
        rtol = peak_rtol or (PEAK_RTOL_BF16 if config.parallelism.mixed_precision == "bf16"
                             else PEAK_RTOL)
        assert measured["peak"] == pytest.approx(estimate.peak, rel=rtol), \
            (measured["peak"] / 2**20, estimate.peak / 2**20)


@pytest.mark.parametrize("case", SINGLE)
def test_memory_estimate_matches_a_measured_step(case, measured_single):
    assert_estimate_matches(SINGLE[case], 1, measured_single[case])


@pytest.mark.parametrize("case", TWO_PROCESSES)
def test_memory_estimate_matches_measured_data_parallel_steps(case, measured_two):
    assert_estimate_matches(TWO_PROCESSES[case], 2, measured_two[case])


@pytest.mark.parametrize("case", MOE_PROCESSES)
def test_memory_estimate_matches_measured_moe_steps(case, measured_two):
    """The MoE model's memory on two workers (torchrun, gloo), with and without expert
    parallelism, against the planner's estimate."""
    assert_estimate_matches(MOE_PROCESSES[case], 2, measured_two[case], ROUTING_RTOL,
                            ROUTING_PEAK_RTOL)


COMPILED = ACTIVATIONS + ("parallelism.compile=true",)


@pytest.mark.slow
def test_memory_estimate_matches_a_measured_compiled_step(tmp_path):
    """parallelism.compile=true on CPU (inductor, fp32): the saved-tensor hooks see what the
    compiled blocks keep (the matmuls' inputs, not the norms' internals); the estimate's
    activations are within 5% of them and its peak within 15% of the resident-set peak
    (measured 2026-11-27: 0.96x and 0.91x; the eager estimate of this step is 1.24x the
    compiled peak). Slow: inductor's first compile of a block and the loss takes 1-2 minutes
    on 2 cores. The H100 peaks (test_compiled_memory_matches_the_h100_peaks) run in CI."""
    [measured] = measure(1, {"compiled": COMPILED}, tmp_path)["compiled"]
    config = load_config(None, case_overrides(COMPILED, 1))
    estimate = planner.plan_layout(config, planner.Cluster(1, 1, 2**40, device="cpu"),
                                   config.parallelism.degrees()).memory
    for key in ("weights", "gradients", "optimizer"):
        assert measured[key] == pytest.approx(getattr(estimate, key), rel=TENSOR_RTOL), key
    assert measured["activations"] == pytest.approx(estimate.activations, rel=0.05)
    assert measured["peak"] == pytest.approx(estimate.peak, rel=0.15), \
        (measured["peak"] / 2**20, estimate.peak / 2**20)


# -- the measuring side ------------------------------------------------------------------------

def _rss(field: str) -> int:
    status = open("/proc/self/status").read()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS
        f.write("5")


def _local_bytes(tensors) -> int:
    """Bytes of distinct storages, looking through DTensors to this rank's shard."""
    storages = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def probe(cases: dict[str, list[str]], steps: int = 2) -> None:
    """For each case, train `steps` optimizer steps with the trainer's own layout, step and
    optimizer code, and record what this rank held in the last one and its peak growth of
    the resident set (in $PROBE_OUT/rank-N.jsonl)."""
    import gc

    import torch
    import torch.distributed as dist

    from training.distributed import init_distributed
    from training.parallelize import clip_grad_norm_, parallelize
    from training.train import build_optimizer, forward_backward, layout_dims

    env = init_distributed(load_config(None, next(iter(cases.values()))).parallelism)
    for name, overrides in cases.items():
        config = load_config(None, overrides)
        tcfg = config.training
        dims, _ = layout_dims(config, env)
        generator = torch.Generator().manual_seed(env.rank)
        batch = torch.randint(0, config.tokenizer.vocab_size,
                              (tcfg.micro_batch_size, tcfg.seq_len + 1), generator=generator)

        def build(args: ModelArgs):
            with torch.device("meta"):
                model = Transformer(args)
            layout = parallelize(model, config.parallelism, dims, env.device, None, tcfg.seed)
            return layout, build_optimizer(layout.model_parts[0], tcfg, env.device)

        def step(layout, optimizer, tokens, activations: dict | None = None) -> int:
            """One optimizer step; returns the gradient bytes held just before the update."""
            for micro in range(tcfg.grad_accum_steps):
                # Micro-batches are alike: the first one's activations stand for each.
                counting = activations is not None and micro == 0
                pack = _counting_pack(activations, layout) if counting else (lambda t: t)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    forward_backward(layout, tokens[:, :-1], tokens[:, 1:], env.device,
                                     last_micro=micro == tcfg.grad_accum_steps - 1,
                                     accum=tcfg.grad_accum_steps)
            grads = _local_bytes(p.grad for p in layout.model_parts[0].parameters())
            clip_grad_norm_(layout, tcfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return grads

        # Warm up kernels, thread pools and communication buffers on a tiny model first.
        tiny, tiny_opt = build(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2,
                                         max_seq_len=tcfg.seq_len))
        step(tiny, tiny_opt, batch % 64)
        del tiny, tiny_opt
        gc.collect()

        baseline = _rss("VmRSS")
        layout, optimizer = build(planner.model_args(config))
        gc.collect()
        _reset_peak_rss()  # initialising the weights (one full parameter at a time) is not part of a step
        for _ in range(steps - 1):
            step(layout, optimizer, batch)
        activations: dict[int, int] = {}
        grads = step(layout, optimizer, batch, activations)
        model = layout.model_parts[0]
        record = {"case": name, "rank": env.rank, "weights": _local_bytes(model.parameters()),
                  "gradients": grads,
                  "optimizer": _local_bytes(t for state in optimizer.state.values()
                                            for t in state.values() if t.dim() > 0),
                  "activations": sum(activations.values()), "peak": _rss("VmHWM") - baseline}
        with open(Path(os.environ["PROBE_OUT"]) / f"rank-{env.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        del layout, model, optimizer
        gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _counting_pack(sizes: dict[int, int], layout):
    """A saved-tensors hook that records each distinct activation storage once. Parameters
    (FSDP's unsharded ones included), views of them, autocast's bf16 copies of them (the
    planner counts those as buffers) and the RoPE buffers are not activations; integer token
    ids are the batch itself."""
    import torch

    model = layout.model_parts[0]
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}

    def copy_of_a_parameter(t) -> bool:
        base = t._base if t._base is not None else t  # matmuls save the copy transposed
        fn = base.grad_fn
        return (fn is not None and fn.name() == "ToCopyBackward0"
                and any(isinstance(getattr(next_fn, "variable", None), torch.nn.Parameter)
                        for next_fn, _ in fn.next_functions if next_fn is not None))

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        if (isinstance(t, torch.nn.Parameter) or isinstance(local._base, torch.nn.Parameter)
                or not t.is_floating_point() or copy_of_a_parameter(t)):
            return t
        storage = local.untyped_storage()
        if storage.data_ptr() not in buffers:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    return pack


if __name__ == "__main__":
    probe(json.loads(sys.argv[1]))


@pytest.mark.parametrize("memory", ["80", "80.5", " 64 "])
def test_cli_refuses_a_gpu_memory_without_its_unit(memory, capsys):
    from flows.cli import main

    code = main(["plan", "--config", str(REPO / "configs/llama3.1-8b.yaml"), "--gpu-memory", memory])
    err = capsys.readouterr().err
    assert code == 2 and (f"--gpu-memory {memory.strip()}: give the memory of one GPU with its "
                          f"unit, e.g. {memory.strip()}GiB") in err


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny-moe.yaml"])
def test_cli_plans_device_auto_on_the_device_training_gets_here(name, capsys):
    """As check-layout plans it: parallelism.device=auto is what training resolves it to on
    this machine (CPU workers on a CPU build of torch), with its memory."""
    from flows.cli import main

    config = load_config(REPO / "configs" / name)
    assert config.parallelism.device == "auto" and config.launch.kind == "local"
    here, _ = planner.run_cluster(config)
    assert main(["plan", "--config", str(REPO / "configs" / name)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "memory per GPU unknown" not in out
    if here.device == "cpu":
        assert "CPU" in out or "cpu" in out



def test_out_of_memory_names_the_save_s_staging_copy_and_no_micro_batch_that_cannot_help():
    """A 1.2B-parameter model on 2 CPU workers of 12 GiB: tp=2 needs 17.8 GiB, of which the
    async save's staging copy is 6.9; a smaller micro-batch changes little (gradients and
    optimizer state dominate). The fix offered was a smaller micro-batch and more tp or pp,
    none of which fit; synchronous saves do."""
    config = load_config(str(REPO / "configs/tiny.yaml"), [
        "model.dim=2048", "model.n_layers=24", "model.n_heads=16", "parallelism.dp_replicate=1",
        "parallelism.tp=2", "parallelism.device=cpu"])
    result = planner.plan_layout(config, planner.Cluster(1, 2, 12 * 2**30, device="cpu", host_processes=True),
                                 layout(tp=2))
    (problem,) = result.problems
    assert str(problem).endswith("fix: set checkpoint.async_mode=sync (saves then block training while "
                                 "they write, but keep no staging copy of the weights and optimizer "
                                 "state) (11.0 GiB)"), problem
    tighter = planner.plan_layout(config, planner.Cluster(1, 2, 8 * 2**30, device="cpu", host_processes=True),
                                  layout(tp=2))
    assert "micro_batch_size" not in str(tighter.problems[0]), tighter.problems
