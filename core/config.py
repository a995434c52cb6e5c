"""RunConfig: the one configuration tree of a run.

Loaded from YAML (`configs/*.yaml`), overridden field by field (`training.max_steps=50`),
validated before anything starts. Errors name the field and say what to do.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError,
                      field_validator, model_validator)

from core.errors import ConfigError, DataError
from core.files import canonical_json, sha256_bytes, sha256_file
from core.layout import DEGREES, ParallelDims, follow_world
from core.protocol import DEFAULT_RETRY_BUDGETS, RunDir
from core.uris import parse_s3_uri


class _Section(BaseModel):
    # Unknown keys are mistakes (a typo silently ignored would train the wrong model).
    # Floats finite: training.lr=inf passed gt=0 and trained three attempts of NaN losses.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _a_directory(path: str) -> str:
    """A local directory setting: where it exists, a directory (a file there failed the first
    write, a traceback ending in "Not a directory"). Created where missing."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a directory: give a directory (it is created "
                         "if missing)")
    return path


def _is_share(weight: float) -> bool:
    """A mix weight: finite and >= 0 (NaN is neither)."""
    return math.isfinite(weight) and weight >= 0


class SourceConfig(_Section):
    """One named source of a mixture; the fields left unset are data's own."""

    name: str = Field(description="What the source is called in the mix, the metrics and "
                      "data.stages (letters, digits, '-', '_').")
    weight: float = Field(description="Its share of the training tokens (the weights are "
                          "normalised to sum 1); 0 leaves it out until a stage gives it one.")
    source: str = Field(description="As data.source: 'builtin', local files, s3://... or a "
                        "hub dataset name.")
    format: Literal["auto", "json", "parquet", "text"] | None = None
    hub_config: str | None = None
    hub_split: str | None = None
    revision: str | None = None
    text_column: str | None = None
    max_docs: int | None = Field(None, ge=1)

    @field_validator("name")
    @classmethod
    def _name_is_a_word(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", value):
            raise ValueError(f"{value!r}: name a source with letters, digits, '-' and '_' "
                             "(it labels metrics and files)")
        return value

    @field_validator("weight")
    @classmethod
    def _weight_is_a_share(cls, value: float) -> float:
        if not _is_share(value):
            raise ValueError(f"weight {value} is not a share of tokens: give a finite weight "
                             ">= 0 (the weights are normalised to sum 1)")
        return value


class StageConfig(_Section):
    """A curriculum stage: from its start on, the mix takes these weights."""

    start_step: int | None = Field(None, ge=1, description="The first optimizer step of the "
                                   "stage (steps count from 1).")
    start_tokens: int | None = Field(None, ge=0, description="Or: the stage starts at the "
                                     "first step after this many training tokens.")
    weights: dict[str, float] = Field(description="Weight per source name; a source left out "
                                      "gets 0 in this stage.")

    @model_validator(mode="after")
    def _one_start(self) -> "StageConfig":
        if (self.start_step is None) == (self.start_tokens is None):
            raise ValueError("give a stage exactly one of start_step and start_tokens")
        for name, weight in self.weights.items():
            if not _is_share(weight):
                raise ValueError(f"weights.{name}={weight} is not a share of tokens: give a "
                                 "finite weight >= 0")
        if not any(self.weights.values()):
            raise ValueError("every weight of the stage is 0; give at least one source a "
                             "positive weight")
        return self


# The fields a mixture's source may set for itself; the rest are shared by all sources.
SOURCE_FIELDS = ("source", "format", "hub_config", "hub_split", "revision", "text_column", "max_docs")
SINGLE_SOURCE = "default"  # the name of data.source in a mix of one


class DataConfig(_Section):
    source: str = Field(
        "builtin",
        description="'builtin' (a corpus built from documentation every Python installation "
        "ships); local files (a path, a glob, a directory, or a comma-separated list of those: "
        ".jsonl/.json/.parquet/.txt, also compressed .gz/.zst); s3://bucket/prefix (read with "
        "storage.endpoint_url and the AWS credentials chain); or a Hugging Face hub dataset "
        "name, streamed (needs network).",
    )
    format: Literal["auto", "json", "parquet", "text"] = Field(
        "auto", description="File format; 'auto' picks it from each file's extension."
    )
    hub_config: str | None = Field(None, description="Hub dataset configuration name.")
    hub_split: str = Field("train", description="Split to read from a hub dataset.")
    revision: str | None = Field(None, description="Hub dataset revision (commit or tag); pin "
                                 "it so the dataset id changes only when the data does.")
    text_column: str = Field("text", description="Column that holds the document text.")
    max_docs: int | None = Field(None, ge=1, description="Use at most this many documents, the "
                                 "first of the source in listing order (read as one work unit: "
                                 "for quick trials, not for corpora).")
    validation_fraction: float = Field(
        0.05, gt=0, lt=0.5, description="Share of documents held out for validation, chosen per "
        "document by a hash of its text (the same document always lands in the same split)."
    )
    shard_tokens: int = Field(
        2**25, ge=1024, le=2**31 - 1, description="Tokens per token shard (about: a shard holds "
        "whole documents and closes once it reaches this). 2^25 uint16 tokens = 64 MiB.")
    unit_bytes: str | int = Field(
        "256MiB", description="Input bytes per work unit (one Prefect task) at most: small "
        "files are grouped, large ones cut into byte ranges or parquet row groups (compressed "
        "files stay whole). A corpus of fewer than 32 such units is cut into 32 (of 16MiB at "
        "least), so every core has work. A unit's memory does not depend on it; a rerun redoes "
        "only the units that did not finish.")
    fingerprint: Literal["listing", "content"] = Field(
        "listing", description="What names the dataset: 'listing' (each file's path, size and "
        "modification time; ETag on S3; revision on the hub: no file is read) or 'content' "
        "(a sha256 over every byte of every file).")
    on_bad_record: Literal["error", "skip"] = Field(
        "error", description="A malformed record (a bad JSON line, a missing text field): "
        "'error' stops with the file and line; 'skip' skips it and counts it in the manifest.")
    data_dir: Annotated[str, AfterValidator(_a_directory)] = Field(
        "./.goodput/data", description="Local cache of prepared datasets (one dir per dataset id)."
    )
    cache_limit: str | int | None = Field(
        None, description="Training on a dataset that is not on this machine reads its shards "
        "from the store as it needs them, through a cache in data_dir/cache/<dataset id>: at "
        "most this much disk (e.g. '50GiB'; least recently used shards evicted). None: no "
        "limit (shards stay once fetched). A dataset prepared here is read in place.")

    sources: list[SourceConfig] = Field(
        default_factory=list, description="A mixture: named sources with weights (shares of "
        "the training tokens), each prepared as a dataset of its own and reused by every mix "
        "that lists it (with one tokenizer: tokenizer.path, or the one trained on the first "
        "source). Empty: data.source alone, a mix of one.")
    stages: list[StageConfig] = Field(
        default_factory=list, description="Curriculum: weights that replace data.sources' "
        "from a given step or token count on (e.g. a final stage with more high-quality data).")

    @model_validator(mode="before")
    @classmethod
    def _no_shard_count(cls, values: Any) -> Any:
        if isinstance(values, dict) and "num_shards" in values:
            raise ValueError("data.num_shards is gone: shards have a fixed size now; set "
                             "data.shard_tokens (tokens per shard) instead, or drop the field")
        return values

    @model_validator(mode="after")
    def _a_mix_that_can_be_drawn(self) -> "DataConfig":
        if not self.sources:
            if self.stages:
                raise ValueError("data.stages change the weights of data.sources, and none are "
                                 "listed: list the sources with their weights in data.sources")
            return self
        if self.source != "builtin":
            raise ValueError(f"data.source={self.source!r} and data.sources are both set: list "
                             "that source in data.sources too, and leave data.source out")
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.sources names {', '.join(twice)} more than once; give each "
                             "source its own name")
        if not any(s.weight for s in self.sources):
            raise ValueError("data.sources: every weight is 0; give at least one source a "
                             "positive weight")
        for i, stage in enumerate(self.stages):
            unknown = sorted(set(stage.weights) - set(names))
            if unknown:
                raise ValueError(f"data.stages[{i}].weights names {', '.join(unknown)}, not a "
                                 f"source of data.sources ({', '.join(names)}); fix the name or "
                                 "add the source")
        return self

    # Set by RunConfig.source_config on the data of one source of data.sources: errors about
    # its source, format, text column... then name that source's fields, which the user set.
    _source_name: str | None = PrivateAttr(None)

    @property
    def field_prefix(self) -> str:
        """How messages name this data's per-source fields (SOURCE_FIELDS): 'data' (data.source,
        data.text_column, ...), or 'data.sources[<name>]' for a source of a mix."""
        return "data" if self._source_name is None else f"data.sources[{self._source_name}]"

    def mix(self) -> list[SourceConfig]:
        """The sources training draws from: data.sources, or data.source as a mix of one."""
        if self.sources:
            return list(self.sources)
        return [SourceConfig(name=SINGLE_SOURCE, weight=1.0, source=self.source,
                             **{f: getattr(self, f) for f in SOURCE_FIELDS[1:]})]

    @field_validator("unit_bytes")
    @classmethod
    def _unit_bytes_is_a_size(cls, value: str | int) -> str | int:
        if _size(value) < 1024:
            raise ValueError(f"{value!r} is below 1KiB; give each work unit at least 1KiB of input")
        return value

    @field_validator("cache_limit")
    @classmethod
    def _cache_limit_is_a_size(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            _size(value)
        return value


class PrepareConfig(_Section):
    runner: Literal["process", "ray"] = Field(
        "process", description="Where work units run: 'process', a process pool on this "
        "machine, writing the dataset here before it is uploaded; 'ray', the tasks of a Ray "
        "cluster (prefect-ray), writing shards straight to storage.uri (no shared disk needed).")
    ray_address: str | None = Field(
        None, description="prepare.runner=ray: the cluster to join ('auto' for RAY_ADDRESS or "
        "the cluster started on this machine, 'HEAD_IP:6379', or 'ray://HEAD:10001'); unset "
        "starts a Ray of this machine for the run.")
    workers: int = Field(0, ge=0, description="Work units tokenized at once, one per process: "
                         "0 = one per CPU core (of the Ray cluster with prepare.runner=ray).")
    progress: bool = Field(True, description="A progress bar on the console (a terminal) while "
                           "preparing.")


class TokenizerConfig(_Section):
    path: str | None = Field(
        None, description="An existing tokenizer to use instead of training one: a "
        "tokenizer.json, or a Hugging Face tokenizer directory (save_pretrained) holding one.",
    )
    eos_token: str | None = Field(
        None, description="The end-of-document token of the tokenizer at tokenizer.path, put "
        "after every document. Unset: the eos_token its directory's tokenizer_config.json "
        "declares (save_pretrained writes it), else the first of <|endoftext|>, </s>, <eos>, "
        "<|end_of_text|> in its vocabulary. A trained tokenizer's is <|endoftext|>.")
    vocab_size: int = Field(
        4096, ge=260, le=1_000_000, description="BPE vocabulary size to train, exactly: ids the "
        "corpus has no merges for are reserved tokens.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency when training BPE.")
    sample_bytes: str | int = Field(
        "64MiB", description="Text the tokenizer is trained on: a deterministic sample of the "
        "train split this large, taken from the start of work units spread over the corpus.")
    sha256: str | None = Field(
        None, description="Filled in from tokenizer.path's tokenizer.json when the config is "
        "validated (leave it unset): the run's config hash names the tokenizer by it, not by "
        "its path, and a saved run config keeps it for when the file has moved.")

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, value: str | None) -> str | None:
        # As given, a relative path would mean another file on a node, or in a later command,
        # that runs from another working directory.
        return _absolute(value)

    @field_validator("sample_bytes")
    @classmethod
    def _sample_is_a_size(cls, value: str | int) -> str | int:
        _size(value)
        return value


