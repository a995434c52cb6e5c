"""A mixture of experts to and from transformers: model.init_from a Qwen3-MoE or a Mixtral
directory (small random Qwen3MoeForCausalLM / MixtralForCausalLM built here with
save_pretrained, offline) gives transformers' logits within 1e-5, whole or laid out with
expert parallelism; `goodput export` writes it back as the same architecture, which
AutoModelForCausalLM loads, tensor for tensor. The Qwen3-MoE has what Qwen3-30B-A3B has:
q/k norms, a head_dim other than hidden_size / heads, top-k renormalised, and (here) a dense
first block (mlp_only_layers). Weights are drawn with std 0.3, so routing and attention are
sharp and any mismatch in names, expert order or routing moves the logits far beyond the
tolerance."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, ParallelismConfig, load_config
from core.layout import ParallelDims
from tests.test_init_from import PARITY, SEQ, VOCAB, save_llama, stored, tokens
from tests.test_init_from import save_pretrained as _save
from training.export import write_hf
from training.hf_weights import load_hf_weights
from training.model import Transformer, model_args_from_config
from training.parallelize import parallelize

transformers = pytest.importorskip("transformers")


def save_mixtral(directory: Path) -> Path:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return _save(transformers.MixtralForCausalLM(config), directory)


def save_qwen3_moe(directory: Path) -> Path:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return _save(transformers.Qwen3MoeForCausalLM(config), directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"mixtral": save_mixtral(root / "mixtral"), "qwen3_moe": save_qwen3_moe(root / "qwen3")}


@pytest.fixture(scope="module")
def mixtral(checkpoints) -> Path:
    return checkpoints["mixtral"]


def hf_model(directory: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def goodput_model(directory: Path, *overrides: str, par: ParallelismConfig | None = None,
                  dims: ParallelDims = ParallelDims()) -> Transformer:
    """The model the trainer builds for model.init_from=directory: on the meta device, laid
    out without initial values, then loaded."""
    config = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}", *overrides])
    with torch.device("meta"):
        model = Transformer(model_args_from_config(config.model, VOCAB))
    layout = parallelize(model, par or ParallelismConfig(device="cpu"), dims, torch.device("cpu"),
                         None, seed=None)
    load_hf_weights(layout.model_parts, directory, config.model.tie_embeddings)
    return layout.model_parts[0].eval()


def test_a_mixtral_checkpoint_fixes_model_moe_and_leaves_balancing_to_the_run(mixtral):
    config = load_config(None, [f"model.init_from={mixtral}", f"training.seq_len={SEQ}",
                                 "model.moe.bias_update_rate=0.001"])
    moe = config.model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_dim) == (4, 2, 48)
    assert moe.route_norm and moe.score_func == "softmax" and moe.first_dense_layers == 0
    assert moe.bias_update_rate == 0.001
    with pytest.raises(ConfigError, match="model.moe.top_k=3 but the checkpoint's is 2"):
        load_config(None, [f"model.init_from={mixtral}", f"training.seq_len={SEQ}", "model.moe.top_k=3"])


def test_a_llama_checkpoint_refuses_model_moe(tmp_path):
    llama = save_llama(tmp_path / "llama", tied=False)
    with pytest.raises(ConfigError, match="model.moe is set but the checkpoint is a dense Llama"):
        load_config(None, [f"model.init_from={llama}", f"training.seq_len={SEQ}", "model.moe.num_experts=4"])


def test_a_qwen3_moe_checkpoint_fixes_its_attention_and_dense_blocks(checkpoints):
    model = load_config(None, [f"model.init_from={checkpoints['qwen3_moe']}",
                               f"training.seq_len={SEQ}"]).model
    assert (model.head_dim, model.qk_norm, model.ffn_hidden_dim) == (32, True, 96)
    moe = model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_dim, moe.first_dense_layers) == (4, 2, 48, 1)
    assert moe.route_norm and moe.score_func == "softmax"


@torch.no_grad()
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_the_loaded_model_gives_transformers_logits(checkpoints, kind):
    directory = checkpoints[kind]
    ours, theirs = goodput_model(directory), hf_model(directory)
    x = tokens()
    torch.testing.assert_close(ours(x), theirs(x).logits, **PARITY)
    # The routing matters: every token through its best expert only gives other logits.
    top1 = Transformer.with_weights(type(ours.args)(**{**vars(ours.args),
                                                       "moe": {**ours.args.moe, "top_k": 1}}),
                                    ours.state_dict())
    assert (top1(x) - ours(x)).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_export_after_zero_steps_gives_back_the_model(checkpoints, kind, tmp_path):
    """Loaded and exported again: every stored tensor, bit for bit, and no other; transformers
    loads the export (AutoModelForCausalLM: the same architecture) and computes the same
    logits."""
    model = goodput_model(checkpoints[kind])
    write_hf(model.args, model.state_dict(), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == kind
    original, exported = stored(checkpoints[kind]), stored(tmp_path / "out")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "out")(x).logits, model(x), **PARITY)


# -- loaded under expert parallelism, two gloo processes ------------------------------------------

def _ep_worker(rank: int, directory: str, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        par = ParallelismConfig(device="cpu", nproc_per_node=2, dp_replicate=1, dp_shard=2, ep=2)
        model = goodput_model(Path(directory), par=par, dims=par.dims())
        x = tokens()
        with torch.no_grad():
            mine = model(x[rank:rank + 1])  # each rank its own sample: experts serve both
            expected = hf_model(Path(directory))(x[rank:rank + 1]).logits
        results.put((rank, bool(torch.allclose(mine, expected, **PARITY))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes importing transformers; the cut is materialize's (CI-tested)
def test_ep_ranks_load_their_experts_and_give_transformers_logits(checkpoints):
    import torch.multiprocessing as mp

    from infra.torchrun import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_ep_worker, args=(rank, str(checkpoints["qwen3_moe"]), port, results))
             for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert all(p.exitcode == 0 for p in procs)
    assert dict(results.get() for _ in range(2)) == {0: True, 1: True}
