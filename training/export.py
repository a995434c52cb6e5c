"""Export a committed checkpoint as a Hugging Face model: safetensors + config.json (a Llama; with
model.qkv_bias a Qwen2, with model.qk_norm a Qwen3; an MoE model as Qwen3-MoE or Mixtral,
training/hf_weights.py), and with --tokenizer the tokenizer and its settings
(hf_tokenizer_files) and generation_config.json.

    goodput export runs/x/checkpoints/step-00000300 --format hf --out exported/ \
        [--tokenizer DATASET_DIR_OR_TOKENIZER_JSON] [--dtype bfloat16] [--force]
    goodput export s3://bucket/prefix/runs/x/checkpoints/step-00000300 --format hf --out exported/

The result loads with `transformers.LlamaForCausalLM.from_pretrained(out)` (and, with a
tokenizer, `AutoTokenizer.from_pretrained(out)`). Our model already is a Llama: the same
blocks, and rotary embeddings in Hugging Face's rotate-half convention, so export only
renames tensors; no q/k permutation is needed (tests/test_export.py checks logit parity).
The same names, read the other way (training/hf_weights.py), load a Hugging Face Llama
into the trainer (model.init_from).

Only the model weights are read (not the optimizer state), whatever layout saved them.
The checkpoint's files are checked against its manifest first, so a corrupt checkpoint is
never exported; from the store only the files holding the weights are fetched, each checked
as it arrives, into a temporary directory beside the output. The output is written to a temporary sibling directory and moved into
place at the end: a failed export leaves no half-written model behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import torch
from safetensors.torch import save_file

from core.files import sha256_file
from core.hf_llama import SHARD_INDEX, SINGLE_FILE, TOKENIZER_FILE
from core.protocol import CHECKPOINT_MANIFEST, RunDir, is_committed
from core.uris import local_path_of
from storage.manifests import (DATASET_MANIFEST, MIXTURE_MANIFEST, CheckpointManifest, MixtureManifest,
                                verify_files)
from training.checkpoint.errors import CheckpointCorrupt
from training.checkpoint.reader import StoreReader, load_all_tensors, model_state_from
from training.model import ModelArgs, Transformer
from training.model_args import hf_architecture, hf_export_problems, hf_exportable_overrides
from training.tokenizer import HF_TOKENIZER_SIDE_FILES

# Hugging Face's default shard size ("5GB"); smaller models are one model.safetensors.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
# A mixture of experts exports as Mixtral (Llama's attention) or, with model.qk_norm, as
# Qwen3-MoE: their names for the router and the experts, which they store one per expert
# (Goodput stacks each weight: experts, out, in). A dense model with model.qk_norm is a
# Qwen3 (q/k norms), with model.qkv_bias a Qwen2 (whose q/k/v biases take _LAYER_NAMES').
_QK_NORM_NAMES = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
_MOE_LAYER_NAMES = {
    "mixtral": {"moe.router.gate": "block_sparse_moe.gate"},
    "qwen3_moe": {"moe.router.gate": "mlp.gate", **_QK_NORM_NAMES},
    "qwen3": _QK_NORM_NAMES,
}
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.experts", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    "qwen3_moe": ("mlp.experts", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
}
_LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")


class ExportError(ValueError):
    """The inputs cannot be exported as asked; the message says what to change."""


# -- names, config and weights in Hugging Face's terms -----------------------------------------

def hf_name(name: str, architecture: str = "llama") -> str:
    """Our parameter name -> the name in a transformers model of `architecture` (e.g.
    layers.3.attention.wq.weight -> model.layers.3.self_attn.q_proj.weight). Stacked experts
    have one name per expert: hf_expert_names."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _LAYER_TENSOR.match(name)
    names = {**_LAYER_NAMES, **_MOE_LAYER_NAMES.get(architecture, {})}
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"
    raise ExportError(f"checkpoint tensor {name!r} has no counterpart in a {architecture} model; "
                      "training.export knows only the tensors of training.model.Transformer")