class RopeScaling(_Section):
    """Llama 3.1's RoPE scaling (Meta's apply_scaling; transformers' rope_type 'llama3'):
    frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor
    are divided by factor, those below original / high_freq_factor are kept, the band between
    is interpolated. Llama 3.1: factor 8, low 1, high 4, original 8192."""

    factor: float = Field(gt=0, description="Divisor of the low frequencies.")
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(
        ge=1, description="The context length the model was first trained at.")

    @model_validator(mode="after")
    def _band_is_ordered(self) -> "RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor} (Llama 3.1: 4 and 1)")
        return self


class MoEConfig(_Section):
    """A Mixture-of-Experts feed-forward in the blocks after the first `first_dense_layers`
    (training/moe.py): a router sends each token to its top_k of num_experts SwiGLU experts;
    shared experts take every token. DeepSeek-V3: 256 experts, top_k 8, 1 shared, 3 dense
    layers, sigmoid scores, route_norm, route_scale 2.5, bias balancing. Qwen3-30B-A3B: 128
    experts, top_k 8, no shared, softmax, route_norm."""

    num_experts: int = Field(ge=2, description="Routed experts per MoE layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    expert_dim: int | None = Field(
        None, ge=1, description="SwiGLU hidden width of one expert; None: the dense width "
        "(model.ffn_hidden_dim or its formula).")
    shared_experts: int = Field(0, ge=0, description="Experts every token passes through "
                                "(computed as one SwiGLU this many times expert_dim wide).")
    first_dense_layers: int = Field(0, ge=0, description="The first blocks keep a dense "
                                    "feed-forward (DeepSeek-V3: 3).")
    score_func: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Router scores: softmax over the experts, or a sigmoid each.")
    route_norm: bool = Field(False, description="Divide each token's top_k scores by their sum "
                             "(Qwen3's norm_topk_prob; DeepSeek-V3 with sigmoid scores).")
    route_scale: float = Field(1.0, gt=0, description="Scale of the routed experts' weights "
                               "(DeepSeek-V3: 2.5).")
    aux_loss_coeff: float = Field(
        0.0, ge=0, description="Weight of the sequence-wise auxiliary balance loss (Switch/"
        "GShard's E/K x sum f_e P_e per sequence, DeepSeek-V3's form); 0: off. Switch used "
        "1e-2, DeepSeek-V3 1e-4 beside bias balancing.")
    bias_update_rate: float = Field(
        0.0, ge=0, description="DeepSeek-V3's auxiliary-loss-free balancing: after every step "
        "each expert's routing bias moves by this toward balance (DeepSeek-V3: 1e-3); 0: off.")
    collapse_steps: int = Field(
        100, ge=1, description="Warn of router collapse when an expert gets no token for this "
        "many steps in a row.")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoEConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts="
                             f"{self.num_experts}; route each token to at most num_experts "
                             "experts")
        return self


# The fields a model.init_from checkpoint's config.json fixes (core.hf_llama.HF_FIELDS,
# plus RoPE). max_seq_len is not among them: a run may use a shorter or longer context.
_FIXED_BY_CHECKPOINT = ("dim", "n_layers", "n_heads", "n_kv_heads", "norm_eps", "rope_theta",
                        "rope_scaling", "vocab_size", "tie_embeddings", "head_dim", "qk_norm",
                        "qkv_bias")
_FFN_FIELDS = ("ffn_hidden_dim", "ffn_multiple_of", "ffn_dim_multiplier")
# What a config read from the checkpoint states, so that it stands without the checkpoint
# (head_dim, qk_norm and qkv_bias came later: a run's config.yaml from before them stands
# without them).
_SAVED_FROM_CHECKPOINT = (*_FIXED_BY_CHECKPOINT[:-3], "ffn_hidden_dim", "max_seq_len")


class ModelConfig(_Section):
    init_from: str | None = Field(
        None, description="A Hugging Face Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE or Mixtral checkpoint directory (config.json + "
        "model.safetensors, or sharded with model.safetensors.index.json) to start from instead "
        "of random weights: the shape comes from its config.json (fields stated here must "
        "agree), tokenizer.path defaults to it (its tokenizer.json), and each worker reads only "
        "its own part of the weights when training starts (a resume reads the checkpoint). A "
        "relative path is made absolute when the config is read. The run is tied to the "
        "checkpoint, not to where it lies: it may move once training has saved a checkpoint.")
    init_from_fingerprint: str | None = Field(
        None, description="Filled in from model.init_from when the config is validated (leave "
        "it unset): names the checkpoint by its config.json, tokenizer.json and weights files, "
        "for the run's config hash; a saved run config keeps it, so it loads after the "
        "checkpoint's directory has moved.")
    dim: int = Field(128, ge=8, description="Hidden size.")
    n_layers: int = Field(4, ge=1, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads.")
    n_kv_heads: int | None = Field(None, ge=1, description="Key/value heads (GQA); None = n_heads.")
    ffn_multiple_of: int = Field(32, ge=1, description="SwiGLU hidden size is rounded up to this.")
    ffn_dim_multiplier: float | None = Field(
        None, gt=0, description="Llama 3's scale of the SwiGLU hidden size: int(2 x 4 x dim / 3), "
        "times this, rounded up to ffn_multiple_of (Llama 3.1 8B: 1.3 with 1024 -> 14336). "
        "None: no scaling (Llama 2).")
    ffn_hidden_dim: int | None = Field(
        None, ge=1, description="The SwiGLU hidden size exactly, instead of the formula of "
        "ffn_multiple_of and ffn_dim_multiplier (model.init_from sets it to the checkpoint's "
        "intermediate_size).")
    vocab_multiple_of: int = Field(
        128, ge=1, description="The embedding and output layers get the tokenizer's vocabulary "
        "rounded up to a multiple of this (GPT-2's 50,257 -> 50,304): tensor parallelism splits "
        "them, and GPU matmuls run fastest on such sizes. The extra ids never occur in data and "
        "are never sampled. 1 turns padding off.")
    vocab_size: int | None = Field(
        None, ge=1, description="Rows of the embedding and output layers, exactly (at least the "
        "tokenizer's vocabulary); None: the tokenizer's vocabulary rounded up to "
        "vocab_multiple_of. model.init_from sets it to the checkpoint's vocab_size.")
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.1's long-context RoPE scaling; None: plain RoPE.")
    max_seq_len: int = Field(256, ge=8, description="Longest sequence the RoPE cache covers.")
    tie_embeddings: bool = Field(
        False, description="The output layer uses the token embedding matrix (Llama 3.2 1B and "
        "3B): one matrix fewer. Needs parallelism.pp=1 (the first and last pipeline stages would "
        "each need it).")
    moe: MoEConfig | None = Field(
        None, description="Mixture-of-Experts feed-forwards (see MoEConfig); None: dense.")
    head_dim: int | None = Field(
        None, ge=2, description="Width of an attention head; None: dim / n_heads. Qwen3 sets "
        "its own (Qwen3-30B-A3B: 128 with dim 2048 and 32 heads).")
    qk_norm: bool = Field(False, description="RMSNorm of each query and key head before RoPE "
                          "(Qwen3).")
    qkv_bias: bool = Field(False, description="A bias on the query, key and value projections "
                           "(Qwen2 and Qwen2.5; the output projection stays bias-free).")

    @model_validator(mode="before")
    @classmethod
    def _shape_from_checkpoint(cls, values: Any) -> Any:
        """With init_from, the fields its config.json fixes: filled in where not stated, an
        error naming the field where stated differently."""
        if not isinstance(values, dict):
            return values
        if not values.get("init_from"):
            return {k: v for k, v in values.items() if k != "init_from_fingerprint"}
        from core import hf_llama

        values = dict(values)
        directory = values["init_from"] = _absolute(values["init_from"])
        if not Path(directory).is_dir():
            return _saved_from_checkpoint(values)
        try:
            found = hf_llama.model_fields(directory)
            values["init_from_fingerprint"] = hf_llama.fingerprint(directory)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        where = f"{Path(directory) / hf_llama.CONFIG_FILE} (model.init_from)"
        conflicts = []
        for field in _FIXED_BY_CHECKPOINT:
            if field in values and _as_stated(field, values) != _as_stated(field, found):
                hf_key = hf_llama.HF_FIELDS.get(field, {"rope_scaling": "the rope scaling of "
                                                        "rope_parameters"}.get(field, field))
                conflicts.append(f"model.{field}={_as_stated(field, values)} but {hf_key} is "
                                 f"{_as_stated(field, found)}")
            values[field] = found[field]
        conflicts += _moe_from_checkpoint(values, found.get("moe"))
        width = found["ffn_hidden_dim"]
        stated = {f: values[f] for f in _FFN_FIELDS if f in values}
        if stated:
            from_stated = ffn_hidden_width(values["dim"], stated.get("ffn_multiple_of", 32),
                                           stated.get("ffn_dim_multiplier"),
                                           stated.get("ffn_hidden_dim"))
            if from_stated != width:
                conflicts.append(", ".join(f"model.{k}={v}" for k, v in stated.items())
                                 + f" give a SwiGLU width of {from_stated} but intermediate_size "
                                 f"is {width}")
        values["ffn_hidden_dim"] = width
        values.setdefault("max_seq_len", found["max_seq_len"])
        if conflicts:
            raise ValueError(f"{'; '.join(conflicts)} in {where}; leave these fields out (the "
                             "checkpoint fixes them) or point init_from at a checkpoint of the "
                             "shape you want")
        return values

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide dim={self.dim}; "
                             "choose n_heads among the divisors of dim (or set head_dim)")
        head_dim = self.head_dim or self.dim // self.n_heads
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE; "
                             "change dim or n_heads (or head_dim)")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_kv_heads={kv} does not divide n_heads={self.n_heads}")
        if self.moe is not None and self.moe.first_dense_layers >= self.n_layers:
            raise ValueError(f"moe.first_dense_layers={self.moe.first_dense_layers} leaves no "
                             f"mixture-of-experts block of n_layers={self.n_layers}; lower it "
                             "below n_layers, or drop model.moe for a dense model")
        return self


def _moe_from_checkpoint(values: dict, found: dict | None) -> list[str]:
    """model.moe from a model.init_from checkpoint: a Qwen3-MoE's or Mixtral's fixes its
    experts and routing (what a stated model.moe gives otherwise is a conflict; the balancing
    settings are the run's own); a Llama has none, so a stated model.moe is a conflict.
    Returns the conflicts."""
    stated = values.get("moe")
    if isinstance(stated, BaseModel):
        stated = stated.model_dump(exclude_unset=True)
    if found is None:
        values["moe"] = None
        return ([] if stated is None else
                ["model.moe is set but the checkpoint is a dense Llama (model_type 'llama'); "
                 "drop model.moe to continue it, or model.init_from to train an MoE model from "
                 "scratch"])
    stated = dict(stated or {})
    conflicts = [f"model.moe.{k}={stated[k]} but the checkpoint's is {v}"
                 for k, v in found.items() if k in stated and stated[k] != v]
    values["moe"] = {**stated, **found}
    return conflicts


def _saved_from_checkpoint(values: dict) -> dict:
    """ModelConfig's fields where model.init_from's directory is not (or no longer) there:
    those of a config that was read from the checkpoint and saved (a run's config.yaml, which
    a resume, a worker or `goodput evaluate` reads after the checkpoint may have moved) stand
    as they are, as the checkpoint is read again only by a run with no checkpoint of its own;
    anything else is an error that says what to do."""
    if values.get("init_from_fingerprint") and all(f in values for f in _SAVED_FROM_CHECKPOINT):
        return values
    raise ValueError(
        f"model.init_from={values['init_from']}: no such directory; point it at the Hugging "
        "Face Llama checkpoint directory (config.json and *.safetensors, as save_pretrained "
        "writes them), e.g. where the checkpoint has moved to. A run that has saved a "
        "checkpoint of its own no longer reads it: the config.yaml in its run directory states "
        "the checkpoint's shape and loads without it.")


