"""The mixture-of-experts model (training/moe.py), expert parallelism's dispatch
(training/expert_parallel.py), the balance bookkeeping (training/moe_balance.py) and the
configuration rules; in one process or two gloo processes, no torchrun."""

import logging
import os

import pytest
import torch
import torch.nn.functional as F

from core.config import load_config
from core.errors import ConfigError
from core.layout import ParallelDims
from tests.helpers import spawn_ranks
from training.model import ModelArgs, Transformer
from training.moe import MoE, MoEArgs, grouped_mm, grouped_mm_loop, sequence_balance, use_grouped_mm


def moe_layer(seed=0, dim=32, hidden=48, **settings) -> MoE:
    args = MoEArgs(**{"num_experts": 4, "top_k": 2, **settings})
    layer = MoE(dim, hidden, args)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    layer.reset_buffers()
    return layer


def naive_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: what MoE computes, written the slow way."""
    moe, flat = layer.moe, x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router.gate.weight.T
    scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        chosen = (scores[t] + layer.expert_bias).topk(moe.top_k).indices
        weights = scores[t, chosen]
        if moe.route_norm:
            weights = weights / weights.sum()
        for e, w in zip(chosen.tolist(), weights * moe.route_scale):
            ex = layer.experts
            h = F.silu(flat[t] @ ex.w1[e].T) * (flat[t] @ ex.w3[e].T)
            out[t] += w * (h @ ex.w2[e].T)
    if layer.shared is not None:
        out += layer.shared(flat)
    return out.view_as(x)


@pytest.mark.parametrize("settings", [
    {},
    {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "shared_experts": 1},
    {"top_k": 1, "shared_experts": 2, "bias_update_rate": 1e-3},
])
def test_moe_layer_computes_what_token_by_token_routing_computes(settings):
    layer = moe_layer(**settings)
    if settings.get("bias_update_rate"):
        layer.expert_bias.copy_(torch.tensor([0.3, -0.3, 0.0, 0.1]))  # steers choices only
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layer(x), naive_moe(layer, x), atol=1e-5)


def test_grouped_mm_matches_a_matmul_per_expert_and_falls_back_on_unaligned_rows():
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 7, 2])
    x, w = torch.randn(12, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    assert use_grouped_mm(x, w)  # rows of 64 and 32 bytes: torch's grouped kernel on CPU
    assert torch.allclose(grouped_mm(x, w, counts), grouped_mm_loop(x, w, counts), atol=1e-6)
    odd_x, odd_w = torch.randn(12, 6, generator=gen), torch.randn(4, 5, 6, generator=gen)
    assert not use_grouped_mm(odd_x, odd_w)
    expected = torch.cat([odd_x[:3] @ odd_w[0].T, odd_x[3:10] @ odd_w[2].T, odd_x[10:] @ odd_w[3].T])
    assert torch.allclose(grouped_mm(odd_x, odd_w, counts), expected, atol=1e-6)


def test_under_autocast_the_grouped_matmul_runs_in_its_dtype_as_a_matmul_would(monkeypatch):
    # The trainer's one-GPU layouts run bf16 autocast over fp32 weights: grouped_mm casts both
    # operands as autocast casts a matmul's. Before, the mixed dtypes left torch's grouped
    # kernel out on CUDA (1.5x slower there: RESULTS, "The experts' matmuls on the GPU").
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 7, 6])
    x, w = torch.randn(16, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    seen = []
    monkeypatch.setattr("training.moe.use_grouped_mm",
                        lambda a, b: seen.append((a.dtype, b.dtype)) or use_grouped_mm(a, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm(x, w, counts)
        expected = torch.cat([x[:3] @ w[0].T, x[3:10] @ w[2].T, x[10:] @ w[3].T])
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    # The weights get their gradients in their own dtype, those a matmul per expert gives.
    grads = []
    for multiply in (grouped_mm, grouped_mm_loop):
        weight = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            multiply(x, weight, counts).float().square().sum().backward()
        grads.append(weight.grad)
    assert grads[0].dtype == torch.float32
    torch.testing.assert_close(grads[0], grads[1])


def test_the_balance_loss_trains_as_if_added_to_the_loss_and_is_one_when_balanced():
    coeff, scale = 0.05, 0.25  # scale: this forward's share of the step's loss
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2))
    target = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(3))
    with_loss = moe_layer(aux_loss_coeff=coeff)
    with_loss.loss_scale = scale
    (scale * F.mse_loss(with_loss(x), target)).backward()

    explicit = moe_layer(aux_loss_coeff=0.0)
    flat = x.reshape(-1, 32)
    scores, experts, _ = explicit.router(flat, None)
    balance = sequence_balance(scores.view(3, 8, -1), experts.view(3, 8, -1), "softmax")
    (scale * (F.mse_loss(explicit(x), target) + coeff * balance.mean())).backward()
    for (name, a), b in zip(with_loss.named_parameters(), explicit.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-7), name
    # Even choices and scores: the statistic is 1.
    even_scores = torch.full((1, 4, 4), 0.25)
    even_choices = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert sequence_balance(even_scores, even_choices, "softmax").item() == pytest.approx(1.0)


def test_the_bias_moves_toward_the_underloaded_experts():
    from training.moe import update_expert_bias

    layer = moe_layer(bias_update_rate=0.01)
    update_expert_bias(layer, torch.tensor([10.0, 2.0, 3.0, 1.0]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    update_expert_bias(layer, torch.tensor([4.0, 4.0, 4.0, 4.0]))  # balanced: no change
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def test_activation_checkpointing_counts_each_forward_once():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, moe={"num_experts": 4})
    plain, wrapped = Transformer(args, seed=3), Transformer(args, seed=3)
    wrapped.layers["1"] = checkpoint_wrapper(wrapped.layers["1"], preserve_rng_state=False)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (plain, wrapped):
        model(tokens, tokens).backward()
        with torch.no_grad():
            model(tokens)  # evaluation does not count
    counted = [m.layers["1"].moe.tokens_per_expert if m is plain
               else m.layers["1"]._checkpoint_wrapped_module.moe.tokens_per_expert
               for m in (plain, wrapped)]
    assert counted[0].sum().item() == 2 * 16 * 2  # tokens x top_k
    assert torch.equal(counted[0], counted[1])


def test_active_parameters_set_the_flops_of_a_token():
    dense = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden_dim=64)
    moe = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden_dim=64,
                    moe={"num_experts": 8, "top_k": 1, "first_dense_layers": 1})
    dense_model, moe_model = Transformer(dense), Transformer(moe)
    # One MoE layer: 8 experts of the dense width and a router; a token uses 1 expert.
    assert moe_model.num_params() - dense_model.num_params() == 7 * 3 * 32 * 64 + 32 * 8
    assert moe_model.inactive_params() == 7 * 3 * 32 * 64
    assert moe_model.flops_per_token(16) - dense_model.flops_per_token(16) == 6 * 32 * 8


def test_expert_balance_warns_of_router_collapse_and_records_loads(caplog):
    from training.moe_balance import ExpertBalance
    from training.parallelize import Layout

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                     moe={"num_experts": 4, "top_k": 1, "bias_update_rate": 1e-6,
                          "collapse_steps": 3, "aux_loss_coeff": 0.01})
    model = Transformer(args, seed=0)
    for layer in (model.layers["0"].moe, model.layers["1"].moe):
        layer.expert_bias[3] = -100.0  # expert 3 is never chosen
    balance = ExpertBalance(args, Layout(None, ParallelDims(), [model]), torch.device("cpu"), True)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    records = []
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            model(tokens, tokens).backward()
            records.append(balance.after_step())
    warnings = [r.getMessage() for r in caplog.records if "router collapse" in r.getMessage()]
    assert len(warnings) == 1 and "layer 0 expert 3" in warnings[0] and "layer 1 expert 3" in warnings[0]
    assert [r["moe/dead_experts"] for r in records] == [0, 0, 2, 2]
    last = records[-1]
    assert last["moe/layer0/load_min"] == 0.0 and last["moe/layer0/load_max"] > 1.0
    assert 0 < last["moe/layer0/load_entropy"] < 1
    assert last["moe/layer0/bias_min"] == pytest.approx(-100 + 4e-6)  # before the 4th update
    assert last["moe/aux_loss"] > 0
    assert model.layers["0"].moe.tokens_per_expert.sum() == 0  # counters reset after each step
    from training.tracking import curves

    assert curves(last)["moe/layer0/load_max"] == last["moe/layer0/load_max"]  # TensorBoard's tags


# -- configuration ------------------------------------------------------------------------------

MOE = ("model.moe.num_experts=4",)


@pytest.mark.parametrize("overrides, message", [
    (("model.moe.num_experts=4", "model.moe.top_k=5"), "model.moe.top_k=5 exceeds model.moe.num_experts=4"),
    (("model.moe.num_experts=4", "model.moe.first_dense_layers=4", "model.n_layers=4"),
     "moe.first_dense_layers=4 leaves no mixture-of-experts block"),
    (("parallelism.ep=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1"),
     "parallelism.ep=2 splits the experts of a mixture-of-experts model"),
    ((*MOE, "parallelism.ep=2", "parallelism.dp_replicate=2"),
     "parallelism.ep=2 does not divide parallelism.dp_shard=1"),
    (("model.moe.num_experts=3", "parallelism.ep=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1"),
     "parallelism.ep=2 does not divide model.moe.num_experts=3"),
    ((*MOE, "parallelism.tp=2", "parallelism.ep=4", "parallelism.dp_replicate=1"),
     r"parallelism.ep=4 does not divide parallelism.dp_shard=1 x tp=2"),
])
def test_bad_moe_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, list(overrides))


def test_expert_parallelism_splits_dp_shard_and_tp_with_ep_inner():
    assert ParallelDims(dp_replicate=2, dp_shard=4, ep=2).expert_mesh_shape == (2, 2, 2)
    assert ParallelDims(dp_shard=4, ep=4).expert_mesh_shape == (1, 1, 4)
    assert ParallelDims(dp_shard=2, tp=2, ep=2).expert_mesh_shape == (1, 2, 2)


# -- expert parallelism through the layout, gloo processes -------------------------------------

def _layout_worker(rank: int, world: int, dp_shard: int, ep: int, tp: int, model: dict,
                   port: int, results) -> None:
    import torch.distributed as dist

    from core.config import ParallelismConfig
    from training.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                         moe={"num_experts": 4, "top_k": 2, "expert_dim": 48, "shared_experts": 1,
                              "aux_loss_coeff": 0.1}, **model)
        whole = Transformer(args, seed=5)
        with torch.device("meta"):
            model = Transformer(args)
        par = ParallelismConfig(device="cpu", nproc_per_node=world, dp_replicate=1,
                                dp_shard=dp_shard, ep=ep, tp=tp)
        part = parallelize(model, par, par.dims(), torch.device("cpu"), None, seed=5).model_parts[0]
        # Each data-parallel rank its own samples of the global batch (TP ranks share theirs);
        # experts see every rank's tokens.
        dp_rank, dp_size = rank // tp, world // tp
        tokens = torch.randint(0, 64, (2 * dp_size, 12), generator=torch.Generator().manual_seed(0))
        mine = tokens[2 * dp_rank:2 * dp_rank + 2]
        part(mine, mine).backward()
        whole(tokens, tokens).backward()
        expected = dict(whole.named_parameters())
        logits = part(mine)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        out = {"logits": torch.allclose(logits, whole(mine), atol=1e-6)}
        for name, param in part.named_parameters():
            if "layers.1" in name:  # the MoE block: experts (EP and FSDP), router, attention
                out[name] = (torch.allclose(param.full_tensor(), expected[name], atol=1e-7)
                             and torch.allclose(param.grad.full_tensor(), expected[name].grad,
                                                atol=1e-6))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, dp_shard, ep, tp, model", [
    (2, 2, 2, 1, {}),
    # EP x FSDP: four processes, kept out of CI (its curve is test_moe_parallel's, slow too)
    pytest.param(4, 4, 2, 1, {}, marks=pytest.mark.slow),
    # TP with the experts replicated over it: slow (its curve test too), to bound CI
    pytest.param(2, 1, 1, 2, {}, marks=pytest.mark.slow),
    # EP over the TP ranks, each with its own part of the sequence; Qwen3's attention
    (2, 1, 2, 2, {"qk_norm": True, "head_dim": 16})])
def test_moe_layouts_give_the_whole_models_weights_and_gradients(world, dp_shard, ep, tp, model):
    """Experts split over EP ranks (and sharded by FSDP over the rest of dp_shard), an MoE
    block under TP (each rank's part of the sequence), and both (EP over the TP ranks): forward
    equals the whole model's, and
    every gradient, balance loss included, equals the whole model's over the global batch
    (EP: the expert gradients, summed over every rank's tokens by the all-to-all's backward,
    are divided by the data-parallel size, not by the experts' FSDP group's; TP: the MoE
    weights' partial gradients summed over the TP ranks, the balance statistic over the
    parts of each sequence)."""
    found = spawn_ranks(_layout_worker, world, dp_shard, ep, tp, model)
    for rank in range(world):
        assert len(found[rank]) > 5 and all(found[rank].values()), (rank, found[rank])