def hf_expert_names(name: str, num_experts: int, architecture: str) -> list[str] | None:
    """The names, one per expert, of the experts stacked in our parameter `name` (None: `name`
    is not a stack of experts)."""
    match = _EXPERTS.match(name)
    if match is None:
        return None
    layer, weight = match.groups()
    prefix, weights = _EXPERT_NAMES[architecture]
    return [f"model.layers.{layer}.{prefix}.{e}.{weights[weight]}.weight" for e in range(num_experts)]


def hf_state_dict(model_state: dict[str, torch.Tensor], dtype: torch.dtype,
                  tied: bool = False, architecture: str = "llama") -> dict[str, torch.Tensor]:
    """The tensors of a transformers model file of `architecture`. With tied embeddings the
    output layer is the embedding matrix, which transformers stores once (as
    model.embed_tokens.weight). The routing bias has no counterpart (export_refusal)."""
    tensors = {}
    for name, tensor in model_state.items():
        if (tied and name == "output.weight") or name.endswith(".expert_bias"):
            continue
        experts = hf_expert_names(name, tensor.shape[0], architecture)
        # contiguous(): safetensors stores raw buffers; clone-free when already contiguous.
        for hf, t in zip(experts, tensor) if experts else [(hf_name(name, architecture), tensor)]:
            tensors[hf] = t.to(dtype).contiguous()
    return tensors


def export_refusal(args: ModelArgs, state: dict[str, torch.Tensor]) -> str | None:
    """Why the model has no form transformers loads, if so (hf_export_problems, a routing
    bias read from its weights), and with what overrides it would have trained into one."""
    biased = next((k for k, v in state.items() if k.endswith(".expert_bias") and bool(v.any())), None)
    problems = hf_export_problems(args, biased)
    if not problems:
        return None
    overrides = hf_exportable_overrides(args, biased)
    return (f"{'; '.join(problems)}. Mixtures of experts export as Mixtral (every block MoE, "
            "softmax router, top-k renormalised, no shared experts) or, with model.qk_norm, "
            "Qwen3-MoE (softmax router, no shared experts); neither has a routing bias. Trained "
            f"with {' '.join(overrides)}, the same model would export")


def hf_config(args: ModelArgs, dtype: torch.dtype, eos_id: int | None = None,
              provenance: dict | None = None, token_ids: dict | None = None) -> dict:
    """config.json for LlamaForCausalLM (or the architecture hf_architecture names), readable
    by transformers 4.x and 5.x. `token_ids`: bos_token_id, eos_token_id and pad_token_id of
    the tokenizer exported with it (hf_tokenizer_files); without, EOS serves as BOS."""
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # transformers 4.x reads rope_theta and rope_scaling; 5.x reads rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "llama3" if args.rope_scaling else "default",
                            "rope_theta": args.rope_theta, **(args.rope_scaling or {})},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name,  # transformers 4.x
        "dtype": dtype_name,        # transformers 5.x
        # Without explicit ids transformers assumes Llama's 1 and 2, which mean other tokens
        # here. Documents in the token stream follow an EOS, so EOS also serves as BOS (as GPT-2).
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        **(token_ids or {}),
    }
    if args.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", **args.rope_scaling}
    moe, architecture = args.moe_args, hf_architecture(args)
    if architecture == "mixtral":  # Llama with every feed-forward a mixture of experts
        config.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                       "intermediate_size": args.expert_hidden,
                       "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                       "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False,
                       "router_jitter_noise": 0.0, "sliding_window": None})
        config.pop("mlp_bias")
    if architecture == "qwen2":  # Llama with q/k/v biases (always on: no attention_bias key)
        config.update({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                       "use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": args.n_layers})
        config.pop("attention_bias")
        config.pop("mlp_bias")
    if architecture == "qwen3":  # Llama with q/k norms and its own head_dim
        config.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                       "use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": args.n_layers})
        config.pop("mlp_bias")
    if architecture == "qwen3_moe":  # and q/k norms, dense blocks first, its own head_dim
        config.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                       "moe_intermediate_size": args.expert_hidden,
                       # 4.x reads num_experts, 5.x num_local_experts
                       "num_experts": moe.num_experts, "num_local_experts": moe.num_experts,
                       "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.route_norm, "decoder_sparse_step": 1,
                       "mlp_only_layers": list(range(moe.first_dense_layers)),
                       "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False,
                       "use_sliding_window": False, "sliding_window": None})
        config.pop("mlp_bias")
    if provenance:
        config["goodput"] = provenance
    return config


