"""Start training from a Hugging Face Llama checkpoint (model.init_from).

The trainer builds the model on the meta device and lays it out (training.parallelize)
without drawing initial values; `load_hf_weights` then fills each rank's parameters from
the checkpoint's safetensors files with DCP's HuggingFaceStorageReader. DCP plans the read
from what the rank holds: an FSDP or TP shard is read as a slice of the stored tensor
(safetensors get_slice), a pipeline stage reads only its own layers, and no rank ever holds
a full copy of a tensor it does not keep.

A Mixtral's or Qwen3-MoE's experts are stored one tensor per expert; the model stacks each layer's
(experts, out, in). They are read whole, a stack at a time, and each rank keeps its part
(expert or FSDP shard), as training.parallelize.materialize does with initial values: peak
memory is one layer's stack of one weight beyond the rank's own part.

Names are those of the Hugging Face export (training.export.hf_name) read the other way;
Goodput's Llama already uses Hugging Face's rotate-half RoPE layout, so q and k need no
permutation in either direction. A tied output layer is the embedding matrix: it is read
once, as model.embed_tokens.weight.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from core import hf_llama
from core.errors import ConfigError
from core.hf_llama import check_complete, read_config
from training.export import hf_expert_names, hf_name
from training.logs import get_logger

log = get_logger("init_from")


def stored_tensors(directory: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in `directory`: HF name -> (file, shape), from the
    safetensors headers only (no tensor data is read; the config check reads the same)."""
    directory = Path(directory)
    if not directory.is_dir():  # moved since the config was read
        raise ConfigError(f"model.init_from={directory}: no such directory; the run has no "
                          "checkpoint of its own yet, so it starts from these weights: point "
                          "model.init_from at the Hugging Face checkpoint's directory")
    return hf_llama.stored_tensors(directory)


class _Reader(dcp.HuggingFaceStorageReader):
    """DCP's safetensors reader, counting the bytes of this rank's read plan (the log says
    how much of the checkpoint each rank read)."""

    bytes_read = 0

    def read_data(self, plan, planner):
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            self.bytes_read += math.prod(item.lengths) * stored.dtype.itemsize
        return super().read_data(plan, planner)


def load_hf_weights(model_parts: list[torch.nn.Module], directory: str | Path,
                    tie_embeddings: bool) -> int:
    """Fill this rank's parameters (every model part: pipeline stages, FSDP/TP shards, DDP
    replicas) from the Hugging Face checkpoint in `directory`, converting the stored dtype to
    the parameters'. Collective: every rank calls it. Returns the bytes this rank read.
    ConfigError when a tensor the model needs is missing or shaped differently."""
    start = time.perf_counter()
    directory = Path(directory)
    states = [get_model_state_dict(part) for part in model_parts]
    architecture = read_config(directory)["model_type"]
    wanted, stacks = {}, {}
    for state in states:
        for name, tensor in state.items():
            if tie_embeddings and name == "output.weight":
                continue  # the embedding's parameter: filled through model.embed_tokens.weight
            if name.endswith(".expert_bias"):
                continue  # the aux-loss-free routing bias: no checkpoint has it; it starts at 0
            experts = hf_expert_names(name, tensor.shape[0], architecture)
            if experts:
                stacks[tuple(experts)] = tensor
            else:
                wanted[hf_name(name, architecture)] = tensor
    stored = stored_tensors(directory)
    _check_complete(wanted, stored, directory)
    _check_complete({name: t[0] for names, t in stacks.items() for name in names}, stored, directory)
    reader = _Reader(str(directory))
    with warnings.catch_warnings():  # a single process (no process group) loads alone: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # Loads in place into the parameters (DTensor shards included): the read plan asks
        # each file only for the slices this rank holds.
        dcp.load(wanted, storage_reader=reader)
    for names, tensor in stacks.items():
        reader.bytes_read += _load_stack(tensor, names, directory, stored)
    for part, state in zip(model_parts, states):
        set_model_state_dict(part, state)
    log.info("initialised %d tensors from %s in %.1fs: read %d bytes (this rank's part)",
             len(wanted), directory, time.perf_counter() - start, reader.bytes_read)
    return reader.bytes_read


def _load_stack(tensor: torch.Tensor, names: tuple[str, ...], directory: Path,
                stored: dict) -> int:
    """Fill `tensor` (a stack of experts, whole or this rank's shard of it) from the stored
    tensors `names`, one per expert. Returns the bytes read."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    pieces = []
    for name in names:
        with safe_open(str(directory / stored[name][0]), framework="pt") as f:
            pieces.append(f.get_tensor(name))
    whole = torch.stack(pieces).to(device=tensor.device, dtype=tensor.dtype)
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            # Each rank cuts its own part of the whole: no communication.
            mine = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(mine.to_local())
        else:
            tensor.copy_(whole)
    return sum(p.numel() * p.element_size() for p in pieces)


def _check_complete(wanted: dict[str, torch.Tensor], stored: dict, directory: Path) -> None:
    """Every tensor the model needs is stored with the model's (whole) shape: DCP's own
    errors for a missing key or a size mismatch would not say which file or what to do.
    (The config's check said so already, core.hf_llama.needed_tensors: this is the model's.)"""
    check_complete(wanted, stored, directory)
    wrong = [f"{name} {stored[name][1]} in {stored[name][0]}, model {tuple(t.shape)}"
             for name, t in wanted.items() if stored[name][1] != tuple(t.shape)]
    if wrong:
        raise ConfigError(f"model.init_from={directory}: tensor shapes differ from the model "
                          f"its config.json describes: {'; '.join(wrong[:3])}; re-save the "
                          "checkpoint with save_pretrained")