def _absolute(path: str | None) -> str | None:
    """A local path made absolute against this process's working directory (~ expanded)."""
    return None if path is None else os.path.abspath(os.path.expanduser(str(path)))


def _as_stated(field: str, values: dict) -> Any:
    """A field's value for comparison: n_kv_heads None means n_heads, rope_scaling as a dict."""
    value = values.get(field)
    if field == "n_kv_heads" and value is None:
        return values.get("n_heads")
    if field == "rope_scaling" and isinstance(value, BaseModel):
        return value.model_dump()
    if field == "rope_scaling" and isinstance(value, dict):
        return {k: float(v) if k != "original_max_position_embeddings" else int(v)
                for k, v in value.items()}
    return value


def ffn_hidden_width(dim: int, multiple_of: int, multiplier: float | None = None,
                     exact: int | None = None) -> int:
    """The SwiGLU width as Meta's Llama (and torchtitan) compute it: 2/3 of 4 x dim (the
    parameters of a 4 x dim MLP), scaled by Llama 3's ffn_dim_multiplier, rounded up to a
    multiple of `multiple_of` so matmuls stay aligned; `exact` (a checkpoint's
    intermediate_size) instead of the formula. Llama 3.1 8B: 4096, 1.3, 1024 -> 14336."""
    if exact is not None:
        return exact
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


def _size(value: str | int) -> int:
    """parse_bytes for a field validator: pydantic reports ValueError with the field's name."""
    try:
        return parse_bytes(value)
    except ConfigError as e:
        raise ValueError(str(e)) from None


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '512MiB', '1.5TiB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"{text!r} is not a memory size; write e.g. 80GiB or 40GB")
    number, prefix, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(prefix.upper() or " "))


# torch.compile's modes that replay CUDA graphs (torch._inductor.list_mode_options).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class ParallelismConfig(_Section):
    """Where the workers run and how the model is laid out over them.

    dp_replicate x dp_shard x cp x tp x pp = world size (nnodes x nproc_per_node); dp_replicate or
    dp_shard may be -1, meaning "whatever the others leave"; both -1 (dp_replicate's
    default with dp_shard=-1) shard over the rest: dp_replicate is then 1. The mesh is named (dp_replicate, dp_shard,
    cp, tp) per pipeline stage with TP innermost, so TP groups sit on the fastest links.

    Pipeline stages split the layers by one rule (core.layout's ParallelDims.stage_layers):
    pp_layers_per_stage lists them outright; otherwise they split as evenly as possible, the
    first and last stages lightened by pp_first_stage_less_layers and
    pp_last_stage_less_layers. Those weights are integers the user sets, not derived from the
    model ("auto"), because what they should balance depends on the run: in time, the output
    layer and loss cost 6 x vocab x dim FLOPs per token against a block's 6 x its parameters
    plus attention (about 0.6 of a block for Llama 3.1 405B, 2.8 for Llama 3.2 1B) while the
    embedding costs next to none (a lookup); in memory, the embedding's and the output
    layer's weights, gradients and optimizer state and the fp32 logits weigh on the ends,
    and under 1F1B the first stage also keeps the most micro-batches in flight. One derived
    number would balance one of these and hide the choice; `goodput plan` shows the others
    (the output layer's weight in blocks, each rank's pace and memory) and names a weight
    that evens the pace, so the choice is made with the numbers in sight. 0 and 0 keep the
    plain split.
    """

    nnodes: int = Field(1, ge=1, description="Nodes (one torchrun each). A range MIN:MAX (e.g. "
                        "2:4) trains elastically on whatever count torchrun's rendezvous gets "
                        "within it: MAX here, MIN in elastic.min_nodes (see there).")
    nproc_per_node: int = Field(2, ge=1, description="Worker processes per node.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="'auto': nccl when CUDA is available, else gloo."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous; None picks a free local port."
    )
    dp_replicate: int = Field(-1, description="Data-parallel replicas (DDP, or HSDP's replicate "
                                              "axis with dp_shard > 1); -1 fills the rest.")
    dp_shard: int = Field(1, description="FSDP2 sharding degree (ZeRO-3 by default); 1 = no FSDP.")
    ep: int = Field(1, ge=1, description="Expert parallelism (a model.moe model): each MoE "
                    "layer's experts split over this many ranks, tokens sent to their experts "
                    "and back by all-to-all. EP borrows its ranks from dp_shard x tp (it must "
                    "divide it; TP ranks hold other parts of the sequences): the experts are "
                    "sharded by EP (and by FSDP over the rest of those ranks), every other "
                    "weight by FSDP over dp_shard.")
    cp: int = Field(1, ge=1, description="Context parallelism, for long sequences: each "
                    "sequence split over this many ranks, each holding two of its 2 x cp chunks "
                    "(the i-th from the start and from the end, so causal attention costs each "
                    "rank the same) and all-gathering every layer's keys and values. Its ranks "
                    "share their samples, and FSDP shards the weights over dp_shard x cp. "
                    "training.seq_len must be a multiple of 2 x cp (x tp with TP). Not with "
                    "pp > 1 or a model.moe model yet.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (within a node).")
    pp: int = Field(1, ge=1, description="Pipeline stages (across nodes).")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = Field("1f1b")
    microbatches: int | None = Field(None, ge=1, description="Pipeline micro-batches per step "
                                                             "(default 2 x pp).")
    pp_virtual_stages: int | None = Field(
        None, ge=1, description="Stages per pipeline rank under pp_schedule=interleaved-1f1b "
        "(None: 2): v stages shrink the bubble to (pp-1)/(v x microbatches + pp-1) and send v "
        "times the activations between ranks; `goodput plan` names the v with the shortest step.")
    pp_layers_per_stage: list[int] | None = Field(
        None, description="Transformer layers of each pipeline stage in order, e.g. [7, 8, ..., 8, "
        "7]: one count per stage (pp, or pp_virtual_stages x pp with interleaved-1f1b), summing to "
        "model.n_layers. None: as even as possible, the first and last stages (which also hold "
        "the embedding and the output layer) lighter when uneven. Not with "
        "pp_first_stage_less_layers / pp_last_stage_less_layers.")
    pp_first_stage_less_layers: int = Field(
        0, ge=0, description="The default pipeline split counts the first stage, which also "
        "holds the token embedding, as this many transformer layers heavier: it gets that many "
        "fewer (as torchtitan's pipeline_parallel_first_stage_less_layers). 0: no weight. "
        "Not with pp_layers_per_stage.")
    pp_last_stage_less_layers: int = Field(
        0, ge=0, description="The same for the last stage, which also holds the final norm, the "
        "output layer and the loss. E.g. 16 layers on pp=4 with 3: [4, 5, 5, 2]; `goodput plan` "
        "says how many blocks of compute the output layer weighs. Not with pp_layers_per_stage.")
    strict_layout: bool = Field(
        False, description="The layout check (train flow, goodput plan) refuses layouts it "
        "would only warn about, e.g. fewer than 2 x pp pipeline micro-batches (a large bubble).")
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free gathered weights after forward (ZeRO-3); False keeps "
                          "them until backward (ZeRO-2-like, more memory, less communication).")
    activation_checkpointing: Literal["none", "selective", "full"] = Field("none")
    compile: bool = Field(False, description="torch.compile each transformer block, and the loss.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune",
                          "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode for the blocks, with compile: "
        "'reduce-overhead' replays each block's kernels as a CUDA graph (on a GPU; where a "
        "small model's step waits on the host launching kernels), 'max-autotune' also tries "
        "Triton matmuls (minutes of compile) and uses CUDA graphs too, "
        "'max-autotune-no-cudagraphs' without them. The loss keeps the default: a CUDA graph "
        "would copy its logits in. CUDA graphs: one GPU, without gradient accumulation, "
        "FSDP, TP, PP, CP, EP, MoE or activation checkpointing.")
    loss_chunk_tokens: int = Field(
        0, ge=0, description="The output layer and the loss computed this many tokens at a "
        "time, their gradients at once (a fused linear cross-entropy): the whole micro-batch's "
        "logits and their fp32 copy are never held, e.g. 16 x 1024 tokens x a 50k vocabulary: "
        "3.3 GB of fp32 logits, against 0.2 GB at 1024. It keeps the output weight's fp32 "
        "gradient from forward to backward instead (vocab x dim x 4 bytes): worth it when a "
        "micro-batch has more tokens than about dim. Runs eagerly under compile, and costs time "
        "on a GPU (an H200: 1.5x the head's at 1024): for a step that does not fit otherwise. 0: the whole "
        "micro-batch at once. Not with tp > 1 or pp > 1, whose output layer and loss are "
        "split their own way.")
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 compute: FSDP2 casts the parameters to bf16 and reduces "
        "gradients in fp32; other layouts run forward under bf16 autocast. 'auto': bf16 on GPU, "
        "fp32 on CPU; 'bf16' on CPU too.")
    device_memory: str | int | None = Field(
        None, description="Memory of one device (a GPU; on CPU, the host memory one worker may "
        "use), e.g. '80GiB': the train flow checks the layout's estimated peak of tensors against "
        "it before launching. None: measured on this machine when launch.kind=local (CPU "
        "workers there also count their processes, the save's staging copy and a share of the "
        "flow's and the verifier's), else not checked.")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def dims(self, world_size: int | None = None, world: str = "") -> ParallelDims:
        """The layout (core.layout), with -1 resolved against `world_size` (default: this
        config's nnodes x nproc_per_node); raises LayoutError when the degrees do not fit."""
        if world_size is None:
            world_size, world = self.world_size, f"world size {self.world_size} (nnodes x nproc_per_node)"
        return ParallelDims.resolve({**{d: getattr(self, d) for d in DEGREES}, "cp": self.cp},
                                    world_size, world, ep=self.ep, **self.pipeline())

    def pipeline(self) -> dict:
        """The pipeline settings ParallelDims takes beside the degrees."""
        layers = tuple(self.pp_layers_per_stage) if self.pp_layers_per_stage is not None else None
        return {"pp_schedule": self.pp_schedule, "microbatches": self.microbatches,
                "layers_per_stage": layers,
                "first_stage_less_layers": self.pp_first_stage_less_layers,
                "last_stage_less_layers": self.pp_last_stage_less_layers,
                "virtual_stages": self.pp_virtual_stages}

    def degrees(self) -> dict[str, int]:
        """The degrees (ParallelDims.degrees) with -1 resolved."""
        return self.dims().degrees

    @model_validator(mode="after")
    def _degrees_fit(self) -> "ParallelismConfig":
        if self.dp_shard == -1 and self.dp_replicate == -1:
            # dp_replicate's default "the rest" gives way to the sharding asked for (a form
            # or a saved config carries the default along, so it is not told apart).
            self.dp_replicate = 1
        self.dims()
        return self

    @model_validator(mode="after")
    def _loss_chunks_without_tp_or_pp(self) -> "ParallelismConfig":
        if self.loss_chunk_tokens and self.dims().splits_output_layer:
            raise ValueError(f"loss_chunk_tokens={self.loss_chunk_tokens} needs tp=1 and pp=1 "
                             f"(here tp={self.tp}, pp={self.pp}): under tensor parallelism the "
                             "output layer is split over the vocabulary, and a pipeline's last "
                             "stage computes the loss in its schedule; set loss_chunk_tokens=0")
        return self

    @property
    def cuda_graphs(self) -> bool:
        """Whether the blocks are compiled into CUDA graphs (on a GPU): the modes that use them."""
        return self.compile and self.compile_mode in CUDA_GRAPH_MODES

    @model_validator(mode="after")
    def _cuda_graphs_where_measured(self) -> "ParallelismConfig":
        if not self.cuda_graphs:
            return self
        resolved = self.dims()
        others = [f"{name}={raw}" + (f" ({value} here)" if raw != value else "")
                  for name, raw, value in (("dp_shard", self.dp_shard, resolved.dp_shard),
                                           ("tp", self.tp, self.tp), ("pp", self.pp, self.pp),
                                           ("cp", self.cp, self.cp), ("ep", self.ep, self.ep))
                  if value != 1]
        if self.activation_checkpointing != "none":
            others.append(f"activation_checkpointing={self.activation_checkpointing}")
        if others:
            raise ValueError(
                f"compile_mode={self.compile_mode} (a CUDA graph per block) has run on one GPU "
                f"only, not with {', '.join(others)}: their hooks, collectives and recomputation "
                "run inside a block, between the kernels its graph replays. Use "
                "compile_mode=default or max-autotune-no-cudagraphs there")
        return self

    @model_validator(mode="after")
    def _device_memory_parses(self) -> "ParallelismConfig":
        if self.device_memory is not None:
            try:
                parse_bytes(self.device_memory)
            except ConfigError as e:
                raise ValueError(f"device_memory: {e}") from None
        return self


