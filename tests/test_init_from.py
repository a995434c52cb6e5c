"""model.init_from: training starts from a Hugging Face Llama checkpoint.

The checkpoints are small random `LlamaForCausalLM`s built here with transformers (offline),
with what real Llama 3 checkpoints have: grouped-query attention, Llama 3.1 RoPE scaling
(all three frequency bands occur at head_dim 16, theta 500000 and an original context of
32), a SwiGLU width no formula gives (intermediate_size 100), tied or untied embeddings,
one file or sharded with an index; a byte-level BPE of exactly the model's vocabulary
beside it. Weights are drawn with std 0.3, far from init, so attention is sharp and any
mismatch in names, RoPE or head layout moves the logits well beyond the tolerance.

Tolerance: fp32 on CPU, torch.testing.assert_close with rtol=atol=1e-5 per logit.
Measured: bit-identical logits (max |difference| 0.0) with transformers 5.24, one process;
training losses equal to the single process within 1e-5 under FSDP and TP.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from core.config import config_from_dict, ConfigError, dump_config, load_config, ParallelismConfig
from core.layout import ParallelDims
from goodput.runs import train_attempt, write_run_config
from infra.torchrun import free_port
from storage.manifests import DatasetManifest
from storage.store import store_from_config
from tests.helpers import REPO, losses_by_step, small_config, synthetic_dataset
from training.data import DistributedSampleLoader, TokenStream
from training.export import hf_config, write_hf
from training.hf_weights import load_hf_weights
from training.model import Transformer, model_args_from_config
from training.parallelize import parallelize
from training.tokenizer import train_tokenizer

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402  (transformers' dependency)
from safetensors.torch import save_file  # noqa: E402

PARITY = {"rtol": 1e-5, "atol": 1e-5}
VOCAB = 320
SEQ = 64
SCALING = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def save_llama(directory: Path, *, tied: bool, max_shard_size: str | None = None,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random LlamaForCausalLM saved with save_pretrained, and its tokenizer.json."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_parameters=dict(SCALING))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": max_shard_size}
                                                  if max_shard_size else {}))
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer"] * 20
    train_tokenizer(texts, vocab_size=VOCAB, min_frequency=1).save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"tied": save_llama(root / "tied", tied=True),
            "untied-sharded": save_llama(root / "untied-sharded", tied=False, max_shard_size="60KB"),
            "bf16": save_llama(root / "bf16", tied=True, dtype=torch.bfloat16)}


def hf_model(directory: Path):
    model, info = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                               output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def goodput_model(directory: Path, par: ParallelismConfig | None = None,
                  dims: ParallelDims = ParallelDims()) -> Transformer:
    """The model the trainer builds for model.init_from=directory (in one process, or laid out
    by `par`): on the meta device, laid out without initial values, then loaded."""
    config = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
    with torch.device("meta"):
        model = Transformer(model_args_from_config(config.model, VOCAB))
    layout = parallelize(model, par or ParallelismConfig(device="cpu"), dims, torch.device("cpu"),
                         None, seed=None)
    load_hf_weights(layout.model_parts, directory, config.model.tie_embeddings)
    return layout.model_parts[0].eval()


def stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


# -- the configuration ----------------------------------------------------------------------------

def test_the_shape_and_tokenizer_come_from_the_checkpoint(checkpoints):
    directory = checkpoints["tied"]
    config = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
    m = config.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden_dim, m.vocab_size,
            m.max_seq_len, m.norm_eps, m.rope_theta, m.tie_embeddings) == \
        (64, 2, 4, 2, 100, VOCAB, SEQ, 1e-6, 500000.0, True)
    assert m.rope_scaling.model_dump() == {k: v for k, v in SCALING.items()
                                           if k not in ("rope_type", "rope_theta")}
    assert config.tokenizer.path == str(directory)
    from goodput.data.prepare import given_tokenizer_file  # the file the prepare stage reads

    assert given_tokenizer_file(config.tokenizer.path) == directory / "tokenizer.json"
    # Fields stated in agreement pass; a shorter context is the run's choice.
    agreeing = load_config(None, [f"model.init_from={directory}", "model.dim=64", "model.n_kv_heads=2",
                                  "model.max_seq_len=32", "training.seq_len=32"])
    assert agreeing.model.max_seq_len == 32 and agreeing.model.dim == 64
    # The workers and a resumed run read the config back as written: the same config.
    dumped = config_from_dict(config.model_dump(mode="json"))
    assert dumped == config and dumped.config_hash() == config.config_hash()


@pytest.mark.parametrize("override, message", [
    ("model.dim=128", "model.dim=128 but hidden_size is 64"),
    ("model.n_kv_heads=4", "model.n_kv_heads=4 but num_key_value_heads is 2"),
    ("model.tie_embeddings=false", "model.tie_embeddings=False but tie_word_embeddings is True"),
    ("model.ffn_dim_multiplier=1.3", "model.ffn_dim_multiplier=1.3 give a SwiGLU width of 224 but "
                                     "intermediate_size is 100"),
    ("model.rope_theta=10000", "model.rope_theta=10000 but rope_theta is 500000.0"),
    ("model.rope_scaling=null", "model.rope_scaling=None but the rope scaling of rope_parameters is "
                               "{'factor': 8.0"),
])
def test_a_stated_shape_that_conflicts_names_the_field(checkpoints, override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.init_from={checkpoints['tied']}", f"training.seq_len={SEQ}", override])
    assert message in str(err.value)
    assert "config.json (model.init_from)" in str(err.value) and "leave these fields out" in str(err.value)


def test_an_init_from_override_displaces_the_files_model_shape(checkpoints, tmp_path):
    """`--config configs/tiny.yaml model.init_from=DIR`: the file's shape was written for the
    tiny model trained from scratch; the checkpoint's replaces it (its context too), the
    file's other choices (training) stay. A shape field that is an override too must still
    agree, and a file stating init_from and another shape is inconsistent in itself."""
    directory = tmp_path / "long-context"  # Llama 3's context: the file's 256 used to stay
    shutil.copytree(checkpoints["tied"], directory)
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 131072}))
    config = load_config(REPO / "configs" / "tiny.yaml", [f"model.init_from={directory}"])
    assert (config.model.dim, config.model.n_layers, config.model.n_kv_heads) == (64, 2, 2)
    assert config.model.max_seq_len == 131072 and config.training.seq_len == 128  # the file's
    assert json.loads(json.dumps(hf_config(model_args_from_config(config.model, VOCAB),
                                           torch.float32)))["max_position_embeddings"] == 131072
    # A max_seq_len stated on the command line wins, and must still hold training.seq_len.
    stated = load_config(REPO / "configs" / "tiny.yaml", [f"model.init_from={directory}",
                                                          "model.max_seq_len=512"])
    assert stated.model.max_seq_len == 512
    with pytest.raises(ConfigError, match="training.seq_len=128 exceeds model.max_seq_len=64; "
                                          "raise model.max_seq_len or lower training.seq_len"):
        load_config(REPO / "configs" / "tiny.yaml", [f"model.init_from={directory}", "model.max_seq_len=64"])
    directory = checkpoints["tied"]
    with pytest.raises(ConfigError, match="model.dim=128 but hidden_size is 64"):
        load_config(REPO / "configs" / "tiny.yaml", [f"model.init_from={directory}", "model.dim=128"])
    # A run's saved config.yaml, its checkpoint directory gone since: an init_from override
    # of that directory leaves the shape the file states (there is no checkpoint to read).
    gone = tmp_path / "gone"
    shutil.copytree(directory, gone)
    saved = tmp_path / "saved.yaml"
    saved.write_text(dump_config(load_config(None, [f"model.init_from={gone}", f"training.seq_len={SEQ}"])))
    shutil.rmtree(gone)
    reloaded = load_config(saved, [f"model.init_from={gone}"])
    assert (reloaded.model.dim, reloaded.model.n_layers, reloaded.model.n_kv_heads) == (64, 2, 2)
    own = tmp_path / "own.yaml"
    own.write_text(f"model:\n  init_from: {directory}\n  dim: 128\n")
    with pytest.raises(ConfigError, match="model.dim=128 but hidden_size is 64"):
        load_config(own, [f"training.seq_len={SEQ}"])


def test_tied_checkpoints_refuse_pipeline_parallelism(checkpoints):
    with pytest.raises(ConfigError, match="tie_embeddings=true .* pp=2 .* set parallelism.pp=1"):
        load_config(None, [f"model.init_from={checkpoints['tied']}", f"training.seq_len={SEQ}",
                           "parallelism.pp=2", "training.micro_batch_size=4"])


def test_directories_that_are_not_llama_checkpoints_are_config_errors(tmp_path, checkpoints):
    def error(directory) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.init_from={directory}"])
        return str(err.value)

    assert "no such directory" in error(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty' / 'config.json'} not found" in error(tmp_path / "empty")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((checkpoints["tied"] / "config.json").read_text())
    assert "neither model.safetensors nor model.safetensors.index.json" in error(no_weights)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                  "architectures": ["GPT2LMHeadModel"]}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    assert "model_type='gpt2' ['GPT2LMHeadModel']; Goodput's model loads model_type 'llama'" in error(gpt2)
    assert "'qwen3_moe' (Qwen3MoeForCausalLM)" in error(gpt2)
    yarn = tmp_path / "yarn"
    yarn.mkdir()
    config = json.loads((checkpoints["tied"] / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (yarn / "config.json").write_text(json.dumps(config))
    (yarn / "model.safetensors").write_bytes(b"")
    assert "rope_type='yarn'" in error(yarn)


def test_a_missing_tensor_or_shard_is_a_config_error_naming_it(tmp_path, checkpoints):
    """When the config is read (the index and the safetensors headers only), not ~30 s later
    in the workers; the workers' own check stays for a directory changed since."""
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (partial / name).write_text((checkpoints["tied"] / name).read_text())
    tensors = stored(checkpoints["tied"])
    lacks = (r"lacks 1 tensor\(s\) the model needs, e\.g\. \['model\.layers\.1\.mlp\.down_proj\."
             r"weight'\] \(in model\.safetensors\).*re-save it")
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    config = load_config(None, [f"model.init_from={partial}", f"training.seq_len={SEQ}"])
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})  # since read
    with pytest.raises(ConfigError, match=lacks):
        load_hf_weights([Transformer(model_args_from_config(config.model, VOCAB))], partial, True)
    with pytest.raises(ConfigError, match=lacks):
        load_config(None, [f"model.init_from={partial}", f"training.seq_len={SEQ}"])

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for path in checkpoints["untied-sharded"].iterdir():
        (sharded / path.name).write_bytes(path.read_bytes())
    gone = sorted(sharded.glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(ConfigError, match=f"{gone} is missing .*copy every shard"):
        load_config(None, [f"model.init_from={sharded}", f"training.seq_len={SEQ}"])
    (sharded / gone.name).write_bytes(b"\xff" * 16)  # not a safetensors file
    with pytest.raises(ConfigError, match=f"{gone} is not a safetensors file"):
        load_config(None, [f"model.init_from={sharded}", f"training.seq_len={SEQ}"])


def test_the_tensors_the_config_check_asks_for_are_those_transformers_stores(checkpoints, relatives):
    """core.hf_llama.needed_tensors (the config's side) names every tensor save_pretrained
    wrote, no other (a tied checkpoint has no lm_head): what the workers then read."""
    from core.hf_llama import model_fields, needed_tensors
    from tests.test_moe_interchange import save_mixtral, save_qwen3_moe

    moe = {"mixtral": save_mixtral, "qwen3_moe": save_qwen3_moe}
    directories = {**checkpoints, **relatives,
                   **{kind: save(checkpoints["tied"].parent / kind) for kind, save in moe.items()}}
    for kind, directory in directories.items():
        model_type = json.loads((directory / "config.json").read_text())["model_type"]
        assert sorted(needed_tensors(model_type, model_fields(directory))) == \
            sorted(stored(directory)), kind


def test_a_checkpoint_without_tokenizer_json_is_refused_when_the_config_is_read(tmp_path, checkpoints):
    """Not late in prepare as "tokenizer.path=...", a field the user never set: model.init_from
    is named, with tokenizer.json and how to get one."""
    directory = tmp_path / "slow-tokenizer"
    shutil.copytree(checkpoints["tied"], directory)
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.model").write_bytes(b"sentencepiece")  # a slow tokenizer only
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
    message = str(err.value)
    assert f"model.init_from={directory} has no tokenizer.json (only tokenizer.model)" in message
    assert f"AutoTokenizer.from_pretrained('{directory}').save_pretrained('{directory}')" in message
    assert "or set tokenizer.path to a tokenizer.json" in message
    assert "tokenizer.path=" not in message
    given = checkpoints["tied"] / "tokenizer.json"
    config = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}",
                                f"tokenizer.path={given}"])
    assert config.tokenizer.path == str(given)


