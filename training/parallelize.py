"""Apply a parallelism layout to the model: the only place that knows about layouts.

    mesh   = core.layout.MESH_DIMS: (pp, dp_replicate, dp_shard, cp, tp), TP innermost;
             expert parallelism sees dp_shard as (efsdp, ep) (build_expert_mesh)
    order  = pipeline split -> tensor parallel -> context parallel -> expert parallel
             -> activation checkpointing -> compile -> data parallel (FSDP2 / HSDP over
             dp_shard x cp, or DDP when the layout is pure replication; the experts by FSDP
             over efsdp) -> materialize (the model is built on the meta device; each rank
             allocates and initialises only what it holds; under context parallelism its
             rotary tables keep its own positions' rows)

The model (training/model.py) is plain PyTorch; pipeline stages are copies of the same
model with the other stages' parts removed, so parameter names (and checkpoints) are the
same under every layout.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.errors import ConfigError
from core.layout import MESH_DIMS, LayoutError, ParallelDims
from training.context_parallel import apply_context_parallel, shard_rotary_tables, shard_sequence
from training.expert_parallel import apply_expert_parallel, apply_tensor_parallel_moe
from training.model import cross_entropy
from training.moe import moe_layers


@dataclass
class Layout:
    """What the training loop needs to know after the layout is applied."""

    mesh: DeviceMesh | None
    dims: ParallelDims
    model_parts: list[nn.Module]  # one, or this rank's pipeline stages
    schedule: object | None = None  # torch.distributed.pipelining schedule when pp > 1
    first_stage: bool = True
    last_stage: bool = True
    ddp: bool = False  # model_parts[0] is DistributedDataParallel
    fsdp: bool = False
    stage_ids: list[int] = field(default_factory=lambda: [0])
    # The loss of a micro-batch, logits -> mean cross-entropy (compiled with the blocks), and
    # whether forward runs under bf16 autocast (FSDP casts the parameters itself instead).
    loss_fn: Callable = cross_entropy
    autocast: bool = False
    # parallelism.loss_chunk_tokens: the model computes its output layer and loss in chunks
    # (training.model.linear_cross_entropy) instead of returning logits for loss_fn.
    loss_chunk_tokens: int = 0

    def mean_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of `model` (this rank's whole model, not a pipeline stage)
        on one micro-batch: in chunks of loss_chunk_tokens, or loss_fn on its logits."""
        if self.loss_chunk_tokens:
            return model(inputs, targets, loss_chunk_tokens=self.loss_chunk_tokens)
        return self.loss_fn(model(inputs), targets)

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return 0
        return (self.mesh.get_local_rank("dp_replicate") * self.dims.dp_shard
                + self.mesh.get_local_rank("dp_shard"))

    @property
    def reports_loss(self) -> bool:
        """The ranks holding a share of the loss (dims.loss_shares of them): last stage, TP
        rank 0; under context parallelism each cp rank holds its tokens' mean."""
        return self.last_stage and (self.mesh is None or self.mesh.get_local_rank("tp") == 0)

    def sequence_part(self, *batches: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each (samples, seq_len) batch: all of it, or under context
        parallelism its two chunks of each sequence (training.context_parallel). Every rank
        of a cp group is handed the same samples."""
        if self.dims.cp == 1:
            return batches
        cp_rank = self.mesh.get_local_rank("cp")
        return tuple(shard_sequence(batch, cp_rank, self.dims.cp) for batch in batches)

    def group(self, dim: str):
        return self.mesh.get_group(dim) if self.mesh is not None else None


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    if not dist.is_initialized():
        return None
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """Where FSDP shards the weights and averages the gradients: (dp_replicate, dp_shard),
    with dp_shard x cp flattened into one axis under context parallelism (its ranks hold the
    same weights, and their losses are each the mean of an equal share of the tokens)."""
    if dims.cp == 1:
        return mesh["dp_replicate", "dp_shard"]
    flat = mesh["dp_replicate", "dp_shard", "cp"]._flatten("data_parallel")
    return flat._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp),
                           ("dp_replicate", "dp_shard_cp"))


def build_expert_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """A pipeline stage's ranks as expert parallelism sees them: (dp_replicate, efsdp, ep),
    dp_shard x tp split with ep inner (ParallelDims.expert_mesh_shape), so an EP group is
    neighbouring ranks (TP ranks first). Experts shard over ep, and by FSDP over
    (dp_replicate, efsdp)."""
    # cp is 1 under EP (core.layout refuses both): in the slice only to keep it contiguous.
    stage = mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
    return stage._unflatten(0, dims.expert_mesh_shape, ("dp_replicate", "efsdp", "ep"))


def parallelize(model: nn.Module, par_cfg, dims: ParallelDims, device: torch.device,
                loss_fn, seed: int | None, microbatch: tuple[int, int] | None = None) -> Layout:
    """Lay `model` (built whole on the meta device: no memory yet) out on this rank according
    to `dims`, then allocate and initialise only what this rank holds (materialize; seed
    None: allocate only, for a caller that loads every weight from a checkpoint).
    `microbatch`: (samples, tokens) of a pipeline micro-batch, which a mixture-of-experts
    model's pipeline stages need stated (_build_schedule), and context parallelism the
    tokens of a sequence (its rotary tables' rows)."""
    mesh = build_mesh(dims, device.type)
    if mesh is None:
        parts = materialize([_checkpoint_and_compile(model, par_cfg)], seed, device)
        return _precision_and_loss(Layout(None, dims, parts), par_cfg, device)

    stage_ids, parts = [0], [model]
    if dims.pp > 1:
        stage_ids, parts = split_pipeline(model, mesh, dims)
    parts = [_apply_tp(part, mesh["tp"], experts=dims.ep == 1) if dims.tp > 1 else part
             for part in parts]
    if dims.cp > 1:
        if microbatch is None:
            raise ValueError("context parallelism needs the sequence length: pass microbatch")
        parts = [apply_context_parallel(part, mesh["cp"]) for part in parts]
    expert_mesh = build_expert_mesh(mesh, dims) if dims.ep > 1 else None
    parts = [apply_expert_parallel(part, expert_mesh["ep"]) if dims.ep > 1 else part for part in parts]
    parts = [_checkpoint_and_compile(part, par_cfg) for part in parts]

    layout = Layout(mesh, dims, parts, stage_ids=stage_ids, fsdp=dims.fsdp, ddp=dims.ddp)
    if layout.fsdp:  # sharded while still on the meta device: each rank allocates its shards
        experts = _expert_fsdp(expert_mesh, dims) if dims.ep > 1 else None
        parts = [_apply_fsdp(p, data_parallel_mesh(mesh, dims), par_cfg, device, experts)
                 for p in parts]
    # Before DDP, which broadcasts rank 0's weights when it wraps them.
    layout.model_parts = materialize(parts, seed, device)
    if dims.cp > 1:
        for part in layout.model_parts:
            shard_rotary_tables(part, mesh["cp"], microbatch[1])
    if layout.ddp:
        from torch.nn.parallel import DistributedDataParallel

        layout.model_parts = [DistributedDataParallel(layout.model_parts[0],
                                                      process_group=mesh.get_group("dp_replicate"))]

    if dims.pp > 1:
        _build_schedule(layout, mesh, device, loss_fn, par_cfg, microbatch)
    return _precision_and_loss(layout, par_cfg, device)


def materialize(parts: list[nn.Module], seed: int | None, device: torch.device) -> list[nn.Module]:
    """Allocate the parts (built on the meta device, laid out) on `device` and give them the
    whole model's initial weights: each parameter is drawn full size from its own seeded
    generator (Transformer.initial_value), one at a time, and this rank keeps its shard.
    Peak memory: this rank's shards plus the largest single parameter, however large the
    model; every layout starts from the single-process model's weights. With seed None the
    weights are only allocated (their values undefined until a checkpoint is loaded)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for part in parts:
        part.to_empty(device=device)
        part.tie_weights()  # to_empty gave the output layer a parameter of its own
        part.init_buffers()
        part.reset_expert_buffers()  # a checkpoint's routing bias replaces them when loaded
        if seed is None:
            continue
        with torch.no_grad():
            for name, param in part.named_parameters():
                full = part.initial_value(whole_model_name(name), param.shape, seed, device)
                if isinstance(param, DTensor):
                    # Each rank cuts its own shard from the same full value: no communication.
                    shard = distribute_tensor(full, param.device_mesh, param.placements,
                                              src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
                else:
                    param.copy_(full)
                del full
    return parts


def whole_model_name(name: str) -> str:
    """A parameter's name in the plain model: without the segments that wrappers add."""
    wrappers = ("_checkpoint_wrapped_module", "_orig_mod", "module")
    return ".".join(part for part in name.split(".") if part not in wrappers)


def _precision_and_loss(layout: Layout, par_cfg, device: torch.device) -> Layout:
    """bf16 autocast where bf16 is asked for (uses_bf16) and FSDP does not cast the
    parameters itself (_apply_fsdp); pipeline stages included: their residual stream stays
    fp32 (an fp32 embedding plus bf16 matmul outputs), so what they exchange is shaped the
    same either way. The loss compiled when parallelism.compile is set."""
    layout.autocast = uses_bf16(par_cfg, device) and not layout.fsdp
    layout.loss_chunk_tokens = par_cfg.loss_chunk_tokens
    if par_cfg.compile:
        # The loss over the vocabulary is memory-bound: eagerly, the fp32 copy of the logits,
        # log-softmax and its gradient each go through memory (for GPT-2's 50k vocabulary,
        # several GB per step, a sizeable share of a small model's step). Compiled, they fuse
        # into a few passes over the bf16 logits. Pipeline schedules keep their own loss.
        layout.loss_fn = torch.compile(cross_entropy)
    return layout


def uses_bf16(par_cfg, device: torch.device) -> bool:
    """parallelism.mixed_precision: 'bf16' anywhere, 'auto' on GPUs."""
    return par_cfg.mixed_precision == "bf16" or (par_cfg.mixed_precision == "auto"
                                                 and device.type == "cuda")


# -- pipeline parallelism ---------------------------------------------------------------------

def split_pipeline(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims):
    """This rank's stages: copies of the model keeping a contiguous run of layers each, as
    many as core.layout's stage rule gives the stage (ParallelDims.stage_layers: the
    configured parallelism.pp_layers_per_stage, or the default split with the first and last
    stages lightened by pp_first/last_stage_less_layers); with interleaving a rank holds
    v = parallelism.pp_virtual_stages of them, r, r + pp, ..., r + (v-1)pp (looping placement).
    Stage 0 keeps the embedding, the last stage the norm and output."""
    layer_names = list(model.layers.keys())
    try:
        bounds = dims.stage_bounds(len(layer_names))
    except LayoutError as e:  # the config's validation says so first; this is for callers without it
        raise ConfigError(str(e.problem)) from None
    stage_ids = dims.stages_of(mesh.get_local_rank("pp"))
    parts = []
    for sid in stage_ids:
        part = copy.deepcopy(model)
        keep = set(layer_names[bounds[sid]:bounds[sid + 1]])
        for name in layer_names:
            if name not in keep:
                del part.layers[name]
        if sid != 0:
            part.tok_embeddings = None
        if sid != dims.n_stages - 1:
            part.norm, part.output = None, None
        parts.append(part)
    return stage_ids, parts


def _build_schedule(layout: Layout, mesh: DeviceMesh, device, loss_fn, par_cfg,
                    microbatch: tuple[int, int] | None) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    dims = layout.dims
    n_stages = dims.n_stages
    group = mesh.get_group("pp")
    stages = [PipelineStage(part, sid, n_stages, device, group=group,
                            **_stage_io(part, sid, n_stages, microbatch, par_cfg, layout, device))
              for sid, part in zip(layout.stage_ids, layout.model_parts)]
    microbatches = dims.microbatches_per_step
    # scale_grads would divide the *accumulated* gradients after every step, which is wrong
    # with gradient accumulation; loss_fn already divides by micro-batches x accumulation.
    if dims.pp_schedule == "interleaved-1f1b":
        layout.schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn,
                                                  scale_grads=False)
    else:
        cls = ScheduleGPipe if dims.pp_schedule == "gpipe" else Schedule1F1B
        layout.schedule = cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    layout.first_stage = 0 in layout.stage_ids
    layout.last_stage = (n_stages - 1) in layout.stage_ids


def _stage_io(part: nn.Module, stage: int, n_stages: int, microbatch: tuple[int, int] | None,
              par_cfg, layout: Layout, device: torch.device) -> dict:
    """What a stage of a mixture-of-experts model receives and sends, stated.

    Without it, each stage learns its shapes at the first step by running one extra forward
    (on the first micro-batch, or on uninitialised tensors), and an MoE layer would count
    that forward's tokens into the step's expert loads (and the routing bias with them).
    Hidden states between stages are fp32, or bf16 where FSDP computes in bf16 (autocast
    keeps the residual stream fp32), and under TP this rank's part of the sequence; logits
    are whole, and bf16 under either."""
    if microbatch is None or not moe_layers(part):
        return {}
    rows, seq = microbatch
    args = part.args
    bf16 = uses_bf16(par_cfg, device)
    hidden = torch.bfloat16 if bf16 and layout.fsdp else torch.float32
    meta = torch.device("meta")

    def states():  # hidden states, which carry gradients back
        return torch.empty(rows, seq // layout.dims.tp, args.dim, dtype=hidden, device=meta,
                           requires_grad=True)

    inputs = torch.empty(rows, seq, dtype=torch.long, device=meta) if stage == 0 else states()
    outputs = (torch.empty(rows, seq, args.vocab_size, device=meta, requires_grad=True,
                           dtype=torch.bfloat16 if bf16 else torch.float32)
               if stage == n_stages - 1 else states())
    # Gradients come back for the hidden states (none for the last stage's logits, whose
    # gradient starts from the loss, nor for the first stage's token ids).
    return {"input_args": inputs, "output_args": outputs,
            "output_grads": outputs if stage < n_stages - 1 else (None,),
            "input_grads": inputs if stage > 0 else (None,)}


# -- tensor parallelism -----------------------------------------------------------------------

def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh, experts: bool = True) -> nn.Module:
    """Megatron-style TP with sequence parallelism for the norms (activations between blocks
    are sharded along the sequence, so norms and residual adds are not duplicated). An MoE
    layer computes on each rank's part of the sequence; its routed experts are replicated
    over TP unless expert parallelism (`experts` False) splits them, TP ranks included."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
        # Each module got its own distributed copy of a tied matrix; both are sharded by
        # vocabulary rows (Shard(0)), so the embedding's serves the output layer as it is.
        model.tie_weights()
    for block in model.layers.values():
        if block.moe is not None:
            # The MoE layer computes on this rank's part of the sequence (its own tokens), and
            # gives back that part, as the dense feed-forward's row-parallel output does.
            apply_tensor_parallel_moe(block.moe, tp_mesh, experts)
            ffn = {"moe": PrepareModuleInput(input_layouts=(Shard(1),),
                                             desired_input_layouts=(Shard(1),), use_local_output=True)}
        else:
            ffn = {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),)),
                   "feed_forward.w1": ColwiseParallel(),
                   "feed_forward.w3": ColwiseParallel(),
                   "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
        if block.attention.q_norm is not None:
            for norm in (block.attention.q_norm, block.attention.k_norm):
                _norm_of_local_heads(norm, tp_mesh)
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **ffn,
        })
    return model


def _norm_of_local_heads(norm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A per-head norm (Qwen3's q_norm, k_norm) under TP: this rank's heads, (batch, seq,
    heads, head_dim), are its shard of them all (Shard(2)), the weight is replicated, and its
    gradient, a partial sum over the ranks' heads, is summed as the other norms' are."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    norm.weight = nn.Parameter(distribute_tensor(norm.weight, tp_mesh, [Replicate()],
                                                 src_data_rank=None))
    parallelize_module(norm, tp_mesh, PrepareModuleInputOutput(
        input_layouts=(Shard(2),), desired_input_layouts=(Shard(2),),
        output_layouts=(Shard(2),), desired_output_layouts=(Shard(2),), use_local_output=True))


# -- activation checkpointing, compile ---------------------------------------------------------

def _checkpoint_and_compile(model: nn.Module, par_cfg) -> nn.Module:
    """Activation checkpointing and compile, per block (both keep parameter names).

    Compiling per block rather than the whole model: the blocks share their code, so Dynamo
    compiles one block once and every other block reuses it (compile time does not grow with
    depth), and the same compiled unit works under every layout (TP's DTensors, FSDP2 per
    block, pipeline stages). What a whole-model compile would add is fusion around the
    embedding lookup and the final norm, which are small; the part outside the blocks that
    matters, the loss over the vocabulary, is compiled on its own (_precision_and_loss).
    """
    if par_cfg.activation_checkpointing != "none":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, name in enumerate(list(model.layers.keys())):
            # "selective": every other block, trading half the recompute for half the memory.
            if par_cfg.activation_checkpointing == "full" or i % 2 == 0:
                model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=False)
    if par_cfg.compile:
        mode = None if par_cfg.compile_mode == "default" else par_cfg.compile_mode
        for block in model.layers.values():
            block.compile(mode=mode)
    return model


# -- data parallelism -------------------------------------------------------------------------

def _expert_fsdp(expert_mesh: DeviceMesh, dims: ParallelDims) -> tuple[DeviceMesh, int]:
    """Where FSDP shards expert-parallel experts, and what divides their gradients.

    Over (dp_replicate, efsdp): the ranks holding the same experts. Their gradients already
    sum the loss gradients of every data-parallel rank's tokens (the all-to-all's backward
    brought them), so they are divided by the whole data-parallel size, as the other weights'
    are after FSDP sums them over dp_shard."""
    return expert_mesh["dp_replicate", "efsdp"], dims.dp_size


def _apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, par_cfg, device: torch.device,
                experts: tuple[DeviceMesh, int] | None = None) -> nn.Module:
    """FSDP2 per block then the root; a 2-D (replicate, shard) mesh makes it HSDP. With
    `experts` (expert parallelism: a mesh and a gradient divisor) each MoE layer's experts
    first get an FSDP unit of their own on that mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if uses_bf16(par_cfg, device) \
        else MixedPrecisionPolicy()
    if experts is not None:
        expert_mesh, divide_by = experts
        for layer in moe_layers(model).values():
            fully_shard(layer.experts, mesh=expert_mesh, mp_policy=mp,
                        reshard_after_forward=par_cfg.reshard_after_forward)
            layer.experts.set_gradient_divide_factor(divide_by)
            # gloo has no pre-multiplied sum: sum, then divide. Not on a shard group of one,
            # where nothing is reduced and torch 2.13's FSDP, told to sum, would divide twice.
            if dist.get_backend() == "gloo" and expert_mesh["efsdp"].size() > 1:
                layer.experts.set_force_sum_reduction_for_comms(True)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=par_cfg.reshard_after_forward)
    # The root's parameters (embeddings, final norm, output) are used last in backward and
    # first in forward: keep them gathered after forward.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