class TrainingConfig(_Section):
    seed: int = 1337
    max_steps: int = Field(300, ge=1, description="Optimizer steps to train.")
    seq_len: int = Field(128, ge=8, description="Tokens per sample.")
    micro_batch_size: int = Field(8, ge=1, description="Samples per rank per micro-step.")
    shuffle_window_tokens: int = Field(
        2**28, ge=1, description="Samples are shuffled within windows of this many tokens of "
        "the train split (consecutive shards), the windows visited in a shuffled order, both "
        "anew each epoch: the loader's memory does not grow with the dataset, and reading "
        "stays within a window's shards at a time.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak.")
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")
    peak_flops_per_device: float | None = Field(
        None, gt=0,
        description="Peak FLOP/s of one device, for the MFU estimate. None: known GPUs are "
        "looked up; on CPU MFU is left out.",
    )
    log_every: int = Field(1, ge=1, description="Log metrics every N steps (and at the last "
                           "step, and at each step a checkpoint is saved: each record stands "
                           "for the steps since the one before).")

    @property
    def tokens_per_rank_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.seq_len


class CheckpointConfig(_Section):
    async_mode: Literal["sync", "thread", "process"] = Field(
        "thread", description="Save in the background: training blocks only while the state is "
        "staged. 'sync' waits for the write.")
    every_steps: int = Field(50, ge=1, description="Save a checkpoint every N steps (and at the "
                             "end); with interval 'auto', the longest allowed gap.")
    interval: Literal["fixed", "auto"] = Field(
        "fixed", description="'auto': re-plan the gap after every save by the Young/Daly rule "
        "sqrt(2 x save cost x MTBF), from the measured blocking time of saves, the step time and "
        "faults.mtbf_hours (else the failures observed in this run), at most every_steps.")
    keep_local: int = Field(
        3, ge=1, description="Local checkpoints kept; older uploaded ones are deleted."
    )
    keep_aside: int = Field(
        2, ge=0, description="Copies moved aside (checkpoints/rejected, and checkpoints/"
        "superseded: a step saved again) kept for inspection, newest of each kind; older ones are "
        "deleted by local retention (the ledger keeps their reasons).")
    save_at_end: bool = Field(
        True, description="Save after the last step. False only for throughput measurements "
        "(benchmarks/mfu_bench.py): the steps after the last periodic save are then not kept.")
    validate_batches: int = Field(
        0, ge=0, description="Validation also computes the held-out loss on this many "
        "batches and rejects the checkpoint when it exceeds the training loss at that step by "
        "more than validate_loss_tolerance. 0 turns the check off.")
    validate_loss_tolerance: float = Field(
        0.5, gt=0, description="Allowed relative excess of held-out over training loss.")
    failed_save_wait_s: float = Field(
        30.0, gt=0, description="When a save failed on some rank, how long the others wait for "
        "their own writes (blocked in a collective the failed rank never joins) before the run "
        "stops.")
    verify_timeout_s: float | None = Field(
        None, gt=0, description="How long the verifier of one checkpoint may take before it counts "
        "as giving no verdict (the checkpoint then stays unjudged and is not resumed from). None: "
        "600 s plus reading the checkpoint twice at 50 MB/s.")
    store_keep_every: int | None = Field(
        None, ge=1, description="Store retention: keep checkpoints whose step is a multiple of "
        "this, the best by eval loss and the newest; delete the others. None keeps all.")


class StorageConfig(_Section):
    uri: str = Field(
        "./.goodput/store",
        description="Object store root: a local directory, file://..., or s3://bucket/prefix.",
    )
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (SeaweedFS, MinIO); None uses AWS."
    )
    region: str | None = None
    credentials_block: str | None = Field(
        None, description="The name of a prefect-aws AwsCredentials block with the store's keys "
        "(or a profile or role to assume), region and endpoint: a run triggered from the UI on "
        "a work pool then needs no AWS environment variables. Unset: the standard AWS chain "
        "(environment, ~/.aws, instance role).")
    part_size: str | int = Field(
        "8MiB", description="S3 multipart part size, e.g. '64MiB' (S3 allows 5MiB to 5GiB; a "
        "file needing more than 10,000 parts gets larger ones). Larger parts: fewer requests.")
    max_concurrency: int = Field(
        10, ge=1, le=256, description="S3 requests in flight per open store (each upload or "
        "fetch task opens one), across all files it moves at once; also the parts it buffers. "
        "Raise it on nodes with fast networks (the default is the AWS CLI's).")

    @field_validator("uri")
    @classmethod
    def _uri_names_a_valid_bucket(cls, value: str) -> str:
        if value.startswith("s3://"):
            parse_s3_uri(value)
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_a_url(cls, value: str | None) -> str | None:
        """boto3 refuses one without a scheme ("Invalid endpoint") once a stage opens the
        store, as a task failure."""
        if value is None:
            return value
        from urllib.parse import urlparse

        try:
            parsed = urlparse(value)
            parsed.port  # noqa: B018 - raises on a port out of range
        except ValueError as e:
            raise ValueError(f"{value!r} is not a URL ({e})") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r} is not an S3 endpoint URL: write it with its scheme, "
                             "e.g. http://127.0.0.1:8333 or https://s3.example.com")
        return value

    @field_validator("part_size")
    @classmethod
    def _part_size_fits_s3(cls, value: str | int) -> str | int:
        size = _size(value)
        if not 5 * 2**20 <= size <= 5 * 2**30:
            raise ValueError(f"{value!r} is outside what S3 accepts; choose 5MiB to 5GiB, e.g. 64MiB")
        return value


