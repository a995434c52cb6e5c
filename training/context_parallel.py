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
and values (views of them). On CPU, SDPA's kernel groups the query heads over the kv heads
itself, so those are the kv heads; and it would take a lower-right causal mask only
materialised, an fp32 (c, keys) tensor that it keeps for backward (16 MiB a layer at seq 4,096,
cp 2). So each chunk's attention is split instead: the keys of the chunks before it, all
visible, and its own, causal (a square, needing no mask), merged by their log-sum-exps as
flash attention merges blocks (ChunkAttentionCPU). On CUDA the chunks' attention runs the
flash or memory-efficient kernel, which takes the lower-right mask without materialising it;
the kv heads are repeated to every query head there, since its memory-efficient kernel does
not group them (torch 2.13).

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
    """CausalAttention of this rank's two chunks of each sequence over the whole sequence."""

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.mesh, self.cp, self.cp_rank = cp_mesh, cp_mesh.size(), cp_mesh.get_local_rank()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """q: (batch, heads, 2c, head_dim), k, v: (batch, kv_heads, 2c, head_dim): this rank's
        chunks. Returns the attention output of its queries, (batch, heads, 2c, head_dim)."""
        if mask is not None:  # packed evaluation runs on one process, never split
            raise ValueError("context parallelism attends causally; it takes no attention mask")
        return attend_chunks(q, self._gathered(k), self._gathered(v),
                             chunks_of(self.cp_rank, self.cp))

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
                  chunks: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of the queries of `chunks` (q holds them in that order, c positions
    each) over the keys and values of the whole sequence (k, v, in sequence order): chunk j's
    queries see the keys of chunks 0..j, those of chunk j up to their own position."""
    if q.device.type == "cpu":
        if torch.is_autocast_enabled("cpu"):  # cast as autocast casts SDPA's inputs
            dtype = torch.get_autocast_dtype("cpu")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return ChunkAttentionCPU.apply(q, k, v, chunks)
    # (imported here: torch.nn.attention.bias imports torch._dynamo, a second in every
    # process that builds the model, CPU's path not needing it)
    from torch.nn.attention.bias import causal_lower_right

    c = q.shape[2] // len(chunks)
    out = []
    for n, chunk in enumerate(chunks):
        keys = (chunk + 1) * c
        q_chunk = q[:, :, n * c:(n + 1) * c]
        # Query i of the chunk sits at position chunk*c + i and sees keys 0..chunk*c + i:
        # the causal mask aligned to the lower right of the (c, keys) scores.
        out.append(F.scaled_dot_product_attention(
            q_chunk, *repeat_kv(q_chunk, k[:, :, :keys], v[:, :, :keys]),
            attn_mask=causal_lower_right(c, keys)))
    return torch.cat(out, dim=2)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _key_blocks(chunk: int, c: int) -> list[tuple[slice, bool]]:
    """The keys that chunk `chunk` (c positions) attends to, as the kernel's blocks, each
    with whether it is causal: the chunk's own (a causal square), then those before it (all
    visible; none for chunk 0)."""
    prefix = chunk * c
    own = (slice(prefix, prefix + c), True)
    return [own, (slice(0, prefix), False)] if prefix else [own]


class ChunkAttentionCPU(torch.autograd.Function):
    """attend_chunks on CPU's flash kernel (which groups the query heads over the kv heads
    itself), without a mask: each chunk j's queries attend to the keys before the chunk (all
    visible) and to the chunk's own (the diagonal block, causal), and the two outputs are
    merged by their log-sum-exps. Backward runs the kernel's backward on each block with the
    merged output and log-sum-exp, which gives each block's share of the gradients exactly
    (flash attention's block-wise backward, as torch's ring attention does).

    Keeps q, k, v (the gathered ones, as they come) and the output and log-sum-exp of the
    rank's queries, as SDPA keeps them. The output is laid out (batch, positions, heads,
    head_dim) as SDPA's CPU kernel lays it out, so that the output projection's input (its
    transpose, reshaped) is a view of it, not a second copy."""

    @staticmethod
    def forward(ctx, q, k, v, chunks):
        batch, heads, local, head_dim = q.shape
        c = local // len(chunks)
        out = q.new_empty(batch, local, heads, head_dim).transpose(1, 2)
        lse = []
        for n, chunk in enumerate(chunks):
            rows = slice(n * c, (n + 1) * c)
            q_chunk = q[:, :, rows]
            o = l = None
            for keys, causal in _key_blocks(chunk, c):
                o_block, l_block = _flash_cpu(q_chunk, k[:, :, keys], v[:, :, keys], 0.0, causal)
                if o is None:
                    o, l = o_block, l_block
                    continue
                merged = torch.logaddexp(l, l_block)
                o = (o * (l - merged).exp().unsqueeze(-1)
                     + o_block * (l_block - merged).exp().unsqueeze(-1))
                l = merged
            out[:, :, rows] = o
            lse.append(l)
        lse = torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks = chunks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        c = q.shape[2] // len(ctx.chunks)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for n, chunk in enumerate(ctx.chunks):
            rows = slice(n * c, (n + 1) * c)
            for keys, causal in _key_blocks(chunk, c):
                dq_block, dk_block, dv_block = _flash_cpu_backward(
                    grad_out[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                    out[:, :, rows], lse[:, :, rows], 0.0, causal)
                dq[:, :, rows] += dq_block
                dk[:, :, keys] += dk_block
                dv[:, :, keys] += dv_block
        return dq, dk, dv, None


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Each block's attention over the whole sequence, from this rank's chunks."""
    for block in model.layers.values():
        if not isinstance(block.attention.core, CausalAttention):
            raise TypeError(f"context parallelism replaces CausalAttention, found "
                            f"{type(block.attention.core).__name__}")
        block.attention.core = ContextParallelAttention(cp_mesh)
    return model


def shard_rotary_tables(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Keep the rows of the model's rotary tables for this rank's positions in a sequence
    of `seq_len` tokens: attention uses row i for the i-th token it is given."""
    positions = shard_sequence(torch.arange(seq_len), cp_mesh.get_local_rank(), cp_mesh.size(), dim=0)
    positions = positions.to(model.rope_cos.device)
    model.rope_cos = model.rope_cos.index_select(0, positions)
    model.rope_sin = model.rope_sin.index_select(0, positions)