def model_args_of(manifest: CheckpointManifest) -> ModelArgs:
    try:
        return ModelArgs(**manifest.model_args)
    except TypeError as e:
        raise ExportError(f"manifest model_args {manifest.model_args} do not describe "
                          f"training.model.ModelArgs: {e}") from None


# -- reading the checkpoint --------------------------------------------------------------------

def read_checkpoint(checkpoint: str | Path) -> tuple[CheckpointManifest, dict[str, torch.Tensor]]:
    """The manifest and model weights of a committed, intact checkpoint (any saving layout)."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ExportError(f"{path} is not a directory; give a checkpoint directory such as "
                          "<run_dir>/checkpoints/step-00000300")
    if not is_committed(path):
        raise ExportError(f"{path} has no {CHECKPOINT_MANIFEST}, so it is not a committed "
                          "checkpoint (an interrupted save, or not a checkpoint at all)")
    try:
        manifest = CheckpointManifest.load(path)
    except Exception as e:  # pydantic or JSON error: either way the checkpoint is unusable
        raise ExportError(f"{path / CHECKPOINT_MANIFEST} is unreadable: {e}") from None
    problems = verify_files(path, manifest.files)
    if problems:
        raise ExportError(f"{path} does not match its manifest ({'; '.join(problems[:3])}); "
                          "export another checkpoint")
    state = model_state_from(load_all_tensors(path, prefix="model."))
    _check_fits(state, model_args_of(manifest), path)
    return manifest, state


def read_checkpoint_from_store(url: str, cache_dir: Path, *, endpoint_url: str | None = None,
                               region: str | None = None) -> tuple[CheckpointManifest, dict[str, torch.Tensor]]:
    """read_checkpoint of a checkpoint in the object store, `s3://bucket/.../step-XXXXXXXX`:
    its manifest, then only the files the model's weights are in (not the optimizer's), each
    fetched into `cache_dir` and checked against the manifest's sha256, as a resume from the
    store reads them (training.checkpoint.reader.StoreReader). Without `endpoint_url` and
    `region` boto3 reads AWS_ENDPOINT_URL and AWS_DEFAULT_REGION, as any AWS tool."""
    from storage.store import open_store  # boto3 only where the store is read

    root, _, name = url.rstrip("/").rpartition("/")
    try:
        store = open_store(root, endpoint_url=endpoint_url, region=region)
        reader = StoreReader(store, name, cache_dir)
        state = model_state_from(load_all_tensors(prefix="model.", reader=reader))
    except FileNotFoundError as e:
        raise ExportError(f"no committed checkpoint at {url} ({e}); give the URL of an uploaded "
                          "checkpoint, such as s3://BUCKET/PREFIX/runs/RUN/checkpoints/step-00000300") from None
    except CheckpointCorrupt as e:
        raise ExportError(f"{url} does not match its manifest ({e.reason}); export another "
                          "checkpoint") from None
    except (OSError, ValueError) as e:  # refused credentials, an unreachable endpoint, a bad URL
        raise ExportError(f"{url}: {e}") from None
    manifest = reader.manifest
    _check_fits(state, model_args_of(manifest), url)
    return manifest, state


def _check_fits(state: dict[str, torch.Tensor], args: ModelArgs, path: Path | str) -> None:
    """The weights are exactly those of Transformer(args): names and shapes."""
    with torch.device("meta"):  # shapes only: no memory, no init cost
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    wrong = [f"{k} {found[k]} != {expected[k]}" for k in sorted(expected.keys() & found.keys())
             if found[k] != expected[k]]
    if missing or unexpected or wrong:
        raise ExportError(f"model weights in {path} do not fit its manifest's model_args: "
                          f"missing {missing[:3]}, unexpected {unexpected[:3]}, shapes {wrong[:3]}")


# -- writing -----------------------------------------------------------------------------------

def write_safetensors(tensors: dict[str, torch.Tensor], directory: Path,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than one
    shard may be (the layout `from_pretrained` expects). Returns the file names written."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    def save(shard: dict[str, torch.Tensor], file_name: str) -> None:
        # "format": "pt" tells transformers these are PyTorch tensors. safetensors writes its
        # file readable by its owner only; made as any other file (the umask's say).
        save_file(shard, directory / file_name, metadata={"format": "pt"})
        os.chmod(directory / file_name, 0o666 & ~UMASK)

    if len(shards) == 1:
        save(shards[0], SINGLE_FILE)
        return [SINGLE_FILE]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for file_name, shard in zip(names, shards):
        save(shard, file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(directory / SHARD_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*names, SHARD_INDEX]


def _umask() -> int:
    """The process's umask; reading it sets it, so once, at import (before any thread)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()