def test_a_tokenizer_other_than_the_checkpoints_is_refused(tmp_path, checkpoints):
    """tokenizer.path beside model.init_from: the checkpoint's own tokenizer saved elsewhere
    is taken; another one (its ids would index embeddings trained for other tokens) is
    refused, naming both. It used to train on without a word."""
    import json

    directory = checkpoints["tied"]
    base = [f"model.init_from={directory}", f"training.seq_len={SEQ}"]
    same = tmp_path / "same" / "tokenizer.json"  # the same tokenizer, written out again
    same.parent.mkdir()
    same.write_text(json.dumps(json.loads((directory / "tokenizer.json").read_text()), indent=1))
    assert load_config(None, [*base, f"tokenizer.path={same.parent}"]).tokenizer.path == str(same.parent)
    other = tmp_path / "other.json"
    train_tokenizer(["a different corpus of other words entirely"] * 30, vocab_size=VOCAB,
                    min_frequency=1).save(str(other))
    with pytest.raises(ConfigError, match=rf"tokenizer.path={other} is another tokenizer than "
                       rf"model.init_from's own \({directory / 'tokenizer.json'}\): \d+ of its "
                       r"\d+ tokens have other ids there"):
        load_config(None, [*base, f"tokenizer.path={other}"])
    # Without a tokenizer.json beside the checkpoint: ids past its vocabulary are refused.
    bare = tmp_path / "bare"
    shutil.copytree(directory, bare)
    (bare / "tokenizer.json").unlink()
    larger = tmp_path / "larger.json"
    train_tokenizer([f"word{i} token{i * 7}" for i in range(400)], vocab_size=2 * VOCAB,
                    min_frequency=1).save(str(larger))
    with pytest.raises(ConfigError, match=rf"has ids up to \d+, beyond model.init_from's vocab_size={VOCAB}"):
        load_config(None, [f"model.init_from={bare}", f"training.seq_len={SEQ}", f"tokenizer.path={larger}"])


