"""Hugging Face export: a checkpoint trained with torchrun loads in `transformers` as
LlamaForCausalLM and gives the trainer's logits on the same input.

Tolerance: fp32 on CPU, |hf - ours| <= 1e-5 + 1e-5 * |ours| per logit (torch.testing.assert_close
with rtol=atol=1e-5). Measured: bit-identical (max difference 0.0) with transformers 5.23.
Checked that it can fail: Meta's interleaved q/k layout or a wrong rope_theta shifts these
logits by 2e-3 to 5e-3, hundreds of times the tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.files import sha256_file
from flows.cli import main as cli_main
from storage.manifests import CheckpointManifest, DatasetManifest
from tests.helpers import flip_bytes, small_config, synthetic_dataset, torchrun_training
from training.checkpoint.reader import load_all_tensors, model_state_from
from training.export import ExportError, export_hf, hf_config, hf_state_dict
from training.model import ModelArgs, Transformer
from training.tokenizer import EOS_TOKEN, train_tokenizer

transformers = pytest.importorskip("transformers")  # the `test` extra

PARITY = {"rtol": 1e-5, "atol": 1e-5}
VOCAB = 300  # > 257 so a byte-level BPE (256 bytes + EOS) fits the model's vocabulary


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint after 4 real training steps (2 torchrun workers) and its dataset's tokenizer.

    Grouped-query attention (2 kv heads for 4 query heads) and a non-default rope_theta, so
    the test sees every config field the conversion must carry over.
    """
    tmp = tmp_path_factory.mktemp("export")
    dataset = synthetic_dataset(tmp / "data", vocab_size=VOCAB)
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer"] * 20
    train_tokenizer(texts, vocab_size=VOCAB, min_frequency=1).save(str(dataset / "tokenizer.json"))
    config = small_config(tmp, "model.n_kv_heads=2", "model.rope_theta=500000",
                          "training.max_steps=4", "checkpoint.every_steps=4", "training.warmup_steps=2")
    proc = torchrun_training(config, dataset)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return config.run_dir.checkpoint(4), dataset / "tokenizer.json"


# Llama 3's additions: a SwiGLU width from ffn_dim_multiplier, RoPE scaling whose three bands
# (kept, interpolated, divided by factor) all occur at head_dim 16 with theta 500000 and an
# "original context" of 64 positions, and the output layer tied to the embedding.
LLAMA3 = ("model.n_kv_heads=2", "model.rope_theta=500000", "model.ffn_dim_multiplier=1.3",
          "model.rope_scaling.factor=8", "model.rope_scaling.low_freq_factor=1",
          "model.rope_scaling.high_freq_factor=4",
          "model.rope_scaling.original_max_position_embeddings=64", "model.tie_embeddings=true")


@pytest.fixture(scope="module")
def trained_llama3(tmp_path_factory) -> Path:
    """A checkpoint of a Llama 3-shaped model after 4 real training steps (FSDP, 2 workers)."""
    tmp = tmp_path_factory.mktemp("export-llama3")
    dataset = synthetic_dataset(tmp / "data", vocab_size=VOCAB)
    config = small_config(tmp, *LLAMA3, "parallelism.dp_replicate=1", "parallelism.dp_shard=2",
                          "training.micro_batch_size=2", "training.max_steps=4",
                          "checkpoint.every_steps=4", "training.warmup_steps=2")
    proc = torchrun_training(config, dataset)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return config.run_dir.checkpoint(4)


def trainer_model(checkpoint: Path) -> Transformer:
    model = Transformer.with_weights(ModelArgs(**CheckpointManifest.load(checkpoint).model_args),
                                     model_state_from(load_all_tensors(checkpoint, prefix="model.")))
    return model.eval()


def hf_model(directory: Path):
    model, info = transformers.LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    return model.eval()


def sample_tokens(batch: int = 2, seq: int = 64) -> torch.Tensor:
    # Every position up to max_seq_len, so RoPE is compared at all angles.
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_exported_model_gives_the_trainers_logits(trained, tmp_path):
    checkpoint, tokenizer = trained
    summary = export_hf(checkpoint, tmp_path / "hf", tokenizer=tokenizer)
    assert summary["files"] == ["model.safetensors", "config.json", "tokenizer.json",
                                "tokenizer_config.json", "generation_config.json"]
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the other files

    ours, theirs = trainer_model(checkpoint), hf_model(tmp_path / "hf")
    assert theirs.config.num_key_value_heads == 2 < theirs.config.num_attention_heads
    tokens = sample_tokens()
    torch.testing.assert_close(theirs(tokens).logits, ours(tokens), **PARITY)