# -- gradient clipping across every layout ----------------------------------------------------

def clip_grad_norm_(layout: Layout, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all stages and shards; clips in place when max_norm > 0.

    The trainer calls this once per step, after backward: it first sums the gradients TP left
    partial, so that neither the norm nor the optimizer reduces them again. Gradients are
    taken per mesh (expert parallelism's experts live on another mesh than the other
    weights, and DTensor ops never mix meshes)."""
    params = [p for part in layout.model_parts for p in part.parameters() if p.grad is not None]
    _reduce_partial_grads(params)
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [_norm([p.grad for p in group]) for group in by_mesh.values()]  # float64
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if layout.dims.pp > 1:  # each stage saw only its own parameters
        squared = norm ** 2
        dist.all_reduce(squared, group=layout.group("pp"))
        norm = squared.sqrt()
    norm = norm.to(params[0].grad.dtype)
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads`, accumulated in float64. In float32 a CPU norm of a 500k-element
    gradient is off by about 4e-6 relative (no pairwise summation), and by another amount for
    each way the gradient is sharded: with clipping active the clip factor, then through
    AdamW the loss curve, differed by layout (2.5e-4 relative by step 15 under FSDP)."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    norm = torch.linalg.vector_norm(torch.stack(norms))
    if hasattr(norm, "full_tensor"):  # DTensor: reduce over its mesh
        norm = norm.full_tensor()
    return norm  # float64: the meshes' and stages' norms are combined in it too


def _reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Make `Partial(sum)` gradients (sequence-parallel norm weights under TP without FSDP,
    which reduces them itself) `Replicate`, with one all-reduce per mesh for all of them.
    Left partial, every foreach op of the clip and of AdamW would all-reduce each again."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    buckets: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        if isinstance(p.grad, DTensor) and any(isinstance(pl, Partial) for pl in p.grad.placements):
            buckets.setdefault((p.grad.device_mesh, p.grad.placements, p.grad.dtype), []).append(p)
    for (mesh, placements, _), bucket in buckets.items():
        summed = [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
        if any(isinstance(pl, Partial) and pl.reduce_op != "sum" for pl in placements):
            for p in bucket:
                p.grad = p.grad.redistribute(placements=summed)
            continue
        with torch.no_grad():
            locals_ = [p.grad.to_local() for p in bucket]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            for dim, pl in enumerate(placements):
                if isinstance(pl, Partial):
                    dist.all_reduce(flat, group=mesh.get_group(dim))
            for p, t, out in zip(bucket, locals_, flat.split([t.numel() for t in locals_])):
                p.grad = DTensor.from_local(out.view_as(t), mesh, summed, run_check=False,
                                            shape=p.grad.shape, stride=p.grad.stride())
