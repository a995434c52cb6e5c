"""Context parallelism (training/context_parallel.py): the sequence split, attention of a
rank's chunks over the whole sequence, the layout's rules, and a model laid out with cp=2 on
two gloo processes against the whole model. The loss curves under CP (with FSDP, TP, a
resume at cp=1) are tests/test_parallel.py's."""

import os

import pytest
import torch
import torch.nn.functional as F

from core.config import load_config
from core.errors import ConfigError
from core.layout import ParallelDims
from tests.helpers import spawn_ranks
from training.context_parallel import attend_chunks, chunks_of, sequence_order, shard_sequence
from training.model import ModelArgs, Transformer, repeat_kv


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_rank_holds_chunks_i_and_2cp_minus_1_minus_i_and_gathering_restores_the_order(cp):
    sequence = torch.arange(8 * cp).view(1, -1)
    parts = [shard_sequence(sequence, rank, cp) for rank in range(cp)]
    c = 4  # 8 cp tokens in 2 cp chunks
    for rank, part in enumerate(parts):
        first, second = chunks_of(rank, cp)
        assert part.tolist()[0] == [*range(first * c, first * c + c), *range(second * c, second * c + c)]
    # Causal attention's work per rank: chunk j attends to j + 1 chunks; each pair costs 2cp + 1.
    assert {sum(j + 1 for j in chunks_of(rank, cp)) for rank in range(cp)} == {2 * cp + 1}
    gathered = torch.cat(parts, dim=1).view(1, 2 * cp, c)  # what the all-gather returns
    assert torch.equal(gathered.index_select(1, sequence_order(cp)).reshape(1, -1), sequence)


@pytest.mark.parametrize("cp, heads, kv_heads", [(2, 4, 4), (2, 4, 2), (3, 6, 2)])
def test_a_ranks_chunks_attend_over_the_whole_sequence_as_causal_attention_does(cp, heads, kv_heads):
    """attend_chunks (the keys and values gathered, of the kv heads) gives each rank the rows
    of whole-sequence causal attention for its chunks, and their gradients."""
    generator = torch.Generator().manual_seed(0)
    batch, seq, head_dim = 2, 12 * cp, 8
    q = torch.randn(batch, heads, seq, head_dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=generator, dtype=torch.float64)
            for _ in range(2))
    for x in (q, k, v):
        x.requires_grad_()
    whole = F.scaled_dot_product_attention(q, *repeat_kv(q, k, v), is_causal=True)
    upstream = torch.randn(whole.shape, generator=generator, dtype=torch.float64)
    (whole * upstream).sum().backward()
    gathered_k, gathered_v = (x.detach().requires_grad_() for x in (k, v))
    for rank in range(cp):
        mine = shard_sequence(q.detach(), rank, cp, dim=2).requires_grad_()
        out = attend_chunks(mine, gathered_k, gathered_v, chunks_of(rank, cp))
        assert torch.allclose(out, shard_sequence(whole, rank, cp, dim=2), atol=1e-12)
        (out * shard_sequence(upstream, rank, cp, dim=2)).sum().backward()
        assert torch.allclose(mine.grad, shard_sequence(q.grad, rank, cp, dim=2), atol=1e-12)
    # The ranks' gradients of the gathered keys and values (which the all-gather's backward
    # reduce-scatters) add up to the whole attention's.
    assert torch.allclose(gathered_k.grad, k.grad, atol=1e-12)
    assert torch.allclose(gathered_v.grad, v.grad, atol=1e-12)


def test_a_ranks_attention_keeps_the_kv_heads_and_no_mask_for_backward():
    """What attend_chunks saves for backward on CPU: the queries, the gathered keys and values
    of the kv heads (not copies repeated to every query head), and the output and
    log-sum-exp of the rank's queries; no causal mask (c x keys) and nothing else the size of
    the keys."""
    generator = torch.Generator().manual_seed(0)
    cp, c, heads, kv_heads, head_dim = 2, 8, 4, 2, 16
    k, v = (torch.randn(1, kv_heads, 2 * cp * c, head_dim, generator=generator).requires_grad_()
            for _ in range(2))
    q = torch.randn(1, heads, 2 * c, head_dim, generator=generator).requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attend_chunks(q, k, v, chunks_of(0, cp))
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    others = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    assert others and all(t.shape[1] == heads and t.shape[2] == 2 * c for t in others), \
        [tuple(t.shape) for t in others]


# -- the layout's rules ----------------------------------------------------------------------