@torch.no_grad()
def test_llama3_shapes_export_with_their_config_fields_and_logits(trained_llama3, tmp_path):
    """ffn_dim_multiplier, rope_scaling and tied embeddings reach config.json as transformers
    names them (intermediate_size, rope_parameters of type llama3, tie_word_embeddings), the
    tied matrix is stored once, and the model gives the trainer's logits."""
    summary = export_hf(trained_llama3, tmp_path / "hf")
    ours, theirs = trainer_model(trained_llama3), hf_model(tmp_path / "hf")
    config = theirs.config
    assert config.eos_token_id == 0  # the checkpoint's: its dataset's, with no --tokenizer
    assert config.intermediate_size == ours.args.ffn_hidden == 224  # int(1.3 * int(8 * 64 / 3)) = 221
    assert config.tie_word_embeddings and theirs.lm_head.weight is theirs.model.embed_tokens.weight
    assert config.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert summary["parameters"] == ours.num_params(non_embedding=False)
    tokens = sample_tokens()
    torch.testing.assert_close(theirs(tokens).logits, ours(tokens), **PARITY)


def test_exported_tokenizer_loads_with_autotokenizer(trained, tmp_path):
    checkpoint, tokenizer_json = trained
    export_hf(checkpoint, tmp_path / "hf", tokenizer=tokenizer_json.parent)  # the dataset dir works too
    from tokenizers import Tokenizer

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "hello quick world"
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_file(str(tokenizer_json)).encode(text).ids
    assert hf_tokenizer.decode(hf_tokenizer(text)["input_ids"]) == text
    assert hf_tokenizer.eos_token == EOS_TOKEN
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.eos_token_id == hf_tokenizer.eos_token_id == 0
    # generate() stops at the end of a document: the EOS the model trained on (also BOS).
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.eos_token_id, generation.bos_token_id) == (0, 0)
    assert config.bos_token_id == 0 and config.pad_token_id is None


