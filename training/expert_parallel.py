"""Mixture-of-experts layers under expert and tensor parallelism.

Expert parallelism: each rank of an EP group holds num_experts / ep of every MoE layer's
experts, and tokens travel to the rank of their expert and back.

training.parallelize applies it (apply_expert_parallel) before FSDP: the experts' stacked
weights become DTensors sharded on dim 0 (the expert) over the mesh's `ep` axis, and the
experts module computes as ExpertParallelExperts, whose forward wraps the model's own expert
compute (training.moe.expert_swiglu) in a dispatch and a combine:

    rows sorted by expert (this rank's tokens)                counts per expert (all experts)
      -> all_to_all_single: each rank gets the rows for its experts from every rank
      -> regrouped from (source rank, expert) to (expert, source rank) order
      -> grouped SwiGLU over this rank's experts
      -> the inverse regrouping, all_to_all_single back: each row returns to its token's rank

No row is dropped: the split sizes are exchanged first (one small all-to-all of the counts),
so each rank receives whatever its experts were chosen for. The all-to-all is
torch.distributed's all_to_all_single, which gloo (CPU) and NCCL both implement; its
backward is the same exchange reversed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from training.moe import MoE, GroupedExperts, expert_swiglu, moe_layers


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` (model on the meta device)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for layer in moe_layers(model).values():
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # Each rank cuts its own slice: no communication (the weights are not there yet).
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_group = ep_mesh.get_group()
    return model


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts whose weights hold this rank's share of the experts (DTensors sharded
    over the EP group): forward takes every expert's rows and returns their outputs, as the
    whole experts would, by sending each expert's rows to the rank holding it."""

    ep_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = counts.numel() // ep
        # How many rows each rank sends for each of this rank's experts: (ep, local).
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        received = received.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        receive_splits = received.sum(1).tolist()
        rows = AllToAll.apply(x, receive_splits, send_splits, group)
        by_expert = regroup_by_expert(received)
        w1, w3, w2 = (w.to_local() for w in (self.w1, self.w3, self.w2))
        out = expert_swiglu(rows[by_expert], received.sum(0), w1, w3, w2)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        return AllToAll.apply(out[back], send_splits, receive_splits, group)


def regroup_by_expert(received: torch.Tensor) -> torch.Tensor:
    """The gather index that reorders rows laid out in blocks (source rank, expert), with
    `received[s, e]` rows each, into (expert, source rank) order."""
    sizes = received.reshape(-1)
    starts = (sizes.cumsum(0) - sizes).view_as(received)  # where each block lies now
    sizes_by_expert = received.T.reshape(-1)
    starts_by_expert = starts.T.reshape(-1)
    new_starts = sizes_by_expert.cumsum(0) - sizes_by_expert  # where it goes
    shift = torch.repeat_interleave(starts_by_expert - new_starts, sizes_by_expert)
    return torch.arange(shift.numel(), device=received.device) + shift


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows: `send_splits[r]` rows go to rank r, `receive_splits[r]`
    come from it. Backward sends the gradients the opposite way."""

    @staticmethod
    def forward(ctx, x, receive_splits, send_splits, group):
        ctx.splits, ctx.group = (receive_splits, send_splits), group
        out = x.new_empty(sum(receive_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        receive_splits, send_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send_splits, receive_splits, group=ctx.group)
        return out, None, None, None


# -- tensor parallelism of the blocks around the experts --------------------------------------

def apply_tensor_parallel_moe(layer: MoE, tp_mesh: DeviceMesh, experts: bool = True) -> None:
    """An MoE layer in a tensor-parallel block (model on the meta device).

    Sequence parallelism hands each TP rank its own part of every sequence; the MoE layer
    computes on that part alone, as a data-parallel rank would on its samples: its weights
    are replicated over TP (DTensors, Replicate), the router and the shared experts take this
    rank's tokens as their shard of all of them (Shard(0)), the routed experts compute on
    local weights. Each weight's gradient is then a partial sum over the TP ranks' tokens,
    which FSDP, or the trainer's clip (training.parallelize._reduce_partial_grads), sums. The
    balance statistic of a sequence adds up the parts of it on every TP rank. The block
    hands the layer this rank's part as a local tensor, and takes back that part of the
    output (training.parallelize._apply_tp). `experts` False: expert parallelism takes the
    routed experts instead (each TP rank is then an EP rank with tokens of its own).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    def replicate(module: nn.Module) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param, tp_mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    tokens = PrepareModuleInputOutput(
        input_layouts=(Shard(0),), desired_input_layouts=(Shard(0),),
        output_layouts=(Shard(0),), desired_output_layouts=(Shard(0),), use_local_output=True)
    linears = [layer.router.gate]
    if layer.shared is not None:
        linears += [layer.shared.w1, layer.shared.w3, layer.shared.w2]
    for linear in linears:
        replicate(linear)
        parallelize_module(linear, tp_mesh, tokens)
    if experts:  # else expert parallelism splits them over the TP ranks too
        replicate(layer.experts)
        layer.experts.__class__ = TensorParallelExperts
    layer.__class__ = TensorParallelMoE
    layer.tp_group = tp_mesh.get_group()


class TensorParallelExperts(GroupedExperts):
    """GroupedExperts with weights replicated over TP: computes with the local copies, whose
    gradients are partial sums over the TP ranks."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Partial

        w1, w3, w2 = (w.to_local(grad_placements=(Partial(),)) for w in (self.w1, self.w3, self.w2))
        return expert_swiglu(x, counts, w1, w3, w2)


class TensorParallelMoE(MoE):
    """MoE on this TP rank's part of each sequence; the balance terms of a sequence summed
    over the parts."""

    tp_group: dist.ProcessGroup

    def balance_terms(self, scores: torch.Tensor, experts: torch.Tensor):
        chosen, score_sums, positions, top_k = super().balance_terms(scores, experts)
        parts = dist.get_world_size(self.tp_group)
        return (SumOverGroup.apply(chosen, self.tp_group),
                SumOverGroup.apply(score_sums, self.tp_group), positions * parts, top_k)


class SumOverGroup(torch.autograd.Function):
    """The sum of x over the group's ranks, every rank's share of one replicated result:
    backward hands each rank the gradient as it is (DTensor's Partial -> Replicate)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None