class TokenizerFiles(NamedTuple):
    path: Path  # tokenizer.json
    eos_token: str
    eos_id: int


def run_tokenizer_dir(checkpoint: Path) -> Path | None:
    """The Hugging Face directory the run of the local `checkpoint` took its tokenizer from
    (its config.yaml's tokenizer.path: model.init_from's directory by default), where it
    still is; None for a tokenizer Goodput trained, or a checkpoint outside a run directory.

    A prepared dataset keeps the side files (chat template, generation settings) of the
    first model that prepared it; its id names tokenizer.json alone, so a second model with
    the same tokenizer.json and its own chat template shares it. The export takes the
    run's own."""
    config_file = RunDir(checkpoint.parent.parent).config_file
    try:
        import yaml

        given = (yaml.safe_load(config_file.read_text()) or {}).get("tokenizer", {}).get("path")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    if not isinstance(given, str):
        return None
    directory = Path(given) if Path(given).is_dir() else Path(given).parent
    return directory if (directory / TOKENIZER_FILE).is_file() else None


def fetch_store_tokenizer(url: str, into: Path) -> Path:
    """The tokenizer of a dataset in the store (`s3://BUCKET/PREFIX/datasets/<dataset_id>`):
    its tokenizer.json, checked against the dataset's manifest, with its Hugging Face side
    files and the manifest (which states the end-of-document id), fetched into `into`; that
    directory, for _tokenizer_files. A machine that trained from the store has no dataset
    directory to give --tokenizer. boto3 reads AWS_ENDPOINT_URL, as for the checkpoint."""
    from storage.manifests import DatasetManifest
    from storage.store import open_store

    try:
        store = open_store(url.rstrip("/"))
        if not store.exists(DATASET_MANIFEST):
            raise ExportError(f"--tokenizer {url}: no prepared dataset there (no {DATASET_MANIFEST}); "
                              "give the dataset's URL in the store, such as "
                              "s3://BUCKET/PREFIX/datasets/<dataset_id>")
        manifest = DatasetManifest.model_validate_json(store.get_bytes(DATASET_MANIFEST))
        for name in HF_TOKENIZER_SIDE_FILES:
            if store.exists(name):
                store.get_file(name, into / name)
        store.get_file(manifest.tokenizer, into / TOKENIZER_FILE)
    except ExportError:
        raise
    except (OSError, ValueError) as e:  # refused credentials, an unreachable endpoint, a bad URL
        raise ExportError(f"--tokenizer {url}: {e}") from None
    if sha256_file(into / TOKENIZER_FILE) != manifest.tokenizer_sha256:
        raise ExportError(f"--tokenizer {url}: its tokenizer differs from its manifest: the "
                          "dataset in the store is damaged; prepare it again")
    manifest.save(into)
    return into


