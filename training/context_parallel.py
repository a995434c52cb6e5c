"""Context parallelism: every sequence split over the ranks of a cp group.

A sequence of S tokens is cut into 2 x cp chunks of c = S / (2 cp); rank i holds chunks i and
2cp-1-i (its tokens, in that order: shard_sequence). Under causal attention a chunk attends to
itself and every chunk before it, so chunk j costs j + 1 blocks of work: the pair costs each
rank 2cp + 1 blocks, the same on every rank.

Everything but attention works on a token alone (embedding, norms, feed-forwards, the output
layer and the loss over this rank's tokens). Attention needs the keys and values of the whole
sequence, and gets them as Llama 3 did (The Llama 3 Herd of Models, section 3.3.2):

    q, k, v of this rank's two chunks
      -> all-gather k and v over the cp group (before grouped-query attention repeats them:
         kv_heads, not heads; its backward reduce-scatters their gradients to their ranks)
      -> reorder the gathered chunks to sequence order
      -> for each of the two chunks j: its queries against the keys of chunks 0..j, causal
         within chunk j (a lower-right causal mask)

What attention keeps for backward is this rank's queries and output and the gathered keys
and values of the kv heads (as gathered: the chunks' keys are views of them). On CPU, SDPA's
kernel groups the query heads over the kv heads itself (enable_gqa), and takes a lower-right
causal mask only as a materialised additive one, queries x keys in the queries' dtype, which it
keeps for backward: each rank builds the masks of its two chunks once and every layer (and
every step) uses the same ones, rather than a mask per chunk per layer. On CUDA the chunks'
attention runs the flash or memory-efficient kernel, which takes the lower-right mask without
materialising it; the kv heads are repeated to every query head there, since its
memory-efficient kernel does not group them (torch 2.13).

Why this rather than torch's `context_parallel` (torch.distributed.tensor.experimental), which
passes the keys and values around a ring and overlaps that with the attention of the chunks
at hand: in torch 2.13 it dispatches only the CUDA kernels of scaled_dot_product_attention
(flash, efficient, cuDNN), so on CPU under gloo it does not run ("Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"); it wraps the attention call
in a global override rather than a module; and with grouped-query attention the keys and
values are the small part (Llama 3 405B: 8 of 128 heads), so gathering them whole costs
little next to the attention itself. The all-gather runs on gloo and NCCL alike, under
torch.compile (functional collectives) and beside TP and FSDP; what it gives up is the ring's
overlap and the memory of holding one peer's chunk at a time instead of all of them.

The rotary tables of each rank's model hold the angles of its own tokens' positions
(shard_rotary_tables), so RoPE is that of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from training.model import CausalAttention, repeat_kv


def chunks_of(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2 x cp chunks of every sequence that rank `cp_rank` holds, in order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `tensor` along its sequence dimension `dim`: its two chunks."""
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[j] for j in chunks_of(cp_rank, cp)], dim=dim)


def sequence_order(cp: int) -> torch.Tensor:
    """Where chunk j of the sequence lies among the all-gathered chunks (rank 0's two, rank
    1's two, ...): chunk j < cp is rank j's first, chunk j >= cp rank 2cp-1-j's second."""
    return torch.tensor([2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)])