# -- where the checkpoint lies -----------------------------------------------------------------------

def test_a_run_is_tied_to_the_checkpoint_not_to_where_it_lies(tmp_path, monkeypatch, checkpoints):
    """init_from is made absolute and fingerprinted when the config is built. The run's
    config.yaml (write_run_config's, which the workers, a resume and `goodput evaluate` read)
    loads after the directory moved, as the same config; the same checkpoint at its new place
    continues the run; another one (same shape and tokenizer, other weights) does not."""
    original = tmp_path / "hf"
    shutil.copytree(checkpoints["tied"], original)
    monkeypatch.chdir(tmp_path)
    run = [f"training.seq_len={SEQ}", f"run.runs_dir={tmp_path / 'runs'}"]
    config = load_config(None, ["model.init_from=hf", *run])  # relative, as in the README
    assert config.model.init_from == config.tokenizer.path == str(original)
    saved = write_run_config(config)
    moved = tmp_path / "mounted" / "elsewhere"
    shutil.move(original, moved)
    monkeypatch.chdir(moved)
    reread = load_config(saved)
    assert reread == config and reread.config_hash() == config.config_hash()
    at_new_place = load_config(None, [f"model.init_from={moved}", *run])
    assert at_new_place.model.init_from_fingerprint == config.model.init_from_fingerprint
    assert at_new_place.config_hash() == config.config_hash()
    assert write_run_config(at_new_place) == saved  # the same run
    other = save_llama(tmp_path / "other", tied=True, seed=1)
    with pytest.raises(ConfigError, match="with a different data/tokenizer/model/training config"):
        write_run_config(load_config(None, [f"model.init_from={other}", *run]))