def _mixture_tokenizer(directory: Path) -> Path:
    """A mixture's tokenizer (data.sources share one): its first source's dataset's."""
    first = MixtureManifest.load(directory).sources[0]
    if first.dir is None:
        raise ExportError(f"--tokenizer {directory}: the mixture does not say where its source "
                          f"{first.name} (dataset {first.dataset_id}) lies; give that dataset's "
                          "directory")
    return Path(first.dir)


def _tokenizer_files(tokenizer: str | Path, vocab_size: int, dataset_id: str | None = None,
                     trained_eos_id: int | None = None, trained_sha256: str | None = None,
                     ignore_mismatch: bool = False) -> TokenizerFiles:
    """A tokenizer.json, given itself or the directory holding it, checked against the model
    (trained on `dataset_id`). The end-of-document id is the one the model trained on
    (`trained_eos_id`, from the checkpoint); for a checkpoint that does not record it, the
    one the directory states (a prepared dataset's manifest, or a Hugging Face tokenizer
    directory's tokenizer_config.json), else a known end-of-text token. A tokenizer other
    than the one the checkpoint records (`trained_sha256`) is refused unless
    `ignore_mismatch`."""
    from core.errors import DataError
    from training.tokenizer import EOS_CANDIDATES, eos_id, read_tokenizer, stated_eos_token

    path = Path(tokenizer)
    if path.is_dir() and (path / MIXTURE_MANIFEST).is_file() and not (path / "tokenizer.json").is_file():
        path = _mixture_tokenizer(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"--tokenizer {tokenizer}: no tokenizer.json there; give the directory "
                          f"of the dataset the run trained on (data.data_dir/"
                          f"{dataset_id or '<dataset_id>'}, or data.data_dir/mixes/<id> for "
                          "data.sources), its URL in the store (s3://BUCKET/PREFIX/datasets/"
                          f"{dataset_id or '<dataset_id>'}) or its tokenizer.json")
    if trained_sha256 and not ignore_mismatch and sha256_file(path) != trained_sha256:
        raise ExportError(
            f"--tokenizer {path} (sha256 {sha256_file(path)[:12]}) is not the tokenizer the "
            f"checkpoint's data was tokenized with (sha256 {trained_sha256[:12]}, dataset "
            f"{dataset_id}): its ids would decode to other text. Give that dataset's directory; "
            "if this file is the same tokenizer saved again, pass --ignore-tokenizer-mismatch")
    try:
        loaded = read_tokenizer(path)
        if trained_eos_id is not None:
            if loaded.id_to_token(trained_eos_id) is None:
                raise ExportError(f"--tokenizer {path} has no token of id {trained_eos_id}, the "
                                  "end-of-document id the model trained on; give the tokenizer of "
                                  "the dataset this run trained on")
            eos = trained_eos_id
        else:
            declared = stated_eos_token(path)
            try:
                eos = eos_id(loaded, declared)
            except DataError:  # its advice is prepare's (tokenizer.eos_token): not export's
                what = (f"the eos_token {declared!r} its directory declares is not in its "
                        "vocabulary" if declared is not None else "it has none of the "
                        f"end-of-document tokens {', '.join(EOS_CANDIDATES)} and its directory "
                        "declares none (tokenizer_config.json)")
                raise ExportError(
                    f"--tokenizer {path}: {what}; give the directory of the dataset the run "
                    f"trained on (data.data_dir/{dataset_id or '<dataset_id>'}): its manifest "
                    "states the end-of-document id") from None
    except DataError as e:
        raise ExportError(f"--tokenizer: {e}") from None
    if loaded.get_vocab_size() > vocab_size:
        raise ExportError(f"tokenizer {path} has {loaded.get_vocab_size()} tokens but the model only "
                          f"{vocab_size}; give the tokenizer of the dataset this run trained on")
    return TokenizerFiles(path, loaded.id_to_token(eos), eos)


def _tokenizer_config(eos_token: str, max_len: int) -> dict:
    # The minimum AutoTokenizer needs to wrap tokenizer.json as a fast tokenizer (a tokenizer
    # Goodput trained, or a dataset prepared before the side files were kept).
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos_token,
            "eos_token": eos_token, "model_max_length": max_len,
            "clean_up_tokenization_spaces": False}