# -- a Hugging Face tokenizer's settings carried through prepare to the export ----------------------

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")  # ids 0, 1, 2
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def save_llama3_style(directory: Path, style: str) -> Path:
    """A small LlamaForCausalLM with Llama 3's special tokens (BOS prepended by tokenizer.json's
    post-processor, EOS, a pad token) in config.json and generation_config.json, its tokenizer
    written as the Hub's Llama 3 has it ("hub": chat_template in tokenizer_config.json, a
    special_tokens_map.json) or as transformers 5's save_pretrained writes it ("saved":
    chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos, pad = LLAMA3_SPECIAL
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
        bos_token_id=0, eos_token_id=1, pad_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer"] * 20,
        trainer=trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=1, special_tokens=list(LLAMA3_SPECIAL),
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                    show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    if style == "saved":
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad,
            model_max_length=131072, chat_template=CHAT_TEMPLATE).save_pretrained(directory)
        assert (directory / "chat_template.jinja").is_file()
        return directory
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "chat_template": CHAT_TEMPLATE,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True}))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": bos, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "eos_token": eos, "pad_token": pad}))
    return directory


@pytest.mark.parametrize("style", ["hub", "saved"])
def test_an_init_from_tokenizers_settings_carry_over_to_the_export(tmp_path, style):
    """model.init_from a Llama 3-style directory, prepared (its tokenizer.json and side files
    copied into the dataset directory), exported with --tokenizer <dataset dir>: the export's
    tokenizer has the checkpoint's BOS, EOS, pad and chat template, config.json and
    generation_config.json their ids. It used to say BOS = EOS = <|end_of_text|>, no pad, no
    template, and wrote no generation_config.json."""
    from goodput.data.prepare import prepare_dataset
    from storage.manifests import DatasetManifest
    from training.export import write_hf
    from training.model import model_args_from_config

    source = save_llama3_style(tmp_path / "llama3", style)
    config = small_config(tmp_path, f"model.init_from={source}", "data.max_docs=50")
    manifest = prepare_dataset(config)
    dataset = Path(config.data.data_dir) / manifest.dataset_id
    sides = {"hub": ["special_tokens_map.json"], "saved": ["chat_template.jinja"]}[style]
    for name in ("tokenizer_config.json", "generation_config.json", *sides):
        assert (dataset / name).read_bytes() == (source / name).read_bytes(), name
    assert manifest.eos_id == 1 and DatasetManifest.load(dataset) == manifest  # intact
    # Each document starts with the BOS the tokenizer's template puts first, as the model was
    # trained and as transformers encodes text for it; they were all prepared without it.
    from storage.shards import read_tokens

    assert manifest.doc_prefix_ids == [0]
    tokens = np.concatenate([read_tokens(dataset / shard.path) for shard in manifest.splits["train"]])
    ends = np.flatnonzero(tokens == 1)
    assert tokens[0] == 0 and len(ends) > 10 and (tokens[ends[:-1] + 1] == 0).all()
    assert (tokens == 0).sum() == len(ends)
    plain = prepare_dataset(small_config(tmp_path / "plain", "data.max_docs=50"))
    assert plain.doc_prefix_ids == []  # Goodput's own tokenizer has no template

    args = model_args_from_config(config.model, manifest.vocab_size)
    write_hf(args, Transformer(args).state_dict(), tmp_path / "out", tokenizer=dataset, eos_id=manifest.eos_id,
             tokenizer_sha256=manifest.tokenizer_sha256)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == LLAMA3_SPECIAL
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer("hello world").input_ids[0] == 0  # BOS first, as the model was trained
    assert tokenizer.model_max_length == 64  # capped at the exported context (model.max_seq_len)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (0, 1, 2)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (0, 1, 2)


def test_a_second_model_with_the_same_tokenizer_exports_its_own_chat_template(tmp_path):
    """Two checkpoints with one tokenizer.json share a prepared dataset (its id names
    tokenizer.json alone), whose side files are the first's. Exported from the second's run
    with --tokenizer <dataset dir>, the chat template and generation settings are the second
    model's own (its run's tokenizer.path), and the summary says where they came from; they
    used to be the first model's, silently."""
    from goodput.data.prepare import prepare_dataset
    from goodput.runs import write_run_config
    from training.export import run_tokenizer_dir, write_hf
    from training.model import model_args_from_config

    first = save_llama3_style(tmp_path / "first", "hub")
    second = tmp_path / "second"
    shutil.copytree(first, second)
    settings = json.loads((second / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ messages[0]['content'] }}"
    (second / "tokenizer_config.json").write_text(json.dumps(settings))
    (second / "generation_config.json").write_text(json.dumps(
        json.loads((first / "generation_config.json").read_text()) | {"temperature": 0.6, "do_sample": True}))
    shared = prepare_dataset(small_config(tmp_path, f"model.init_from={first}", "data.max_docs=50"))
    config = small_config(tmp_path, f"model.init_from={second}", "data.max_docs=50", "run.run_id=second")
    manifest = prepare_dataset(config)
    assert manifest.dataset_id == shared.dataset_id
    dataset = Path(config.data.data_dir) / manifest.dataset_id
    assert (dataset / "tokenizer_config.json").read_bytes() == (first / "tokenizer_config.json").read_bytes()
    write_run_config(config)
    checkpoint = config.run_dir.checkpoint(4)  # one of the run's checkpoints
    assert run_tokenizer_dir(checkpoint) == second

    def export(out: Path, run_tokenizer) -> dict:
        args = model_args_from_config(config.model, manifest.vocab_size)
        return write_hf(args, Transformer(args).state_dict(), out, tokenizer=dataset,
                        eos_id=manifest.eos_id, tokenizer_sha256=manifest.tokenizer_sha256,
                        run_tokenizer=run_tokenizer)

    summary = export(tmp_path / "out", run_tokenizer_dir(checkpoint))
    assert summary["tokenizer_side_files_from"] == str(second)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == settings["chat_template"]
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").temperature == 0.6
    # The first model's run: the dataset's side files are its own, nothing to say.
    summary = export(tmp_path / "first-out", first)
    assert "tokenizer_side_files_from" not in summary
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "first-out").chat_template == CHAT_TEMPLATE


@torch.no_grad()
def test_sharded_and_bfloat16_exports_load(trained, tmp_path):
    checkpoint, _ = trained
    summary = export_hf(checkpoint, tmp_path / "sharded", max_shard_bytes=100_000)
    shards = [f for f in summary["files"] if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in summary["files"]
    tokens = sample_tokens()
    torch.testing.assert_close(hf_model(tmp_path / "sharded")(tokens).logits,
                               trainer_model(checkpoint)(tokens), **PARITY)

    export_hf(checkpoint, tmp_path / "bf16", dtype="bfloat16")
    bf16 = hf_model(tmp_path / "bf16")
    assert bf16.dtype == torch.bfloat16
    ours = trainer_model(checkpoint).state_dict()
    assert torch.equal(bf16.model.embed_tokens.weight, ours["tok_embeddings.weight"].bfloat16())


SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}