class EvalConfig(_Section):
    max_batches: int = Field(20, ge=1, description="Validation batches for held-out loss.")
    batch_size: int = Field(8, ge=1, description="Sequences per forward pass: held-out loss "
                            "batches; for eval.tasks, items (an item's requests packed as one "
                            "sequence).")
    num_samples: int = Field(3, ge=0, description="Generated samples in the report.")
    sample_tokens: int = Field(48, ge=1)
    temperature: float = Field(0.8, ge=0, description="0 means greedy decoding.")
    top_k: int | None = Field(50, ge=1)
    prompts: list[str] = Field(
        default_factory=lambda: ["The ", "A function ", "In Python, "],
        description="Prompts for generated samples (cycled).",
    )
    every_steps: int = Field(0, ge=0, description="In-loop validation: the held-out loss (of "
                             "each source and the mix) every this many steps, inside training, "
                             "logged with the training metrics; 0 = off.")
    in_loop_batches: int = Field(4, ge=1, description="Validation batches (of "
                                 "training.micro_batch_size samples, per source) that in-loop "
                                 "validation reads, split over the data-parallel ranks.")
    every_validated: int = Field(0, ge=0, description="Evaluate every N-th checkpoint, once "
                                 "validated, while training goes on (a process of its own, at the "
                                 "lowest CPU priority); 0: only the evaluate stage evaluates.")
    background_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the evaluations of eval.every_validated run: 'cpu' keeps them "
        "off the GPUs that training uses; 'cuda' puts them on the flow host's first visible "
        "GPU (beside training's rank 0 on a training node: its memory and time; for a host "
        "with a GPU to spare, give the flow CUDA_VISIBLE_DEVICES).")
    best_metric: str = Field(
        "loss", description="What 'best by eval' means for store retention: 'loss', "
        "'perplexity', 'bits_per_byte', 'loss/<source>' of a mix, or '<task>/<metric>' of "
        "eval.tasks (e.g. hellaswag/acc_norm). Losses, perplexities and bits per byte are "
        "better lower, other scores higher.")
    # Downstream benchmarks, scored by EleutherAI's lm-evaluation-harness (training.downstream).
    tasks: list[str] = Field(
        default_factory=list, description="lm-eval task (or group) names, e.g. hellaswag, "
        "arc_easy, piqa, lambada_openai, winogrande, or tasks of eval.task_dir; empty: none.")
    limit: int | None = Field(
        None, ge=1, description="Items per task (the first N); None: every item.")
    num_fewshot: int | None = Field(
        None, ge=0, description="Few-shot examples per item; None: each task's own default.")
    task_dir: str | None = Field(
        None, description="A folder of custom lm-eval task YAMLs (lm-eval's include_path); "
        "its tasks may read local data: dataset_path: json, dataset_kwargs: {data_files: ...}.")
    offline: bool = Field(
        True, description="Read task data only from local files and the datasets cache, never "
        "the network (fetch it once: python -m training.downstream --fetch TASK ...).")
    datasets_cache: str | None = Field(
        None, description="HF datasets cache holding the tasks' data (HF_DATASETS_CACHE); None: "
        "the environment's or ~/.cache/huggingface/datasets.")
    bootstrap_iters: int = Field(
        1000, ge=0, description="lm-eval's bootstrap resamples for the stderr of metrics "
        "without a closed form (perplexities); 0 leaves those stderrs out.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="The forward pass that scores eval.tasks: 'auto' runs it under bf16 "
        "autocast where the device has bf16 matrix instructions (a GPU that supports bf16, a CPU "
        "with AVX512-BF16 or AMX: about 3x fp32's speed there) and in fp32 elsewhere; 'fp32' "
        "everywhere gives log-likelihoods within 1e-4 of scoring each request alone in fp32; "
        "'bf16' everywhere. Log-probabilities are summed in float64 either way.")

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: list[str]) -> list[str]:
        blank = [t for t in tasks if not t.strip()]
        if blank:
            raise ValueError("an empty task name; list lm-eval task names, e.g. [hellaswag, arc_easy]")
        twice = sorted({t for t in tasks if tasks.count(t) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; list each task once")
        return tasks


class TrackingConfig(_Section):
    """Where training and evaluation metrics also go, besides metrics.jsonl and Prefect."""

    tensorboard: bool = Field(True, description="TensorBoard event files in the run directory "
                              "(`tensorboard --logdir <runs_dir>`); no server needed.")
    mlflow_uri: str | None = Field(None, description="An MLflow tracking server "
                                   "(http://host:5000) or store URI: one MLflow run per run id.")
    mlflow_experiment: str = Field("goodput", description="The MLflow experiment of the runs.")
    wandb_project: str | None = Field(None, description="A Weights & Biases project: one W&B run "
                                      "per run id (credentials: `wandb login` or WANDB_API_KEY).")
    wandb_entity: str | None = Field(None, description="The W&B team or user (default: yours).")
    wandb_api_key_block: str | None = Field(
        None, description="The name of a Prefect Secret block holding the W&B API key (instead "
        "of `wandb login` or WANDB_API_KEY on the machine).")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="'offline' writes W&B runs to the run directory for `wandb sync`.")

    @field_validator("mlflow_uri", "wandb_project")
    @classmethod
    def _client_installed(cls, value: str | None, info) -> str | None:
        # Checked here, not when rank 0 first logs: a missing package fails every retry alike.
        package = {"mlflow_uri": "mlflow", "wandb_project": "wandb"}[info.field_name]
        if value and not _installed(package):
            raise ValueError(f"{info.field_name}={value!r} needs the {package} package, which is "
                             "not installed here; install the tracking extra from the goodput "
                             "checkout, pip install -e '.[tracking]' (goodput is not on PyPI), "
                             f"on every node (or leave {info.field_name} unset)")
        directory = value and ("://" not in value or value.startswith("file:")) and \
            value.split(":")[0] not in ("databricks", "databricks-uc")  # MLflow's own names
        if (info.field_name == "mlflow_uri" and directory
                and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1")):
            # MLflow 3 refuses a directory store at its first call: every record would be lost.
            raise ValueError(f"mlflow_uri={value!r} is a directory, which MLflow 3 no longer "
                             "records to; give a database (sqlite:///mlflow.db) or a tracking "
                             "server (http://host:5000)")
        return value


def _installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (both are slow to import)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


class FaultsConfig(_Section):
    """How training reacts to bad steps, and faults to inject (each injection fires once per run)."""

    spike_factor: float | None = Field(
        3.0, gt=1, description="A loss above this multiple of the rolling mean is a spike: the "
        "step is not applied and the run rolls back past its data. None turns detection off.")
    spike_window: int = Field(20, ge=2, description="Steps in the rolling mean (detection starts "
                                                    "once the window is full).")
    mtbf_hours: float | None = Field(
        None, gt=0, description="Mean time between failures for checkpoint-interval advice "
        "(Young/Daly); None uses the failures observed in the run.")
    emergency_save_s: float = Field(
        60.0, gt=0, description="Time a worker gets on SIGTERM to save and exit before it is killed.")
    crash_at_step: int | None = Field(
        None, ge=1, description="Inject: kill a worker (SIGKILL) when this step is reached."
    )
    crash_rank: int = Field(0, ge=0, description="Rank that crashes.")
    nan_at_step: int | None = Field(
        None, ge=1, description="Inject: make the loss of this step non-finite.")
    hang_at_step: int | None = Field(
        None, ge=1, description="Inject: freeze a worker (SIGSTOP, rank faults.crash_rank) at this step.")
    sigterm_at_step: int | None = Field(
        None, ge=1, description="Inject: SIGTERM every worker (a preemption) at this step; the "
        "emergency checkpoint is this step's (with faults.save_crash_at_step, a crash in it).")
    save_crash_at_step: int | None = Field(
        None, ge=1, description="Inject: kill a worker (SIGKILL) while the checkpoint of this "
        "step is being saved, at faults.save_crash_point.")
    save_crash_point: Literal["staging", "writing", "before_manifest", "while_committing",
                              "after_manifest"] = Field(
        "writing", description="Where in the save: 'staging' (rank faults.crash_rank's copy of "
        "the state fails, no kill; background saves only), 'writing' (rank faults.crash_rank, "
        "shards in flight; background saves only), 'before_manifest' (rank 0, shards durable, "
        "no manifest), 'while_committing' (rank faults.crash_rank, not 0, shards durable, "
        "while rank 0 commits: a node lost at the commit), 'after_manifest' (rank 0, "
        "committed, not yet in the ledger).")


class ProfilingConfig(_Section):
    """torch.profiler traces of chosen training steps, every rank's, in
    `<run dir>/profiles/step-A-B/` (training.profiling)."""

    steps: int = Field(0, ge=0, description="Steps in a profile; 0 profiles nothing. The "
                       "profiled steps run slower: their metrics are not the run's speed.")
    start_step: int = Field(10, ge=1, description="The first profiled step: past compilation "
                            "and the first steps' warm-up.")
    every: int = Field(0, ge=0, description="Profile again every this many steps (0: once); "
                       "more than profiling.steps.")
    memory: bool = Field(False, description="Also record tensor allocations (the trace's "
                         "memory timeline, memory columns in the table).")

    @model_validator(mode="after")
    def _windows_apart(self) -> "ProfilingConfig":
        if self.every and self.every <= self.steps:
            raise ValueError(f"profiling.every={self.every} must exceed profiling.steps="
                             f"{self.steps}: each profile needs a step before it to warm the "
                             f"profiler up (e.g. profiling.every={max(100, self.steps + 1)})")
        return self


class RunSection(_Section):
    run_id: str = Field("tiny", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
                        description="Names the run; checkpoints and ledger live under it.")
    runs_dir: Annotated[str, AfterValidator(_a_directory)] = Field(
        "./.goodput/runs", description="Local run directories.")
    max_attempts: int = Field(6, ge=1, description="Training attempts in one flow run "
                                                   "(1 + Prefect retries), all classes together.")
    retry_budgets: dict[str, int] = Field(
        default_factory=lambda: dict(DEFAULT_RETRY_BUDGETS),
        description="Retries per failure class (retryable: crash, comm timeout, preemption; "
                    "hang; rollback: non-finite loss or spike; oom; disk_full: a checkpoint write hit "
                    "ENOSPC; corrupt_checkpoint: the checkpoint to resume from no longer matches its "
                    "manifest, so the retry resumes from the store copy or an older one). Config "
                    "errors never retry.")
    @field_validator("retry_budgets")
    @classmethod
    def _budgets_over_defaults(cls, budgets: dict[str, int]) -> dict[str, int]:
        """A budget given overrides that class only; the others keep their defaults."""
        unknown = sorted(budgets.keys() - DEFAULT_RETRY_BUDGETS.keys())
        if unknown:
            raise ValueError(f"unknown failure class(es) {unknown}; the classes "
                             f"are {sorted(DEFAULT_RETRY_BUDGETS)}")
        negative = sorted(k for k, v in budgets.items() if v < 0)
        if negative:
            raise ValueError(f"{negative} below 0; 0 means no retry")
        return {**DEFAULT_RETRY_BUDGETS, **budgets}

    no_progress_attempts: int = Field(
        3, ge=1, description="Stop when this many failed attempts in a row committed no newer "
                             "checkpoint than the one they resumed from.")
    retry_delay_s: float = Field(1.0, ge=0)
    hang_timeout_s: float | None = Field(
        None, gt=0, description="Kill the workers when no step completes for this long; None "
        "derives it: max(run.hang_min_s, 20 x the slowest step seen in the attempt).")
    hang_min_s: float = Field(60.0, gt=0, description="Floor of the derived hang timeout.")
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Allowance until an attempt's first step (imports, rendezvous, "
        "checkpoint load, compilation).")
    checkpoint_timeout_s: float = Field(
        1800.0, gt=0, description="Allowance for one checkpoint save while training is blocked.")


class SshLaunch(_Section):
    options: list[str] = Field(
        # Keepalives: a host that vanishes without closing the connection is noticed within a
        # minute, not when TCP gives up (hours).
        default_factory=lambda: ["-o", "BatchMode=yes", "-o", "ServerAliveInterval=15",
                                 "-o", "ServerAliveCountMax=4"],
        description="Extra ssh options, e.g. ['-i', 'key', '-o', 'StrictHostKeyChecking=no'].")


class SlurmLaunch(_Section):
    partition: str | None = Field(None, description="sbatch --partition")
    account: str | None = Field(None, description="sbatch --account")
    time: str = Field("24:00:00", description="sbatch --time: the job's wall-clock limit, as sbatch "
                      "takes it: minutes (30), hours:minutes:seconds, days-hours[:minutes].")
    gpus_per_node: int | None = Field(None, ge=1, description="sbatch --gpus-per-node; None "
                                                              "requests no GPUs.")
    cpus_per_node: int | None = Field(None, ge=1, description="sbatch --cpus-per-task (one "
                                                              "task, one torchrun, per node).")
    extra_sbatch: list[str] = Field(default_factory=list,
                                    description="More sbatch options, one per #SBATCH line, "
                                                "e.g. '--qos=high' or '--exclusive'.")
    setup: list[str] = Field(default_factory=list,
                             description="Shell lines run before srun, e.g. 'module load cuda'.")

    @field_validator("time", mode="before")
    @classmethod
    def _time_as_sbatch_reads_it(cls, value):
        """sbatch's forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
        days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED. A number is minutes, as
        sbatch reads it (`time: 30` in YAML, `launch.slurm.time=30`); anything else sbatch
        refused only once the job was submitted."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # 0: none
            return str(value)
        if isinstance(value, str) and (_SLURM_TIME.fullmatch(value.strip())
                                       or value.strip().upper() in ("UNLIMITED", "INFINITE")):
            return value.strip()
        raise ValueError(f"{value!r} is not a Slurm time limit: write minutes (30), "
                         "hours:minutes:seconds ('4:00:00') or days-hours[:minutes] ('2-12'), as "
                         "sbatch --time takes it")


_SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")


class KubernetesLaunch(_Section):
    kind: Literal["jobset", "pytorchjob"] = Field(
        "jobset", description="A JobSet (jobset.x-k8s.io) or a Kubeflow PyTorchJob.")
    namespace: str = "default"
    image: str | None = Field(None, description="Container image with this repository and its "
                                                "environment installed.")
    gpus_per_node: int | None = Field(None, ge=1, description="nvidia.com/gpu limit per pod.")
    volume_claim: str | None = Field(
        None, description="PersistentVolumeClaim (ReadWriteMany) holding the run and data "
                          "directories, mounted at mount_path in the training pods and where the "
                          "flow runs (run.runs_dir and data.data_dir must lie under it).")
    mount_path: str = "/goodput"
    shm_size: str = Field("16Gi", description="The pods' /dev/shm (a memory-backed emptyDir): "
                          "NCCL and DataLoader workers need more than a container's 64 MB.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="The training pods' nodeSelector, e.g. "
        "{cloud.google.com/gke-accelerator: nvidia-h100-80gb}.")
    tolerations: list[dict] = Field(
        default_factory=list, description="The training pods' tolerations, e.g. [{key: "
        "nvidia.com/gpu, operator: Exists, effect: NoSchedule}] for a tainted GPU pool.")
    cpu: str | int | None = Field(None, description="CPU request and limit per pod, e.g. 96 or "
                                  "'95500m'.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. '1800Gi'.")


class LaunchConfig(_Section):
    """How the nodes of a training attempt are started: one torchrun per node.

    Every node must see the run directory, the dataset and the config at the same paths
    (a shared filesystem), as the launch task watches the heartbeat and exit records there.
    """

    kind: Literal["local", "ssh", "slurm", "kubernetes"] = Field(
        "local", description="local: parallelism.nnodes torchrun 'nodes' on this machine; ssh: one "
                             "per host in `hosts`; slurm: an sbatch job; kubernetes: a JobSet or "
                             "PyTorchJob.")
    hosts: list[str] = Field(default_factory=list, description="ssh: one host per node; the first "
                                                               "hosts the rendezvous.")
    rdzv_port: int = Field(29400, ge=1, le=65535, description="Port of the c10d rendezvous on the "
                                                             "first node (ssh, slurm, kubernetes).")
    network_interface: str | None = Field(
        None, description="GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on every node, e.g. 'eth0'.")
    workdir: str | None = Field(None, description="Directory the nodes run in; None: this "
                                                  "process's working directory.")
    python: str | None = Field(None, description="Python on the nodes; None: this interpreter.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra worker environment.")
    poll_s: float = Field(10.0, gt=0, description="How often slurm/kubernetes job state is queried.")
    orphan_timeout_s: float = Field(
        120.0, gt=0, description="Workers whose supervisor (the launch task) has not renewed "
        "the run's lease for this long stop by themselves, after an emergency checkpoint: a "
        "killed flow process or worker leaves no training running on; a new attempt waits for "
        "them.")
    scheduler_unreachable_s: float = Field(
        600.0, gt=0, description="How long slurm/kubernetes queries may keep failing (a controller "
        "restarting or failing over; the job runs on meanwhile) before the attempt is given up.")
    max_restarts: int = Field(
        1, ge=0, description="In-job restarts (torchrun --max-restarts): when a worker dies (kill "
        "-9, crash, lost peer), torchrun restarts the workers up to this many times within the "
        "attempt, and they resume from the newest validated checkpoint on local disk. Faster than "
        "a retry of the launch task, which stays the second line (run.retry_budgets). Failures a "
        "restart cannot fix (config, rollback, oom, disk_full) go straight to the launch task. "
        "0 turns in-job restarts off.")
    restart_verdict_wait_s: float = Field(
        300.0, gt=0, description="After an in-job restart, how long the workers wait for the "
        "validate task's verdict on checkpoints committed before the failure, so they resume from "
        "the newest good one rather than an older one (must stay below the collective timeout).")
    ssh: SshLaunch = Field(default_factory=SshLaunch)
    slurm: SlurmLaunch = Field(default_factory=SlurmLaunch)
    kubernetes: KubernetesLaunch = Field(default_factory=KubernetesLaunch)

    @model_validator(mode="after")
    def _kubernetes_image_and_volume(self) -> "LaunchConfig":
        if self.kind == "kubernetes" and not self.kubernetes.image:
            raise ValueError("kind=kubernetes needs kubernetes.image: an image with this "
                             "repository and its environment")
        # The training pods and the flow that supervises them read and write one run and data
        # directory (heartbeats, exit records, checkpoints, the dataset): a volume both mount.
        # Where the directories lie is checked where the pods are made (infra.launchers'
        # KubernetesLauncher.check_shared): a config planned on a laptop has them elsewhere.
        if self.kind == "kubernetes" and not self.kubernetes.volume_claim:
            raise ValueError(
                "launch.kind=kubernetes needs launch.kubernetes.volume_claim: the training pods "
                "and this flow read and write the same run and data directories (heartbeats, "
                "exit records, checkpoints, the dataset); name a PersistentVolumeClaim "
                "(ReadWriteMany) mounted at launch.kubernetes.mount_path in both")
        return self


NODE_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")  # parallelism.nnodes=MIN:MAX


class ElasticConfig(_Section):
    """Training on through lost nodes, on torchrun's own elastic machinery.

    With elastic.min_nodes below parallelism.nnodes (or parallelism.nnodes=MIN:MAX), torchrun
    runs with --nnodes=MIN:MAX on the c10d rendezvous. When a node is lost, the workers of the
    others fail their next collective and torchrun restarts them in the job (no retry of the
    launch task) once the rendezvous settles: it waits elastic.wait_for_replacement_s for the
    node or a replacement, then goes on with the nodes it has. The layout follows the world
    it gets (core.layout.follow_world): tp and pp stay, the data-parallel degree absorbs the
    change, and gradient accumulation keeps the global batch, so the run resumes from its
    newest checkpoint on the same sample order. A node that joins is taken in at the next
    restart of the workers (torchrun restarts them as soon as it sees it waiting).
    """

    min_nodes: int | None = Field(
        None, ge=1, description="Fewest nodes to train on; None: parallelism.nnodes (not "
        "elastic). Below it the others wait elastic.wait_for_replacement_s, then the attempt "
        "fails as node_lost and the launch task's retry starts again.")
    wait_for_replacement_s: float = Field(
        30.0, gt=0, description="How long the remaining nodes wait for a lost node (or its "
        "replacement) before training on without it, and how long fewer than "
        "elastic.min_nodes wait before the attempt fails (the rendezvous' last_call_timeout "
        "and join_timeout). `goodput plan` compares waiting with shrinking for the run's "
        "failure rate.")
    grow: bool = Field(
        True, description="Take nodes back in: the local and ssh launchers start a lost node's "
        "agent again once elastic.wait_for_replacement_s has passed and the others train on "
        "without it (at most launch.max_restarts times per node), and the world grows at the "
        "next restart of the workers. false: the world only shrinks.")


class RunConfig(_Section):
    run: RunSection = Field(default_factory=RunSection)
    data: DataConfig = Field(default_factory=DataConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)

    @model_validator(mode="before")
    @classmethod
    def _node_range(cls, tree: Any) -> Any:
        """parallelism.nnodes=MIN:MAX is nnodes=MAX with elastic.min_nodes=MIN."""
        if not isinstance(tree, dict) or not isinstance(tree.get("parallelism"), dict):
            return tree
        nnodes = tree["parallelism"].get("nnodes")
        if not isinstance(nnodes, str):
            return tree
        match = NODE_RANGE.match(nnodes)
        if match is None:
            if nnodes.strip().isdigit():
                return tree
            raise ValueError(f"parallelism.nnodes={nnodes!r}: give a node count (e.g. 2) or a "
                             "range MIN:MAX (e.g. 2:4) to train elastically on whatever count "
                             "is at hand within it")
        low, high = int(match.group(1)), int(match.group(2))
        if low > high:
            raise ValueError(f"parallelism.nnodes={nnodes.strip()} is a reversed range: give "
                             f"it as MIN:MAX, fewest nodes first (parallelism.nnodes={high}:{low})")
        elastic = dict(tree.get("elastic") or {})
        if elastic.get("min_nodes") not in (None, low):
            raise ValueError(f"parallelism.nnodes={nnodes} says at least {low} nodes, "
                             f"elastic.min_nodes={elastic['min_nodes']} says otherwise: give "
                             "the minimum once (drop elastic.min_nodes, or give nnodes as a count)")
        elastic["min_nodes"] = low
        return {**tree, "parallelism": {**tree["parallelism"], "nnodes": high}, "elastic": elastic}

    @model_validator(mode="after")
    def _cuda_graphs_without_accumulation_or_moe(self) -> "RunConfig":
        par = self.parallelism
        if not par.cuda_graphs:
            return self
        if self.training.grad_accum_steps > 1:
            # A graph's replay for the next micro-batch would write over the buffers that
            # hold the previous one's gradients.
            raise ValueError(
                f"parallelism.compile_mode={par.compile_mode} (CUDA graphs) with "
                f"training.grad_accum_steps={self.training.grad_accum_steps}: the next "
                "micro-batch's graph would write over the gradients kept from the last; raise "
                "training.micro_batch_size instead, or use parallelism.compile_mode=default")
        if self.model.moe is not None:
            raise ValueError(
                f"parallelism.compile_mode={par.compile_mode} (CUDA graphs) with model.moe: a "
                "mixture of experts' blocks have shapes that follow the routing, and a graph "
                "is recorded per shape; use parallelism.compile_mode=default")
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.training.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"training.seq_len={self.training.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; raise model.max_seq_len or lower training.seq_len")
        if self.training.warmup_steps >= self.training.max_steps:
            raise ValueError(
                f"training.warmup_steps={self.training.warmup_steps} must be below "
                f"training.max_steps={self.training.max_steps}: lower training.warmup_steps "
                f"(e.g. training.warmup_steps={self.training.max_steps // 10}) or raise "
                "training.max_steps")
        model = self.model
        problems = [p for p in self.parallelism.dims().problems(
            n_heads=model.n_heads, n_kv_heads=model.n_kv_heads or model.n_heads,
            n_layers=model.n_layers, seq_len=self.training.seq_len,
            micro_batch_size=self.training.micro_batch_size,
            tied_embeddings=model.tie_embeddings,
            num_experts=model.moe.num_experts if model.moe else None) if not p.advice]
        if problems:
            raise ValueError("; ".join(f"{p.reason}; {p.fix}" for p in problems))
        if self.launch.kind == "ssh" and len(self.launch.hosts) != self.parallelism.nnodes:
            raise ValueError(f"launch.kind=ssh needs one host per node: {len(self.launch.hosts)} "
                             f"launch.hosts for parallelism.nnodes={self.parallelism.nnodes}")
        self._stages_in_order()
        if self.faults.crash_rank >= self.parallelism.world_size:
            raise ValueError(f"faults.crash_rank={self.faults.crash_rank} is not a rank of "
                             f"world size {self.parallelism.world_size}")
        if (self.faults.save_crash_at_step is not None and self.faults.crash_rank == 0
                and self.faults.save_crash_point == "while_committing"):
            raise ValueError("faults.save_crash_point=while_committing kills another rank while "
                             "rank 0 commits: set faults.crash_rank to a rank other than 0")
        if self.model.init_from and self.tokenizer.path is None:
            # A checkpoint's embeddings mean the ids of its own tokenizer (tokenizer.json,
            # which save_pretrained of a tokenizer writes beside the model).
            self._init_from_has_a_tokenizer()
            self.tokenizer.path = self.model.init_from
        elif self.model.init_from:
            self._tokenizer_means_init_froms_ids()
        if self.tokenizer.eos_token is not None and self.tokenizer.path is None:
            raise ValueError(f"tokenizer.eos_token={self.tokenizer.eos_token!r} names the "
                             "end-of-document token of a given tokenizer (tokenizer.path or "
                             "model.init_from's); a trained one's is <|endoftext|>: set "
                             "tokenizer.path, or unset tokenizer.eos_token")
        self._name_the_tokenizer()
        return self

    @model_validator(mode="after")
    def _elastic_range(self) -> "RunConfig":
        """Every node count of an elastic range keeps the global batch and makes a layout."""
        low, high = self.node_range
        if low > high:
            raise ValueError(f"elastic.min_nodes={low} exceeds parallelism.nnodes={high}: "
                             f"give at most {high} (or raise parallelism.nnodes)")
        if low == high:
            return self
        if self.launch.kind == "kubernetes":
            raise ValueError(f"elastic training (elastic.min_nodes={low} < parallelism.nnodes="
                             f"{high}) runs on the local, ssh and slurm launchers; on kubernetes "
                             "a lost pod fails the attempt (node_lost) and the retry starts "
                             "again: drop elastic.min_nodes")
        failing = {}
        for nodes in range(low, high):
            try:
                self.layout_on(nodes)
            except ValueError as e:  # LayoutError, or a rule of the layout it would get
                failing[nodes] = str(e)
        if failing:
            first = min(failing)
            raise ValueError(
                f"parallelism.nnodes={low}:{high} (elastic.min_nodes={low}): on "
                f"{', '.join(map(str, failing))} node(s) the run cannot keep its layout rules "
                f"and global batch ({first} nodes: {failing[first]}); fix: "
                + self._elastic_fix(low, high))
        return self

    def _elastic_fix(self, low: int, high: int) -> str:
        """The accumulation that keeps the global batch on every count of the range, where
        one does (a multiple of each count's data-parallel degree over its gcd with the
        full world's)."""
        dims, accum = self.parallelism.dims(), self.training.grad_accum_steps
        inner = dims.tp * dims.pp
        worlds = [n * self.parallelism.nproc_per_node for n in range(low, high)]
        if any(world % inner for world in worlds):
            return (f"give a range whose every count of nodes x parallelism.nproc_per_node is "
                    f"a multiple of tp x pp = {inner}")
        fit = math.lcm(accum, *(w // inner // math.gcd(w // inner, dims.dp_size) for w in worlds))
        if fit != accum:
            return (f"set training.grad_accum_steps={fit} (a multiple of it: the global batch "
                    "then divides over every count in the range), or narrow the range")
        return "narrow the range to the counts that fit"

    @property
    def node_range(self) -> tuple[int, int]:
        """(fewest, most) nodes the run trains on; equal unless elastic."""
        return self.elastic.min_nodes or self.parallelism.nnodes, self.parallelism.nnodes

    @property
    def elastic_run(self) -> bool:
        low, high = self.node_range
        return low < high

    def layout_on(self, nodes: int) -> tuple[ParallelDims, int]:
        """The layout and gradient accumulation of the run on `nodes` nodes (an elastic
        run's world after it shrank or grew; core.layout.follow_world): the configured ones
        on parallelism.nnodes. Raises ValueError (a LayoutError, or the rule the layout
        breaks, with its fix) when the run cannot train there."""
        par, model = self.parallelism, self.model
        world = nodes * par.nproc_per_node
        dims, accum = follow_world(par.dims(), self.training.grad_accum_steps, world,
                                   f"{nodes} node(s) x {par.nproc_per_node} workers")
        if nodes != par.nnodes:
            problems = [p for p in dims.problems(
                n_heads=model.n_heads, n_kv_heads=model.n_kv_heads or model.n_heads,
                n_layers=model.n_layers, seq_len=self.training.seq_len,
                micro_batch_size=self.training.micro_batch_size,
                tied_embeddings=model.tie_embeddings,
                num_experts=model.moe.num_experts if model.moe else None) if not p.advice]
            if problems:
                raise ValueError(f"layout {dims.name} on {nodes} node(s): "
                                 + "; ".join(map(str, problems)))
        return dims, accum

    @model_validator(mode="after")
    def _one_worker_per_gpu(self) -> "RunConfig":
        """The GPUs a node gets from the scheduler are its workers', one each: 4 requested for
        2 workers left two idle (and billed); 2 for 4 workers put two on one GPU."""
        kind = self.launch.kind
        gpus = getattr(getattr(self.launch, kind, None), "gpus_per_node", None)
        workers = self.parallelism.nproc_per_node
        if gpus and gpus != workers:
            raise ValueError(
                f"launch.{kind}.gpus_per_node={gpus} but parallelism.nproc_per_node={workers}: "
                f"each node runs one worker per GPU; set parallelism.nproc_per_node={gpus} (or "
                f"launch.{kind}.gpus_per_node={workers})")
        return self

    @model_validator(mode="after")
    def _best_metric_is_scored(self) -> "RunConfig":
        """eval.best_metric must name a score the reports will have: a typo would leave
        best-by-eval retention with nothing to compare, and it would keep no checkpoint for it."""
        metric, sources = self.eval.best_metric, [s.name for s in self.data.mix()]
        known = ["loss", "perplexity", "bits_per_byte"] + (
            [f"loss/{name}" for name in sources] if len(sources) > 1 else [])  # a mix's sources
        if metric in known:
            return self
        task, _, score = metric.partition("/")
        if metric.startswith("loss/") or not score or not self.eval.tasks:
            raise ValueError(
                f"eval.best_metric={metric!r} is not a score the evaluation reports; use one of "
                f"{', '.join(known)}" + (", or '<task>/<metric>' of eval.tasks (e.g. "
                f"{self.eval.tasks[0]}/acc)" if self.eval.tasks else
                ", or set eval.tasks and name '<task>/<metric>' (e.g. hellaswag/acc_norm)"))
        # A task outside eval.tasks may be a subtask of one of its groups (the flows check it
        # against lm-eval's index before training); one spelt almost as a task of eval.tasks
        # is a typo, refused here.
        close = difflib.get_close_matches(task, self.eval.tasks, n=1, cutoff=0.8)
        if task not in self.eval.tasks and close:
            raise ValueError(f"eval.best_metric={metric!r}: {task!r} is not in eval.tasks "
                             f"({', '.join(self.eval.tasks)}); did you mean {close[0]}/{score}?")
        return self

    def _stages_in_order(self) -> None:
        """Each stage of data.stages starts at a later step than the one before, and none at
        the first step (data.sources' weights hold there), named as the user wrote them."""
        starts = [start for start, _ in self.mix_stages()[1:]]

        def stated(i: int) -> str:
            stage = self.data.stages[i]
            if stage.start_step is not None:
                return f"data.stages[{i}].start_step={stage.start_step}"
            if starts[i] == 0:
                return f"data.stages[{i}].start_tokens={stage.start_tokens}"
            return (f"data.stages[{i}].start_tokens={stage.start_tokens} (step "
                    f"{starts[i] // self.global_batch + 1}: the first after them, at "
                    f"{self.global_batch * self.training.seq_len} tokens a step)")

        for i, start in enumerate(starts):
            if start == 0:
                raise ValueError(f"{stated(i)} starts the stage at the run's first step, so "
                                 "data.sources' weights would never be used: put these weights "
                                 "in data.sources instead")
            if i and start <= starts[i - 1]:
                raise ValueError(f"{stated(i)} does not start after {stated(i - 1)}: give the "
                                 "stages in order, each starting at a later step than the one "
                                 "before")
            if start >= self.training.max_steps * self.global_batch:
                raise ValueError(f"{stated(i)} starts after the run's last step (training."
                                 f"max_steps={self.training.max_steps}), so its weights would "
                                 "never be used: start it earlier, or raise training.max_steps")

    def _init_from_has_a_tokenizer(self) -> None:
        """model.init_from holds the tokenizer.json that tokenizer.path defaults to (checked
        where the directory is: a saved config states tokenizer.path)."""
        from core import hf_llama

        directory = Path(self.model.init_from)
        if directory.is_dir() and not (directory / hf_llama.TOKENIZER_FILE).is_file():
            slow = [p.name for p in directory.glob("tokenizer*") if p.is_file()]
            raise ValueError(
                f"model.init_from={directory} has no {hf_llama.TOKENIZER_FILE}"
                + (f" (only {', '.join(sorted(slow))})" if slow else "")
                + ", the file the checkpoint's own tokenizer is read from (its embeddings mean "
                "that tokenizer's ids): write it with transformers, "
                f"`AutoTokenizer.from_pretrained('{directory}').save_pretrained('{directory}')` "
                f"(a fast tokenizer saves {hf_llama.TOKENIZER_FILE}), or set tokenizer.path to "
                f"a {hf_llama.TOKENIZER_FILE} of the same tokenizer")

    def _tokenizer_means_init_froms_ids(self) -> None:
        """A tokenizer.path given beside model.init_from must be the checkpoint's tokenizer
        (the same tokens with the same ids, saved elsewhere): another one's ids would index
        embeddings trained for other tokens, and training would run on without a word."""
        from core import hf_llama

        try:
            given = hf_llama.given_tokenizer_file(self.tokenizer.path)
        except DataError:  # not there (any more): tokenizer.path's own check says so
            return
        own = Path(self.model.init_from) / hf_llama.TOKENIZER_FILE
        if own.is_file() and (own.resolve() == given.resolve() or sha256_file(own) == sha256_file(given)):
            return
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(given)).get_vocab(with_added_tokens=True)
        if own.is_file():
            theirs = Tokenizer.from_file(str(own)).get_vocab(with_added_tokens=True)
            if vocab != theirs:
                moved = sum(theirs.get(token) != i for token, i in vocab.items())
                raise ValueError(
                    f"tokenizer.path={self.tokenizer.path} is another tokenizer than "
                    f"model.init_from's own ({own}): {moved} of its {len(vocab)} tokens have "
                    f"other ids there ({len(theirs)} tokens), and the checkpoint's embeddings "
                    "mean that tokenizer's ids; leave tokenizer.path unset to use it")
        elif max(vocab.values(), default=-1) >= self.model.vocab_size:
            raise ValueError(
                f"tokenizer.path={self.tokenizer.path} has ids up to {max(vocab.values())}, "
                f"beyond model.init_from's vocab_size={self.model.vocab_size}: it is not the "
                "checkpoint's tokenizer; give the one it was trained with")

    def _name_the_tokenizer(self) -> None:
        """tokenizer.sha256 from the file tokenizer.path names, where it is there."""
        from core import hf_llama

        if self.tokenizer.path is None:
            self.tokenizer.sha256 = None
            return
        try:
            self.tokenizer.sha256 = sha256_file(hf_llama.given_tokenizer_file(self.tokenizer.path))
        except DataError:  # not there (any more): a saved config keeps the sha256 it had
            copy = self._prepared_copy_of_the_tokenizer()
            if copy is not None:
                self.tokenizer.path = str(copy)

    def _prepared_copy_of_the_tokenizer(self) -> Path | None:
        """Where tokenizer.path is gone (model.init_from's directory moved once the run had
        checkpoints of its own), a dataset prepared with it: it keeps the same tokenizer.json
        (by the sha256 the run's config.yaml recorded) and its Hugging Face side files. A
        resume, an evaluation or a prepare of such a run failed on the missing directory."""
        if self.tokenizer.sha256 is None:
            return None
        data_dir = Path(self.data.data_dir)
        for tokenizer_json in sorted([*data_dir.glob("*/tokenizer.json"), *data_dir.glob("cache/*/tokenizer.json")]):
            with contextlib.suppress(OSError):
                if sha256_file(tokenizer_json) == self.tokenizer.sha256:
                    return tokenizer_json.parent.absolute()
        return None

    # -- derived paths -----------------------------------------------------------------
    @property
    def run_dir(self) -> RunDir:
        return RunDir(Path(self.run.runs_dir) / self.run.run_id)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all data-parallel ranks."""
        return (self.training.micro_batch_size * self.training.grad_accum_steps
                * self.parallelism.dims().dp_size)

    def mix_stages(self) -> list[tuple[int, dict[str, float]]]:
        """The weights of the mix from each stage's first global sample on: data.sources'
        from sample 0, then data.stages' (their steps and token counts as samples)."""
        stages = [(0, {s.name: s.weight for s in self.data.mix()})]
        for stage in self.data.stages:
            if stage.start_step is not None:
                step = stage.start_step - 1
            else:  # the first step after start_tokens
                step = -(-stage.start_tokens // (self.global_batch * self.training.seq_len))
            stages.append((step * self.global_batch,
                           {name: stage.weights.get(name, 0.0) for name in stages[0][1]}))
        return stages

    def source_config(self, source: SourceConfig) -> "RunConfig":
        """This config as if `source` were its data.source alone: what prepares it."""
        fields = {f: getattr(source, f) for f in SOURCE_FIELDS if getattr(source, f) is not None}
        data = self.data.model_copy(update={**fields, "sources": [], "stages": []})
        if self.data.sources:
            data._source_name = source.name
        return self.model_copy(update={"data": data})

    def config_hash(self) -> str:
        """Hash of what determines the training trajectory (not paths, faults or eval)."""
        return sha256_bytes(canonical_json(self.trajectory()))[:16]

    def trajectory(self) -> dict:
        """The tree config_hash hashes: what determines the training trajectory."""
        keys = ("data", "tokenizer", "model", "training")
        # The global batch, not how it is split over ranks and micro-steps: a run may resume
        # under another layout (checkpoints reshard) and keep its trajectory.
        per_rank = {"micro_batch_size", "grad_accum_steps", "log_every", "peak_flops_per_device"}
        # A mix of one hashes as before mixtures existed: its runs resume.
        unset = {f for f in ("sources", "stages") if not getattr(self.data, f)}
        # Likewise a tokenizer without tokenizer.eos_token (its end-of-document token found).
        tok_unset = {"eos_token"} if self.tokenizer.eos_token is None else set()
        tree = self.model_dump(include=set(keys), exclude={"data": {"data_dir", "cache_limit", *unset},
                                                           "training": per_rank,
                                                           # The RoPE table's length, not its
                                                           # values: a run started with the
                                                           # file's max_seq_len continues with
                                                           # the checkpoint's (init_from).
                                                           "model": {"init_from_fingerprint",
                                                                     "max_seq_len"},
                                                           "tokenizer": {"sha256", *tok_unset}})
        tree["training"]["global_batch"] = self.global_batch
        # The checkpoint and the tokenizer by what they hold, not where they lie: moved or
        # mounted elsewhere, they continue the run (and a run without them hashes as before).
        tree["model"]["init_from"] = self.model.init_from_fingerprint
        if self.tokenizer.path is not None:
            tree["tokenizer"]["path"] = self.tokenizer.sha256 or self.tokenizer.path
        return tree

    def eval_hash(self) -> str:
        """Hash of what decides an eval report besides the checkpoint and the dataset: the
        eval section, the sequence length it scores and the seed its samples draw from."""
        # Neither in-loop validation nor where task data is read from changes a report.
        tree = {"eval": self.eval.model_dump(exclude={"every_steps", "in_loop_batches", "offline",
                                                      "datasets_cache", "every_validated",
                                                      "best_metric"}),
                "seq_len": self.training.seq_len,
                "seed": self.training.seed}
        if self.eval.tasks:  # how downstream tasks are scored: a report scored otherwise is not reused
            tree["scoring"] = DOWNSTREAM_SCORING
        return sha256_bytes(canonical_json(tree))[:16]


# The version of how lm-eval tasks are scored (training.downstream): 2, lm-eval's own few-shot
# seeds and generation's context cut once as its hf model cuts it (29 Nov).
DOWNSTREAM_SCORING = 2


# -- loading -------------------------------------------------------------------------------

def trajectory_conflicts(saved: dict, here: dict, saved_as: str = "the run",
                         here_as: str = "here", both_only: bool = True) -> list[str]:
    """'field: X in the run, Y here' for each trajectory field (RunConfig.trajectory, as JSON)
    whose values differ. With `both_only`, a field only one tree has is no conflict: code that
    added a field (with its default) reads the trees older code saved."""
    found = []

    def walk(a, b, name):
        if isinstance(a, dict) and isinstance(b, dict):
            keys = a.keys() & b.keys() if both_only else a.keys() | b.keys()
            for key in sorted(keys):
                walk(a.get(key), b.get(key), f"{name}.{key}" if name else key)
        elif a != b:
            found.append(f"{name}: {a} in {saved_as}, {b} {here_as}")

    walk(saved, here, "")
    return found


def trajectory_json(config: RunConfig) -> dict:
    """config.trajectory() as it reads back from JSON (a manifest's), for comparing."""
    return json.loads(canonical_json(config.trajectory()))


def trajectory_differences(run: RunConfig, here: RunConfig, most: int = 4) -> str:
    """The first trajectory fields whose values differ, as trajectory_conflicts names them."""
    found = trajectory_conflicts(trajectory_json(run), trajectory_json(here), both_only=False)
    return "; ".join(found[:most]) + (f"; {len(found) - most} more" if len(found) > most else "")


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds (through `X | None`, lists and dicts of it), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_section_model, get_args(annotation))), None)


def _section_at(path: list) -> type[BaseModel] | None:
    """RunConfig's section at `path`, a validation error's place (list indices passed over)."""
    section: type[BaseModel] | None = RunConfig
    for part in path:
        if isinstance(part, str):
            field = section.model_fields.get(part)
            section = field and _section_model(field.annotation)
            if section is None:
                return None
    return section


def config_fields(section: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """The dotted name of every field of RunConfig that holds a value (not a section),
    e.g. training.max_steps, model.moe.num_experts."""
    names = []
    for name, field in (section or RunConfig).model_fields.items():
        inner = _section_model(field.annotation)
        names += config_fields(inner, f"{prefix}{name}.") if inner else [f"{prefix}{name}"]
    return names


_GLOBAL_BATCH_NAMES = ("global_batch", "global_batch_size", "global_batch_tokens")


def unknown_field_hint(loc: tuple) -> str:
    """What to say of the unknown field at `loc`: the closest real field(s), by full name."""
    *where, name = loc
    name = str(name)
    everything = " (`goodput show-config` prints every field with its value)"
    if name.lower() in _GLOBAL_BATCH_NAMES:
        return ("the global batch is training.micro_batch_size x training.grad_accum_steps x "
                "the data-parallel degree (parallelism.dp_replicate x parallelism.dp_shard), "
                f"in samples of training.seq_len tokens: set those{everything}")
    section = _section_at(where)
    prefix = "".join(f"{p}." for p in where if isinstance(p, str))
    close = [prefix + n for n in _closest(name, list(section.model_fields) if section else [])]
    if not close:  # a field of another section (`lr`), or given without its section
        leaves = config_fields()
        close = ([f for f in leaves if f.rsplit(".", 1)[-1] == name]
                 or [f for f in leaves
                     if f.rsplit(".", 1)[-1] in _closest(name, {f.rsplit(".", 1)[-1] for f in leaves})])[:3]
    if not close:
        return "check the spelling against `goodput show-config`, which prints every field"
    return f"did you mean {' or '.join(close)}?{everything}"


def _closest(name: str, names: Any, cutoff: float = 0.75) -> list[str]:
    """The names nearest `name` (difflib's ratio), those as near as the nearest within 0.1."""
    scored = sorted(((difflib.SequenceMatcher(None, name, n).ratio(), n) for n in names),
                    reverse=True)
    return [n for score, n in scored[:3] if score >= max(cutoff, scored[0][0] - 0.1)]


def _format_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field; {unknown_field_hint(e['loc'])}"
        elif e["type"] == "list_type" and isinstance(e.get("input"), str):
            items = [i.strip() for i in e["input"].split(",") if i.strip()]
            msg += f" (got {e['input']!r}); give a list in brackets: '{field}=[{', '.join(items)}]'"
        # A check across sections has no place of its own: its message names the fields (as
        # does a section's message that starts with one of its fields).
        lines.append(f"  {field}: {msg}" if field and not msg.startswith(f"{field}.") else f"  {msg}")
    return "\n".join(lines)


class _ConfigLoader(yaml.SafeLoader):
    """YAML as configs mean it: `2:4` is text (a node range), not YAML 1.1's base-60 number
    124, which safe_load would silently make of it; a key given twice in one mapping is an
    error, not the last one silently winning (a second `training:` section replaced the
    first whole)."""

    def construct_mapping(self, node, deep=False):
        # A mapping another one merged (`<<: *base`) was flattened then, its merged keys put
        # beside its own: those repeats are meant.
        if isinstance(node, yaml.MappingNode) and id(node) not in self._flattened:
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges are meant to be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                typed = (type(key), key)  # 1 and true are two keys
                if isinstance(key, (str, int, float, bool)) and typed in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"key {key!r} is given twice (first on line {seen[typed] + 1}): keep one",
                        key_node.start_mark)
                seen[typed] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def flatten_mapping(self, node):
        super().flatten_mapping(node)
        self._flattened.add(id(node))

    def __init__(self, stream):
        super().__init__(stream)
        self._flattened: set[int] = set()


_BASE_60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_ConfigLoader.yaml_implicit_resolvers = {
    first: ([("tag:yaml.org,2002:str", _BASE_60)] if first in "+-0123456789" else []) + resolvers
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigLoader)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.max_steps=50` -> (['training', 'max_steps'], 50). Values parse as YAML."""
    if "=" not in text:
        if text.endswith((".yaml", ".yml")) or os.path.isfile(text):
            raise ConfigError(f"{text!r} is read as an override (section.field=value); to read "
                              f"a config file, give it as --config {text}")
        raise ConfigError(f"override {text!r} must look like section.field=value "
                          "(e.g. training.max_steps=50)")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r} has an empty field name")
    listed = next((p for p in path if re.fullmatch(r"\w+\[\d+\]", p) or p.isdigit()), None)
    if listed is not None:
        whole = ".".join(path[:path.index(listed) + (not listed.isdigit())]).split("[")[0]
        raise ConfigError(f"override {text!r}: an item of a list is not overridden on its own; "
                          f"give the whole list, e.g. '{whole}=[{{...}}, {{...}}]' (YAML), or "
                          "edit it in the config file")
    try:
        value = _load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    # A '#' after a space starts a YAML comment, which would silently cut the value short
    # (a path such as "/runs/my runs #2"); a command-line argument never means one.
    if raw.count("#") > str(value).count("#"):
        raise ConfigError(f"override {text!r}: the part from ' #' on would be read as a YAML "
                          f"comment and dropped; quote the value in YAML, e.g. "
                          f"""'{key}="{raw.strip()}"' in a shell""")
    return path, value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """`tree` (a file's, a form's) with `overrides` applied, last one winning. A
    `model.init_from` override also displaces the model shape `tree` states (written for
    another model: configs/tiny.yaml's, say) by its checkpoint's; shape fields that are
    overrides themselves must still agree with the checkpoint."""
    tree = dict(tree)
    parsed = [parse_override(text) for text in overrides]
    init_from = [value for path, value in parsed if path == ["model", "init_from"]]
    # (Not one whose directory is gone: a run's saved config.yaml then stands on the shape
    # it states.)
    if (init_from and init_from[-1] and Path(_absolute(str(init_from[-1]))).is_dir()
            and isinstance(tree.get("model"), dict)):
        stated = {path[1] for path, _ in parsed if len(path) >= 2 and path[0] == "model"}
        # The file's max_seq_len too: the checkpoint's context (max_position_embeddings) is
        # what it was trained for, and what an export tells lm-eval; an override still wins.
        tree["model"] = {k: v for k, v in tree["model"].items()
                         if k not in (*_FIXED_BY_CHECKPOINT, *_FFN_FIELDS, "max_seq_len")
                         or k in stated}
        if isinstance(tree["model"].get("moe"), dict):  # (model.moe={...} replaces it whole)
            tree["model"] = _file_moe_displaced(tree["model"], _absolute(str(init_from[-1])),
                                               {path[2] for path, _ in parsed if len(path) >= 3
                                                and path[:2] == ["model", "moe"]})
    for text, (path, value) in zip(overrides, parsed):
        node = tree
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is a value, not a section")
            else:
                child = node[part] = dict(child)
            node = child
        node[path[-1]] = value
    return tree


def _file_moe_displaced(model: dict, directory: str, stated: set[str]) -> dict:
    """The file's model.moe under a `model.init_from` override, as apply_overrides treats the
    file's dim and n_layers: the fields the checkpoint fixes (a Mixtral's or Qwen3-MoE's experts
    and routing) give way to the checkpoint's, unless `stated` as overrides too (which must
    then agree); the run's own settings (balancing, collapse warning) stay. A dense checkpoint
    displaces the file's model.moe whole."""
    from core import hf_llama

    try:
        found = hf_llama.model_fields(directory).get("moe")
    except ConfigError:
        return model  # the checkpoint itself is refused when the config is validated
    if found is None and not stated:
        return {k: v for k, v in model.items() if k != "moe"}
    return {**model, "moe": {k: v for k, v in model["moe"].items()
                             if found is None or k not in found or k in stated}}


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                ) -> RunConfig:
    """Read YAML (or nothing: all defaults), apply overrides, validate."""
    tree: dict = {}
    origin = "defaults"
    if path is not None:
        p = Path(path)
        if p.is_dir():
            yamls = sorted(y.name for y in p.glob("*.y*ml"))
            example = "tiny.yaml" if "tiny.yaml" in yamls else yamls[0] if yamls else None
            raise ConfigError(f"config {p} is a directory: give a YAML file in it" + (
                f", e.g. --config {p / example} (there: {', '.join(yamls)})" if example else ""))
        if not p.is_file():
            where = "" if p.is_absolute() else f" (in {Path.cwd()})"
            raise ConfigError(f"config file {p} not found{where}; pass an existing YAML file "
                              "(e.g. configs/tiny.yaml)")
        try:
            tree = _load_yaml(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start}): "
                              "give a YAML file, e.g. configs/tiny.yaml") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(tree).__name__}")
        origin = str(p)
    tree = apply_overrides(tree, overrides or [])
    return config_from_dict(tree, origin if not overrides else f"{origin} + overrides")


def runs_own_eval_settings(run_dir: RunDir, eval_hash: str | None) -> bool:
    """Whether eval settings of `eval_hash` are the run's own: those of its saved config.yaml
    (which `goodput train` and `pipeline` write), or any where it has none here (or it no
    longer loads). Reports made otherwise (a one-off `goodput evaluate eval.limit=4`) are
    kept apart from the run's: goodput.evaluation.report_path, training.evaluate.curves_prefix."""
    try:
        stat = os.stat(run_dir.config_file)
    except OSError:
        return True
    saved = _saved_eval_hash(str(run_dir.config_file), stat.st_mtime_ns, stat.st_size)
    return saved is None or eval_hash in (None, saved)


@functools.lru_cache(maxsize=16)
def _saved_eval_hash(config_file: str, mtime_ns: int, size: int) -> str | None:
    try:
        return load_config(config_file).eval_hash()
    except (OSError, ConfigError):
        return None


def config_from_dict(tree: dict, origin: str = "dict") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, origin)) from None


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
