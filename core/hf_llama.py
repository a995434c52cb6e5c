"""A Hugging Face Llama (or Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral) checkpoint directory,
in the config's terms (model.init_from). Each is a Llama with a part more: Qwen2 q/k/v
biases (model.qkv_bias), Qwen3 q/k norms (model.qk_norm); Mistral without a sliding window
is Llama. Mixtral is Llama with a mixture-of-experts feed-forward in every block
(softmax router, top-k renormalised, no shared experts): `model_fields` gives it as model.moe.
`model_fields` also checks, from the index and the safetensors headers, that every tensor
the model needs is there (`needed_tensors`), before any worker starts.

Such a directory holds config.json (LlamaConfig), the weights as model.safetensors or as
model-0000i-of-0000n.safetensors with model.safetensors.index.json, and usually the
tokenizer.json the model was trained with. `model_fields` reads config.json as ModelConfig
fields; training/export.py writes the same mapping the other way (hf_config), and
tests/test_init_from.py checks the two agree. The weights themselves are read by the
workers (training/hf_weights.py), each rank only its own part. `fingerprint` names the
checkpoint by what it holds (the run's config hash uses it, not the directory's path), and
`given_tokenizer_file` finds the tokenizer.json of such a directory (or of tokenizer.path).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from core.errors import ConfigError, DataError
from core.files import canonical_json, sha256_bytes, sha256_file

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
_SAMPLE_BYTES = 64 * 1024  # of each weights file, twice, in its fingerprint
_TENSOR_SAMPLE_BYTES = 4096  # of each tensor, twice, in weights_digest
# safetensors' floating-point dtypes; a weight in any other is a quantized checkpoint's.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}

# ModelConfig field <- config.json key, for the fields that carry over one to one.
HF_FIELDS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}
# model_type -> class. Qwen2 is Llama with q/k/v biases (model.qkv_bias), Qwen3 with q/k
# norms (model.qk_norm) and a head_dim of its own, Mistral without a sliding window is Llama.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# What training/model.py is, said for the config.json field that asks for something else.
_NOT_IMPLEMENTED = {
    "hidden_act": "its feed-forward is SwiGLU (hidden_act 'silu')",
    "attention_bias": "its attention projections are bias-free, but for Qwen2's q/k/v biases "
                      "(model_type qwen2); attention_bias=true also puts one on o_proj",
    "mlp_bias": "its feed-forward is bias-free",
}
# model.moe field <- Mixtral's config.json key; the rest of a Mixtral's routing is fixed
# (MIXTRAL_ROUTING): softmax scores, the top-k renormalised, every block an MoE one.
MIXTRAL_FIELDS = {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
                  "expert_dim": "intermediate_size"}
MIXTRAL_ROUTING = {"shared_experts": 0, "first_dense_layers": 0, "score_func": "softmax",
                   "route_norm": True, "route_scale": 1.0}
# model.moe field <- Qwen3-MoE's config.json key; its router is a softmax without shared
# experts, and mlp_only_layers (a prefix of the blocks) keep a dense feed-forward.
QWEN3_MOE_FIELDS = {"num_experts": "num_experts", "top_k": "num_experts_per_tok",
                    "expert_dim": "moe_intermediate_size", "route_norm": "norm_topk_prob"}
QWEN3_MOE_ROUTING = {"shared_experts": 0, "score_func": "softmax", "route_scale": 1.0}
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


def read_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a Llama checkpoint directory that also holds its weights; ConfigError
    saying what is missing otherwise."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"model.init_from={directory}: no such directory; point it at a "
                          "Hugging Face Llama checkpoint directory (config.json and "
                          "*.safetensors, as save_pretrained writes them)")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ConfigError(f"model.init_from={directory}: {config_file} not found; the directory "
                          "must be a Hugging Face checkpoint (save_pretrained writes config.json "
                          "beside the weights)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.init_from: {config_file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.init_from: {config_file} must hold a JSON object")
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ConfigError(f"model.init_from: {config_file} has a quantization_config (quant_method "
                          f"{method!r}): a quantized checkpoint. Goodput trains from "
                          "floating-point weights; dequantize it first (e.g. load it with "
                          "transformers and save_pretrained it in bfloat16), or start from the "
                          "model's unquantized release")
    architectures = config.get("architectures") or []
    kind = config.get("model_type")
    if kind not in ARCHITECTURES or (architectures and ARCHITECTURES[kind] not in architectures):
        known = ", ".join(f"model_type {t!r} ({a})" for t, a in ARCHITECTURES.items())
        raise ConfigError(f"model.init_from: {config_file} describes model_type={kind!r} "
                          f"{architectures}; Goodput's model loads {known}: a Llama, and with "
                          "model.moe the mixture-of-experts ones. Convert the model to one of "
                          "those, or train from scratch (leave model.init_from unset)")
    if not (path / SINGLE_FILE).is_file() and not (path / SHARD_INDEX).is_file():
        raise ConfigError(f"model.init_from={directory}: neither {SINGLE_FILE} nor {SHARD_INDEX} "
                          "is there; save the model with safetensors (save_pretrained does by "
                          "default; convert .bin or Meta's .pth weights first)")
    return config


def fingerprint(directory: str | Path) -> str:
    """What identifies the checkpoint in `directory` wherever it lies: config.json's and
    tokenizer.json's sha256, and each safetensors file's name, size and a sample of its
    weights (64 KiB from the middle and from the end: a fine-tune of the same model has the
    same names and sizes, not the same weights). Milliseconds for any size of model; moving,
    copying or re-mounting the directory keeps it, another checkpoint changes it."""
    path = Path(directory)
    tokenizer = path / TOKENIZER_FILE
    weights = []
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        sample = hashlib.sha256()
        with open(file, "rb") as f:
            for offset in (size // 2, max(0, size - _SAMPLE_BYTES)):
                f.seek(offset)
                sample.update(f.read(_SAMPLE_BYTES))
        weights.append([file.name, size, sample.hexdigest()])
    return sha256_bytes(canonical_json({
        CONFIG_FILE: sha256_file(path / CONFIG_FILE),
        TOKENIZER_FILE: sha256_file(tokenizer) if tokenizer.is_file() else None,
        "safetensors": weights,
    }))[:16]


def given_tokenizer_file(path: str | Path) -> Path:
    """tokenizer.path as a file: a tokenizer.json, or the one in a Hugging Face tokenizer
    directory (save_pretrained of a fast tokenizer writes it, as beside a checkpoint)."""
    found = Path(path).expanduser()
    if not found.exists():
        raise DataError(f"tokenizer.path={path} does not exist (moved, or not mounted here?); give "
                        f"its new place, or a prepared dataset's directory holding the same "
                        f"{TOKENIZER_FILE} (a run's own config finds one in data.data_dir itself)")
    if found.is_dir():
        found = found / TOKENIZER_FILE
    if not found.is_file():
        raise DataError(f"tokenizer.path={path}: no {TOKENIZER_FILE} there; point it at a "
                        f"{TOKENIZER_FILE} or a directory saved by save_pretrained (a fast "
                        "tokenizer), or leave it unset to train one")
    return found


def model_fields(directory: str | Path) -> dict[str, Any]:
    """The ModelConfig fields the checkpoint in `directory` fixes (its shape, RoPE, norm eps,
    tied embeddings, vocabulary and context), from its config.json."""
    config = read_config(directory)
    where = Path(directory) / CONFIG_FILE
    missing = [key for key in HF_FIELDS.values()
               if key not in config and key not in ("num_key_value_heads", "tie_word_embeddings")]
    if missing:
        raise ConfigError(f"model.init_from: {where} lacks {missing}; a LlamaConfig saved by "
                          "transformers has them all")
    kind = config["model_type"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    unsupported = [f"{key}={config.get(key)!r} ({_NOT_IMPLEMENTED[key]})" for key, ok in (
        ("hidden_act", config.get("hidden_act", "silu") == "silu"),
        ("attention_bias", not config.get("attention_bias", False)),
        ("mlp_bias", not config.get("mlp_bias", False)),
    ) if not ok]
    if unsupported:
        raise ConfigError(f"model.init_from: {where} has {'; '.join(unsupported)}, which "
                          "training/model.py does not implement; start from a checkpoint "
                          "without it, or train from scratch (leave model.init_from unset)")
    _attends_to_whole_context(config, where)
    fields = {field: config[key] for field, key in HF_FIELDS.items() if key in config}
    fields["n_kv_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    # Absent means LlamaConfig's default (untied), as transformers would build the model.
    fields["tie_embeddings"] = bool(config.get("tie_word_embeddings", False))
    fields["rope_theta"], fields["rope_scaling"] = _rope(config, where)
    fields["head_dim"] = None if config.get("head_dim") in (None, head_dim) else config["head_dim"]
    fields["qk_norm"] = kind in ("qwen3", "qwen3_moe")  # Qwen3's q_norm and k_norm
    fields["qkv_bias"] = kind == "qwen2"  # Qwen2's q/k/v projections always have one
    if kind == "mixtral":
        fields["moe"] = _mixtral_moe(config, where)
    if kind == "qwen3_moe":
        fields["moe"] = _qwen3_moe(config, where)
    _check_weights(Path(directory), needed_tensors(kind, fields))
    return fields


def stored_tensors(directory: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in `directory`: HF name -> (file, shape), from the
    index and the safetensors headers only (an 8-byte length, then that much JSON): no
    tensor data is read, so a checkpoint of any size is checked in milliseconds."""
    return {key: (name, tuple(entry["shape"])) for key, (name, entry) in _stored_entries(directory).items()}