@torch.no_grad()
@pytest.mark.parametrize("llama3", [False, True], ids=["mha", "llama3-tied-scaled"])
def test_conversion_of_a_multi_head_model_with_large_weights(llama3):
    """Plain multi-head attention, and weights far from init so attention is sharp: any
    mismatch in RoPE or head layout would show. The Llama 3 case adds RoPE scaling and tied
    embeddings, and checks the scaling matters at these positions."""
    extra = {"rope_theta": 500000.0, "rope_scaling": SCALING, "tie_embeddings": True,
             "ffn_dim_multiplier": 1.5} if llama3 else {}
    args = ModelArgs(vocab_size=64, dim=48, n_layers=2, n_heads=6, norm_eps=1e-6, max_seq_len=32,
                     **extra)
    ours = Transformer(args).eval()
    for p in ours.parameters():
        p.normal_(0.0, 0.3)
    config = hf_config(args, torch.float32)
    config.pop("architectures"), config.pop("model_type")
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    loaded = theirs.load_state_dict(hf_state_dict(ours.state_dict(), torch.float32, args.tie_embeddings),
                                    strict=False)
    # Tied, the file holds the matrix once: lm_head.weight is embed_tokens.weight.
    assert loaded.missing_keys == (["lm_head.weight"] if llama3 else []) and not loaded.unexpected_keys
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == llama3
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(theirs(tokens).logits, ours(tokens), **PARITY)
    if llama3:  # without the scaling the logits move far beyond the tolerance
        plain = Transformer.with_weights(ModelArgs(**{**vars(args), "rope_scaling": None}),
                                         ours.state_dict())
        assert (plain(tokens) - ours(tokens)).abs().max() > 1e-2


def test_cli_refuses_to_overwrite_unless_forced(trained, tmp_path, capsys):
    checkpoint, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["export", str(checkpoint), "--format", "hf", "--out", str(out)]
    assert cli_main(argv) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    # --force replaces an earlier export only, never a user's files.
    assert cli_main([*argv, "--force"]) == 2
    assert "holds files that are not an earlier export (keep.txt)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert cli_main(argv) == 0
    assert cli_main(argv) == 2 and "not empty" in capsys.readouterr().err
    assert cli_main([*argv, "--force"]) == 0
    # (the model's generation_config.json too: generate() stops at the EOS it trained on)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors"]
    assert not list(tmp_path.glob(".out.*"))  # no staging or replaced directories left behind
    # An earlier export the user has since added to is theirs too.
    (out / "README.md").write_text("my model card")
    assert cli_main([*argv, "--force"]) == 2
    assert "holds files that are not an earlier export (README.md)" in capsys.readouterr().err
    assert (out / "README.md").read_text() == "my model card"


def test_export_never_replaces_the_checkpoint_or_the_directories_above_it(trained, tmp_path,
                                                                          monkeypatch):
    """--out at the checkpoint, at its run (or any directory above the checkpoint), or at the
    working directory would have been swapped out whole, with everything in it."""
    checkpoint, _ = trained
    run_dir = checkpoint.parents[1]
    before = sorted(p.name for p in run_dir.iterdir())
    for out in (checkpoint, checkpoint.parent, run_dir, checkpoint / "hf"):
        with pytest.raises(ExportError, match="the checkpoint exported"):
            export_hf(checkpoint, out, force=True)
    work = tmp_path / "project"
    (work / "src").mkdir(parents=True)
    monkeypatch.chdir(work / "src")
    for out in (".", ".."):
        with pytest.raises(ExportError, match="the working directory"):
            export_hf(checkpoint, out, force=True)
    assert sorted(p.name for p in run_dir.iterdir()) == before and (work / "src").is_dir()