def test_a_run_whose_checkpoint_directory_moved_reads_its_tokenizer_from_its_dataset(tmp_path, checkpoints):
    """The run's config.yaml names model.init_from's directory as tokenizer.path. Once it had
    moved, `goodput evaluate`, `train` and `prepare` of the run failed on it ("no
    tokenizer.json there"), against the README's word that it may move. The dataset prepared
    with it keeps the same tokenizer.json (the sha256 config.yaml recorded): it stands in."""
    from goodput.data.prepare import plan_dataset, prepare_dataset

    original = tmp_path / "hf"
    shutil.copytree(checkpoints["tied"], original)
    config = small_config(tmp_path, f"model.init_from={original}", f"training.seq_len={SEQ}",
                          "data.max_docs=50")
    manifest = prepare_dataset(config)
    saved = write_run_config(config)
    shutil.move(original, tmp_path / "moved")
    reread = load_config(saved)
    assert Path(reread.tokenizer.path) == (Path(config.data.data_dir) / manifest.dataset_id).absolute()
    assert reread.config_hash() == config.config_hash()
    assert plan_dataset(reread).dataset_id == manifest.dataset_id
    shutil.rmtree(Path(config.data.data_dir) / manifest.dataset_id)  # no copy left: said plainly
    with pytest.raises(Exception, match=r"tokenizer.path=.*/hf does not exist \(moved, or not mounted here\?\)"):
        plan_dataset(load_config(saved))


def test_other_weights_that_share_the_fingerprint_do_not_continue_the_run(tmp_path, checkpoints):
    """The config hash's fingerprint samples two windows of each weights file; a checkpoint
    that differs elsewhere (a LoRA merged into a few projections) hashed the same, and the
    run of the original was taken for its own: "already trained", the original's scores
    reported. The run records a sample of every tensor when it starts (init_from.json) and
    refuses other weights; the same weights elsewhere still continue it."""
    import numpy as np

    from core.hf_llama import _safetensors_entries, fingerprint, weights_digest

    original = tmp_path / "hf"
    shutil.copytree(checkpoints["tied"], original)
    merged = tmp_path / "merged"
    shutil.copytree(original, merged)
    file = merged / "model.safetensors"
    entries, start = _safetensors_entries(file)
    size = file.stat().st_size
    windows = [(size // 2, size // 2 + 64 * 1024), (max(0, size - 64 * 1024), size)]

    def between_the_windows(entry) -> bool:
        begin, end = (start + int(x) for x in entry["data_offsets"])
        return all(end <= low or begin >= high for low, high in windows)

    name = next(n for n, e in sorted(entries.items()) if "proj" in n and between_the_windows(e))
    begin, end = (start + int(x) for x in entries[name]["data_offsets"])
    with open(file, "r+b") as f:  # the tensor changed in place: every other byte is the same
        f.seek(begin)
        weights = np.frombuffer(f.read(end - begin), dtype=np.float32) + 0.5
        f.seek(begin)
        f.write(weights.tobytes())
    assert fingerprint(merged) == fingerprint(original)  # what the config hash sees
    assert weights_digest(merged) != weights_digest(original)

    run = [f"training.seq_len={SEQ}", f"run.runs_dir={tmp_path / 'runs'}", "run.run_id=hf"]
    saved = write_run_config(load_config(None, [f"model.init_from={original}", *run]))
    record_file = load_config(saved).run_dir.init_from_record
    record = json.loads(record_file.read_text())
    assert record["weights"] == weights_digest(original) and record["init_from"] == str(original)
    refused = "run 'hf' already exists .* was started from other weights than model.init_from="
    with pytest.raises(ConfigError, match=refused):
        write_run_config(load_config(None, [f"model.init_from={merged}", *run]))
    # A run from before the record: the weights its saved config names, where they still are.
    record_file.unlink()
    with pytest.raises(ConfigError, match=refused):
        write_run_config(load_config(None, [f"model.init_from={merged}", *run]))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert write_run_config(load_config(None, [f"model.init_from={copy}", *run])) == saved
    assert json.loads(record_file.read_text())["weights"] == record["weights"]


def test_a_checkpoint_cut_short_or_quantized_is_a_config_error(tmp_path, checkpoints):
    """When the config is read, naming the file and what to do: before, a copy cut short
    passed the check and failed in every worker as retryable (three attempts, no file
    named), and FP8 weights loaded as if they were floats, their scales left out."""
    from safetensors.torch import load_file

    cut = tmp_path / "cut"
    shutil.copytree(checkpoints["tied"], cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=f"{weights} is cut short: .* copy it again"):
        load_config(None, [f"model.init_from={cut}", f"training.seq_len={SEQ}"])

    fp8 = tmp_path / "fp8"
    shutil.copytree(checkpoints["tied"], fp8)
    tensors = load_file(fp8 / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name.replace("weight", "weight_scale_inv")] = torch.ones(1)
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"stores weights as F8_E4M3 \(e\.g\. {name}\): a "
                                          "quantized checkpoint.*dequantize it first"):
        load_config(None, [f"model.init_from={fp8}", f"training.seq_len={SEQ}"])
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"has a quantization_config \(quant_method 'fp8'\)"):
        load_config(None, [f"model.init_from={fp8}", f"training.seq_len={SEQ}"])