def test_cp_is_a_degree_of_the_layout_and_shards_the_weights_over_dp_shard_x_cp():
    alone = load_config(None, ["parallelism.nproc_per_node=2", "parallelism.cp=2"]).parallelism.dims()
    assert alone.degrees == {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1, "pp": 1}
    assert alone.fsdp and not alone.ddp and alone.dp_size == 1 and alone.loss_shares == 2
    dims = ParallelDims.resolve({"dp_replicate": 1, "dp_shard": -1, "tp": 2, "pp": 1, "cp": 2}, 8)
    assert dims.dp_shard == 2 and dims.world_size == 8 and dims.name == \
        "dp_replicate=1 x dp_shard=2 x cp=2 x tp=2 x pp=1"
    assert dims.mesh_shape == (1, 1, 2, 2, 2)  # (pp, dp_replicate, dp_shard, cp, tp)
    # A caller that leaves cp out (the planner's search) lays out without it.
    assert ParallelDims.resolve({"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1}, 2).cp == 1


@pytest.mark.parametrize("overrides, message", [
    (("parallelism.cp=2", "parallelism.nproc_per_node=4", "parallelism.dp_replicate=1"),
     r"dp_replicate\*dp_shard\*cp\*tp\*pp = 2 does not match world size 4"),
    (("parallelism.cp=4", "parallelism.nproc_per_node=4", "training.seq_len=36"),
     r"training.seq_len=36 does not split into 2 x cp = 8 equal chunks.*multiple of 8, e.g. 40, "
     r"or parallelism.cp to one of \[2\]$"),  # 3, 6, 9 and 18 split 36 but not 4 workers
    (("parallelism.cp=2", "parallelism.tp=4", "parallelism.nproc_per_node=8", "model.n_heads=4",
      "training.seq_len=36"),
     r"tp=4 does not divide the 18 tokens of training.seq_len=36 each of cp=2 ranks holds"
     r".*divisible by 8, e.g. 40"),
    (("parallelism.cp=2", "model.moe.num_experts=4"),
     "parallelism.cp=2 with a mixture-of-experts model"),
    (("parallelism.cp=2", "parallelism.pp=2", "parallelism.nproc_per_node=4"),
     "parallelism.cp=2 with pp=2 is not supported"),
    (("parallelism.cp=0",), "parallelism.cp"),
])
def test_bad_cp_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.max_seq_len=128", *overrides])


# -- a model laid out with context parallelism, gloo processes -------------------------------

def _cp_worker(rank: int, world: int, cp: int, tp: int, model: dict, port: int, results) -> None:
    import torch.distributed as dist

    from core.config import ParallelismConfig
    from training.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        seq = 16
        args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32, **model)
        whole = Transformer(args, seed=5)
        with torch.device("meta"):
            model = Transformer(args)
        par = ParallelismConfig(device="cpu", nproc_per_node=world, dp_replicate=1,
                                dp_shard=world // (cp * tp), cp=cp, tp=tp)
        layout = parallelize(model, par, par.dims(), torch.device("cpu"), None, seed=5,
                             microbatch=(2, seq))
        part = layout.model_parts[0]
        tokens = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(0))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine, my_targets = layout.sequence_part(inputs, targets)
        logits, whole_logits = part(mine), whole(inputs)
        F.cross_entropy(logits.flatten(0, 1), my_targets.flatten()).backward()
        F.cross_entropy(whole_logits.flatten(0, 1), targets.flatten()).backward()
        cp_rank = layout.mesh.get_local_rank("cp")
        out = {"logits": torch.allclose(logits, shard_sequence(whole_logits, cp_rank, cp), atol=1e-6)}
        expected = dict(whole.named_parameters())
        for name, param in part.named_parameters():
            out[name] = (torch.allclose(param.full_tensor(), expected[name], atol=1e-7)
                         and torch.allclose(param.grad.full_tensor(), expected[name].grad, atol=1e-6))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, cp, tp, model", [
    # Grouped-query attention with Qwen3's per-head norms: keys and values gathered per kv head
    (2, 2, 1, {"n_kv_heads": 2, "qk_norm": True}),
    # CP x TP: each TP rank's heads of this cp rank's chunks; four processes, kept out of CI
    # (its curve is tests/test_parallel.py's)
    pytest.param(4, 2, 2, {"n_kv_heads": 2}, marks=pytest.mark.slow)])
def test_a_model_laid_out_with_cp_computes_the_whole_models_logits_and_gradients(world, cp, tp, model):
    """Each cp rank's logits are the whole model's at its positions (RoPE of the positions
    it holds, attention over the whole sequence), and every gradient, averaged by FSDP over
    the cp ranks, is the whole model's for the mean loss over every token."""
    found = spawn_ranks(_cp_worker, world, cp, tp, model)
    for rank in range(world):
        assert len(found[rank]) > 10 and all(found[rank].values()), (rank, found[rank])