def test_a_tokenizer_other_than_the_checkpoints_is_refused(trained, tmp_path):
    """The checkpoint records the sha256 of the tokenizer its data was tokenized with: another
    one (its ids decode to other text) is refused unless the user says it is the same one."""
    from core.files import sha256_file
    from storage.manifests import MixSource, MixtureManifest
    from training.export import _tokenizer_files

    _, tokenizer_json = trained
    right = sha256_file(tokenizer_json)
    assert _tokenizer_files(tokenizer_json, 512, "ds", 0, right).path == tokenizer_json
    with pytest.raises(ExportError, match=r"is not the tokenizer the checkpoint's data was "
                                          r"tokenized with \(sha256 0123456789ab, dataset ds\)"):
        _tokenizer_files(tokenizer_json, 512, "ds", 0, "0123456789ab" + right[12:])
    assert _tokenizer_files(tokenizer_json, 512, "ds", 0, "0" * 64, ignore_mismatch=True).eos_id == 0
    # A mixture's directory (data.data_dir/mixes/<id>) gives its sources' tokenizer.
    mix = tmp_path / "mixes" / "m1"
    MixtureManifest(dataset_id="m1", tokenizer_sha256=right, vocab_size=VOCAB, eos_id=0, sources=[
        MixSource(name="a", weight=1.0, dataset_id="ds", dir=str(tokenizer_json.parent))]).save(mix)
    assert _tokenizer_files(mix, 512, "m1", 0, right).path == tokenizer_json
    with pytest.raises(ExportError, match="no tokenizer.json there; give the directory of the dataset"):
        _tokenizer_files(tmp_path, 512, "m1", 0, right)


def test_rejects_what_is_not_a_committed_intact_checkpoint(trained, tmp_path):
    checkpoint, _ = trained
    with pytest.raises(ExportError, match="not a directory"):
        export_hf(tmp_path / "missing", tmp_path / "a")
    uncommitted = tmp_path / "step-00000009"
    shutil.copytree(checkpoint, uncommitted)
    (uncommitted / "manifest.json").unlink()
    with pytest.raises(ExportError, match="not a committed checkpoint"):
        export_hf(uncommitted, tmp_path / "b")

    corrupt = tmp_path / "step-00000004"
    shutil.copytree(checkpoint, corrupt)
    shard = next(corrupt.glob("*_model.distcp"))  # a file of the weights, which export reads
    flip_bytes(shard)
    with pytest.raises(ExportError, match="does not match its manifest"):
        export_hf(corrupt, tmp_path / "c")
    assert not any(tmp_path.glob("[abc]")) and not any(tmp_path.glob(".[abc].*"))


