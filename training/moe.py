"""Mixture-of-Experts feed-forward: a top-k router, routed SwiGLU experts, shared experts.

The shapes of DeepSeek-V3 and Qwen3-MoE. Each token's hidden state goes to the `top_k`
experts its router scores highest; their outputs, weighted by the router's scores, add up,
plus the output of the shared experts that every token passes through. No token is ever
dropped (no capacity limit): an expert takes however many tokens choose it.

Expert compute is grouped: the (token, expert) pairs are sorted by expert, so each expert's
tokens lie contiguous, and one grouped matmul (torch's grouped_mm) runs every expert over
its own run of rows. Expert parallelism (training.expert_parallel) swaps in only the
experts' forward: it sends each expert's rows to the rank holding that expert and back;
tensor parallelism of the blocks around it hands the layer each rank's part of the
sequences. This file knows nothing of either.

Load balancing, two ways (each its own setting in model.moe):
- the auxiliary balance loss of Switch / GShard, computed per sequence as DeepSeek-V3's
  sequence-wise loss: alpha * E/K * sum_e f_e * P_e, with f_e the share of the sequence's
  (token, expert) choices that went to expert e and P_e the mean normalised router score of
  e, averaged over the sequences of the batch. Per sequence, it is the same however a batch
  is split over ranks and micro-batches.
- DeepSeek-V3's auxiliary-loss-free balancing: a bias per expert, added to the scores only
  to choose experts (never to weight their outputs), nudged after every optimizer step
  toward the under-loaded experts by `bias_update_rate` (update_expert_bias, which the
  trainer calls with the step's token counts summed over every data-parallel rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.model_args import MoEArgs  # noqa: F401 (the experts' shape, torch-free)


class Router(nn.Module):
    """Scores every expert for every token; picks each token's top_k."""

    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        """x: (tokens, dim). Returns the scores (tokens, experts) in fp32, and each token's
        chosen experts and their weights (tokens, top_k)."""
        logits = self.gate(x).float()  # fp32 scores: the choice is sensitive to rounding
        scores = logits.softmax(-1) if self.moe.score_func == "softmax" else logits.sigmoid()
        choice = scores if expert_bias is None else scores + expert_bias
        experts = choice.topk(self.moe.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.moe.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, experts, weights * self.moe.route_scale


class GroupedExperts(nn.Module):
    """num_experts SwiGLU feed-forwards whose weights are stacked: w1 and w3 (experts,
    hidden, dim), w2 (experts, dim, hidden), the layout of nn.Linear weights per expert."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # down

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim), sorted by expert; counts: rows of each expert (experts,)."""
        return expert_swiglu(x, counts, self.w1, self.w3, self.w2)


def expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU over its own rows of x (sorted by expert, `counts` rows each)."""
    x = autocast_operand(x)  # once here, not in each of the two matmuls that read it
    return grouped_mm(F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts), w2, counts)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of expert e (a run of counts[e] rows of x) times w[e].T, for every expert at once.

    torch's grouped_mm where it runs (CUDA with bf16; on CPU in fp32 too when every row is a
    multiple of 16 bytes), else one matmul per expert: the same products either way. Under
    autocast both operands are cast to its dtype first, as autocast casts a matmul's: it does
    not know grouped_mm, and the fp32 weights beside bf16 rows would leave the fast kernel
    out on CUDA (and run it in fp32 on CPU)."""
    x, w = autocast_operand(x), autocast_operand(w)
    if use_grouped_mm(x, w):
        offsets = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return grouped_mm_loop(x, w, counts)


def autocast_operand(t: torch.Tensor) -> torch.Tensor:
    """`t` as autocast hands a matmul its operands: in autocast's dtype where it is on."""
    device = t.device.type
    return t.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else t


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The fallback of grouped_mm: one matmul per expert over its rows."""
    pieces = x.split(counts.tolist())
    return torch.cat([piece @ w[e].T for e, piece in enumerate(pieces)])


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cuda":
        # The kernels need sm90 and bf16 operands.
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    # The CPU kernel needs every stride a multiple of 16 bytes: rows of dim and hidden values.
    # Under torch.compile its shape function accepts bf16 only (torch 2.13): eager there.
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and all(n * x.element_size() % 16 == 0
                                          for n in (x.shape[-1], w.shape[-2]))


class SwiGLU(nn.Module):
    """The shared experts: one SwiGLU as wide as all of them together (DeepSeek-V3's form)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.router = Router(dim, moe)
        self.experts = GroupedExperts(moe.num_experts, dim, hidden)
        self.shared = SwiGLU(dim, hidden * moe.shared_experts) if moe.shared_experts else None
        # The aux-loss-free bias (checkpointed: it is part of the model's routing) and what
        # the trainer reads after each step: (token, expert) choices per expert and the sum
        # of the sequences' balance statistics, over this step's micro-batches.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)
        self.register_buffer("balance_sum", torch.zeros(2), persistent=False)  # (sum, sequences)
        # The balance loss's gradient is that of aux_loss_coeff x its value, divided as the
        # step's cross-entropy is (by its micro-batches): set_loss_scale.
        self.loss_scale = 1.0

    def reset_buffers(self) -> None:
        """Start values: no bias, nothing counted."""
        for buf in (self.expert_bias, self.tokens_per_expert, self.balance_sum):
            buf.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        bias = self.expert_bias if self.moe.bias_update_rate > 0 else None
        scores, experts, weights = self.router(flat, bias)

        # Every (token, choice) pair, sorted by expert: each expert's rows lie together.
        choices = experts.reshape(-1)
        order = choices.argsort(stable=True)
        token_of_row = order // self.moe.top_k
        counts = torch.bincount(choices, minlength=self.moe.num_experts)
        rows = self.experts(flat[token_of_row], counts)
        rows = rows * weights.reshape(-1, 1)[order].to(rows.dtype)
        out = torch.zeros_like(flat).index_add_(0, token_of_row, rows.to(flat.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)

        balance = balance_statistic(*self.balance_terms(scores.view(batch, seq, -1),
                                                        experts.view(batch, seq, -1)))
        if counting_forward():
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
                self.balance_sum += torch.stack([balance.detach().sum(), balance.new_tensor(batch)])
        if self.moe.aux_loss_coeff > 0 and torch.is_grad_enabled():
            out = AddLossGradient.apply(out, balance.mean(), self.moe.aux_loss_coeff * self.loss_scale)
        return out.view(batch, seq, dim)

    def balance_terms(self, scores: torch.Tensor, experts: torch.Tensor):
        """What the balance statistic of each sequence is made of (balance_terms)."""
        return balance_terms(scores, experts, self.moe.score_func)


def balance_terms(scores: torch.Tensor, experts: torch.Tensor, score_func: str):
    """Per sequence and expert, over its positions: the choices of the expert (for f_e) and
    the sum of its normalised scores (for P_e); and the positions. Sums, so that the parts of
    a sequence split over ranks add up (training.expert_parallel's tensor-parallel MoE).
    scores (batch, seq, experts); experts (batch, seq, top_k), the choices."""
    if score_func != "softmax":  # sigmoid scores: normalised per token first (DeepSeek-V3)
        scores = scores / scores.sum(-1, keepdim=True)
    chosen = torch.zeros_like(scores).scatter_(-1, experts, 1.0).sum(1)
    return chosen, scores.sum(1), scores.new_full((), scores.shape[1]), experts.shape[-1]


def balance_statistic(chosen: torch.Tensor, score_sums: torch.Tensor, positions: torch.Tensor,
                      top_k: int) -> torch.Tensor:
    """The balance statistic of each sequence: E/K * sum_e f_e * P_e, with f_e the share of
    the sequence's choices that went to expert e and P_e its mean normalised score: 1 when
    choices and scores are spread evenly, up to E/K when one expert takes everything."""
    n_experts = chosen.shape[-1]
    share = chosen / (positions * top_k)  # sums to 1 over the experts
    return n_experts * (share * score_sums / positions).sum(-1)


def sequence_balance(scores: torch.Tensor, experts: torch.Tensor, score_func: str) -> torch.Tensor:
    """The balance statistic of each whole sequence (balance_statistic)."""
    return balance_statistic(*balance_terms(scores, experts, score_func))


class AddLossGradient(torch.autograd.Function):
    """Passes `out` through unchanged; in backward, gives `loss` the gradient `scale`, as if
    scale x loss had been added to the training loss. So a loss computed inside a layer trains
    without the model's output (or a pipeline stage's) carrying it (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(loss, ctx.scale), None


def counting_forward() -> bool:
    """A training forward that counts: gradients on, and not activation checkpointing's
    recompute inside backward (it would count the micro-batch twice)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE layers by block name (layers.N), in order (inside DDP's wrapper too)."""
    model = getattr(model, "module", model)
    layers = getattr(model, "layers", None) or {}
    found = {}
    for name, block in layers.items():
        for module in block.modules():
            if isinstance(module, MoE):
                found[name] = module
    return found


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """The share of a step's loss one forward's loss is (1 / (micro-steps x pipeline
    micro-batches)): the balance loss gradients are scaled by it as the cross-entropy is."""
    for layer in moe_layers(model).values():
        layer.loss_scale = scale


@torch.no_grad()
def update_expert_bias(layer: MoE, counts: torch.Tensor) -> None:
    """DeepSeek-V3's aux-loss-free step: each expert's bias rises by bias_update_rate when it
    took fewer (token, expert) choices than the mean this step, falls when it took more.
    `counts`: the step's choices per expert over the whole global batch."""
    rate = layer.moe.bias_update_rate
    if rate > 0:
        layer.expert_bias += rate * torch.sign(counts.float().mean() - counts.float())