def weights_files(directory: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index lists, or model.safetensors."""
    directory = Path(directory)
    index = directory / SHARD_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"model.init_from: {index} is not a safetensors index with a "
                              f"weight_map ({e}); re-save the model with save_pretrained") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    return [directory / SINGLE_FILE]


def _stored_entries(directory: str | Path) -> dict[str, tuple[str, dict]]:
    """HF name -> (file, its safetensors header entry: dtype, shape, data_offsets)."""
    found: dict[str, tuple[str, dict]] = {}
    for path in weights_files(directory):
        if not path.is_file():
            raise ConfigError(f"model.init_from: {path} is missing ({SHARD_INDEX} lists it); copy "
                              "every shard of the checkpoint into the directory")
        for key, entry in _safetensors_entries(path)[0].items():
            found[key] = (path.name, entry)
    return found


def _safetensors_entries(path: Path) -> tuple[dict[str, dict], int]:
    """The header's entries of the safetensors file at `path` (name -> dtype, shape,
    data_offsets) and where its tensor data starts. A copy cut short (its header places
    more data than the file holds) is a ConfigError here, before any worker starts, not a
    retried failure in every worker."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        entries = {key: entry for key, entry in header.items() if key != "__metadata__"}
        data_bytes = max((int(entry["data_offsets"][1]) for entry in entries.values()), default=0)
        for entry in entries.values():
            tuple(entry["shape"]), entry["dtype"]  # noqa: B018 - present, or not safetensors
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ConfigError(f"model.init_from: {path} is not a safetensors file ({e}); copy it "
                          "again, or re-save the model with save_pretrained") from None
    if 8 + length + data_bytes != size:
        raise ConfigError(
            f"model.init_from: {path} is {'cut short' if 8 + length + data_bytes > size else 'longer than its header says'}: "
            f"its header places {data_bytes:,} bytes of tensor data after the header, the file "
            f"holds {size - 8 - length:,}; copy it again (an interrupted download or copy), or "
            "re-save the model with save_pretrained")
    return entries, 8 + length