def test_a_checkpoint_directory_that_is_gone_is_a_config_error_saying_what_to_do(tmp_path, checkpoints):
    original = tmp_path / "hf"
    shutil.copytree(checkpoints["tied"], original)
    config = load_config(None, [f"model.init_from={original}", f"training.seq_len={SEQ}",
                                f"run.runs_dir={tmp_path / 'runs'}", f"storage.uri={tmp_path / 'store'}"])
    saved = write_run_config(config)
    tree = yaml.safe_load(saved.read_text())
    shutil.rmtree(original)
    what_to_do = (rf"model.init_from={original}: no such directory; point it at the Hugging Face "
                  r"Llama checkpoint directory .* where the checkpoint has moved to\. A run that "
                  r"has saved a checkpoint of its own no longer reads it: the config.yaml in its "
                  r"run directory states the checkpoint's shape")
    # Unless a config states all the checkpoint gave it (as a saved one does), it needs it.
    unsaved = {k: v for k, v in tree["model"].items() if k != "init_from_fingerprint"}
    no_dim = {k: v for k, v in tree["model"].items() if k != "dim"}
    for model in ({"init_from": str(original)}, unsaved, no_dim):
        with pytest.raises(ConfigError, match=what_to_do):
            config_from_dict({**tree, "model": model})
    # The saved config loads; a run with no checkpoint yet would start from the weights, and
    # is told before any worker starts.
    with pytest.raises(ConfigError, match=rf"model.init_from={original}: no such directory, and "
                                          "run 'tiny' has no checkpoint to resume from yet"):
        train_attempt(load_config(saved), tmp_path, store_from_config(config.storage), "a-1", print)
    # A run's config.yaml written before fingerprints, whose checkpoint has moved: which file.
    saved.write_text(yaml.safe_dump({**tree, "model": unsaved}))
    with pytest.raises(ConfigError, match=rf"(?s)run 'tiny' already exists .* its saved config no "
                                          rf"longer loads.*{what_to_do}.*Fix that in {saved}"):
        write_run_config(config)


@pytest.mark.parametrize("kind", ["tied", "untied-sharded"])
def test_the_planner_plans_the_checkpoints_model(checkpoints, kind):
    """What the train flow checks before launching: the checkpoint's model, its size exactly
    (the vocabulary from its tokenizer.json, the embeddings from its config.json)."""
    from goodput import planner

    config = load_config(None, [f"model.init_from={checkpoints[kind]}", f"training.seq_len={SEQ}",
                                "parallelism.device=cpu", "parallelism.device_memory=1GiB"])
    result, _, _ = planner.check_run(config)
    assert result.ok, result.problems
    assert result.params.total == hf_model(checkpoints[kind]).num_parameters()


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_is_refused(checkpoints):
    config = load_config(None, [f"model.init_from={checkpoints['tied']}", f"training.seq_len={SEQ}"])
    with pytest.raises(ConfigError, match=f"the tokenizer has 400 tokens but model.vocab_size={VOCAB}"):
        model_args_from_config(config.model, 400)


def test_a_checkpoint_whose_own_tokenizer_outgrows_its_vocab_size_names_both_files(checkpoints, tmp_path):
    """tokenizer.path unset (the checkpoint's own tokenizer): not "leave tokenizer.path unset",
    which it is, but the two files of the checkpoint that disagree."""
    directory = tmp_path / "grown"
    shutil.copytree(checkpoints["tied"], directory)
    train_tokenizer([f"word{i} token{i * 7}" for i in range(400)], vocab_size=400,
                    min_frequency=1).save(str(directory / "tokenizer.json"))
    config = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
    with pytest.raises(ConfigError) as err:
        model_args_from_config(config.model, 400)
    assert (f"the checkpoint's own tokenizer ({directory}/tokenizer.json) has 400 tokens but its "
            f"config.json's vocab_size is {VOCAB}") in str(err.value)
    assert "leave tokenizer.path unset" not in str(err.value)


