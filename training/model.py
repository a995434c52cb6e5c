"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Plain PyTorch that knows nothing about parallelism or checkpoints: one file a reader can
follow in one sitting. Rotary embeddings use the rotate-half convention of Hugging Face's
Llama, so exported weights need no permutation.
"""

from __future__ import annotations

import math
import zlib
from itertools import islice
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# The model's shape lives apart, torch-free (the flow process reads it); it is this model's.
from training.model_args import ModelArgs, model_args_from_config, moe_facts  # noqa: F401
from training.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel (forward and backward in one pass each, statistics in fp32):
        # x * rsqrt(mean(x^2) + eps) * weight, as written out in Llama and transformers.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequency of each pair of dimensions (head_dim / 2 of them).

    With Llama 3.1's `scaling`, frequencies whose wavelength exceeds the original context
    (original_max_position_embeddings / low_freq_factor) are divided by `factor`, those
    shorter than original / high_freq_factor stay, and the band between is interpolated
    smoothly. The operations and their order are those of Meta's apply_scaling and
    transformers' _compute_llama3_parameters, so an exported model computes the same angles
    to the bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cache(head_dim: int, max_seq_len: int, theta: float,
               scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim), halves repeated
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim). Rotates pairs (i, i + head_dim/2):
    x * cos + (-x2, x1) * sin, where x1, x2 are x's halves."""
    half = x.shape[-1] // 2
    # (-x2, x1) * sin == roll(x, half) * (-sin, sin): the sign moves to the small table, and
    # one roll replaces a negation, two slices and a concatenation of the large tensor
    # (whose backward zero-fills a gradient per slice). The same products, bit for bit.
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return x * cos + x.roll(half, dims=-1) * signed_sin


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v with a causal mask: each position attends to itself
    and the positions before it. A module of its own (it holds no weights), so that a layout
    that gives a rank only part of the sequence can put in its place one that attends over
    the keys and values of the whole sequence."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim); `mask`
        (True where a token may attend) in place of the causal one, as evaluation packs them."""
        return F.scaled_dot_product_attention(q, *repeat_kv(q, k, v), attn_mask=mask,
                                              is_causal=mask is None)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each key/value head serves heads / kv_heads query heads."""
    if k.shape[1] == q.shape[1]:
        return k, v
    repeat = q.shape[1] // k.shape[1]
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