def test_a_tokenizer_without_a_known_eos_names_the_dataset_directory_to_give(tmp_path):
    """Export has no tokenizer.eos_token: a --tokenizer whose end-of-document token it cannot
    tell is refused with export's fix (the dataset's directory), not prepare's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from training.export import _tokenizer_files

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["the quick brown fox"] * 4, trainers.BpeTrainer(
        vocab_size=270, special_tokens=["[END]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    tokenizer.save(str(bare))
    with pytest.raises(ExportError, match=r"none of the end-of-document tokens .* give the "
                                          r"directory of the dataset the run trained on "
                                          r"\(data.data_dir/0123abcd\)") as e:
        _tokenizer_files(bare, 512, "0123abcd")
    assert "tokenizer.eos_token" not in str(e.value) and "tokenizer.path" not in str(e.value)
    (bare.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ExportError, match="the eos_token '<|im_end|>' its directory declares is "
                                          "not in its vocabulary; give the directory"):
        _tokenizer_files(bare.parent, 512)
    (bare.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[END]"}))
    assert _tokenizer_files(bare.parent, 512)[1:3] == ("[END]", 0)
    # A checkpoint records the id its model trained on (a run's tokenizer.eos_token included):
    # that id wins over what any file beside the tokenizer states.
    assert _tokenizer_files(bare, 512, trained_eos_id=5)[1:3] == (tokenizer.id_to_token(5), 5)
    assert _tokenizer_files(bare.parent, 512, trained_eos_id=5)[2] == 5
    with pytest.raises(ExportError, match="has no token of id 400, the end-of-document id the "
                                          "model trained on"):
        _tokenizer_files(bare, 512, trained_eos_id=400)


@pytest.mark.s3
def test_a_checkpoint_in_the_store_exports_by_its_url(trained, tmp_path, s3_uri, s3_server, capsys):
    """`goodput export s3://.../checkpoints/step-N`: the model's files are fetched with the
    store's checks (each against the manifest's sha256, as a resume from the store does) into
    a temporary directory that goes away; the export equals the local checkpoint's. A damaged
    stored file is refused, as is a URL of a kind the store does not serve, named unmangled."""
    from storage import open_store

    checkpoint, tokenizer = trained
    store = open_store(s3_uri)
    store.upload_dir(checkpoint, "runs/test/checkpoints/step-00000004")
    url = f"{s3_uri}/runs/test/checkpoints/step-00000004"
    # Its dataset in the store, as prepare publishes it: a machine that trained from the store
    # has no dataset directory to give --tokenizer; its URL in the store does as well.
    manifest = DatasetManifest.load(tokenizer.parent)
    store.put_file(tokenizer, "datasets/synthetic/tokenizer.json")
    store.put_bytes("datasets/synthetic/manifest.json", manifest.model_copy(update={
        "tokenizer_sha256": sha256_file(tokenizer)}).model_dump_json().encode())
    assert cli_main(["export", url, "--format", "hf", "--out", str(tmp_path / "from-store"),
                     "--tokenizer", f"{s3_uri}/datasets/synthetic"]) == 0, capsys.readouterr().err
    assert cli_main(["export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "local"),
                     "--tokenizer", str(tokenizer.parent)]) == 0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "from-store" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    with pytest.raises(ExportError, match=r"^--tokenizer s3://[^ ]*/datasets/gone: no prepared dataset "
                                          r"there \(no manifest.json\)"):
        export_hf(url, tmp_path / "no-tokenizer", tokenizer=f"{s3_uri}/datasets/gone")
    config = json.loads((tmp_path / "from-store" / "config.json").read_text())
    assert config["goodput"]["checkpoint"] == url and config["goodput"]["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-store", "local"]  # nothing fetched left

    shard = next(k for k in store.list("runs/test/checkpoints/step-00000004")
                 if k.endswith("_model.distcp"))  # a file of the weights, which export fetches
    data = bytearray(store.get_bytes(shard))
    data[100] ^= 0xFF
    s3_server.client().put_object(Bucket=store.bucket, Key=f"{store.prefix}/{shard}", Body=bytes(data))
    assert cli_main(["export", url, "--format", "hf", "--out", str(tmp_path / "damaged")]) == 2
    err = capsys.readouterr().err
    assert url in err and "sha256" in err, err
    with pytest.raises(ExportError, match=r"no committed checkpoint at s3://.*/step-00000005"):
        export_hf(f"{s3_uri}/runs/test/checkpoints/step-00000005", tmp_path / "missing")
    with pytest.raises(ExportError, match=r"gs://bucket/runs/x/checkpoints/step-00000004: "):
        export_hf("gs://bucket/runs/x/checkpoints/step-00000004", tmp_path / "gs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-store", "local"]


def test_the_weights_a_run_starts_from_are_evaluated_as_its_baseline(tmp_path):
    """`goodput evaluate --checkpoint init`: a run with model.init_from evaluated before its
    first step (its held-out loss on the run's data: the baseline continued pretraining is
    measured against). There was no way but a run at a learning rate of 1e-30."""
    import torch.nn.functional as F

    from core.errors import ConfigError
    from goodput.data.prepare import prepare_dataset
    from goodput.evaluation import INITIAL, evaluate, pick_checkpoint, report_path
    from storage.store import store_from_config
    from training.data import open_training_data, sequential_batches

    source = save_llama3_style(tmp_path / "llama3", "saved")
    config = small_config(tmp_path, f"model.init_from={source}", "data.max_docs=50", "eval.max_batches=1",
                          "eval.batch_size=2", "eval.num_samples=1")
    manifest = prepare_dataset(config)
    dataset = Path(config.data.data_dir) / manifest.dataset_id
    store = store_from_config(config.storage)
    initial = pick_checkpoint(config, store, INITIAL)
    assert initial == source
    report = evaluate(config, initial, dataset)
    assert (report.step, report.checkpoint, report.copy_id) == (0, str(source), config.model.init_from_fingerprint)
    assert report_path(config, initial).parent.name == "initial" and report_path(config, initial).is_file()
    # The loss transformers' own model gives on the same held-out batch.
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32).eval()
    [(inputs, targets)] = sequential_batches(open_training_data(dataset).sources[0].stream("validation"),
                                             config.training.seq_len, 2, 1)
    with torch.no_grad():
        logits = hf(inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten()).item()
    assert report.loss == pytest.approx(expected, rel=1e-4)
    assert evaluate(config, initial, dataset) == report  # kept: evaluated once
    with pytest.raises(ConfigError, match="has none: it starts from random weights"):
        pick_checkpoint(small_config(tmp_path / "scratch"), store, INITIAL)