def weights_digest(directory: str | Path) -> str:
    """A sample of every tensor's weights (its first and its middle 4 KiB) in the safetensors
    files of `directory`, hashed with their names: what tells apart two checkpoints of the
    same model that `fingerprint`'s two samples per file may not (a LoRA merged into a few
    projections, a fine-tune of some layers), over the files the checkpoint lists
    (weights_files). Two reads of 4 KiB per tensor: 1,446 for a 70B Llama (about a second
    on NFS). goodput.runs checks it when a run's config is written, not in the config hash
    (the workers read the config too), and keeps it with the files' sizes and times, which
    spare the reads while they hold (weights_stat)."""
    directory = Path(directory)
    return _weights_digest(directory, tuple(map(tuple, weights_stat(directory))))


def weights_stat(directory: str | Path) -> list[list]:
    """[name, size, mtime_ns] of each of the checkpoint's weights files (weights_files)."""
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in weights_files(directory)]


@functools.lru_cache(maxsize=8)  # keyed by the files' stat: a command checks more than once
def _weights_digest(directory: Path, stat: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stat:
        file = directory / name
        entries, start = _safetensors_entries(file)
        with open(file, "rb") as f:
            for name in sorted(entries):
                begin, end = (int(x) for x in entries[name]["data_offsets"])
                digest.update(f"{file.name}:{name}:{end - begin}".encode())
                for offset in sorted({begin, begin + (end - begin) // 2}):
                    f.seek(start + offset)
                    digest.update(f.read(min(_TENSOR_SAMPLE_BYTES, end - offset)))
    return digest.hexdigest()[:16]


def needed_tensors(kind: str, fields: dict[str, Any]) -> list[str]:
    """The names of the tensors the model of `fields` (model_fields') reads from a checkpoint
    of model_type `kind`: training/export.py's hf_name and hf_expert_names, from the config's
    side, so a checkpoint lacking one is refused before any worker starts."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not fields["tie_embeddings"]:
        names.append("lm_head.weight")
    moe = fields.get("moe")
    for i in range(fields["n_layers"]):
        layer = f"model.layers.{i}"
        names += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"]
        names += [f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"{layer}.self_attn.{p}_proj.bias" for p in "qkv" if fields["qkv_bias"]]
        names += [f"{layer}.self_attn.{p}_norm.weight" for p in "qk" if fields["qk_norm"]]
        if moe is None or i < moe["first_dense_layers"]:
            names += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        elif kind == "mixtral":
            names.append(f"{layer}.block_sparse_moe.gate.weight")
            names += [f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                      for e in range(moe["num_experts"]) for w in ("w1", "w2", "w3")]
        else:  # qwen3_moe
            names.append(f"{layer}.mlp.gate.weight")
            names += [f"{layer}.mlp.experts.{e}.{p}_proj.weight"
                      for e in range(moe["num_experts"]) for p in ("gate", "up", "down")]
    return names


def check_complete(needed, stored: dict, directory: Path) -> None:
    """Every tensor `needed` is `stored` (stored_tensors'); ConfigError naming what is not."""
    missing = sorted(set(needed) - set(stored))
    if missing:
        listing = SHARD_INDEX if (directory / SHARD_INDEX).is_file() else SINGLE_FILE
        raise ConfigError(
            f"model.init_from={directory}: the checkpoint lacks {len(missing)} tensor(s) the model "
            f"needs, e.g. {missing[:3]} (in {listing}); "
            "its weights do not match its config.json (a partial copy, or another architecture "
            "under a Llama config): re-save it with save_pretrained")


def _check_weights(directory: Path, needed: list[str]) -> None:
    """Every tensor the model needs is there, and in floating point: an FP8 or int8
    checkpoint's weights loaded as floats, their scales left out, gave a model of garbage
    without a word."""
    stored = _stored_entries(directory)
    check_complete(needed, {k: (f, tuple(e["shape"])) for k, (f, e) in stored.items()}, directory)
    quantized = {name: stored[name] for name in needed if stored[name][1]["dtype"] not in _FLOAT_DTYPES}
    if quantized:
        name, (file, _) = next(iter(quantized.items()))
        dtypes = sorted({e["dtype"] for _, e in quantized.values()})
        raise ConfigError(
            f"model.init_from: {directory / file} stores weights as {', '.join(dtypes)} (e.g. "
            f"{name}): a quantized checkpoint. Goodput trains from floating-point weights "
            "(F64, F32, F16, BF16); dequantize it first (e.g. load it with transformers and "
            "save_pretrained it in bfloat16), or start from the model's unquantized release")


def _attends_to_whole_context(config: dict, where: Path) -> None:
    """training/model.py attends to the whole context: a checkpoint whose layers attend to a
    sliding window (Mistral's and Mixtral's sliding_window; Qwen's use_sliding_window) is
    refused, one whose window is off, or spans max_position_embeddings, loads."""
    kind = config["model_type"]
    window, context = config.get("sliding_window"), config.get("max_position_embeddings")
    if isinstance(window, int) and isinstance(context, int) and window >= context:
        window = None  # a window as wide as the context: the whole context, as here
    if kind in ("mistral", "mixtral") and window is not None:
        raise ConfigError(f"model.init_from: {where} has sliding_window="
                          f"{config['sliding_window']}; training/model.py attends to the whole "
                          f"context (a {kind} config with sliding_window null loads)")
    if kind.startswith("qwen") and config.get("use_sliding_window"):
        raise ConfigError(f"model.init_from: {where} has use_sliding_window=true; "
                          "training/model.py attends to the whole context (a config with "
                          "use_sliding_window false loads)")


def _qwen3_moe(config: dict, where: Path) -> dict[str, Any]:
    """model.moe's fields that a Qwen3-MoE config.json fixes."""
    if "num_experts" not in config and "num_local_experts" in config:  # transformers 5's name
        config = {**config, "num_experts": config["num_local_experts"]}
    missing = [key for key in QWEN3_MOE_FIELDS.values() if key not in config]
    if missing:
        raise ConfigError(f"model.init_from: {where} lacks {missing}; a Qwen3MoeConfig saved "
                          "by transformers has them all")
    dense = sorted(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    if dense != list(range(len(dense))) or step != 1:
        raise ConfigError(f"model.init_from: {where} has mlp_only_layers={dense} and "
                          f"decoder_sparse_step={step}; training/model.py keeps the dense "
                          "blocks first (model.moe.first_dense_layers): mlp_only_layers must "
                          "be [0, 1, ..., k-1] and decoder_sparse_step 1")
    fields = {field: config[key] for field, key in QWEN3_MOE_FIELDS.items()}
    return {**fields, "route_norm": bool(fields["route_norm"]), "first_dense_layers": len(dense),
            **QWEN3_MOE_ROUTING}


def _mixtral_moe(config: dict, where: Path) -> dict[str, Any]:
    """model.moe's fields that a Mixtral config.json fixes."""
    missing = [key for key in MIXTRAL_FIELDS.values() if key not in config]
    if missing:
        raise ConfigError(f"model.init_from: {where} lacks {missing}; a MixtralConfig saved by "
                          "transformers has them all")
    return {**{field: config[key] for field, key in MIXTRAL_FIELDS.items()}, **MIXTRAL_ROUTING}


def _rope(config: dict, where: Path) -> tuple[float, dict | None]:
    """rope_theta and Llama 3 scaling from either spelling: transformers 5's rope_parameters,
    or 4.x's top-level rope_theta with rope_scaling."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"model.init_from: {where} asks for rope_type={kind!r}, which "
                          "training/model.py does not implement (it has plain RoPE, 'default', "
                          "and Llama 3's scaling, 'llama3'): the model would see its positions "
                          "otherwise than it was trained to. Start from a checkpoint with one "
                          "of those, or train from scratch (leave model.init_from unset)")
    missing = [k for k in ROPE_SCALING_KEYS if k not in params]
    if missing:
        raise ConfigError(f"model.init_from: {where}'s llama3 rope scaling lacks {missing}")
    scaling = {k: params[k] for k in ROPE_SCALING_KEYS}
    scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        scaling[key] = float(scaling[key])
    return float(theta), scaling