class LayerKV:
    """One layer's keys and values of the positions a generation has run (KVCache)."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' keys and values (batch, kv_heads, new, head_dim); returns
        those of every position so far."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


class KVCache:
    """What a generation has computed of the positions it ran, by layer: each new token
    attends to their keys and values instead of the whole sequence being run again
    (Transformer.stream). `length`: the positions it holds."""

    def __init__(self):
        self.layers: dict[str, LayerKV] = {}
        self.length = 0

    def layer(self, name: str) -> LayerKV:
        return self.layers.setdefault(name, LayerKV())


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        # Qwen2's q/k/v biases (args.qkv_bias): tensor parallelism splits each with its
        # projection's output rows, so a rank adds the bias of its own heads.
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cache: LayerKV | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = cos[..., :seq, :], sin[..., :seq, :]
        # Head counts come from the projections' outputs (-1), so the same code runs when
        # tensor parallelism gives this rank only some of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generation: the earlier positions' keys and values are kept
            k, v = cache.append(k, v)
            if k.shape[2] > seq:  # (else the plain causal mask: the first pass)
                # Each new position attends to every earlier one and to the new ones up to itself.
                mask = torch.ones(seq, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - seq)
        out = self.core(q, k, v, mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Attention then a feed-forward: dense (feed_forward), or mixture-of-experts (moe)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        moe = args.is_moe_layer(layer)
        self.feed_forward = None if moe else FeedForward(args)
        self.moe = MoE(args.dim, args.expert_hidden, args.moe_args) if moe else None

    def forward(self, x, cos, sin, mask=None, cache=None):
        # mask and cache by keyword: tensor parallelism lays out the positional inputs
        x = x + self.attention(self.attention_norm(x), cos, sin, mask=mask, cache=cache)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class Embedding(nn.Embedding):
    """nn.Embedding without an initialisation of its own: Transformer.init_weights (or a
    checkpoint) gives every weight its value. nn.Embedding's normal_ on the meta device,
    where the trainer and the verifier build the model, imports torch._dynamo: about a
    second of CPU in every such process, for values thrown away."""

    def reset_parameters(self) -> None:
        pass


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, seed: int = 0):
        super().__init__()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index: a pipeline stage that keeps layers 4..7 still names
        # them layers.4..layers.7, so checkpoints mean the same thing under every layout.
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Derived from args, so not part of the checkpoint.
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        # Built under torch.device("meta") (as the trainer builds it, to lay it out before
        # any memory is spent on it) there is nothing to fill yet: the layout fills what
        # each rank holds (training.parallelize.materialize).
        if not self.rope_cos.is_meta:
            self.init_weights(seed)

    def tie_weights(self) -> None:
        """With args.tie_embeddings, make the output layer use the embedding's parameter.

        Moving parameters to new storage (to_empty after building on the meta device, a
        tensor-parallel layout distributing each module's weights) gives each module a
        parameter of its own: whoever does that ties them again with this. A pipeline stage
        holding only one of the two has nothing to tie."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """The rotary tables, on `device` (default: where the buffers are)."""
        a = self.args
        cos, sin = rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)
        device = device if device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        self.init_buffers()
        self.reset_expert_buffers()
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape, seed, p.device))

    def reset_expert_buffers(self) -> None:
        """The MoE layers' routing bias and counters at their start values (zero); a
        checkpoint's bias replaces them when it is loaded."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()

    def initial_value(self, name: str, shape: torch.Size, seed: int,
                      device: torch.device) -> torch.Tensor:
        """The initial value of parameter `name` (as the whole model names it), full size.

        Drawn from a generator of its own, seeded by (seed, name): a parameter's value does
        not depend on which other parameters a module holds, so a pipeline stage and a
        tensor- or data-parallel shard start from exactly the whole model's weights.
        """
        if name.endswith(".bias"):
            return torch.zeros(shape, device=device)  # q/k/v biases start at nothing
        if len(shape) == 1:
            return torch.ones(shape, device=device)  # norm weights
        std = 0.02
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            # GPT-2's scaled init for projections that add into the residual stream.
            std /= math.sqrt(2 * self.args.n_layers)
        generator = torch.Generator(device).manual_seed(
            (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

    @classmethod
    def with_weights(cls, args: ModelArgs, state: dict[str, torch.Tensor]) -> "Transformer":
        """The model holding `state` (every weight, as a checkpoint or export has them),
        without first drawing initial values it would overwrite."""
        with torch.device("meta"):
            model = cls(args)
        if args.tie_embeddings:  # one matrix: a state that lists it twice holds it once here
            state = {k: v for k, v in state.items() if k != "output.weight"}
            model.output.weight = None  # so strict loading expects it once, as the embedding
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        model.init_buffers(model.output.weight.device)
        for module in model.modules():  # counters start at zero; the bias came with `state`
            if isinstance(module, MoE):
                module.tokens_per_expert = torch.zeros_like(module.expert_bias)
                module.balance_sum = torch.zeros(2, device=module.expert_bias.device)
        return model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                loss_chunk_tokens: int = 0, cache: KVCache | None = None):
        """tokens: (batch, seq) ids. Returns logits, or the mean cross-entropy with targets:
        with `loss_chunk_tokens`, from the output layer's weight that many tokens at a time,
        never holding the whole batch's logits (linear_cross_entropy).

        A pipeline stage is this model with the parts of other stages set to None: then the
        input may be hidden states and the output is hidden states.

        Packed sequences (evaluation scores several continuations of one context in one
        row): `positions` (batch, seq) is each token's position, `mask` (batch, 1, seq, seq)
        True where a token may attend. Default: positions 0, 1, ... and causal attention.

        Generation (`cache`): `tokens` are the positions after those the cache holds; their
        keys and values join it.
        """
        # Attention slices the rotary tables to its own sequence length: a pipeline stage
        # with sequence parallelism receives only this rank's part of the sequence.
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        if cache is not None:
            if positions is not None or mask is not None:
                raise ValueError("a generation's positions and mask follow from its cache")
            positions = torch.arange(cache.length, cache.length + tokens.shape[1],
                                     device=tokens.device).expand(tokens.shape[0], -1)
        if positions is not None:  # each row's own angles, broadcast over the heads
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        for name, layer in self.layers.items():
            x = layer(x, cos, sin, mask=mask, cache=None if cache is None else cache.layer(name))
        if cache is not None:
            cache.length += tokens.shape[1]
        if self.output is None:
            return x
        x = self.norm(x)
        if targets is not None and loss_chunk_tokens:
            return linear_cross_entropy(x, self.output.weight, targets, loss_chunk_tokens)
        logits = self.output(x)
        if targets is None:
            return logits
        return cross_entropy(logits, targets)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (a tied embedding counted once); non_embedding leaves out the embedding
        matrix."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.args.vocab_size * self.args.dim if non_embedding else n

    def inactive_params(self) -> int:
        """Expert parameters a token does not use: in each MoE layer, the routed experts
        beyond its top_k (whose weights it never multiplies)."""
        moe = self.args.moe_args
        if moe is None:
            return 0
        per_expert = 3 * self.args.dim * self.args.expert_hidden
        moe_layers = sum(self.args.is_moe_layer(int(name)) for name in self.layers)
        return moe_layers * (moe.num_experts - moe.top_k) * per_expert

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus attention scores (PaLM appendix B):
        6 x N + 12 x layers x heads x head_dim x seq_len. N leaves out only the input
        embedding table (a lookup); the output projection is a matmul and counts, also when it
        shares the embedding's matrix. Causal masking is not discounted, as in PaLM's MFU.
        For a mixture of experts N is the active parameters: those of the top_k experts a
        token goes to, not the others (inactive_params)."""
        a = self.args
        matmul_params = (self.num_params() + (a.vocab_size * a.dim if a.tie_embeddings else 0)
                         - self.inactive_params())
        return 6 * matmul_params + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 n_tokens: int | None = None) -> torch.Tensor:
        """`tokens` (batch, seq) followed by `max_new_tokens` more (stream)."""
        new = islice(self.stream(tokens, temperature, top_k, generator, n_tokens), max_new_tokens)
        return torch.cat([tokens, *new], dim=1)

    @torch.no_grad()
    def stream(self, tokens: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               generator: torch.Generator | None = None,
               n_tokens: int | None = None) -> Iterator[torch.Tensor]:
        """Continue `tokens` (batch, seq): yields each next token (batch, 1), for as long as
        the caller asks. Temperature 0 picks the likeliest; otherwise a sample among the
        `top_k` likeliest. Only ids below `n_tokens` (the tokenizer's size, when the
        vocabulary is padded) are ever chosen.

        Each step runs the new token alone against the kept keys and values (KVCache). Past
        max_seq_len the window slides: each step then runs the last max_seq_len tokens from
        position 0, as training saw sequences."""
        window = self.args.max_seq_len
        cache, new = KVCache(), tokens[:, -window:]
        while True:
            if cache.length + new.shape[1] > window:
                cache, new = KVCache(), tokens[:, -window:]
            logits = self(new, cache=cache)[:, -1, :n_tokens].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            tokens, new = torch.cat([tokens, next_id], dim=1), next_id
            yield next_id


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


IGNORE_INDEX = -100  # F.cross_entropy's: a target that counts for nothing


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The output projection and the mean cross-entropy, `chunk` tokens at a time.

    Per chunk: its logits (the matmul in the ambient autocast dtype, as nn.Linear would run
    it), their fp32 log-sum-exp and the loss, then at once the gradient of the loss with
    respect to those logits (softmax minus one-hot) and through the matmul to the hidden
    states and the weight. Only the two gradients are kept for backward, which scales them
    by the loss's own gradient: the logits of the whole batch, and their fp32 copy, are
    never alive at once. The same FLOPs as the unchunked path, every matmul in the same
    dtype (Liger-Kernel's fused linear cross-entropy does the same on GPUs). Without
    `gradients` (evaluation) only the loss is computed."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, gradients):
        wanted_hidden = gradients and ctx.needs_input_grad[0]
        wanted_weight = gradients and ctx.needs_input_grad[1]
        counted = (targets != IGNORE_INDEX).sum()
        # The mean's 1/count, applied to each chunk's logit gradient in fp32 before the cast,
        # as autograd orders it (no target counted: zero gradients, as F.cross_entropy's).
        per_target = 1 / counted.clamp(min=1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = grad_weight = None
        for start in range(0, hidden.size(0), chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logits = F.linear(h, weight)  # under autocast: bf16, as the output layer's
            compute_dtype = logits.dtype
            logits = logits.float()
            valid = t != IGNORE_INDEX
            # Ignored targets pick class 0 (and count for nothing); any other negative one
            # fails in gather, as in F.cross_entropy.
            picked = t.masked_fill(~valid, 0).unsqueeze(1)
            target_logits = logits.gather(1, picked).squeeze(1)
            # The log-sum-exp and the softmax in the logits' own memory (torch.logsumexp
            # would allocate two more chunks of fp32 logits).
            shift = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(shift).exp_()
            del logits
            sum_exp = probs.sum(dim=1)
            total += ((sum_exp.log() + shift.squeeze(1) - target_logits) * valid).sum()
            if not (wanted_hidden or wanted_weight):
                del probs  # before the next chunk's logits: one chunk alive at a time
                continue
            grad_logits = probs.div_(sum_exp.unsqueeze(1))  # softmax
            del probs
            grad_logits.scatter_add_(1, picked, -torch.ones_like(target_logits).unsqueeze(1))
            grad_logits.mul_(valid.unsqueeze(1) * per_target)
            grad_logits = grad_logits.to(compute_dtype)  # as autograd hands it to the matmul
            # Under autocast the two matmuls cast as the output layer's did (the weight's
            # bf16 copy is autocast's cached one).
            if wanted_hidden:
                if grad_hidden is None:
                    grad_hidden = torch.empty(hidden.shape, dtype=compute_dtype, device=hidden.device)
                grad_hidden[start:start + chunk] = grad_logits @ weight
            if wanted_weight:
                part = grad_logits.t() @ h
                if grad_weight is None:  # fp32 across chunks, rounded once at the end
                    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                grad_weight += part
                del part
            del grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / counted

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (None if grad_hidden is None else (grad_hidden * grad_loss).to(hidden_dtype),
                None if grad_weight is None else (grad_weight * grad_loss).to(weight_dtype),
                None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """cross_entropy(F.linear(hidden, weight), targets), `chunk_tokens` tokens at a time
    (_ChunkedLinearCrossEntropy): equal within float rounding, without the whole batch's
    logits. hidden (..., dim), targets (...). Under torch.no_grad only the loss."""
    gradients = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.size(-1)), weight,
                                            targets.reshape(-1), chunk_tokens, gradients)


def shape_differences(saved: dict, args: ModelArgs) -> list[str]:
    """How the model a checkpoint holds (its manifest's model_args) differs from `args` in
    what gives the weights their shapes and meaning; [] when it can be loaded. (norm_eps,
    rope_theta and max_seq_len may change on resume: e.g. a longer context.)"""
    def facts(a: ModelArgs) -> dict:
        return {"vocab_size (padded)": a.vocab_size, "dim": a.dim, "n_layers": a.n_layers,
                "n_heads": a.n_heads, "n_kv_heads": a.kv_heads, "SwiGLU width": a.ffn_hidden,
                "tie_embeddings": a.tie_embeddings, "head_dim": a.head_dim,
                "qk_norm": a.qk_norm, "qkv_bias": a.qkv_bias, **moe_facts(a)}

    before, now = facts(ModelArgs(**saved)), facts(args)
    return [f"{name} {before[name]} in the checkpoint, {now[name]} now"
            for name in now if before[name] != now[name]]