# -- the weights -----------------------------------------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("kind", ["tied", "untied-sharded"])
def test_the_loaded_model_gives_transformers_logits(checkpoints, kind):
    ours, theirs = goodput_model(checkpoints[kind]), hf_model(checkpoints[kind])
    assert (ours.output.weight is ours.tok_embeddings.weight) == (kind == "tied")
    x = tokens()
    torch.testing.assert_close(ours(x), theirs(x).logits, **PARITY)
    # Without the checkpoint's RoPE scaling the same weights give other logits: it is used.
    plain = Transformer.with_weights(type(ours.args)(**{**vars(ours.args), "rope_scaling": None}),
                                     ours.state_dict())
    assert (plain(x) - ours(x)).abs().max() > 1e-2


@torch.no_grad()
def test_bfloat16_weights_load_into_the_fp32_model_exactly(checkpoints):
    ours = goodput_model(checkpoints["bf16"])
    assert ours.tok_embeddings.weight.dtype == torch.float32
    files = stored(checkpoints["bf16"])
    assert files["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(ours.tok_embeddings.weight, files["model.embed_tokens.weight"].float())
    assert torch.equal(ours.layers["1"].attention.wk.weight,
                       files["model.layers.1.self_attn.k_proj.weight"].float())


@pytest.mark.parametrize("kind", ["tied", "untied-sharded"])
def test_export_after_zero_steps_gives_back_the_original_tensors(checkpoints, kind, tmp_path):
    """Loaded and exported again (Goodput's names both ways): every stored tensor, bit for bit,
    and no other; the exported config.json describes the same model."""
    directory = checkpoints[kind]
    model = goodput_model(directory)
    write_hf(model.args, model.state_dict(), tmp_path / "out")
    original, exported = stored(directory), stored(tmp_path / "out")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    # (written without a tokenizer: the original's, given, as a run from it would need)
    again = load_config(None, [f"model.init_from={tmp_path / 'out'}", f"training.seq_len={SEQ}",
                               f"tokenizer.path={directory / 'tokenizer.json'}"])
    first = load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
    where = {"init_from", "init_from_fingerprint"}  # another directory, files other than the weights
    assert again.model.model_dump(exclude=where) == first.model.model_dump(exclude=where)


# -- training from the checkpoint ------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("init-from-data") / "dataset", vocab_size=VOCAB)


STEPS = 3


def train(tmp_path: Path, dataset: Path, checkpoint: Path, nproc: int, *overrides: str):
    """`python -m training` (one process) or torchrun from model.init_from; the config, the
    per-step losses and the output."""
    config = small_config(tmp_path, f"model.init_from={checkpoint}", f"training.max_steps={STEPS}",
                          f"checkpoint.every_steps={STEPS}", "training.warmup_steps=1",
                          f"parallelism.nproc_per_node={nproc}", *overrides)
    module = ["-m", "training", "--config", str(write_run_config(config)), "--dataset", str(dataset)]
    cmd = [sys.executable, *module] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *module]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return config, losses_by_step(config.run_dir), proc.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory, dataset, checkpoints):
    """Three steps in one process from the tied checkpoint: the reference of the layouts."""
    return train(tmp_path_factory.mktemp("single"), dataset, checkpoints["tied"], 1,
                 "training.micro_batch_size=4")


@torch.no_grad()
def test_training_starts_from_the_checkpoints_weights(single, dataset, checkpoints):
    """The first step's loss is the Hugging Face model's loss on the same batch (the trainer's
    first batch, drawn again here), not that of initial weights."""
    config, losses, stdout = single
    assert "[init_from] initialised 20 tensors" in stdout  # tied: 2 x 9 + embedding + norm
    manifest = DatasetManifest.load(dataset)
    t = config.training
    inputs, targets = DistributedSampleLoader(TokenStream(dataset, manifest, "train"), t.seq_len,
                                              t.micro_batch_size, 0, 1, t.seed,
                                              t.shuffle_window_tokens).next_batch()
    logits = hf_model(checkpoints["tied"])(inputs).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item()
    assert losses[1] == pytest.approx(hf_loss, rel=1e-5)
    # Initial weights drawn from training.seed give another loss (measured 5.80 vs 6.14).
    fresh = Transformer(model_args_from_config(config.model, VOCAB), seed=t.seed)
    assert fresh(inputs, targets).item() != pytest.approx(hf_loss, rel=1e-2)
    assert sorted(losses) == list(range(1, STEPS + 1))