class ContextParallelAttention(nn.Module):
    """CausalAttention of this rank's two chunks of each sequence over the whole sequence.
    `masks`: the chunks' causal masks where the kernel needs them materialised (attend_chunks),
    one dict shared by every layer of the model."""

    def __init__(self, cp_mesh: DeviceMesh, masks: dict | None = None):
        super().__init__()
        self.mesh, self.cp, self.cp_rank = cp_mesh, cp_mesh.size(), cp_mesh.get_local_rank()
        self.masks = masks if masks is not None else {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """q: (batch, heads, 2c, head_dim), k, v: (batch, kv_heads, 2c, head_dim): this rank's
        chunks. Returns the attention output of its queries, (batch, heads, 2c, head_dim)."""
        if mask is not None:  # packed evaluation runs on one process, never split
            raise ValueError("context parallelism attends causally; it takes no attention mask")
        return attend_chunks(q, self._gathered(k), self._gathered(v),
                             chunks_of(self.cp_rank, self.cp), self.masks)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's chunks of `x` (batch, heads, 2c, head_dim), in sequence order."""
        batch, heads, local, head_dim = x.shape
        gathered = funcol.all_gather_single_autograd(x.contiguous(), gather_dim=2, group=self.mesh)
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered = gathered.wait()
        by_chunk = gathered.reshape(batch, heads, 2 * self.cp, local // 2, head_dim)
        order = sequence_order(self.cp).to(x.device)
        return by_chunk.index_select(2, order).reshape(batch, heads, self.cp * local, head_dim)


def attend_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  chunks: tuple[int, ...], masks: dict | None = None) -> torch.Tensor:
    """Causal attention of the queries of `chunks` (q holds them in that order, c positions
    each) over the keys and values of the whole sequence (k, v, in sequence order): chunk j's
    queries see the keys of chunks 0..j, those of chunk j up to their own position. `masks`
    keeps the materialised masks (CPU) for the next call: pass the same dict to every layer."""
    c = q.shape[2] // len(chunks)
    masks = masks if masks is not None else {}
    out = []
    for n, chunk in enumerate(chunks):
        keys = (chunk + 1) * c
        q_chunk = q[:, :, n * c:(n + 1) * c]
        k_seen, v_seen = k[:, :, :keys], v[:, :, :keys]
        if q.device.type == "cpu":
            # The diagonal chunk alone (chunk 0) is plain causal attention; the others take
            # the mask of the lower right of their (c, keys) scores, shared (lower_right_mask).
            mask = lower_right_mask(c, keys, q, masks) if chunk else None
            out.append(F.scaled_dot_product_attention(q_chunk, k_seen, v_seen, attn_mask=mask,
                                                      is_causal=not chunk, enable_gqa=True))
        else:
            # Query i of the chunk sits at position chunk*c + i and sees keys 0..chunk*c + i:
            # the causal mask aligned to the lower right of the (c, keys) scores.
            out.append(F.scaled_dot_product_attention(q_chunk, *repeat_kv(q_chunk, k_seen, v_seen),
                                                      attn_mask=causal_lower_right(c, keys)))
    return torch.cat(out, dim=2)


def lower_right_mask(queries: int, keys: int, like: torch.Tensor, masks: dict) -> torch.Tensor:
    """The additive causal mask (0 where visible, -inf elsewhere) of `queries` queries that are
    the last of `keys` positions, in `like`'s dtype and device: built once, then taken from
    `masks`. Additive rather than boolean because CPU's SDPA converts a boolean mask into such
    a tensor on every call and keeps that copy for backward."""
    key = (queries, keys, like.dtype, like.device)
    if key not in masks:
        hidden = torch.ones(queries, keys, dtype=torch.bool,
                            device=like.device).triu(keys - queries + 1)
        masks[key] = torch.zeros(queries, keys, dtype=like.dtype,
                                 device=like.device).masked_fill_(hidden, float("-inf"))
    return masks[key]


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Each block's attention over the whole sequence, from this rank's chunks."""
    masks: dict = {}  # one chunk's mask serves every layer
    for block in model.layers.values():
        if not isinstance(block.attention.core, CausalAttention):
            raise TypeError(f"context parallelism replaces CausalAttention, found "
                            f"{type(block.attention.core).__name__}")
        block.attention.core = ContextParallelAttention(cp_mesh, masks)
    return model


def shard_rotary_tables(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Keep the rows of the model's rotary tables for this rank's positions in a sequence
    of `seq_len` tokens: attention uses row i for the i-th token it is given."""
    positions = shard_sequence(torch.arange(seq_len), cp_mesh.get_local_rank(), cp_mesh.size(), dim=0)
    positions = positions.to(model.rope_cos.device)
    model.rope_cos = model.rope_cos.index_select(0, positions)
    model.rope_sin = model.rope_sin.index_select(0, positions)