def _read_json_object(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"--tokenizer: {path} is not valid JSON ({e}); save the tokenizer "
                          "again with save_pretrained, or remove the file") from None
    if not isinstance(found, dict):
        raise ExportError(f"--tokenizer: {path} must hold a JSON object")
    return found


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json states it: a string, or an AddedToken
    written out ({"content": ...})."""
    return token.get("content") if isinstance(token, dict) else token


def hf_tokenizer_files(tok: TokenizerFiles, max_len: int) -> tuple[dict[str, str], dict]:
    """The tokenizer files of the export besides tokenizer.json (name -> text), and the
    bos/eos/pad ids config.json states with them.

    A tokenizer from a Hugging Face directory (a model.init_from checkpoint's, or
    tokenizer.path's: prepare keeps its side files beside the dataset's tokenizer.json) keeps
    its own: tokenizer_config.json (special tokens, chat template), special_tokens_map.json,
    chat_template.jinja and generation_config.json, copied as they are, the special tokens'
    ids read from tokenizer.json. Only model_max_length is capped at the exported context.
    Otherwise (a tokenizer Goodput trained) EOS also serves as BOS, as documents in the token
    stream follow an EOS (GPT-2's convention), and no token pads."""
    from training.tokenizer import read_tokenizer, tokenizer_side_files

    side = {path.name: path for path in tokenizer_side_files(tok.path)}
    if "tokenizer_config.json" not in side:
        ids = {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, "pad_token_id": None}
        files = {"tokenizer_config.json": _json_text(_tokenizer_config(tok.eos_token, max_len)),
                 "generation_config.json": _json_text(_generation_config(ids))}
        return files, ids
    tokenizer_config = _read_json_object(side["tokenizer_config.json"])
    special = {}
    if "special_tokens_map.json" in side:
        special = _read_json_object(side["special_tokens_map.json"])
    tokenizer = read_tokenizer(tok.path)
    ids = {}
    for role in ("bos", "eos", "pad"):
        text = _token_text(tokenizer_config.get(f"{role}_token", special.get(f"{role}_token")))
        ids[f"{role}_token_id"] = tokenizer.token_to_id(text) if isinstance(text, str) else None
    if ids["eos_token_id"] is None:  # it declares none: the id its documents ended with
        ids["eos_token_id"] = tok.eos_id
    # Hugging Face's "unset" is 1e30 (VERY_LARGE_INTEGER): lm-eval and pipelines would
    # then feed sequences longer than the positions the model was trained for.
    stated = tokenizer_config.get("model_max_length")
    tokenizer_config["model_max_length"] = (min(int(stated), max_len)
                                            if isinstance(stated, (int, float)) else max_len)
    tokenizer_config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    files = {name: path.read_text() for name, path in side.items()}
    files["tokenizer_config.json"] = _json_text(tokenizer_config)
    files.setdefault("generation_config.json", _json_text(_generation_config(ids)))
    return files, ids


def _generation_config(ids: dict) -> dict:
    # What generate() reads: it stops at eos_token_id (without it, only at max_new_tokens).
    return {key: value for key, value in ids.items() if value is not None}


def _json_text(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(_json_text(obj))


def _check_out(out: Path, force: bool, checkpoint: Path | None = None) -> None:
    """`out` may become the export: a new or empty directory, or with `force` an earlier
    export (its config.json says it is one). Nothing else is replaced: not the checkpoint or a
    directory above it, not the working directory or one above it, not a user's files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory")
    cwd = Path.cwd().resolve()
    for what, path in (("the checkpoint exported", checkpoint), ("the working directory", cwd)):
        if path is not None and (out == path or out in path.parents):
            raise ExportError(f"--out {out} is {'' if out == path else 'above '}{what} "
                              f"({path}); the export replaces its directory: give another one")
    if checkpoint is not None and checkpoint in out.parents:  # retention would delete it
        raise ExportError(f"--out {out} is inside the checkpoint exported ({checkpoint}); give a "
                          "directory outside it")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ExportError(f"--out {out} is not empty; choose another directory or pass --force "
                          "to replace an earlier export there")
    others = sorted(p.name for p in out.iterdir() if not EXPORT_FILES.fullmatch(p.name))
    if not _is_export(out) or others:
        held = others or sorted(p.name for p in out.iterdir())
        raise ExportError(f"--out {out} holds files that are not an earlier export "
                          f"({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); --force "
                          "replaces only an export of this command: choose another directory")


# What an export writes (write_hf): --force replaces a directory of these files only.
EXPORT_FILES = re.compile("|".join([
    re.escape(SINGLE_FILE), r"model-\d+-of-\d+\.safetensors", re.escape(SHARD_INDEX),
    *(re.escape(name) for name in ("config.json", "tokenizer.json", *HF_TOKENIZER_SIDE_FILES))]))


def _is_export(directory: Path) -> bool:
    """An export of this command: its config.json records where it came from."""
    try:
        return "goodput" in json.loads((directory / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")


def _move_into_place(staging: Path, out: Path) -> None:
    """Swap the finished export in for `out`; an old `out` is removed only after the swap."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old)


def export_hf(checkpoint: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
              dtype: str | None = None, force: bool = False,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              ignore_tokenizer_mismatch: bool = False) -> dict:
    """Write `checkpoint` to `out` as a LlamaForCausalLM; returns a summary of what was written.

    `checkpoint` is a committed checkpoint directory (a path or file:// URL) or the URL of
    one in the store (s3://..., read_checkpoint_from_store).

    `dtype` (float32, bfloat16, float16) defaults to the dtype the weights were saved in.
    A non-empty `out` is replaced only with `force`, and only when it holds an earlier export.
    A `tokenizer` other than the one the checkpoint records is refused unless
    `ignore_tokenizer_mismatch`.
    """
    out = Path(out).resolve()  # so the staging directory beside it has a name ("." has none)
    checkpoint = local_path_of(str(checkpoint))
    # A URL, not a local directory whose name holds "x://" (Path() would collapse the "//")
    scheme = urlparse(checkpoint).scheme if "://" in checkpoint and not Path(checkpoint).exists() else ""
    if scheme and scheme != "s3":
        raise ExportError(f"{checkpoint}: not a checkpoint directory, and not a URL of the store "
                          "(s3://BUCKET/PREFIX/runs/RUN/checkpoints/step-XXXXXXXX)")
    local = None if scheme == "s3" else Path(checkpoint).resolve()
    _check_out(out, force, local)  # before reading a possibly large checkpoint
    _check_dtype(dtype)
    out.parent.mkdir(parents=True, exist_ok=True)  # what the store gives is fetched beside the export
    with contextlib.ExitStack() as fetched:  # the tokenizer's copy, until write_hf has read it
        if tokenizer is not None and urlparse(str(tokenizer)).scheme == "s3":  # first: it fails fast
            tokenizer = fetch_store_tokenizer(str(tokenizer), Path(fetched.enter_context(
                tempfile.TemporaryDirectory(prefix=f".{out.name}.tokenizer-", dir=out.parent))))
        if local is None:
            with tempfile.TemporaryDirectory(prefix=f".{out.name}.fetch-", dir=out.parent) as cache:
                manifest, state = read_checkpoint_from_store(str(checkpoint), Path(cache))
        else:
            manifest, state = read_checkpoint(checkpoint)
        refusal = export_refusal(model_args_of(manifest), state)
        if refusal:
            raise ExportError(f"{checkpoint} holds a model with no form transformers loads: {refusal}")
        provenance = {"checkpoint": str(local or checkpoint), "step": manifest.step,
                      "tokens_seen": manifest.tokens_seen, "dataset_id": manifest.dataset_id,
                      "config_hash": manifest.config_hash}
        summary = write_hf(model_args_of(manifest), state, out, tokenizer=tokenizer, dtype=dtype,
                           provenance=provenance, max_shard_bytes=max_shard_bytes,
                           eos_id=manifest.eos_id, tokenizer_sha256=manifest.tokenizer_sha256,
                           ignore_tokenizer_mismatch=ignore_tokenizer_mismatch,
                           run_tokenizer=run_tokenizer_dir(local) if local is not None else None)
    return {**summary, "step": manifest.step}


def write_hf(args: ModelArgs, state: dict[str, torch.Tensor], out: str | Path, *,
             tokenizer: str | Path | None = None, dtype: str | None = None,
             provenance: dict | None = None,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, eos_id: int | None = None,
             tokenizer_sha256: str | None = None, ignore_tokenizer_mismatch: bool = False,
             run_tokenizer: Path | None = None) -> dict:
    """Write the model `state` (training.model names, whole tensors) of shape `args` to the
    directory `out` (empty, or replaced by the caller's choice) as a LlamaForCausalLM.
    `eos_id`, `tokenizer_sha256`: the end-of-document id and the tokenizer the model trained
    on, where known. `run_tokenizer`: the Hugging Face directory the run's tokenizer came
    from (run_tokenizer_dir): where it holds the same tokenizer.json as `tokenizer` and other
    side files, the export takes its side files (the model's own chat template)."""
    out = Path(out).resolve()
    _check_dtype(dtype)
    target = DTYPES[dtype] if dtype else state["tok_embeddings.weight"].dtype
    tok = (_tokenizer_files(tokenizer, args.vocab_size, (provenance or {}).get("dataset_id"),
                            eos_id, tokenizer_sha256, ignore_tokenizer_mismatch)
           if tokenizer is not None else None)
    side_files_from = None
    # Only for a prepared dataset's copy: side files a user points --tokenizer at are theirs.
    if (tok is not None and run_tokenizer is not None
            and (tok.path.parent / DATASET_MANIFEST).is_file()
            and _other_side_files(tok.path, run_tokenizer)):
        tok = tok._replace(path=run_tokenizer / TOKENIZER_FILE)  # the same bytes, its own side files
        side_files_from = str(run_tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        files = write_safetensors(hf_state_dict(state, target, args.tie_embeddings,
                                                hf_architecture(args)), staging, max_shard_bytes)
        tokenizer_files, token_ids = hf_tokenizer_files(tok, args.max_seq_len) if tok else ({}, {})
        if not tok and eos_id is not None:  # without a tokenizer: the id documents ended with
            token_ids = {"bos_token_id": eos_id, "eos_token_id": eos_id}
            tokenizer_files = {"generation_config.json": _json_text(_generation_config(token_ids))}
        _write_json(staging / "config.json", hf_config(args, target, eos_id, provenance, token_ids))
        files.append("config.json")
        if tok:
            shutil.copyfile(tok.path, staging / "tokenizer.json")
            files.append("tokenizer.json")
        for name, text in tokenizer_files.items():
            (staging / name).write_text(text)
            files.append(name)
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # A tied matrix counts once, as the model holds it.
    parameters = sum(t.numel() for k, t in state.items()
                     if not (args.tie_embeddings and k == "output.weight")
                     and not k.endswith(".expert_bias"))  # a buffer, not a parameter
    return {"out": str(out), "format": "hf", "dtype": str(target).removeprefix("torch."),
            "parameters": parameters, "files": files,
            **({"tokenizer_side_files_from": side_files_from} if side_files_from else {})}


def _other_side_files(tokenizer_json: Path, directory: Path) -> bool:
    """Whether the Hugging Face `directory` holds the same tokenizer.json as `tokenizer_json`
    with other side files beside it (names or contents)."""
    from training.tokenizer import tokenizer_side_files

    theirs = directory / TOKENIZER_FILE
    if theirs.resolve() == tokenizer_json.resolve() or sha256_file(theirs) != sha256_file(tokenizer_json):
        return False
    contents = lambda files: {p.name: p.read_bytes() for p in files}  # noqa: E731
    return contents(tokenizer_side_files(theirs)) != contents(tokenizer_side_files(tokenizer_json))