def test_a_run_resumes_after_its_checkpoint_directory_moved(tmp_path, dataset, checkpoints):
    """After the run's first checkpoint init_from is never read: the workers load the run's
    config.yaml without it and resume from the run's own checkpoint."""
    original = tmp_path / "hf"
    shutil.copytree(checkpoints["tied"], original)
    config, losses, _ = train(tmp_path, dataset, original, 1, "training.micro_batch_size=4",
                              "checkpoint.every_steps=1")
    assert sorted(losses) == list(range(1, STEPS + 1))
    shutil.move(original, tmp_path / "moved")
    shutil.rmtree(config.run_dir.checkpoint(STEPS))  # the last step is trained again, from STEPS - 1
    proc = subprocess.run([sys.executable, "-m", "training", "--config", str(config.run_dir.config_file),
                           "--dataset", str(dataset)],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[init_from]" not in proc.stdout
    assert f"resumed from {config.run_dir.checkpoint(STEPS - 1)}" in proc.stdout + proc.stderr
    resumed = losses_by_step(config.run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == losses  # the steps before not trained again, the last the same again


LAYOUTS = {
    "fsdp": ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "training.micro_batch_size=2"),
    "tp": ("parallelism.dp_replicate=1", "parallelism.tp=2", "training.micro_batch_size=4"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_layouts_load_their_part_and_train_the_same_curve(layout, tmp_path, dataset,
                                                                  single, checkpoints):
    """Two workers load the tied checkpoint under FSDP (each rank reads its half of every
    tensor: exactly half the bytes) or TP (its heads, vocabulary rows and SwiGLU units; the
    norm weights whole): the single process's losses, step by step."""
    _, losses, stdout = train(tmp_path, dataset, checkpoints["tied"], 2, *LAYOUTS[layout])
    reference = single[1]
    assert sorted(losses) == sorted(reference)
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), (step, loss, reference[step])
    read = {int(rank): int(n) for rank, n in
            re.findall(r"\[rank(\d)\] \[init_from\] initialised .* read (\d+) bytes", stdout)}
    total = sum(t.numel() * t.element_size() for t in stored(checkpoints["tied"]).values())
    assert sorted(read) == [0, 1]
    if layout == "fsdp":
        assert read[0] == read[1] == total // 2
    else:
        norms = 4 * 64 * (2 * 2 + 1)  # fp32, replicated under TP
        assert read[0] == read[1] == (total - norms) // 2 + norms


def test_pipeline_stages_read_only_their_layers(tmp_path, dataset, checkpoints):
    """Untied and sharded over several files, under two pipeline stages: each stage reads its
    own layers (and the embedding or the head), together the whole checkpoint once, and
    trains the single process's curve."""
    checkpoint = checkpoints["untied-sharded"]
    _, reference, _ = train(tmp_path / "one", dataset, checkpoint, 1, "training.micro_batch_size=4")
    _, losses, stdout = train(tmp_path / "pp", dataset, checkpoint, 2, "parallelism.dp_replicate=1",
                              "parallelism.pp=2", "training.micro_batch_size=4")
    assert sorted(losses) == sorted(reference)
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), (step, loss, reference[step])
    read = re.findall(r"\[rank\d\] \[init_from\] initialised (\d+) tensors .* read (\d+) bytes", stdout)
    total = sum(t.numel() * t.element_size() for t in stored(checkpoint).values())
    assert sorted(int(n) for n, _ in read) == [10, 11]  # embedding + layer 0; layer 1 + norm + head
    assert sum(int(b) for _, b in read) == total


@pytest.mark.slow
def test_the_pipeline_prepares_with_the_checkpoints_tokenizer_and_trains_from_it(
        prefect_api, tmp_path, checkpoints):
    """Real flow runs: prepare tokenizes the corpus with init_from's tokenizer.json (tokenizer.path
    left unset), train starts from its weights, evaluate scores the result."""
    from flows.pipeline import pipeline

    checkpoint = checkpoints["tied"]
    config = small_config(tmp_path, f"model.init_from={checkpoint}", "training.max_steps=4",
                          "checkpoint.every_steps=4", "training.warmup_steps=1")
    result = pipeline(config)
    assert result["final_step"] == 4
    manifest = DatasetManifest.load(Path(config.data.data_dir) / result["dataset_id"])
    assert manifest.vocab_size == VOCAB
    from core.files import sha256_file

    assert manifest.tokenizer_sha256 == sha256_file(checkpoint / "tokenizer.json")
    assert math.isfinite(result["eval_loss"])


# -- Llama's relatives: Qwen2, Qwen3, Mistral, a head_dim of its own --------------------------------

def save_pretrained(model, directory: Path) -> Path:
    """`model` (a transformers model) with std-0.3 weights, saved with its tokenizer.json."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer"] * 20
    train_tokenizer(texts, vocab_size=VOCAB, min_frequency=1).save(str(directory / "tokenizer.json"))
    return directory


SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
             rms_norm_eps=1e-6)
RELATIVES = {
    # Qwen2.5: q/k/v biases, tied embeddings, its sliding window off
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SHAPE, tie_word_embeddings=True, use_sliding_window=False, rope_theta=1000000.0)),
    # Qwen3: q/k norms and a head_dim other than hidden_size / heads
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=32)),
    # Mistral without a sliding window: a Llama
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SHAPE, sliding_window=None)),
    # a Llama whose heads are not hidden_size / heads wide
    "llama-head-dim": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, head_dim=24)),
}
EXPORTED_AS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "LlamaForCausalLM", "llama-head-dim": "LlamaForCausalLM"}


@pytest.fixture(scope="module")
def relatives(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("relatives")
    return {kind: save_pretrained(build(), root / kind) for kind, build in RELATIVES.items()}


def auto_model(directory: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def test_relatives_set_their_model_fields(relatives):
    def model(kind):
        return load_config(None, [f"model.init_from={relatives[kind]}", f"training.seq_len={SEQ}"]).model

    assert (model("qwen2").qkv_bias, model("qwen2").qk_norm, model("qwen2").tie_embeddings) == (True, False, True)
    assert (model("qwen3").qkv_bias, model("qwen3").qk_norm, model("qwen3").head_dim) == (False, True, 32)
    assert (model("mistral").qkv_bias, model("mistral").qk_norm, model("mistral").head_dim) == (False, False, None)
    assert model("llama-head-dim").head_dim == 24


@torch.no_grad()
@pytest.mark.parametrize("kind", RELATIVES)
def test_relatives_give_transformers_logits_and_export_back(relatives, kind, tmp_path):
    """Loaded: transformers' logits on the same tokens. Exported again: every stored tensor,
    bit for bit, as the architecture transformers loads with the same logits."""
    directory = relatives[kind]
    ours, x = goodput_model(directory), tokens()
    torch.testing.assert_close(ours(x), auto_model(directory)(x).logits, **PARITY)
    write_hf(ours.args, ours.state_dict(), tmp_path / "out")
    original, exported = stored(directory), stored(tmp_path / "out")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    again = auto_model(tmp_path / "out")
    assert type(again).__name__ == EXPORTED_AS[kind]
    torch.testing.assert_close(again(x).logits, ours(x), **PARITY)
    if kind == "qwen2":  # the biases are used: without them, other logits
        layer = ours.layers["0"].attention
        layer.wq.bias.zero_(), layer.wk.bias.zero_(), layer.wv.bias.zero_()
        assert (ours(x) - again(x).logits).abs().max() > 1e-2


def _tp_worker(rank: int, world: int, directory: str, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        par = ParallelismConfig(device="cpu", nproc_per_node=world, dp_replicate=1, tp=world)
        model = goodput_model(Path(directory), par=par, dims=par.dims())
        bias = model.layers["0"].attention.wq.bias
        x = tokens()
        with torch.no_grad():
            difference = (model(x) - auto_model(Path(directory))(x).logits).abs().max().item()
        results.put((rank, (tuple(bias.to_local().shape), tuple(bias.shape), difference)))
    finally:
        dist.destroy_process_group()


def test_tensor_parallelism_splits_the_qkv_biases_with_their_heads(relatives):
    """Two gloo ranks under TP: each holds the q bias of its own heads (ColwiseParallel splits
    it with the projection's rows) and the model gives transformers' logits."""
    from tests.helpers import spawn_ranks

    results = spawn_ranks(_tp_worker, 2, str(relatives["qwen2"]))
    for rank in (0, 1):
        local, whole, difference = results[rank]
        assert (local, whole) == ((32,), (64,))
        assert difference <= 1e-5, (rank, difference)


def test_relatives_with_a_sliding_window_or_other_parts_are_refused(tmp_path, relatives):
    def error(kind: str, **changes) -> str:
        directory = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(relatives[kind], directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.init_from={directory}", f"training.seq_len={SEQ}"])
        return str(err.value)

    assert f"has sliding_window={SEQ // 2}; training/model.py attends to the whole context (a mistral " \
           "config with sliding_window null loads)" in error("mistral", sliding_window=SEQ // 2)
    assert "has use_sliding_window=true" in error("qwen2", use_sliding_window=True)
    # A window as wide as the context (Mistral's 4096 of a 4096 context) attends to it whole.
    wide = tmp_path / "mistral-wide"
    shutil.copytree(relatives["mistral"], wide)
    settings = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**settings, "sliding_window": settings["max_position_embeddings"]}))
    assert load_config(None, [f"model.init_from={wide}", f"training.seq_len={SEQ}"]).model.init_from
    # Each refusal says what of training/model.py the field asks otherwise, and only that.
    gelu = error("mistral", hidden_act="gelu")
    assert "hidden_act='gelu' (its feed-forward is SwiGLU (hidden_act 'silu'))" in gelu
    assert "bias" not in gelu and "head_dim" not in gelu
    biased = error("mistral", attention_bias=True)
    assert "attention_bias=True (its attention projections are bias-free, but for Qwen2's " \
           "q/k/v biases (model_type qwen2); attention_bias=true also puts one on o_proj)" in biased
    assert "SwiGLU" not in biased and "head_dim" not in biased
    linear = error("mistral", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    assert "rope_type='linear', which training/model.py does not implement" in linear
    assert "Start from a checkpoint with one of those, or train from scratch (leave " \
           "model.init_from unset)" in linear
