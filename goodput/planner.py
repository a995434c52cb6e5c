"""The layout planner: will this model and batch fit this cluster, and how should it be cut?

    goodput plan --config configs/llama2-7b.yaml --nodes 4 --gpus-per-node 8 --gpu-memory 80GiB

`plan_layout` explains one layout (memory per GPU, pipeline bubble, communication, step
time, or why it cannot run, each problem with its fix: core.layout states the rules), and
`search` ranks every factorisation of the world size by estimated tokens/s; `explain_table`
(`goodput plan --explain`) shows the arithmetic behind each figure. The train flow and the
pipeline run `check_run` first (tasks/layout.py). The memory model (see "memory" below)
mirrors what training/parallelize.py does and is checked against measured steps in
tests/test_plan.py; the step-time model (see "the step-time model") reproduces published
runs there, each executed by its own framework: a `Recipe` says what that software did
that this trainer does not (GOODPUT, the default, is this trainer).
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

from core.config import ConfigError, RunConfig, parse_bytes  # noqa: F401 (parse_bytes: API)
from core.hf_llama import given_tokenizer_file
from core.layout import DEGREES, MESH_DIMS, LayoutError, ParallelDims, Problem, follow_world, pipeline_bubble  # noqa: F401 (API)
from training.model_args import LOSS_CHUNK_TOKENS, ModelArgs, model_args_from_config
from training.allocator import THRESHOLD_BYTES, THRESHOLD_ENV

# A layout's degrees in the order of its name (core.layout: ParallelDims.degrees, cp before tp).
LAYOUT_DEGREES = tuple(ParallelDims().degrees)
GiB = 1024**3
H100_FLOPS = 989e12  # dense bf16, H100 SXM
A100_FLOPS = 312e12  # dense bf16, A100 SXM
H100_HBM = 3.35e12  # bytes/s, H100 SXM 80GB (HBM3)
A100_HBM = 2.04e12  # bytes/s, A100 SXM 80GB (HBM2e)
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 weights and gradients

# -- the step-time model: each kind of work at the rate the GPU sustains for it -------------------
#
# A step's compute is timed per kind of work (a roofline per operation class), so that one set
# of constants holds for small and large models, eager and compiled, bf16 and float8:
#   - matmuls: their FLOPs at MATMUL_EFFICIENCY of the dense bf16 peak (float8 ones
#     FLOAT8_SPEEDUP times faster);
#   - attention (flash/cuDNN SDPA, causal: it computes half the 12·d·s FLOPs per token and
#     layer that MFU counts) at ATTENTION_EFFICIENCY of the peak;
#   - the memory-bound rest (norms, RoPE, SwiGLU's product, residual adds, dtype casts, the loss
#     over the vocabulary, AdamW's update) as the bytes it moves, at MEMORY_EFFICIENCY of the
#     HBM bandwidth. The bytes are counted from training/model.py's ops, eager or as
#     torch.compile (or a framework's hand-fused kernels) fuses them (_elementwise_bytes);
#   - communication at LINK_EFFICIENCY of the links' bandwidth; data-parallel collectives hidden
#     behind compute up to COMM_OVERLAP; TP's and PP's exposed unless the recipe overlaps them.
# The pipeline bubble and the busiest pipeline rank stretch the compute. The constants are set
# once for all the published runs in tests/test_plan.py (PUBLISHED; `python
# benchmarks/plan_vs_published.py` prints them against the planner): the values, within what
# these GPUs are known to sustain, that make the worst planned/published ratio the smallest
# (a grid search, 2026-11-27). The planner reproduces each within 20% (0.85-1.18):
# torchtitan's Llama 3.1 8B/70B/405B tables, Meta's Llama 3 405B (Table 4), MegaScale's 175B,
# llm.c's GPT-2 124M and this trainer's own H100 runs.
# A run of your own measures it better: goodput plan --from-run RUN_DIR.
MATMUL_EFFICIENCY = 0.66
ATTENTION_EFFICIENCY = 0.30
MEMORY_EFFICIENCY = 0.85
LINK_EFFICIENCY = 0.80
# float8 matmuls (torchao's, dynamic scaling): the peak is twice bf16's, but the GEMMs reach
# less of it. Their rate over bf16 matmuls':
FLOAT8_SPEEDUP = 1.25
# AsyncTP (torchtitan's: matmuls decomposed to overlap TP's collectives) hides this share of them.
ASYNC_TP_OVERLAP = 0.3
# COMM_OVERLAP: the share of data-parallel communication (FSDP's prefetched all-gathers and
# its reduce-scatters, DDP's bucketed all-reduce, all issued while backward computes) hidden
# behind compute. torchtitan's 8B on 128 GPUs (Table 3: FSDP across 16 nodes at 50 GB/s) ran
# 2.7% below its 8-GPU run though its FSDP traffic takes over 40% of its step at link speed.
COMM_OVERLAP = 0.93
# Cluster.compute_efficiency's default (--compute-efficiency, --from-run set another).
COMPUTE_EFFICIENCY = MATMUL_EFFICIENCY


@dataclass(frozen=True)
class Cluster:
    """What the layout runs on. Defaults: H100 SXM (dense bf16 peak, HBM3, NVLink) and one
    400 Gb/s InfiniBand NIC per GPU; with the efficiencies above they make the step-time
    estimate."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int | None  # bytes; None: unknown, memory is not checked
    gpu_flops: float | None = H100_FLOPS  # None: unknown, no step-time estimate
    intra_node_bandwidth: float = 450e9  # bytes/s per GPU, one direction
    inter_node_bandwidth: float = 50e9
    device: str = "cuda"  # "cpu" plans the fp32 layouts the test-suite measures
    # The share of gpu_flops matmuls sustain; attention and memory-bound work scale with it
    # (a measured run's efficiency, --from-run, slows or speeds all three alike).
    compute_efficiency: float = MATMUL_EFFICIENCY
    comm_overlap: float = COMM_OVERLAP  # share of data-parallel communication hidden
    efficiency_source: str = "default, set on published runs (tests/test_plan.py)"
    memory_bandwidth: float = H100_HBM  # bytes/s of one GPU's memory
    # CPU workers checked against this machine's own memory (run_cluster): the memory is the
    # processes', so what they hold beside the training tensors counts too (see "memory").
    host_processes: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Recipe:
    """How the software running a layout executes what the config does not say: this
    trainer's way by default (GOODPUT). Published runs used frameworks that do some things
    otherwise; to reproduce them (tests/test_plan.py) the planner models what they did."""

    name: str = "goodput"
    # What activation_checkpointing=selective recomputes: "blocks", every other block whole
    # (goodput); "ops", torchtitan's op-level policy (it keeps every other matmul's output and
    # the attention's, and recomputes the rest); "attention", Megatron-LM's (the core
    # attention only, nothing else).
    selective: str = "blocks"
    # Megatron-LM's sequence parallelism keeps what it saves in sequence shards (the
    # column-parallel matmuls' inputs are all-gathered again in backward): every saved
    # activation is divided by tp (Korthikanti et al. 2022). goodput (DTensor) saves those
    # inputs gathered; Megatron's kernels are fused (norms, RoPE, SwiGLU, loss).
    sharded_saves: bool = False
    fused_kernels: bool = False  # hand-fused elementwise kernels: as torch.compile's
    # The loss on each TP rank's vocabulary shard (torchtitan's loss_parallel, Megatron's).
    vocab_parallel_loss: bool = False
    # bf16 weights beside fp32 gradients, with the fp32 master weights and AdamW's moments
    # sharded over the data-parallel ranks (Megatron's distributed optimizer, Meta's FSDP):
    # 2 + 4 bytes per parameter whole, 12 sharded. goodput: 16, all sharded by FSDP.
    bf16_weights: bool = False
    float8: bool = False  # torchao float8 linear layers (the output layer stays bf16)
    tp_overlap: float = 0.0  # share of TP's collectives hidden behind matmuls (AsyncTP)
    pp_overlap: bool = False  # pipeline sends hidden behind compute (asynchronous p2p)
    parallel_blocks: bool = False  # attention and MLP read one norm (PaLM, MegaScale's PTB)
    # The loss compiled with the blocks when parallelism.compile is set (goodput); torchtitan
    # compiled the blocks only (its loss eager, fp32 log-probabilities and all).
    compiled_loss: bool = True
    # EP's all-to-alls hidden behind another micro-batch's compute (DeepSeek-V3's DualPipe);
    # goodput's sit between the computations that need them.
    ep_overlap: bool = False
    # Context parallelism across pipeline stages (Meta's Llama 3: the stages exchange the
    # parts of sequences CP splits); goodput's pipeline does not, and core.layout refuses cp
    # with pp.
    pipelined_context: bool = False


GOODPUT = Recipe()


# -- parameters ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockParams:
    """One transformer block's parameters, split the way the trainer lays them out
    (training/parallelize.py, training/expert_parallel.py).

    `matrix`: split by tensor parallelism (attention, a dense block's SwiGLU). `vector`: norm
    weights, replicated over TP. An MoE block's router and shared experts (`replicated`) are
    replicated over TP too: the MoE layer computes on each TP rank's part of the sequence.
    Its routed experts (`experts`, all of them) are split by expert parallelism, and sharded
    by FSDP over the ranks left (efsdp); each token multiplies `active_experts` of them (its
    top_k)."""

    matrix: int
    vector: int
    replicated: int = 0
    experts: int = 0
    active_experts: int = 0

    @property
    def total(self) -> int:
        return self.matrix + self.vector + self.replicated + self.experts

    @property
    def active_matmul(self) -> int:
        """The matmul parameters one token is multiplied by in this block."""
        return self.matrix + self.replicated + self.active_experts


@dataclass(frozen=True)
class ParamCount:
    """Parameters of training/model.py's Transformer, split the way layouts cut them.

    "matrix" parameters are split by tensor parallelism; "vector" ones (norm weights) are
    replicated across TP ranks. A mixture-of-experts model has two kinds of block: the first
    `first_moe_layer` dense, the rest MoE (`moe`, see BlockParams).
    """

    n_layers: int
    embedding: int  # vocab x dim (token embeddings, sharded over vocab by TP)
    block_matrix: int  # attention + SwiGLU projections of one dense block
    block_vector: int  # the two RMSNorm weights of one block (and Qwen3's q/k norms)
    head_matrix: int  # output projection, vocab x dim; 0 when it is the embedding (tied)
    head_vector: int  # final RMSNorm
    tied: bool = False  # the output projection multiplies by the embedding matrix
    moe: BlockParams | None = None  # an MoE block's; None: a dense model
    first_moe_layer: int = 0  # model.moe.first_dense_layers

    @property
    def dense(self) -> BlockParams:
        return BlockParams(self.block_matrix, self.block_vector)

    def block(self, layer: int) -> BlockParams:
        """The parameters of block `layer` (0-based)."""
        return self.moe if self.moe is not None and layer >= self.first_moe_layer else self.dense

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.first_moe_layer if self.moe is not None else 0

    @property
    def blocks(self) -> int:
        return sum(self.block(i).total for i in range(self.n_layers))

    @property
    def total(self) -> int:
        return self.embedding + self.blocks + self.head_matrix + self.head_vector

    @property
    def non_embedding(self) -> int:
        """As Transformer.num_params(): everything but the token embeddings."""
        return self.total - self.embedding

    @property
    def inactive(self) -> int:
        """Routed-expert parameters a token does not multiply (Transformer.inactive_params)."""
        if self.moe is None:
            return 0
        return self.moe_layers * (self.moe.experts - self.moe.active_experts)

    @property
    def active(self) -> int:
        """The parameters one token uses: all but the experts its router did not choose."""
        return self.total - self.inactive

    @property
    def matmul(self) -> int:
        """The parameters each token is multiplied by (6 FLOPs each in training): all but the
        embedding lookup and, in MoE blocks, the routed experts beyond the token's top_k; a
        tied output layer is a matmul by the embedding matrix and counts. The trainer's MFU
        counts the same (Transformer.flops_per_token)."""
        return self.non_embedding - self.inactive + (self.embedding if self.tied else 0)


def count_params(args: ModelArgs) -> ParamCount:
    dim, q_dim, kv_dim = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = 2 * dim * q_dim + 2 * dim * kv_dim  # wq, wo; wk, wv
    vector = (2 * dim + (2 * args.head_dim if args.qk_norm else 0)  # norms; Qwen3's q/k norms
              + (q_dim + 2 * kv_dim if args.qkv_bias else 0))  # Qwen2's q/k/v biases
    moe, first_moe = None, 0
    if args.moe is not None:
        m = args.moe_args
        expert = 3 * dim * args.expert_hidden  # one routed expert's w1, w3, w2
        moe = BlockParams(matrix=attention, vector=vector,
                          replicated=dim * m.num_experts + m.shared_experts * expert,  # router, shared
                          experts=m.num_experts * expert, active_experts=m.top_k * expert)
        first_moe = m.first_dense_layers
    return ParamCount(n_layers=args.n_layers, embedding=args.vocab_size * dim,
                      block_matrix=attention + 3 * dim * args.ffn_hidden, block_vector=vector,
                      head_matrix=0 if args.tie_embeddings else args.vocab_size * dim,
                      head_vector=dim, tied=args.tie_embeddings, moe=moe, first_moe_layer=first_moe)


def attention_width(args: ModelArgs) -> int:
    """Width of the queries and of the attention output: n_heads x head_dim (dim for Llama;
    Qwen3 sets a head_dim of its own)."""
    return args.n_heads * args.head_dim


def model_args(config: RunConfig) -> ModelArgs:
    """The model the config trains, with the tokenizer's vocabulary size (padded)."""
    return model_args_from_config(config.model, config.tokenizer.vocab_size)


# -- activations -----------------------------------------------------------------------------

def _norm_bytes(args: ModelArgs, tokens: int, tp: int, residual_bytes: int,
                fused_norm: bool = False) -> float:
    """training/model.py's RMSNorm is F.rms_norm, statistics in fp32. `fused_norm` (CUDA: its
    kernel, _fused_rms_norm) saves the input as it comes and the fp32 inverse RMS. Elsewhere
    (CPU) torch decomposes it (rms_norm_composite, counted with saved-tensor hooks): it saves
    the input in fp32 (the input itself when it is fp32, a copy when bf16), the fp32 inverse
    RMS and the fp32 normalised tensor that the weight multiplies (the result is cast back
    after the product, so nothing is saved in the residual stream's dtype). Sequence
    parallelism gives each TP rank a sequence shard."""
    per_token = residual_bytes * args.dim if fused_norm else 2 * 4 * args.dim
    return tokens * (per_token + 4) / tp


def _rope_table_bytes(args: ModelArgs, seq: int, residual_bytes: int) -> float:
    """What RoPE saves beside q and k (training/model.py's apply_rope: x * cos + x.roll(half)
    * signed_sin): the tables its products take, (seq, head_dim) each, whatever the batch or
    tp (each rank rotates its heads over the whole sequence). The roll itself saves nothing,
    and cos is the model's buffer (not an activation), but each call builds its signed sin
    table anew: two per block (q and k), fp32 as the buffers. Where FSDP casts the block's
    inputs to bf16 (mixed precision with a bf16 residual stream: cast_forward_inputs), cos
    and sin arrive as bf16 copies: then the products also keep the cos copy, and the signed
    tables are bf16."""
    if residual_bytes == 2:
        return 3 * 2 * seq * args.head_dim
    return 2 * 4 * seq * args.head_dim


def block_activation_bytes(args: ModelArgs, batch: int, seq: int, tp: int, act_bytes: int,
                           residual_bytes: int | None = None, compiled: bool = False,
                           fused_norm: bool = False) -> float:
    """Bytes one block saves for backward for one micro-batch (training/model.py's Block):
    matmul inputs and outputs in `act_bytes`, the residual stream the norms read and write in
    `residual_bytes` (default the same; fp32 under autocast, see residual_bytes()).

    Eager: two norms (_norm_bytes; `fused_norm`: CUDA's kernel), whose outputs the following
    matmuls save (whole under TP: all-gathered from the sequence shards); RoPE's sin and cos
    tables (_rope_table_bytes). SDPA saves q, k, v (k and v repeated to all heads under GQA),
    its output (also wo's input, a view) and an fp32 log-sum-exp per head. SwiGLU saves the w1
    and w3 outputs, silu(w1) and w2's input. TP splits attention by heads and SwiGLU by
    hidden units.

    `compiled` (parallelism.compile: each block one compiled graph, measured on CPU with
    saved-tensor hooks): AOTAutograd's partitioner keeps the matmuls' inputs and recomputes
    the pointwise ops between them. It keeps the two norms' outputs as the matmuls take them
    (whole under TP: all-gathered) with their fp32 inverse RMS, q, k and v, SDPA's output and
    log-sum-exp, and wo's input (a contiguous copy of the output), the w1 and w3 outputs and
    w2's input; not the norms' fp32 internals or silu(w1).
    """
    tokens = batch * seq
    residual_bytes = residual_bytes or act_bytes
    attention = (4 * act_bytes * tokens * attention_width(args) + 4 * tokens * args.n_heads) / tp
    if compiled:
        norms = 2 * act_bytes * tokens * args.dim + 2 * 4 * tokens / tp
        return (norms + attention + act_bytes * tokens * args.dim / tp
                + 3 * act_bytes * tokens * args.ffn_hidden / tp)
    # The norms' outputs as the matmuls save them: one tensor each, whole under TP. Autocast
    # casts an fp32 input once per matmul: wq, wk and wv save three bf16 copies, w1 and w3 two.
    autocast = act_bytes < residual_bytes
    matmul_inputs = (5 if autocast else 2) * act_bytes * tokens * args.dim
    swiglu = 4 * act_bytes * tokens * args.ffn_hidden / tp
    return (2 * _norm_bytes(args, tokens, tp, residual_bytes, fused_norm)
            + _rope_table_bytes(args, seq, residual_bytes) + matmul_inputs + attention + swiglu)


def sharded_block_activation_bytes(args: ModelArgs, tokens: int, tp: int, act_bytes: int,
                                   recompute_attention: bool = False) -> float:
    """Megatron-LM's block with sequence parallelism (Recipe.sharded_saves), fused kernels and
    flash attention: everything it saves is in TP shards (Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", 2022, with the attention-score term
    gone under flash attention), here for a Llama block: the two norms' inputs and the two
    column-parallel matmuls' inputs (d each), q, k and v (d + 2 kv), the attention output (d)
    with its fp32 log-sum-exp, the w1 and w3 outputs and w2's input (3 x ffn).
    `recompute_attention`: Megatron's selective recomputation re-runs the core attention in
    backward, so its output is not kept."""
    kv = args.kv_heads * args.head_dim
    kept = 5 * args.dim + 2 * kv + 3 * args.ffn_hidden + (0 if recompute_attention else args.dim)
    return tokens * (act_bytes * kept + (0 if recompute_attention else 4 * args.n_heads)) / tp


def op_checkpointed_block_bytes(args: ModelArgs, tokens: int, tp: int, act_bytes: int,
                                residual_bytes: int) -> float:
    """torchtitan's op-level selective checkpointing (Recipe.selective="ops"): a block keeps
    its input, the outputs of every other matmul (wq, wv, w1, w2 of its seven, in order) and
    SDPA's output with its log-sum-exp; the other matmuls and every elementwise op are
    recomputed in backward."""
    kv = args.kv_heads * args.head_dim
    kept = act_bytes * (3 * args.dim + kv + args.ffn_hidden) + 4 * args.n_heads
    return tokens * (residual_bytes * args.dim + kept) / tp


def head_activation_bytes(args: ModelArgs, batch: int, seq: int, tp: int, act_bytes: int,
                          residual_bytes: int | None = None, compiled: bool = False,
                          vocab_parallel: bool = False, fused_norm: bool = False,
                          chunk_tokens: int = 0) -> float:
    """Final norm, the output projection's input, and what the loss keeps: eagerly the fp32
    log-probabilities (training/model.py's cross_entropy casts the logits to fp32), compiled
    the logits as they come (the fused loss recomputes the softmax from them and its fp32
    log-sum-exp). The logits are all-gathered under TP (the loss works on the whole
    vocabulary) unless the loss is vocabulary-parallel.

    In chunks (parallelism.loss_chunk_tokens, training.model.linear_cross_entropy) the loss
    keeps its two gradients instead: the hidden states' in the matmul's dtype, the same size
    as the input a matmul keeps, and the output weight's in fp32, the whole matrix."""
    tokens = batch * seq
    if chunk_tokens:
        return (_norm_bytes(args, tokens, tp, residual_bytes or act_bytes, fused_norm)
                + act_bytes * tokens * args.dim + 4 * args.vocab_size * args.dim)
    vocab = args.vocab_size / (tp if vocab_parallel else 1)
    logits = (act_bytes * vocab + 4) if compiled else 4 * vocab
    return (_norm_bytes(args, tokens, tp, residual_bytes or act_bytes, fused_norm)
            + act_bytes * tokens * args.dim + tokens * logits)


def loss_workspace_bytes(args: ModelArgs, batch: int, seq: int, compiled: bool = False,
                         act_bytes: int = 4, tp: int = 1, chunk_tokens: int = 0,
                         residual_bytes: int | None = None, weight_bytes: int = 4) -> float:
    """Backward's start: eagerly the fp32 gradients of the log-probabilities and of the
    logits, alive at once; compiled, only the logits' gradient, in their dtype (the fused
    kernel computes softmax minus one-hot from the saved logits and log-sum-exp without an
    fp32 copy). `tp`: the vocabulary shard (vocabulary-parallel loss).

    In chunks (`chunk_tokens`): the larger of one chunk's work in forward (its logits, their
    fp32 copy, then the gradient cast back beside it; in fp32 the logits and the weight's
    partial gradient) and backward's scaled copies of the two kept gradients (cast to the
    weight's dtype where it is bf16: FSDP2's bf16 parameters)."""
    if chunk_tokens:
        chunk, vocab_by_dim = min(chunk_tokens, batch * seq), args.vocab_size * args.dim
        if act_bytes == 4:
            forward = 4 * chunk * args.vocab_size + 4 * vocab_by_dim
        else:
            forward = max((4 + act_bytes) * chunk * args.vocab_size,
                          act_bytes * (chunk * args.vocab_size + vocab_by_dim))
        residual = residual_bytes or act_bytes
        backward = (batch * seq * args.dim * (act_bytes + (residual if residual != act_bytes else 0))
                    + (4 + (weight_bytes if weight_bytes != 4 else 0)) * vocab_by_dim)
        return max(forward, backward)
    per_token = act_bytes if compiled else 2 * 4
    return per_token * batch * seq * args.vocab_size / tp


# -- layouts ---------------------------------------------------------------------------------

@dataclass
class Memory:
    """Bytes per GPU on the pipeline rank that needs the most."""

    weights: float
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    workspace: float  # backward
    step_workspace: float  # optimizer update
    grads_live_in_backward: bool  # gradient accumulation: gradients exist during backward
    # How the figures came (explain_table): this rank's parameters after TP and PP, the
    # data-parallel ranks its states are sharded over, its micro-batches in flight and what
    # its heaviest stage keeps for one of them.
    local_params: float = 0.0
    state_shard: int = 1
    inflight: int = 1
    stage_bytes: float = 0.0
    expert_params: float = 0.0  # of local_params, the routed experts (after EP)
    expert_shard: int = 1  # the ranks their states are sharded over (efsdp under EP)
    # CPU workers on this machine's memory (Cluster.host_processes); 0 elsewhere:
    process: float = 0.0  # the worker process itself: interpreter, torch, gloo, data loader
    staging: float = 0.0  # the async save's copy of this rank's share of the state
    allocator_kept: float = 0.0  # freed memory glibc keeps in the process (training/allocator.py)
    machine_share: float = 0.0  # this worker's share of the flow and verifier processes
    flow_process: float = 0.0  # of which the flow's and the verifier's, whole (explain_table)
    verifier_process: float = 0.0

    @property
    def peak(self) -> float:
        """The training tensors' peak (what a GPU's memory holds)."""
        backward = self.activations + self.workspace
        if self.grads_live_in_backward:
            backward += self.gradients
        update = self.gradients + self.step_workspace
        return self.weights + self.optimizer + self.buffers + max(backward, update)

    @property
    def host(self) -> float:
        """What a CPU worker's process holds beside the tensors."""
        return self.process + self.staging + self.allocator_kept

    @property
    def worker(self) -> float:
        """One worker process's resident peak: the tensors' and the rest it holds."""
        return self.peak + self.host

    @property
    def need(self) -> float:
        """What the device's memory must hold per worker: the tensors on a GPU; on this
        machine's memory, the worker's process and its share of the machine's processes."""
        return self.worker + self.machine_share


@dataclass
class LayoutPlan:
    degrees: dict[str, int]
    params: ParamCount
    microbatches: int  # pipeline micro-batches per step (1 without PP)
    memory: Memory | None = None
    bubble: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # bytes sent per GPU per step, by axis
    crosses_nodes: dict[str, bool] = field(default_factory=dict)
    step_time_s: float | None = None
    # training.micro_batch_size is per data-parallel rank: layouts differ in work per step.
    tokens_per_step: int = 0
    stage_layers: list[int] = field(default_factory=list)  # pipeline stages' layers, in order
    imbalance: float = 1.0  # the busiest pipeline rank's compute over the mean rank's
    output_blocks: float | None = None  # the output layer and loss's compute, in blocks (PP)
    # parallelism.pp_last_stage_less_layers that would even the pace better than the config's:
    # (weight, its split, its imbalance); None when the config's is as good.
    balancing: tuple[int, list[int], float] | None = None
    compute_s: float | None = None  # compute part of the step (bubble and imbalance included)
    exposed_comm_s: float | None = None  # communication not hidden behind compute
    mfu: float | None = None  # model FLOPs (no recomputation) / peak, over the estimated step
    work: "_Work | None" = None  # the busiest pipeline rank's compute, by kind (explain_table)
    comm_seconds: dict[str, float] = field(default_factory=dict)  # per axis, at link speed (not TP's)
    # parallelism.pp_virtual_stages with the shortest estimated step (interleaved-1f1b): (v, step s)
    best_virtual_stages: tuple[int, float] | None = None
    problems: list[Problem] = field(default_factory=list)  # why it cannot run
    warnings: list[Problem] = field(default_factory=list)  # runs, but costs (parallelism.strict_layout refuses)
    departures: list[str] = field(default_factory=list)  # where it leaves DESIGN's defaults
    ep: int = 1  # expert parallelism (parallelism.ep): ranks of dp_shard x tp, none of its own

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def name(self) -> str:
        """core.layout's name of the layout (ParallelDims.name, cp in its place), with "x ep=N"
        after it under expert parallelism, which adds no ranks."""
        ep = {"ep": self.ep} if self.ep > 1 else {}
        return " x ".join(f"{k}={v}" for k, v in {**self.degrees, **ep}.items())

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_time_s if self.step_time_s else None


@dataclass(frozen=True)
class _Setup:
    """What every layout of one config and cluster shares."""

    config: RunConfig
    cluster: Cluster
    args: ModelArgs
    params: ParamCount
    bf16: bool
    recipe: Recipe = GOODPUT

    @property
    def moe_args(self) -> ModelArgs | None:
        """An MoE block as the dense formulas see it: its SwiGLU as wide as the experts a
        token passes through (top_k routed + the shared ones), each token's rows computed on
        the rank that holds them. None for a dense model."""
        if self.args.moe is None:
            return None
        m = self.args.moe_args
        return replace(self.args, moe=None,
                       ffn_hidden_dim=(m.top_k + m.shared_experts) * self.args.expert_hidden)

    def seq_shard(self, dims: ParallelDims) -> int:
        """Tokens of one sequence on one rank (context parallelism splits it over dims.cp)."""
        return self.config.training.seq_len // dims.cp

    @property
    def fused(self) -> bool:
        """Elementwise work fused: torch.compile, or a framework's own kernels."""
        return self.config.parallelism.compile or self.recipe.fused_kernels

    @property
    def fused_loss(self) -> bool:
        return self.recipe.fused_kernels or (self.config.parallelism.compile
                                             and self.recipe.compiled_loss)

    @property
    def act_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def fused_norm(self) -> bool:
        """F.rms_norm runs torch's fused kernel: on CUDA (elsewhere it decomposes, _norm_bytes)."""
        return self.cluster.device == "cuda"

    def residual_bytes(self, dims: ParallelDims) -> int:
        """The residual stream (embedding output, norms, block outputs, what pipeline stages
        exchange): bf16 only where FSDP casts the parameters to bf16. Under autocast it stays
        fp32: the embedding is fp32 and adding bf16 matmul outputs to it keeps fp32.
        Recipes with bf16 weights keep it in bf16."""
        return 2 if self.bf16 and (dims.fsdp or self.recipe.bf16_weights) else 4


def _setup(config: RunConfig, cluster: Cluster, recipe: Recipe = GOODPUT) -> _Setup:
    args = model_args(config)
    mp = config.parallelism.mixed_precision
    bf16 = mp == "bf16" or (mp == "auto" and cluster.device == "cuda")
    return _Setup(config, cluster, args, count_params(args), bf16, recipe)


def _with_cp(config: RunConfig, degrees: dict[str, int]) -> dict[str, int]:
    """`degrees` in core.layout's order (ParallelDims.degrees), context parallelism's taken
    from parallelism.cp where `degrees` does not give it: cp is never filled by -1, so the
    search's factorisations of the GPUs left beside it leave it out."""
    given = {"cp": config.parallelism.cp, **degrees}
    return {d: given[d] for d in LAYOUT_DEGREES}


def _resolve(config: RunConfig, cluster: Cluster, degrees: dict[str, int]) -> ParallelDims:
    """The layout of `degrees` (_with_cp; and parallelism.ep) on the cluster: core.layout
    counts cp's ranks in the world like the others'. Raises LayoutError."""
    world = cluster.world_size
    return ParallelDims.resolve(_with_cp(config, degrees), world, f"the cluster's {world} GPUs",
                                ep=config.parallelism.ep, **config.parallelism.pipeline())


def plan_layout(config: RunConfig, cluster: Cluster, degrees: dict[str, int],
                strict: bool | None = None, recipe: Recipe = GOODPUT,
                suggest: bool = True) -> LayoutPlan:
    """Explain one layout (a -1 degree fills the cluster): memory, bubble, communication,
    step time, or why it cannot run. What the trainer runs at a cost (core.layout's advice,
    e.g. a large pipeline bubble) is a warning, or a problem when `strict` (default:
    parallelism.strict_layout). `recipe`: how the software executes it (GOODPUT: this
    trainer). `suggest`: with pipeline stages, also find the pp_virtual_stages with the
    shortest step (best_virtual_stages). `degrees` may give context parallelism's "cp"
    (default: parallelism.cp): its ranks are part of the cluster, each holding 1/cp of every
    sequence (Llama 3's all-gather of K/V; see _communication and _block_saved_bytes)."""
    s = _setup(config, cluster, recipe)
    par = config.parallelism
    strict = par.strict_layout if strict is None else strict
    try:
        dims = _resolve(config, cluster, degrees)
    except LayoutError as e:  # nothing to estimate
        return LayoutPlan(_with_cp(config, degrees), s.params, 1, problems=[e.problem])
    m = dims.microbatches_per_step
    plan = LayoutPlan(dims.degrees, s.params, m, ep=dims.ep)
    found = dims.problems(
        n_heads=s.args.n_heads, n_kv_heads=s.args.kv_heads, n_layers=s.args.n_layers,
        seq_len=config.training.seq_len, micro_batch_size=config.training.micro_batch_size,
        vocab_size=s.args.vocab_size, gpus_per_node=cluster.gpus_per_node,
        tied_embeddings=s.args.tie_embeddings,
        num_experts=s.args.moe_args.num_experts if s.args.moe is not None else None)
    if recipe.pipelined_context:
        found = [p for p in found if p not in _unbuilt_context_pipeline(s, dims)]
    plan.problems = [p for p in found if strict or not p.advice]
    plan.warnings = [p for p in found if p.advice and not strict]
    plan.bubble = dims.bubble
    if dims.stage_problem(s.args.n_layers) is not None or (dims.dp_shard * dims.tp) % dims.ep:
        return plan  # no stages, or experts split over ranks that are not there: nothing to estimate
    plan.stage_layers = dims.stage_layers(s.args.n_layers)
    if dims.pp > 1:
        block, head = _block_and_head_flops(s)
        plan.output_blocks = head / block
        plan.balancing = _balancing_weight(s, dims)
    plan.memory = _memory(s, dims, par.activation_checkpointing)
    plan.comm, plan.crosses_nodes = _communication(s, dims)
    tcfg = config.training
    plan.tokens_per_step = tcfg.micro_batch_size * tcfg.grad_accum_steps * tcfg.seq_len * dims.dp_size
    _estimate_step(s, dims, plan)
    plan.problems += _memory_problems(s, dims, plan.memory)
    plan.departures = _departures(plan, cluster)
    if suggest and dims.pp > 1 and plan.step_time_s is not None:
        plan.best_virtual_stages = _best_virtual_stages(config, cluster, dims.degrees, recipe)
    return plan


def _unbuilt_context_pipeline(s: _Setup, dims: ParallelDims) -> list[Problem]:
    """core.layout's refusal of cp with pp (this trainer's pipeline does not carry the parts
    of sequences CP splits), which a recipe that did so (Recipe.pipelined_context) waives:
    the context rules this layout breaks that it would not break without pipeline stages."""
    seq = s.config.training.seq_len
    experts = s.args.moe_args.num_experts if s.args.moe is not None else None
    flat = replace(dims, pp=1).context_problems(seq, experts)
    return [p for p in dims.context_problems(seq, experts) if p not in flat]


def _best_virtual_stages(config: RunConfig, cluster: Cluster, degrees: dict[str, int],
                         recipe: Recipe) -> tuple[int, float] | None:
    """The interleaved-1f1b stages per rank (parallelism.pp_virtual_stages) with the shortest
    estimated step among those that fit: more stages shrink the bubble, (pp-1)/(v m + pp-1),
    and send v times the activations between ranks (and keep more micro-batches in flight).
    None when no v fits or the layout has no step estimate."""
    par = config.parallelism
    pp = degrees["pp"]
    best = None
    for v in range(2, config.model.n_layers // pp + 1):
        interleaved = config.model_copy(update={"parallelism": par.model_copy(update={
            "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": v, "pp_layers_per_stage": None})})
        p = plan_layout(interleaved, cluster, degrees, strict=False, recipe=recipe, suggest=False)
        if p.ok and p.step_time_s is not None and (best is None or p.step_time_s < best[1]):
            best = (v, p.step_time_s)
    return best


def _departures(plan: LayoutPlan, cluster: Cluster) -> list[str]:
    """DESIGN's default rules a valid layout does not follow (TP within a node is a hard one):
    ZeRO-style sharding whenever there is data parallelism, pipeline stages across nodes."""
    d = plan.degrees
    notes = []
    if d["dp_replicate"] > 1 and d["dp_shard"] == 1:
        notes.append("optimizer state replicated, not sharded: set parallelism.dp_shard > 1 "
                     "to shard it")
    if d["pp"] > 1 and cluster.nodes > 1 and not _axis_crosses_nodes(d, "pp", cluster.gpus_per_node):
        notes.append("pipeline stages inside a node, where the planner's default puts PP "
                     "across nodes")
    return notes


def search(config: RunConfig, cluster: Cluster, strict: bool | None = None) -> list[LayoutPlan]:
    """Every factorisation of the world size: valid ones first -- those that follow DESIGN's
    default rules, highest estimated throughput (tokens/s) first, then the others -- and then
    the ones that cannot run. Throughput, not step time: the batch is per data-parallel rank,
    so a layout with less data parallelism has shorter steps only because it does less."""
    # Context parallelism's degree is the config's (set by the sequence length, not searched):
    # the other degrees factorise the GPUs left beside it.
    world = cluster.world_size // config.parallelism.cp
    plans = [plan_layout(config, cluster, d, strict, suggest=False) for d in factorisations(world)]
    valid = sorted((p for p in plans if p.ok),
                   key=lambda p: (bool(p.departures), -(p.tokens_per_s or 0.0), p.memory.need))
    # Of those that cannot run, the one explained when none can is the nearest: short of
    # memory alone (which its fix addresses) before any other problem, fewer problems first,
    # then the smallest peak it could reach with activation checkpointing and the loss in
    # chunks (its fix names what it takes). A layout with no estimate (a stage without a
    # layer, degrees that make no layout) comes last.
    def peak(p: LayoutPlan) -> float:
        return p.memory.need if p.memory is not None else math.inf

    eased: dict[str, float] = {}
    if not valid:
        saving = _with_loss_chunks(config, activation_checkpointing="full")
        for d in factorisations(world):
            easier = plan_layout(saving, cluster, d, strict, suggest=False)
            eased[easier.name] = peak(easier)

    def memory_only(p: LayoutPlan) -> bool:
        return len(p.problems) == 1 and peak(p) > (cluster.gpu_memory or math.inf)

    failing = sorted((p for p in plans if not p.ok), key=lambda p: (
        not memory_only(p), len(p.problems), eased[p.name] if p.name in eased else peak(p)))
    ranked = valid + failing
    if ranked[0].degrees["pp"] > 1 and ranked[0].step_time_s is not None:  # the one explained
        ranked[0].best_virtual_stages = _best_virtual_stages(config, cluster, ranked[0].degrees,
                                                             GOODPUT)
    return ranked


def plan(config: RunConfig, cluster: Cluster, force_search: bool = False,
         strict: bool | None = None) -> list[LayoutPlan]:
    """The config's own layout, or a ranked search when it leaves the degrees at defaults."""
    if force_search or layout_is_default(config):
        return search(config, cluster, strict)
    return [plan_layout(config, cluster, configured_degrees(config), strict)]


def check(config: RunConfig, cluster: Cluster) -> LayoutPlan:
    """The config's layout if it is valid on `cluster`; ConfigError with reasons and fixes."""
    result = plan_layout(config, cluster, configured_degrees(config))
    if not result.ok:
        raise ConfigError(f"layout {result.name} cannot run on {cluster.world_size} GPUs:\n"
                          + "\n".join(f"  - {p}" for p in result.problems))
    return result


# -- a measured run's efficiency --------------------------------------------------------------

def measured_mfu(run_dir: str | Path) -> tuple[float, int]:
    """The MFU a run measured: the median of its metrics.jsonl records' `mfu` (the first
    record left out when there are others: its window holds warm-up and compilation), and how
    many records it comes from. ConfigError when the run logged none."""
    from core.protocol import RunDir
    from training.metrics import read_metrics

    run = RunDir.of(run_dir)
    if not run.metrics_file.is_file():
        raise ConfigError(f"--from-run {run_dir}: no {run.metrics_file.name} there; give the "
                          "directory of a run that trained (runs_dir/run_id)")
    values = [r["mfu"] for r in read_metrics(run) if r.get("mfu")]
    if not values:
        raise ConfigError(f"--from-run {run_dir}: {run.metrics_file} records no MFU: a run on CPU "
                          "logs none (no peak FLOP/s to divide by) unless training."
                          "peak_flops_per_device is set; plan from a GPU run's directory, or "
                          "give --compute-efficiency")
    values = values[1:] if len(values) > 1 else values
    values.sort()
    middle = len(values) // 2
    median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    return median, len(values)


def efficiency_from_run(run_dir: str | Path, cluster: Cluster) -> Cluster:
    """`cluster` with the compute efficiency a run measured: the efficiency at which the
    planner's estimate of that run's own config and layout (on its own nodes, with this
    cluster's links and overlap) gives the MFU it logged. The efficiency, not the MFU, carries
    over: it leaves out the run's bubble, recomputation and exposed communication, which the
    estimate of another layout has its own of."""
    from core.config import load_config
    from core.protocol import RunDir

    mfu, n = measured_mfu(run_dir)
    run_config = with_run_vocab(load_config(str(RunDir.of(run_dir).config_file)))
    par = run_config.parallelism
    own = replace(cluster, nodes=par.nnodes, gpus_per_node=par.nproc_per_node, gpu_memory=None,
                  gpu_flops=cluster.gpu_flops or H100_FLOPS)

    def estimated_mfu(efficiency: float) -> float:
        return plan_layout(run_config, replace(own, compute_efficiency=efficiency),
                           configured_degrees(run_config), strict=False).mfu

    if estimated_mfu(1.0) is None:
        raise ConfigError(f"--from-run {run_dir}: its layout cannot be estimated: "
                          + failure_message(plan_layout(run_config, own, configured_degrees(run_config)),
                                            own, "not checked"))
    # The estimated MFU grows with the efficiency: bisect for the measured one.
    low, high = 1e-4, 1.0
    if estimated_mfu(high) <= mfu:
        low = high  # the run beat the estimate even at peak: its links are faster than assumed
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if estimated_mfu(middle) < mfu else (low, middle)
    return replace(cluster, compute_efficiency=low,
                   efficiency_source=f"measured: run {Path(run_dir).name} logged MFU {mfu:.1%} "
                                     f"(median of {n} metrics records)")


# -- the run's own hardware -----------------------------------------------------------------

def run_cluster(config: RunConfig) -> tuple[Cluster, str]:
    """The cluster a run launches on: parallelism.nnodes nodes of nproc_per_node workers, each
    device with parallelism.device_memory or, for a local launch, this machine's (the GPU's
    memory; on CPU, the host memory shared by the workers, which also caps a
    device_memory stated for GPUs). Returns the cluster and where its memory figure comes
    from (or why memory cannot be checked)."""
    par = config.parallelism
    device = _run_device(config)
    if par.device_memory is not None:
        memory, source = parse_bytes(par.device_memory), f"parallelism.device_memory={par.device_memory}"
        if device == "cpu" and config.launch.kind == "local":
            # A GPU's figure (configs/llama3.2-1b.yaml's 80GiB) for workers that run on this
            # CPU: they share this machine's memory, and past it the kernel's OOM killer picks.
            here, where = local_device_memory(device, par.world_size)
            if here < memory:
                memory, source = here, (f"{where}; parallelism.device_memory="
                                        f"{par.device_memory} is more than a CPU worker has here")
    elif config.launch.kind == "local":
        memory, source = local_device_memory(device, par.world_size)
    else:
        memory, source = None, (f"not checked: launch.kind={config.launch.kind} runs on other "
                                "machines; set parallelism.device_memory (e.g. 80GiB) to check it")
    # On CPU there is no peak to assume, so no step-time estimate unless the config gives one.
    flops = config.training.peak_flops_per_device or (H100_FLOPS if device == "cuda" else None)
    # Checked against this machine's memory (not a figure the config states per worker), CPU
    # workers share it with everything else their processes and the flow's hold.
    host = device == "cpu" and config.launch.kind == "local" and source.startswith("this machine's")
    return Cluster(par.nnodes, par.nproc_per_node, memory, gpu_flops=flops, device=device,
                   host_processes=host), source


def _run_device(config: RunConfig) -> str:
    """As the trainer decides it (training.train.init_distributed); remote nodes with 'auto'
    are taken to have GPUs unless a Slurm or Kubernetes launch requests none."""
    par, launch = config.parallelism, config.launch
    if par.device != "auto":
        return par.device
    if launch.kind == "local":
        if not torch_build_has_gpu_support():
            return "cpu"  # what torch.cuda.is_available() answers there, without importing torch
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    requested = {"slurm": launch.slurm.gpus_per_node, "kubernetes": launch.kubernetes.gpus_per_node}
    return "cuda" if requested.get(launch.kind, 1) else "cpu"


def torch_build_has_gpu_support() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its version.py
    without importing it (about 1 s of a core, which a flow's process spares itself on a
    CPU build). When that cannot be told: True, and the caller asks torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    return gpu_build_in(Path(next(iter(spec.submodule_search_locations))) / "version.py")


def gpu_build_in(version_py: Path) -> bool:
    """torch's version.py names a CUDA or a ROCm build (`cuda`, `hip` or `rocm` not None);
    True when the file does not say (unreadable, `cuda` or `hip` missing)."""
    import ast

    builds = {}
    try:
        for node in ast.parse(version_py.read_text()).body:
            target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                      else node.target if isinstance(node, ast.AnnAssign) else None)
            if isinstance(target, ast.Name) and target.id in ("cuda", "hip", "rocm") and node.value:
                builds[target.id] = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        return True
    return not {"cuda", "hip"} <= set(builds) or any(builds.values())


def local_device_memory(device: str, workers: int) -> tuple[int, str]:
    """Memory of one device here: the first GPU's (nvidia-smi, which leaves this process
    without a CUDA context, else torch); on CPU the host memory (or the cgroup limit, when
    lower) over the `workers` that share it."""
    if device == "cuda":
        try:
            first = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                    "--format=csv,noheader,nounits"], capture_output=True,
                                   text=True, timeout=30, check=True).stdout.splitlines()[0]
            name, mib = (part.strip() for part in first.rsplit(",", 1))
            return int(mib) * 2**20, f"this machine's {name} (nvidia-smi)"
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            import torch

            props = torch.cuda.get_device_properties(0)
            return props.total_memory, f"this machine's {props.name}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total // workers, f"this machine's memory ({_gib(total)} GiB) shared by {workers} workers"


def run_vocab_size(config: RunConfig) -> int:
    """The vocabulary the run's model gets: an existing tokenizer.path's own size (a
    tokenizer.json, or the one in a directory such as model.init_from's), else
    tokenizer.vocab_size (what a trained tokenizer has, exactly: training.tokenizer)."""
    if config.tokenizer.path is not None:
        try:
            from tokenizers import Tokenizer

            path = given_tokenizer_file(config.tokenizer.path)
            return Tokenizer.from_file(str(path)).get_vocab_size()
        except Exception:  # the prepare stage reports a missing or broken tokenizer file
            pass
    return config.tokenizer.vocab_size


def check_run(config: RunConfig) -> tuple[LayoutPlan, Cluster, str]:
    """The config's layout planned on the hardware it launches on (run_cluster), with the
    model's real vocabulary. Returns the plan (check `.ok`), the cluster and the memory source."""
    cluster, source = run_cluster(config)
    config = with_run_vocab(config)
    return plan_layout(config, cluster, configured_degrees(config)), cluster, source


def with_run_vocab(config: RunConfig) -> RunConfig:
    """The config with the vocabulary its model will really have (run_vocab_size)."""
    vocab = run_vocab_size(config)
    if vocab == config.tokenizer.vocab_size:
        return config
    # No re-validation: only the planner reads it.
    return config.model_copy(update={"tokenizer": config.tokenizer.model_copy(
        update={"vocab_size": vocab})})


def failure_message(p: LayoutPlan, cluster: Cluster, source: str) -> str:
    """A ConfigError's text: what cannot work and the change that fixes each problem."""
    return (f"layout {p.name} cannot run on {cluster.nodes} node(s) x {cluster.gpus_per_node} "
            f"{_device_noun(cluster)}s (device memory: {source}):\n"
            + "\n".join(f"  - {problem}" for problem in p.problems))


def layout_is_default(config: RunConfig) -> bool:
    defaults = type(config.parallelism)()
    return all(getattr(config.parallelism, d) == getattr(defaults, d) for d in DEGREES)


def configured_degrees(config: RunConfig) -> dict[str, int]:
    """The config's degrees as written (plan_layout resolves a -1 on the cluster)."""
    return {d: getattr(config.parallelism, d) for d in DEGREES}


def factorisations(world: int) -> list[dict[str, int]]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [dict(zip(DEGREES, combo)) for combo in itertools.product(divisors, repeat=4)
            if math.prod(combo) == world]


# -- memory ------------------------------------------------------------------------------------
#
# Byte accounting, per GPU (worst pipeline rank), AdamW:
# - weights     fp32 master copy, 4 bytes/param, sharded over dp_shard by FSDP.
# - gradients   fp32, 4 bytes/param, sharded like the weights.
# - optimizer   AdamW exp_avg + exp_avg_sq in fp32, 8 bytes/param, sharded like the weights.
#   Together 16 bytes/param: bf16-on-GPU mixed precision keeps fp32 master weights, gradients
#   reduced in fp32 and fp32 Adam moments (FSDP2 MixedPrecisionPolicy(bf16, reduce fp32)), and
#   plain fp32 on CPU is 4 + 4 + 8 as well. 7B parameters: 112 GB unsharded, 14 GB over 8 shards.
# - buffers     what data parallelism adds: DDP's gradient buckets (one more fp32 gradient
#   copy); FSDP's all-gathered weights in compute precision (the root module, kept after
#   forward, plus two blocks in flight, or every block without reshard_after_forward or under
#   a pipeline schedule, which keeps them gathered after backward until its step ends) and its
#   unsharded gradients (one block in flight, or all of them, in fp32, while micro-batches
#   accumulate without syncing); bf16 weight copies that autocast saves for backward outside FSDP.
# - activations what autograd saves for backward, counted tensor by tensor for
#   training/model.py (per block: norms, q/k/v/attention output and log-sum-exp, SwiGLU's
#   four hidden-size tensors; the head's fp32 log-probabilities), times the micro-batches a
#   pipeline schedule keeps in flight. Compiled (parallelism.compile) a block keeps its
#   matmuls' inputs and outputs but not the pointwise ops' (the norms' fp32 internals,
#   silu), and the compiled loss the logits, not fp32 log-probabilities
#   (block_activation_bytes, head_activation_bytes). Checkpointed blocks keep only their
#   input. Other frameworks' recipes keep otherwise: Megatron-LM's sequence-parallel shards
#   (sharded_block_activation_bytes), torchtitan's op-level selection
#   (op_checkpointed_block_bytes), Megatron's bf16 weights with a sharded fp32 optimizer. In bf16
#   the residual stream (norms, block inputs, what pipeline stages and sequence parallelism
#   exchange) is bf16 only under FSDP2, which casts the parameters; under autocast it stays
#   fp32, and autocast saves a bf16 copy of a matmul's input for each matmul. Tensor
#   parallelism (with sequence parallelism for norms) divides everything but the all-gathered
#   inputs of the column-parallel matmuls and the replicated logits.
# - workspace   in backward, the larger of the loss gradient (fp32 gradients of the
#   log-probabilities and the logits, at its start; compiled, the logits' gradient in their
#   dtype) and one block recomputed under activation
#   checkpointing (later, once the loss is done); in the optimizer step, the temporaries of
#   AdamW's per-tensor update on CPU (sqrt and division of the largest tensor) -- the fused
#   CUDA update needs none.
#
# Peak = weights + optimizer + buffers + the larger of the backward phase (activations +
# backward workspace, plus gradients when they live across micro-batches: gradient
# accumulation, pipeline micro-batches) and the update (gradients + step workspace).
#
# On this machine's memory (CPU workers of a local launch, checked against the host memory
# they share: Cluster.host_processes) the device memory is the processes', and each worker
# needs, beside that peak (measured 2026-11-29 on a 110M model, FSDP over 2 workers, async
# saves: the tensors' estimate 1.25 GiB, each worker's resident peak 3.61-3.70 GiB):
# - process      the worker itself: interpreter, torch, gloo, the data loader
#   (WORKER_PROCESS_BYTES: a trainer of a 64-dim model peaked at 0.39-0.40 GiB here, and
#   0.49 GiB on a CI machine, 2026-12-03, read through getrusage, which may carry the
#   launcher's peak (training.metrics.peak_resident_bytes); the constant sits between them).
# - staging      an async save's (checkpoint.async_mode thread or process) copy of what this
#   rank writes: its weights and optimizer state, split among ranks holding the same.
# - allocator's kept memory  training/allocator.py fixes glibc's trim threshold at
#   THRESHOLD_BYTES, so up to that much freed memory stays in the process between steps (no
#   more than it allocated: the tensors' peak and the staging copy); none where launch.env
#   sets the thresholds.
# - flow and verifier processes, once per machine, shared by its workers: the flow's
#   (FLOW_PROCESS_BYTES) and the checkpoint verifier's (VERIFIER_PROCESS_BYTES, plus the
#   largest group of tensors it reads at once, training.checkpoint.verify.DEFAULT_MAX_BYTES,
#   or the largest tensor; plus the model's fp32 weights when checkpoint.validate_batches
#   computes a held-out loss).
# A worker's resident peak = peak + process + staging + allocator's kept memory; what the
# check needs per worker adds its share of the flow and verifier processes.
WORKER_PROCESS_BYTES = 450 * 2**20
FLOW_PROCESS_BYTES = 300 * 2**20  # its imports alone: 0.15 GiB (no torch on a CPU build)
VERIFIER_PROCESS_BYTES = 300 * 2**20  # torch and the checkpoint modules: 0.28 GiB
VERIFY_GROUP_BYTES = 256 * 2**20  # training.checkpoint.verify.DEFAULT_MAX_BYTES (imports torch)


@dataclass(frozen=True)
class _Rank:
    """One pipeline rank's share of the model: its stages' layer counts and ends."""

    layers: tuple[int, ...]
    first: bool  # holds the embeddings
    last: bool  # holds the final norm, output projection and loss
    inflight: int  # stage-forwards whose activations are alive at once
    # Each stage's blocks in order, True where the block is a mixture-of-experts one.
    kinds: tuple[tuple[bool, ...], ...] = ()

    @property
    def moe_blocks(self) -> int:
        return sum(sum(stage) for stage in self.kinds)

    @property
    def dense_blocks(self) -> int:
        return sum(self.layers) - self.moe_blocks


def _pipeline_ranks(n_layers: int, dims: ParallelDims, first_moe_layer: int | None = None) -> list[_Rank]:
    """Layers per stage as training/parallelize.py splits them (ParallelDims.stage_layers;
    rank r holds stages r, r+pp, ...) and the in-flight micro-batches of each rank under
    torch.distributed.pipelining's schedules. `first_moe_layer`: blocks from there on are
    mixture-of-experts ones (None: a dense model)."""
    sizes, pp, m, v = dims.stage_layers(n_layers), dims.pp, dims.microbatches_per_step, dims.stages_per_rank
    bounds = dims.stage_bounds(n_layers)
    moe = n_layers if first_moe_layer is None else first_moe_layer
    kinds = [tuple(i >= moe for i in range(bounds[st], bounds[st + 1])) for st in range(len(sizes))]
    ranks = []
    for r in range(pp):
        if pp == 1:
            inflight = 1
        elif dims.pp_schedule == "gpipe":
            inflight = m
        elif dims.pp_schedule == "1f1b":
            inflight = min(m, pp - r)
        else:  # interleaved 1F1B: warm-up forwards plus the first steady one (schedules.py)
            rounds = max(1, m // pp)
            inflight = min((v - 1) * (m // rounds) + 2 * (pp - 1 - r) + 1, m * v)
        ranks.append(_Rank(tuple(sizes[st] for st in dims.stages_of(r)), r == 0, r == pp - 1,
                           inflight, tuple(kinds[st] for st in dims.stages_of(r))))
    return ranks


def _ranks(s: _Setup, dims: ParallelDims) -> list[_Rank]:
    return _pipeline_ranks(s.args.n_layers, dims,
                           s.params.first_moe_layer if s.params.moe is not None else None)


def _memory(s: _Setup, dims: ParallelDims, checkpointing: str) -> Memory:
    per_rank = [_rank_memory(s, dims, checkpointing, r) for r in _ranks(s, dims)]
    if s.cluster.host_processes:
        per_rank = [_with_host_memory(s, dims, mem) for mem in per_rank]
    return max(per_rank, key=lambda mem: mem.need)


def _with_host_memory(s: _Setup, dims: ParallelDims, mem: Memory) -> Memory:
    """`mem` with what a CPU worker on this machine holds beside the tensors, and its share of
    the machine's other processes (see "memory": on this machine's memory)."""
    config = s.config
    # Ranks holding the same tensors split what they stage (training/checkpoint/replicas.py).
    replicas = dims.dp_replicate * (1 if dims.fsdp else dims.cp)
    staging = ((mem.weights + mem.optimizer) / replicas
               if config.checkpoint.async_mode != "sync" else 0.0)
    kept = (0.0 if any(name in config.launch.env for name in THRESHOLD_ENV)
            else min(THRESHOLD_BYTES, mem.peak + staging))
    params = s.params.total
    largest = max(s.params.embedding, s.params.head_matrix, s.args.dim * s.args.ffn_hidden,
                  s.params.moe.experts / 3 if s.params.moe is not None else 0)
    verifier = VERIFIER_PROCESS_BYTES + max(VERIFY_GROUP_BYTES, MASTER_BYTES * largest)
    if config.checkpoint.validate_batches:  # the held-out loss: the model's weights, whole
        verifier += MASTER_BYTES * params
    workers = s.cluster.gpus_per_node
    return replace(mem, process=WORKER_PROCESS_BYTES, staging=staging, allocator_kept=kept,
                   machine_share=(FLOW_PROCESS_BYTES + verifier) / workers,
                   flow_process=FLOW_PROCESS_BYTES, verifier_process=verifier)


@dataclass(frozen=True)
class _Local:
    """A pipeline rank's parameters, after TP splits the matrices and EP the experts."""

    root: float  # embeddings, final norm and output where it holds them
    blocks: float  # its blocks' parameters but the routed experts
    experts: float  # the routed experts it holds: num_experts / ep of each of its MoE layers
    unit: float  # the largest of its blocks (FSDP gathers a block at a time), experts included
    matrices: float  # its blocks' matmul weights (autocast keeps bf16 copies of them)

    @property
    def total(self) -> float:
        return self.root + self.blocks + self.experts


def _local_params(s: _Setup, rank: _Rank, dims: ParallelDims) -> _Local:
    """What one rank holds (training/parallelize.py): attention (and a dense SwiGLU) split
    by TP; an MoE block's router and shared experts replicated over TP (the layer computes on
    each TP rank's part of the sequence); its routed experts split by EP, or whole on every
    TP rank without EP."""
    pc, tp, ep = s.params, dims.tp, dims.ep
    root = (pc.embedding / tp if rank.first else 0) + \
        (pc.head_matrix / tp + pc.head_vector if rank.last else 0)
    dense = pc.block_matrix / tp + pc.block_vector
    blocks, experts, unit = rank.dense_blocks * dense, 0.0, dense if rank.dense_blocks else 0.0
    matrices = rank.dense_blocks * pc.block_matrix / tp
    if rank.moe_blocks:
        moe = pc.moe
        shared = moe.matrix / tp + moe.vector + moe.replicated
        blocks += rank.moe_blocks * shared
        experts = rank.moe_blocks * moe.experts / ep
        unit = max(unit, shared + moe.experts / ep)
        matrices += rank.moe_blocks * (moe.matrix / tp + moe.replicated + moe.experts / ep)
    return _Local(root, blocks, experts, unit, matrices)


def _state_shards(s: _Setup, dims: ParallelDims) -> tuple[int, int]:
    """The ranks over which the optimizer state (and, under FSDP, weights and gradients) is
    sharded: (every weight but the routed experts, the routed experts). FSDP shards over
    dp_shard, and over the context-parallel ranks with it (they hold the same weights, as
    torchtitan's dp_shard_cp); experts under EP over efsdp = dp_shard x tp / ep, the ranks
    holding the same experts (training.parallelize._expert_fsdp). With bf16 weights (the
    distributed optimizer) the optimizer over every data-parallel rank holding the same
    weights."""
    cp = dims.cp
    if s.recipe.bf16_weights and s.bf16:
        dense = dims.dp_size * cp
        return dense, (dims.dp_size * dims.tp // dims.ep * cp if dims.ep > 1 else dense)
    if not dims.fsdp:
        return 1, 1
    dense = dims.dp_shard * cp
    return dense, (dims.dp_shard * dims.tp // dims.ep * cp if dims.ep > 1 else dense)


def _rank_memory(s: _Setup, dims: ParallelDims, checkpointing: str, rank: _Rank) -> Memory:
    pc, args, par, tcfg, recipe = s.params, s.args, s.config.parallelism, s.config.training, s.recipe
    tp, m = dims.tp, dims.microbatches_per_step
    fsdp, ddp = dims.fsdp, dims.ddp

    loc = _local_params(s, rank, dims)
    local = loc.total  # this rank's parameters after TP and EP
    shard, expert_shard = _state_shards(s, dims)
    sharded = (loc.root + loc.blocks) / shard + loc.experts / expert_shard
    n_micro = tcfg.grad_accum_steps * m

    compute_bytes = 2 if s.bf16 else 4
    buffers = 0.0
    if recipe.bf16_weights and s.bf16:
        # Megatron's distributed optimizer (Meta's FSDP keeps the same: weights not resharded
        # after forward, gradients accumulated in fp32): bf16 weights and fp32 gradients
        # whole on every data-parallel rank, fp32 master weights and moments sharded over them.
        weights, gradients = 2 * local, MASTER_BYTES * local
        optimizer = (MASTER_BYTES + ADAM_STATE_BYTES) * sharded
    else:
        weights = gradients = MASTER_BYTES * sharded
        optimizer = ADAM_STATE_BYTES * sharded
        if fsdp:
            # A pipeline schedule keeps its stage's blocks gathered after backward until the
            # end of its step (PipelineStage turns reshard_after_backward off), so all of them
            # are gathered at once by the last backward.
            gathered = (2 * loc.unit if par.reshard_after_forward and dims.pp == 1
                        else loc.blocks + loc.experts)
            buffers += compute_bytes * (loc.root + gathered)
            # Without gradient sync (accumulating micro-batches) FSDP2 keeps unsharded
            # gradients, accumulated in the reduce dtype (fp32) even when it computes in bf16.
            buffers += MASTER_BYTES * local if n_micro > 1 else 4 * loc.unit
        else:
            if ddp:
                buffers += MASTER_BYTES * local  # reducer buckets: a second gradient copy
            if s.bf16:  # bf16 copies of the matmul weights that autocast saves for backward
                head = pc.embedding if pc.tied else pc.head_matrix  # the output matmul's weight
                buffers += 2 * (loc.matrices + (head / tp if rank.last else 0))

    mb = tcfg.micro_batch_size // m
    seq = s.seq_shard(dims)
    residual = s.residual_bytes(dims)
    stage_bytes = max(_stage_activations(s, mb, dims, kinds, checkpointing, residual)
                      for kinds in rank.kinds)
    activations = rank.inflight * stage_bytes
    vocab_parallel = recipe.vocab_parallel_loss or recipe.sharded_saves
    chunk = 0 if dims.splits_output_layer else par.loss_chunk_tokens
    if rank.last:
        # The last stage's loss runs backward as soon as its forward is done (1F1B and
        # interleaved): one micro-batch's head at a time; GPipe keeps all of them.
        head_inflight = rank.inflight if dims.pp_schedule == "gpipe" else 1
        activations += head_inflight * head_activation_bytes(
            args, mb, seq, tp, s.act_bytes, residual, compiled=s.fused_loss,
            vocab_parallel=vocab_parallel, fused_norm=s.fused_norm, chunk_tokens=chunk)
    loss = (loss_workspace_bytes(args, mb, seq, s.fused_loss, s.act_bytes,
                                 tp if vocab_parallel else 1, chunk, residual,
                                 weight_bytes=compute_bytes if fsdp else MASTER_BYTES)
            if rank.last else 0.0)
    recompute = (max(_block_saved_bytes(s, mb, dims, residual, "none", moe)
                     for moe in {kind for stage in rank.kinds for kind in stage})
                 if checkpointing != "none" else 0.0)
    largest = max(pc.embedding / tp if rank.first else 0, pc.head_matrix / tp if rank.last else 0,
                  args.dim * args.ffn_hidden / tp,  # w1/w2/w3 are the largest block matrices,
                  pc.moe.experts / 3 / dims.ep if rank.moe_blocks else 0)  # or the stacked experts'
    step_workspace = 2 * MASTER_BYTES * largest / shard if s.cluster.device == "cpu" else 0.0
    return Memory(weights=weights, gradients=gradients, optimizer=optimizer, buffers=buffers,
                  activations=activations, workspace=max(loss, recompute),
                  step_workspace=step_workspace,
                  grads_live_in_backward=n_micro > 1 or recipe.bf16_weights,
                  local_params=local, state_shard=shard, inflight=rank.inflight,
                  stage_bytes=stage_bytes, expert_params=loc.experts, expert_shard=expert_shard)


def _moe_saved_bytes(s: _Setup, dims: ParallelDims, tokens: int) -> float:
    """What an MoE layer keeps beyond a SwiGLU as wide as a token's experts (training/moe.py,
    counted with saved-tensor hooks): the router's fp32 logits and scores (num_experts each),
    three sets of top_k rows of dim values (the rows the experts take, as gathered for them
    or, under EP, as received and regrouped by expert; the experts' output rows that the
    routing weights scale; the scaled rows the combine adds), and per (token, choice) the
    int64 expert ids, sort order and token index and the fp32 weight. On this TP rank's part
    of the tokens."""
    m = s.args.moe_args
    per_choice = 3 * s.act_bytes * s.args.dim + 3 * 8 + 4
    return tokens * (m.top_k * per_choice + 2 * 4 * m.num_experts) / dims.tp


def _gathered_kv_bytes(s: _Setup, dims: ParallelDims, tokens: int, mode: str) -> float:
    """Context parallelism: what attention keeps of the keys and values (all-gathered from
    the cp ranks, Llama 3's CP) beyond the K and V of this rank's `tokens` that the block
    formulas count, as one process keeps them. Megatron-style kernels (and op-level
    checkpointing) keep the kv heads: the other cp - 1 ranks' chunks come on top. goodput's
    attention (training/context_parallel.py, counted with saved-tensor hooks on CPU) keeps
    on CPU the kv heads of the whole sequence as gathered (its flash kernel groups the
    query heads itself, and no mask is kept), in place of the K and V repeated to every
    head that the block formula counts; on CUDA each of its two chunks' keys repeated to
    every head, chunk j's (j + 1) c of them (c = tokens / 2): the pair (2 cp + 1) c.
    Nothing where the attention is recomputed in backward (it gathers them again)."""
    if dims.cp == 1 or mode in ("full", "attention"):
        return 0.0
    args, cp = s.args, dims.cp
    kv, width = args.kv_heads * args.head_dim, attention_width(args)
    if s.recipe.sharded_saves or mode == "ops":
        return 2 * s.act_bytes * kv * tokens * (cp - 1) / dims.tp
    if s.cluster.device == "cpu":
        return 2 * s.act_bytes * tokens * (cp * kv - width) / dims.tp
    return 2 * s.act_bytes * width * tokens * ((2 * cp + 1) / 2 - 1) / dims.tp


def _block_saved_bytes(s: _Setup, mb: int, dims: ParallelDims, residual_bytes: int, mode: str,
                       moe: bool = False) -> float:
    """What one block keeps for backward for a micro-batch of `mb` sequences (this rank's
    part of each under CP): "none" everything it saves (as the recipe saves it:
    goodput's eager or compiled accounting, or Megatron's shards), "full" its input alone
    (sequence-sharded under TP), "ops" torchtitan's op-level selection, "attention" all but
    the core attention's output (Megatron's selective). `moe`: an MoE block (s.moe_args:
    its experts as one SwiGLU, plus the routing, _moe_saved_bytes)."""
    args, tp = (s.moe_args if moe else s.args), dims.tp
    seq = s.seq_shard(dims)
    tokens = mb * seq
    if mode == "full":
        return residual_bytes * tokens * args.dim / tp
    extra = (_moe_saved_bytes(s, dims, tokens) if moe else 0.0) + _gathered_kv_bytes(s, dims, tokens, mode)
    if mode == "ops":
        return op_checkpointed_block_bytes(args, tokens, tp, s.act_bytes, residual_bytes) + extra
    if s.recipe.sharded_saves:
        return extra + sharded_block_activation_bytes(args, tokens, tp, s.act_bytes,
                                                      recompute_attention=mode == "attention")
    full = block_activation_bytes(args, mb, seq, tp, s.act_bytes, residual_bytes, s.fused,
                                  s.fused_norm)
    if mode == "attention":
        return extra + full - tokens * (s.act_bytes * attention_width(args) + 4 * args.n_heads) / tp
    return extra + full


def _checkpointed_blocks(s: _Setup, layers: int, checkpointing: str) -> dict[str, int]:
    """How many of a stage's `layers` blocks each checkpointing mode applies to
    (_block_saved_bytes' modes): parallelism.activation_checkpointing as the recipe does it.
    goodput's "selective" checkpoints every other block, starting with the first."""
    counts: dict[str, int] = {}
    for mode, _ in _block_modes(s, (False,) * layers, checkpointing):
        counts[mode] = counts.get(mode, 0) + 1
    return counts


def _block_modes(s: _Setup, kinds: tuple[bool, ...], checkpointing: str) -> list[tuple[str, bool]]:
    """Each block of a stage (`kinds`: MoE or not, in order) with its checkpointing mode."""
    if checkpointing in ("none", "full"):
        return [(checkpointing, moe) for moe in kinds]
    if s.recipe.selective == "blocks":  # training.parallelize: blocks 0, 2, 4, ... of the part
        return [("full" if i % 2 == 0 else "none", moe) for i, moe in enumerate(kinds)]
    return [(s.recipe.selective, moe) for moe in kinds]


def _stage_activations(s: _Setup, mb: int, dims: ParallelDims, kinds: tuple[bool, ...],
                       checkpointing: str, residual_bytes: int) -> float:
    """One micro-batch through a stage's blocks (`kinds`), each keeping what its checkpointing
    mode keeps."""
    return sum(_block_saved_bytes(s, mb, dims, residual_bytes, mode, moe)
               for mode, moe in _block_modes(s, kinds, checkpointing))


def _memory_problems(s: _Setup, dims: ParallelDims, mem: Memory) -> list[Problem]:
    """Out of memory on the cluster, and, for an elastic run (parallelism.nnodes=MIN:MAX), on
    any smaller node count it trains on after losing nodes: there the data-parallel degree
    shrinks (core.layout.follow_world), so FSDP shards the states over fewer GPUs, and the
    accumulation that keeps the global batch grows (gradients then live through backward).
    An out-of-memory crash after a shrink has no retry budget, so the count that needs the
    most is the one checked and named. A layout that cannot follow a smaller world at all
    (core.config checks the configured one; the search's others) is a problem of its own."""
    have, nodes = s.cluster.gpu_memory, s.cluster.nodes
    low, high = s.config.node_range
    checkpointing = s.config.parallelism.activation_checkpointing
    problems, peaks = [], {nodes: (s, dims, mem)}
    for fewer in range(low, nodes) if s.config.elastic_run else ():
        after = f"at {fewer} of {low}-{high} nodes (after losing {nodes - fewer})"
        try:
            shrunk, accum = follow_world(dims, s.config.training.grad_accum_steps,
                                         fewer * s.cluster.gpus_per_node,
                                         f"{fewer} node(s) x {s.cluster.gpus_per_node} workers")
        except LayoutError as e:
            problems.append(Problem(f"{after} {e.problem.reason}", e.problem.fix))
            continue
        training = s.config.training.model_copy(update={"grad_accum_steps": accum})
        there = replace(s, config=s.config.model_copy(update={"training": training}),
                        cluster=replace(s.cluster, nodes=fewer))
        peaks[fewer] = (there, shrunk, _memory(there, shrunk, checkpointing))
    if have is None:
        return problems
    # The full count wins a tie: a non-elastic run, or one whose peak no loss raises, reads
    # as before.
    worst = max(peaks, key=lambda n: (peaks[n][2].need, n == nodes))
    there, shrunk, need = peaks[worst]
    if need.need <= have:
        return problems
    problem = _out_of_memory(there, shrunk, need, full=dims)
    if worst == nodes:
        return [problem, *problems]
    fix = problem.fix
    if peaks[nodes][2].need <= have:  # the full count fits: so does a narrower range
        enough = nodes  # the fewest nodes from which every count up to the full one fits
        while enough - 1 in peaks and peaks[enough - 1][2].need <= have:
            enough -= 1
        fix += (f", or raise the minimum to {enough} nodes (parallelism.nnodes={enough}:{high})"
                if enough < nodes else f", or do not shrink: parallelism.nnodes={high}")
    reason = f"at {worst} of {low}-{high} nodes (after losing {nodes - worst}) it {problem.reason}"
    return [Problem(reason, fix), *problems]


def _out_of_memory(s: _Setup, dims: ParallelDims, mem: Memory,
                   full: ParallelDims | None = None) -> Problem:
    """Name the first single change that makes the layout fit, with its estimate. `full`:
    the full world's layout where `dims` is an elastic run's after losing nodes (the degrees
    a fix names are the config's, which it shrinks from)."""
    have, device = s.cluster.gpu_memory, _device_noun(s.cluster)
    reason = f"needs {_amount(mem.need)} per {device}, more than the {_amount(have)} it has"
    checkpointing = s.config.parallelism.activation_checkpointing
    options = []
    chunked = None
    if (s.recipe == GOODPUT and not s.config.parallelism.loss_chunk_tokens
            and not dims.splits_output_layer):
        # First: it recomputes nothing (a large vocabulary's logits are often the largest
        # activation of a small model).
        chunked = replace(s, config=_with_loss_chunks(s.config))
        options.append((f"set parallelism.loss_chunk_tokens={LOSS_CHUNK_TOKENS} (the output "
                        "layer and loss a chunk of tokens at a time, never the whole "
                        "micro-batch's logits)", _memory(chunked, dims, checkpointing)))
    if checkpointing != "full":
        options.append(("set parallelism.activation_checkpointing=full",
                        _memory(s, dims, "full")))
    if dims.dp_replicate > 1:
        shard = dims.dp_size
        options.append((f"shard instead of replicating: dp_shard={(full or dims).dp_size}, "
                        "dp_replicate=1 (FSDP shards weights, gradients and optimizer state)",
                        _memory(s, replace(dims, dp_shard=shard, dp_replicate=1), checkpointing)))
    if s.params.moe is not None:
        # More expert parallelism splits the experts further (their states shard over fewer
        # ranks, but each rank holds fewer experts).
        experts, ranks = s.args.moe_args.num_experts, dims.dp_shard * dims.tp
        # An elastic run's shrunk world (`full` given): an ep the configured world takes too.
        full_ranks = (full or dims).dp_shard * (full or dims).tp
        for ep in range(dims.ep + 1, ranks + 1):
            if ranks % ep == 0 and full_ranks % ep == 0 and experts % ep == 0:
                options.append((f"set parallelism.ep={ep} (each MoE layer's experts split {ep} "
                                "ways)", _memory(s, replace(dims, ep=ep), checkpointing)))
    if s.config.checkpoint.async_mode != "sync":
        # Last: saves then stall training for their write. The staging copy of weights and
        # optimizer state can be most of what does not fit (6.9 of 31.6 GiB in a walk).
        options.append(("set checkpoint.async_mode=sync (saves then block training while they "
                        "write, but keep no staging copy of the weights and optimizer state)",
                        _memory(_with(s, checkpoint={"async_mode": "sync"}), dims, checkpointing)))
    for text, alternative in options:
        if alternative.need <= have:
            return Problem(reason, f"{text} ({_amount(alternative.need)})")
    # No one change is enough: the recomputation and chunking ones together, then what is left.
    if checkpointing != "full" and chunked is not None:
        both = _memory(chunked, dims, "full")
        if both.need <= have:
            return Problem(reason, "set parallelism.activation_checkpointing=full and "
                                   f"parallelism.loss_chunk_tokens={LOSS_CHUNK_TOKENS} "
                                   f"({_amount(both.need)})")
    # A smaller micro-batch only where it would change the verdict: weights, gradients and
    # optimizer state do not shrink with it.
    smallest = _memory(_with(s, training={"micro_batch_size": 1}), dims, checkpointing)
    left = (["lower training.micro_batch_size"]
            if s.config.training.micro_batch_size > 1 and smallest.need <= have else [])
    left += ["split the model over more tp or pp ranks", f"use more {device}s"]
    return Problem(reason, ", ".join(left[:-1]) + f", or {left[-1]}")


def _with(s, **sections):
    """Scenario `s` with some fields of its config's sections changed, e.g.
    checkpoint={"async_mode": "sync"}."""
    config = s.config.model_copy(update={name: getattr(s.config, name).model_copy(update=fields)
                                         for name, fields in sections.items()})
    return replace(s, config=config)


def _with_loss_chunks(config: RunConfig, **parallelism) -> RunConfig:
    """`config` with the output layer and loss in chunks (parallelism.loss_chunk_tokens, the
    planner's LOSS_CHUNK_TOKENS unless set) and any other `parallelism` settings given."""
    par = config.parallelism
    return config.model_copy(update={"parallelism": par.model_copy(update={
        "loss_chunk_tokens": par.loss_chunk_tokens or LOSS_CHUNK_TOKENS, **parallelism})})


def _device_noun(cluster: Cluster) -> str:
    return "GPU" if cluster.device == "cuda" else "CPU worker"


def _amount(x: float) -> str:
    """GiB, or MiB below one GiB (where a GiB figure would read 0); whole numbers stay whole."""
    value, unit = (x / GiB, "GiB") if x >= GiB else (x / 2**20, "MiB")
    return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"


# -- communication and time ------------------------------------------------------------------------

def _axis_crosses_nodes(degrees: dict[str, int], axis: str, gpus_per_node: int) -> bool:
    """Ranks of one group along `axis` are `stride` apart; it stays in a node when it spans
    no more than one node's GPUs. `degrees` may hold "ep" beside core's five: context
    parallelism sits between dp_shard and tp (torchtitan's mesh, Llama 3's [TP, CP, PP, DP]);
    an EP group is `ep` neighbouring ranks of dp_shard x tp (core.layout's expert mesh), and
    "efsdp", the ranks holding the same experts, spans all of dp_shard x cp x tp."""
    d = {"ep": 1, **degrees}
    if axis == "ep":
        span = d["ep"] if d["ep"] <= d["tp"] else d["ep"] * d["cp"]
    elif axis == "efsdp":
        span = d["dp_shard"] * d["cp"] * d["tp"]
    else:
        order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        span = math.prod(d[a] for a in order[order.index(axis):])
    return span > gpus_per_node


def _communication(s: _Setup, dims: ParallelDims) -> tuple[dict[str, float], dict[str, bool]]:
    """Bytes each GPU sends per optimizer step along each mesh axis (ring collectives:
    all-reduce 2(d-1)/d of the data, all-gather and reduce-scatter (d-1)/d; an all-to-all
    (ep-1)/ep of what it exchanges). Under EP the experts' FSDP traffic is its own axis,
    "efsdp"; the all-to-all of token rows is "ep"; context parallelism's K/V all-gathers "cp".
    The pipeline rank that sends the most (with MoE models, one holding MoE blocks)."""
    comm = max((_rank_communication(s, dims, rank) for rank in _ranks(s, dims)),
               key=lambda c: sum(c.values()))
    degrees = {**dims.degrees, "ep": dims.ep}
    crosses = {k: _axis_crosses_nodes(degrees, k, s.cluster.gpus_per_node) for k in comm}
    return comm, crosses


def _rank_communication(s: _Setup, dims: ParallelDims, busiest: _Rank) -> dict[str, float]:
    """_communication for one pipeline rank."""
    args, tcfg, par = s.args, s.config.training, s.config.parallelism
    tp, pp, rep, m, cp = dims.tp, dims.pp, dims.dp_replicate, dims.microbatches_per_step, dims.cp
    loc = _local_params(s, busiest, dims)
    # Under EP the experts are FSDP units of their own on another mesh: their traffic apart.
    apart = dims.ep > 1
    blocks = loc.blocks + (0.0 if apart else loc.experts)
    local = loc.root + blocks
    shard, expert_shard = _state_shards(s, dims)
    n_micro = tcfg.grad_accum_steps * m
    mb = tcfg.micro_batch_size // m
    comm: dict[str, float] = {}

    if s.recipe.bf16_weights and s.bf16 and dims.dp_size * cp > 1:
        # Distributed optimizer: fp32 gradients reduce-scattered, bf16 weights all-gathered,
        # once per step each.
        axis = "dp_shard" if dims.dp_shard * cp > 1 else "dp_replicate"
        comm[axis] = _ring(shard) * (4 + 2) * local
        if apart:
            comm["efsdp"] = _ring(expert_shard) * (4 + 2) * loc.experts
    elif dims.ddp:  # DDP: fp32 gradient all-reduce once per step
        comm["dp_replicate"] = 2 * _ring(rep) * 4 * local
    elif rep * shard > 1:  # FSDP2 / HSDP
        compute_bytes = 2 if s.bf16 else 4
        # Gradients are reduced once per step, or with pipeline stages at the end of every
        # schedule step, i.e. every accumulation micro-step.
        reductions = tcfg.grad_accum_steps if pp > 1 else 1

        def gathered(units: float, root: float) -> float:
            if pp > 1:
                # A pipeline stage's blocks stay gathered after backward (PipelineStage keeps
                # them for the step's later micro-batches): gathered again only where forward
                # resharded them, once per micro-batch.
                return ((n_micro if par.reshard_after_forward else tcfg.grad_accum_steps) * units
                        + tcfg.grad_accum_steps * root)
            return n_micro * ((2 if par.reshard_after_forward else 1) * units + root)

        comm["dp_shard"] = _ring(shard) * (compute_bytes * gathered(blocks, loc.root)
                                           + reductions * 4 * local)
        comm["dp_replicate"] = reductions * 2 * _ring(rep) * 4 * (
            local / shard + (loc.experts / expert_shard if apart else 0.0))
        if apart:
            comm["efsdp"] = _ring(expert_shard) * (compute_bytes * gathered(loc.experts, 0.0)
                                                   + reductions * 4 * loc.experts)
    if tp > 1:
        comm["tp"] = n_micro * _tp_bytes_per_microbatch(s, dims, busiest, mb)
    if dims.ep > 1 and busiest.moe_blocks:
        comm["ep"] = n_micro * _all_to_all_bytes_per_microbatch(s, dims, busiest, mb)
    if cp > 1:
        comm["cp"] = n_micro * _kv_bytes_per_microbatch(s, dims, busiest, mb)
    if pp > 1:
        boundary = s.residual_bytes(dims) * mb * s.seq_shard(dims) * args.dim / tp
        sends = 2 * len(busiest.layers)  # activations forward, their gradients backward
        comm["pp"] = n_micro * sends * boundary
    return {k: v for k, v in comm.items() if v > 0}


def _ring(d: int) -> float:
    """Share of the data each member of a ring of `d` sends in one all-gather or reduce-scatter."""
    return (d - 1) / d


def _all_to_all_bytes_per_microbatch(s: _Setup, dims: ParallelDims, rank: _Rank, mb: int) -> float:
    """Expert parallelism (training/expert_parallel.py): in every MoE block each of this
    rank's tokens (its part of the micro-batch: 1/tp of the sequences' tokens under TP, 1/cp
    under CP) sends top_k rows of dim values to the ranks holding its experts (dispatch) and
    gets them back (combine), in the norm output's dtype; with routing spread evenly,
    (ep-1)/ep of the rows leave the rank. Backward sends the gradients the same ways; a block
    checkpointed whole dispatches and combines again when it recomputes."""
    moe = s.args.moe_args
    tokens = mb * s.seq_shard(dims) / dims.tp
    rows = tokens * moe.top_k * s.args.dim * s.residual_bytes(dims) * _ring(dims.ep)
    exchanges = sum(4 + (2 if mode == "full" else 0)
                    for kinds in rank.kinds
                    for mode, is_moe in _block_modes(s, kinds, s.config.parallelism.activation_checkpointing)
                    if is_moe)
    return exchanges * rows


def _kv_bytes_per_microbatch(s: _Setup, dims: ParallelDims, rank: _Rank, mb: int) -> float:
    """Context parallelism as Llama 3 does it: in every block each rank all-gathers the keys
    and values of the whole sequence (its kv heads: kv_heads x head_dim / tp wide) before
    attention, and reduce-scatters their gradients in backward; a block whose attention is
    recomputed gathers again. (torch's ring attention passes the same K/V chunks around the
    ring: the same bytes.)"""
    args = s.args
    kv = 2 * args.kv_heads * args.head_dim / dims.tp * mb * s.config.training.seq_len
    volume = kv * s.act_bytes * _ring(dims.cp)
    exchanges = sum(2 + (1 if mode in ("full", "attention") else 0)
                    for kinds in rank.kinds
                    for mode, _ in _block_modes(s, kinds, s.config.parallelism.activation_checkpointing))
    return exchanges * volume


def _tp_bytes_per_microbatch(s: _Setup, dims: ParallelDims, rank: _Rank, mb: int) -> float:
    """Sequence parallelism: per block, two all-gathers into (of norm outputs, in the
    residual dtype) and two reduce-scatters out of (matmul outputs) the parallel matmuls in
    forward, their mirror images in backward, and again when a checkpointed block
    recomputes; the embedding's reduce-scatter and the head's all-gathers (the logits whole)
    at the ends. An MoE block has the attention's half: its MoE layer computes on each TP
    rank's own part of the sequence (training/expert_parallel.py)."""
    seq, args, par = s.seq_shard(dims), s.args, s.config.parallelism
    tp, residual_bytes = dims.tp, s.residual_bytes(dims)
    hidden = mb * seq * args.dim * _ring(tp)  # elements
    per_block = 4 * hidden * (residual_bytes + s.act_bytes)  # forward and backward
    if s.recipe.parallel_blocks:  # attention and MLP share one all-gather and one reduce-scatter
        per_block /= 2
    # A block checkpointed whole repeats its forward collectives (half its traffic);
    # torchtitan's op-level policy keeps the reduce-scatters' outputs but repeats the two
    # all-gathers (its _save_list has reduce_scatter_tensor, not all_gather); Megatron's
    # selective keeps both.
    total = 0.0
    for kinds in rank.kinds:
        for mode, moe in _block_modes(s, kinds, par.activation_checkpointing):
            share = 0.5 if moe else 1.0
            total += share * per_block * (1.5 if mode == "full" else 1.0)
            if mode == "ops":
                total += share * 2 * hidden * residual_bytes / (2 if s.recipe.parallel_blocks else 1)
    if rank.first:
        total += 2 * hidden * residual_bytes
    if rank.last:
        total += 2 * hidden * residual_bytes
        if not (s.recipe.vocab_parallel_loss or s.recipe.sharded_saves):  # the logits whole
            total += s.act_bytes * mb * seq * args.vocab_size * _ring(tp)
    return total


def model_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs of one token without recomputation, as training/metrics.py counts them
    for its MFU (Transformer.flops_per_token): 6 per matmul parameter a token is multiplied
    by (a mixture of experts: its active parameters, the top_k experts it is routed to), and
    attention's 12 x layers x n_heads x head_dim x seq_len."""
    return 6 * count_params(args).matmul + 12 * args.n_layers * attention_width(args) * seq_len


def _layer_flops(s: _Setup) -> list[float]:
    """Training FLOPs per token of each block (matmuls, a token's experts only, and
    attention), in order."""
    attention = 12 * attention_width(s.args) * s.config.training.seq_len
    return [6 * s.params.block(i).active_matmul + attention for i in range(s.args.n_layers)]


def _block_and_head_flops(s: _Setup) -> tuple[float, float]:
    """Training FLOPs per token of the mean block (matmuls and attention) and of the output
    layer (the embedding is a lookup: next to none)."""
    layers = _layer_flops(s)
    return sum(layers) / len(layers), 6 * s.args.vocab_size * s.args.dim


def _rank_work(s: _Setup, dims: ParallelDims, layers: list[int]) -> list[float]:
    """FLOPs per token of each pipeline rank: its blocks (matmuls and attention), and on the
    last one the output layer. The busiest rank sets the pipeline's pace."""
    flops, (_, head) = _layer_flops(s), _block_and_head_flops(s)
    bounds = list(itertools.accumulate(layers, initial=0))
    stage = [sum(flops[bounds[st]:bounds[st + 1]]) for st in range(len(layers))]
    return [sum(stage[st] for st in dims.stages_of(r)) + (head if r == dims.pp - 1 else 0)
            for r in range(dims.pp)]


def _balancing_weight(s: _Setup, dims: ParallelDims) -> tuple[int, list[int], float] | None:
    """The parallelism.pp_last_stage_less_layers (the first stage's weight kept) whose split
    gives the busiest pipeline rank the least compute, when it beats the configured one by
    more than 0.5%: (weight, split, imbalance). Ties go to the weight nearest the output
    layer's compute in blocks. None with an explicit pp_layers_per_stage."""
    if dims.layers_per_stage is not None:
        return None
    n_layers = s.args.n_layers
    block, head = _block_and_head_flops(s)

    def busiest(d: ParallelDims) -> float:
        return max(_rank_work(s, d, d.stage_layers(n_layers)))

    current = busiest(dims)
    # A weight above n_layers / (n_stages - 1) leaves the last stage no layer.
    options = [replace(dims, last_stage_less_layers=w)
               for w in range(n_layers // (dims.n_stages - 1) + 2)]
    options = [d for d in options if d.stage_problem(n_layers) is None]
    best = min(options, key=lambda d: (busiest(d), abs(d.last_stage_less_layers - head / block)))
    if busiest(best) >= current / 1.005:
        return None
    work = _rank_work(s, best, best.stage_layers(n_layers))
    return (best.last_stage_less_layers, best.stage_layers(n_layers),
            max(work) / (sum(work) / len(work)))


# Bytes the memory-bound ops move per token and block, forward and backward, counted from
# training/model.py (bf16 activations; R: the residual stream's bytes, 4 under autocast, 2
# under FSDP's bf16 parameters), in multiples of (dim, kv width, ffn width) for R = 2 and R = 4.
#   eager forward: each RMSNorm about 36 x dim (x.float(), pow, mean, scale, cast, weight),
#     autocast's casts of the five matmul inputs 6 x dim each (R = 4 only), RoPE on q and k
#     24 x (dim + kv) (cat of halves, two products, a sum), GQA's repeat of k and v and the
#     attention output's transpose 4 x dim each, two residual adds (2R + 2) x dim, SwiGLU's
#     silu and product 10 x ffn;
#   compiled (or hand-fused) forward: each norm fused with the residual add before it
#     (2R + 4) x dim, RoPE 4 x (dim + kv), the repeat and the transpose 4 x dim each,
#     SwiGLU 6 x ffn;
#   backward moves about twice what forward does.
def _elementwise_bytes(args: ModelArgs, residual_bytes: int, fused: bool, autocast: bool) -> float:
    """Bytes per token of one block's memory-bound ops, forward and backward (whole, before TP)."""
    d, kv, f, r = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden, residual_bytes
    q = attention_width(args)  # dim, unless the model sets a head_dim of its own (Qwen3)
    if fused:
        forward = 2 * (2 * r + 4) * d + 4 * (q + kv) + 8 * q + 6 * f
    else:
        forward = (2 * 36 * d + (30 * d if autocast else 0) + 24 * (q + kv) + 8 * q
                   + 2 * (2 * r + 2) * d + 10 * f)
    return 3 * forward


def _float8_cast_bytes(args: ModelArgs) -> float:
    """torchao's dynamic float8 scaling, per token and block: each linear layer's input (in
    forward) and output gradient (in backward) is read for its absolute maximum, read again
    and written in 1 byte: 5 bytes per element. Inputs: wq, wk, wv and w1, w3 each cast
    their own copy (5 x dim), wo its (dim), w2 its (ffn); output gradients: q, k, v and wo's
    (2 dim + 2 kv), w1's and w3's (2 ffn)."""
    d, kv, f = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden
    return 5 * ((6 * d + f) + (2 * d + 2 * kv + 2 * f))


@dataclass
class _Work:
    """One pipeline rank's work in a step, by kind: FLOPs and bytes, and the seconds each
    takes (_rank_seconds). The explanation prints it."""

    matmul_flops: float = 0.0  # bf16 (or fp32) matmuls, recomputation included
    float8_flops: float = 0.0  # matmuls run in float8
    attention_flops: float = 0.0  # as executed (causal), recomputation included
    memory_bytes: float = 0.0  # memory-bound ops, the loss and the optimizer update
    tp_bytes: float = 0.0  # TP collectives on the critical path (not overlapped)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def _recompute_shares(s: _Setup, mode: str, moe: bool) -> tuple[float, float, float]:
    """Forward work a block checkpointed in `mode` repeats in backward, as shares of its
    training work (forward is a third of forward + backward): (matmuls, attention,
    memory-bound)."""
    if mode == "full":
        return 1 / 3, 1 / 3, 1 / 3
    if mode == "ops":  # wk, wo and w3 recomputed with every elementwise op
        args = s.moe_args if moe else s.args
        kv, q = args.kv_heads * args.head_dim, attention_width(args)
        block = s.params.moe if moe else s.params.dense
        return (args.dim * kv + q * args.dim + args.dim * args.ffn_hidden) / block.active_matmul / 3, 0.0, 1 / 3
    if mode == "attention":
        return 0.0, 1 / 3, 0.0
    return 0.0, 0.0, 0.0


def _routing_bytes(s: _Setup, dims: ParallelDims) -> float:
    """Bytes per token an MoE layer's routing moves, forward and backward: the router's fp32
    logits and scores (cast, softmax or sigmoid, top-k: about 3 passes over num_experts),
    the token rows gathered for the experts, scaled by the routing weights and added back
    (index_add), top_k x dim each read and written, and under EP regrouped by expert and
    back (two more)."""
    m = s.args.moe_args
    passes = 3 + (2 if dims.ep > 1 else 0)
    return 3 * (2 * passes * m.top_k * s.args.dim * s.act_bytes + 3 * 2 * 4 * m.num_experts)


def _rank_seconds(s: _Setup, dims: ParallelDims, rank: _Rank) -> _Work:
    """One pipeline rank's compute in a step (its micro-batches through its blocks, the
    output layer and loss on the last, the optimizer update), each kind of work at the rate
    the cluster sustains for it; TP's exposed collectives sit between its computations.
    An MoE block's matmuls are those of a token's experts (top_k routed and the shared
    ones), on this rank's part of the tokens (each TP rank routes its own part of the
    sequence; EP brings each rank as many rows as it sends out, routing spread evenly)."""
    args, tcfg, cluster, recipe = s.args, s.config.training, s.cluster, s.recipe
    tp, m = dims.tp, dims.microbatches_per_step
    # Through this rank: its micro-batches' tokens, 1/cp of each sequence under CP.
    tokens = tcfg.grad_accum_steps * tcfg.micro_batch_size * s.seq_shard(dims)
    work = _Work()
    residual = s.residual_bytes(dims)
    autocast = s.bf16 and residual == 4
    for kinds in rank.kinds:
        for mode, moe in _block_modes(s, kinds, s.config.parallelism.activation_checkpointing):
            mm, attention, memory = _recompute_shares(s, mode, moe)
            block, block_args = (s.params.moe, s.moe_args) if moe else (s.params.dense, args)
            # float8 linear layers (torchao) leave the grouped expert matmuls in bf16.
            float8 = block.matrix if recipe.float8 and s.bf16 else 0
            work.float8_flops += 6 * float8 / tp * tokens * (1 + mm)
            work.matmul_flops += 6 * (block.active_matmul - float8) / tp * tokens * (1 + mm)
            if float8:
                work.memory_bytes += _float8_cast_bytes(block_args) / tp * tokens
            # Causal attention computes half the 12 x heads x head_dim x seq FLOPs per token
            # MFU counts (each rank's CP chunks attend to the whole sequence's keys).
            work.attention_flops += (6 * attention_width(args) * tcfg.seq_len / tp * tokens
                                     * (1 + attention))
            elementwise = _elementwise_bytes(block_args, residual, s.fused, autocast)
            if moe:
                elementwise += _routing_bytes(s, dims)
            work.memory_bytes += elementwise / tp * tokens * (1 + memory)
    vocab_parallel = recipe.vocab_parallel_loss or recipe.sharded_saves
    if rank.last:
        work.matmul_flops += 6 * args.vocab_size * args.dim / tp * tokens
        loss_bytes = (8 if s.fused_loss else 32) * args.vocab_size / (tp if vocab_parallel else 1)
        work.memory_bytes += loss_bytes * tokens
    loc = _local_params(s, rank, dims)
    shard, expert_shard = _state_shards(s, dims)
    # AdamW: reads p, g, m, v; writes p, m, v (fp32), on this rank's shard.
    work.memory_bytes += 28 * ((loc.root + loc.blocks) / shard + loc.experts / expert_shard)
    if tp > 1:
        per_micro = _tp_bytes_per_microbatch(s, dims, rank, tcfg.micro_batch_size // m)
        work.tp_bytes = tcfg.grad_accum_steps * m * per_micro * (1 - recipe.tp_overlap)

    speed = cluster.compute_efficiency / MATMUL_EFFICIENCY  # a measured run's scales them all
    peak = cluster.gpu_flops
    work.seconds = {
        "matmuls": work.matmul_flops / (cluster.compute_efficiency * peak),
        "float8 matmuls": work.float8_flops / (FLOAT8_SPEEDUP * cluster.compute_efficiency * peak),
        "attention": work.attention_flops / (ATTENTION_EFFICIENCY * speed * peak),
        "memory-bound": work.memory_bytes / (MEMORY_EFFICIENCY * speed * cluster.memory_bandwidth),
        "tp exposed": work.tp_bytes / (LINK_EFFICIENCY * _link(cluster, dims.degrees, "tp")),
    }
    return work


def _link(cluster: Cluster, degrees: dict[str, int], axis: str) -> float:
    return _bandwidth(cluster, _axis_crosses_nodes(degrees, axis, cluster.gpus_per_node))


def _bandwidth(cluster: Cluster, crosses_nodes: bool) -> float:
    return cluster.inter_node_bandwidth if crosses_nodes else cluster.intra_node_bandwidth


def _estimate_step(s: _Setup, dims: ParallelDims, plan: LayoutPlan) -> None:
    """Step time = the busiest pipeline rank's compute, stretched by the bubble, + the
    communication compute does not hide.

    Compute per rank: _rank_seconds (matmuls, attention, memory-bound work, TP's exposed
    collectives). Communication at LINK_EFFICIENCY of the links: the data-parallel part
    overlapped with compute up to COMM_OVERLAP (and never more than the compute lasts), the
    pipeline's sends whole unless the recipe overlaps them. Sets step_time_s, compute_s,
    exposed_comm_s, imbalance, work and mfu."""
    cluster = s.cluster
    work = _rank_work(s, dims, plan.stage_layers)
    plan.imbalance = max(work) / (sum(work) / len(work))
    if cluster.gpu_flops is None:
        return
    ranks = [_rank_seconds(s, dims, r) for r in _ranks(s, dims)]
    busiest = max(ranks, key=lambda w: w.total_s)
    plan.work = busiest
    tcfg = s.config.training
    model_flops = model_flops_per_token(s.args, tcfg.seq_len) * plan.tokens_per_step / cluster.world_size
    if dims.fsdp and not s.recipe.bf16_weights:
        # FSDP2 copies each all-gathered parameter out of, and each gradient into, the
        # collective's flat buffer: the buffers' size read and written once more.
        shards = _state_shards(s, dims)
        flat = sum(plan.comm.get(axis, 0.0) / _ring(n)
                   for axis, n in zip(("dp_shard", "efsdp"), shards) if n > 1)
        busiest.memory_bytes += 2 * flat
        speed = cluster.compute_efficiency / MATMUL_EFFICIENCY
        busiest.seconds["memory-bound"] += 2 * flat / (MEMORY_EFFICIENCY * speed
                                                       * cluster.memory_bandwidth)
    compute_s = busiest.total_s / (1 - plan.bubble)
    seconds = {k: v / (LINK_EFFICIENCY * _bandwidth(cluster, plan.crosses_nodes[k]))
               for k, v in plan.comm.items() if k != "tp"}  # TP's is in the compute
    # FSDP's (and the experts' FSDP, efsdp) are issued ahead and behind compute; EP's
    # all-to-alls and CP's K/V all-gathers sit between the computations that need them.
    data_parallel = sum(v for k, v in seconds.items() if k.startswith("dp_") or k == "efsdp")
    hidden = min(cluster.comm_overlap * data_parallel, compute_s)
    if s.recipe.pp_overlap and "pp" in seconds:
        hidden += min(seconds["pp"], compute_s)
    if s.recipe.ep_overlap and "ep" in seconds:
        hidden += min(seconds["ep"], compute_s)
    exposed = sum(seconds.values()) - hidden
    plan.compute_s, plan.exposed_comm_s = compute_s, exposed
    plan.comm_seconds = seconds
    plan.step_time_s = compute_s + exposed
    plan.mfu = model_flops / (cluster.gpu_flops * plan.step_time_s)


# -- presentation ------------------------------------------------------------------------------------

def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _size(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def format_table(plans: list[LayoutPlan], limit: int | None = None) -> str:
    """One line per layout: memory split in GiB (need: the peak, plus on CPU workers what their
    processes hold beside it), bubble, communication, estimated step time."""
    header = ("rank", "dp_rep", "dp_shard", "cp", "tp", "pp", "weights", "grads", "optim", "buffers",
              "acts", "need GiB", "bubble", "comm/step", "step s", "tokens/s", "verdict")
    rows = []
    shown = plans if limit is None else plans[:limit]
    for i, p in enumerate(shown, 1):
        d, mem = p.degrees, p.memory
        mem_cols = ([_gib(mem.weights), _gib(mem.gradients), _gib(mem.optimizer), _gib(mem.buffers),
                     _gib(mem.activations), _gib(mem.need)] if mem else ["-"] * 6)
        rows.append((str(i) if p.ok else "-", *(str(d[k]) for k in LAYOUT_DEGREES), *mem_cols,
                     f"{p.bubble:.1%}", _size(sum(p.comm.values())),
                     f"{p.step_time_s:.3f}" if p.step_time_s is not None else "-",
                     f"{p.tokens_per_s:,.0f}" if p.tokens_per_s is not None else "-",
                     _verdict(p)))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in [header, *rows]]
    if limit is not None and len(plans) > limit:
        lines.append(f"... {len(plans) - limit} more layouts")
    return "\n".join(lines)


def _verdict(p: LayoutPlan) -> str:
    if not p.ok:
        return p.problems[0].reason
    return "; ".join(["ok", *p.departures, *(f"warning: {w.reason}" for w in p.warnings)])


def explain(p: LayoutPlan, cluster: Cluster) -> str:
    """Everything the planner knows about one layout, in words."""
    pc, mem = p.params, p.memory
    memory = "memory unknown" if cluster.gpu_memory is None else f"{_gib(cluster.gpu_memory)} GiB each"
    lines = [f"layout {p.name} on {cluster.nodes} node(s) x {cluster.gpus_per_node} "
             f"{_device_noun(cluster)}s ({memory})",
             f"  parameters: {pc.total:,} total, {pc.non_embedding:,} non-embedding"]
    if mem is not None:
        backward = ("gradients + activations + workspace" if mem.grads_live_in_backward
                    else "activations + workspace")
        lines += [f"  memory per {_device_noun(cluster)} (GiB): weights {_gib(mem.weights)}, gradients "
                  f"{_gib(mem.gradients)}, optimizer {_gib(mem.optimizer)}, buffers "
                  f"{_gib(mem.buffers)}, activations {_gib(mem.activations)}, workspace "
                  f"{_gib(mem.workspace)} (backward) / {_gib(mem.step_workspace)} (update)",
                  f"  peak {_gib(mem.peak)} GiB = weights + optimizer + buffers + "
                  f"max({backward}, gradients + update workspace)"]
        if cluster.host_processes:
            lines += [f"  beside the tensors (GiB): process {_gib(mem.process)}, checkpoint staging "
                      f"{_gib(mem.staging)}, allocator's kept memory {_gib(mem.allocator_kept)}; "
                      f"flow and verifier processes {_gib(mem.machine_share)} (their "
                      f"{_gib(mem.flow_process + mem.verifier_process)} over "
                      f"{cluster.gpus_per_node} workers)",
                      f"  needs {_gib(mem.need)} GiB per {_device_noun(cluster)} = peak + process + "
                      f"checkpoint staging + allocator's kept memory + flow and verifier processes "
                      f"(the worker's own resident peak: {_gib(mem.worker)} GiB)"]
    if p.degrees["pp"] > 1:
        lines.append(f"  pipeline: {_pipeline_facts(p)}")
    lines += [f"  {fact}" for fact in _step_facts(p, _device_noun(cluster), cluster)]
    lines += [f"  warning: {warning}" for warning in p.warnings]
    lines += [f"  ruled out: {problem}" for problem in p.problems]
    return "\n".join(lines)


def _pipeline_facts(p: LayoutPlan) -> str:
    text = f"{p.microbatches} micro-batches, bubble {p.bubble:.1%}"
    if p.stage_layers:
        text += f"; layers per stage {p.stage_layers}"
        if p.imbalance > 1.005:
            text += f" (busiest rank {p.imbalance - 1:.1%} above the mean: it sets the pace)"
    if p.output_blocks is not None:
        text += f"; the output layer and loss compute as much as {p.output_blocks:.1f} blocks"
    if p.best_virtual_stages is not None:
        v, step = p.best_virtual_stages
        text += (f"; interleaved-1f1b with parallelism.pp_virtual_stages={v} gives the shortest "
                 f"step that fits ({step:.3f} s)")
    if p.balancing is not None:
        weight, split, imbalance = p.balancing
        text += (f"; parallelism.pp_last_stage_less_layers={weight} would split {split}, the "
                 f"busiest rank {imbalance - 1:.1%} above the mean")
    return text


def explain_markdown(p: LayoutPlan, cluster: Cluster, source: str) -> str:
    """The explanation as a markdown report (the train flow's layout artifact)."""
    noun, mem = _device_noun(cluster), p.memory
    have = "unknown" if cluster.gpu_memory is None else _amount(cluster.gpu_memory)
    lines = [f"# Layout {p.name}: {'fits' if p.ok else 'cannot run'}", "",
             f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {noun}s; memory per {noun}: "
             f"{have} ({source}). Parameters: {p.params.total:,}.", ""]
    if p.problems:
        lines += ["## Why it cannot run", ""]
        lines += [f"- {problem.reason}. **Fix:** {problem.fix}" for problem in p.problems]
        lines.append("")
    if p.warnings:
        lines += ["## Warnings", ""]
        lines += [f"- {warning.reason}. **Fix:** {warning.fix}" for warning in p.warnings]
        lines.append("")
    if mem is not None:
        rows = [("weights", mem.weights), ("gradients", mem.gradients),
                ("optimizer state", mem.optimizer), ("buffers", mem.buffers),
                ("activations", mem.activations), ("backward workspace", mem.workspace),
                ("update workspace", mem.step_workspace), ("**peak**", mem.peak)]
        if cluster.host_processes:
            rows += [("process", mem.process), ("checkpoint staging", mem.staging),
                     ("allocator's kept memory", mem.allocator_kept),
                     ("flow and verifier processes (this worker's share)", mem.machine_share),
                     ("**per worker on this machine**", mem.need)]
        lines += [f"## Memory per {noun} (estimate)", "", "| part | GiB |", "|---|---|"]
        lines += [f"| {name} | {_gib(value)} |" for name, value in rows]
        lines.append("")
    lines += ["## Step", "", (f"- pipeline: {_pipeline_facts(p)}" if p.degrees["pp"] > 1
                              else f"- pipeline bubble: {p.bubble:.1%}")]
    lines += [f"- {fact}" for fact in _step_facts(p, noun, cluster)]
    return "\n".join(lines) + "\n"


def _step_facts(p: LayoutPlan, noun: str, cluster: Cluster) -> list[str]:
    """Communication per axis, the step-time estimate with the assumptions it rests on, and
    the notes: both explanations."""
    facts = [f"communication {axis}: {_size(volume)} per {noun} per step "
             f"({'inter-node' if p.crosses_nodes[axis] else 'intra-node'})"
             for axis, volume in p.comm.items()]
    if p.step_time_s is not None:
        facts.append(f"estimated step time: {p.step_time_s:.3f} s for {p.tokens_per_step:,} "
                     f"tokens, {p.tokens_per_s:,.0f} tokens/s ({p.tokens_per_s / cluster.world_size:,.0f}"
                     f" per {noun}), MFU {p.mfu:.1%}")
        speed = cluster.compute_efficiency / MATMUL_EFFICIENCY
        facts.append(f"assumed: matmuls at {cluster.compute_efficiency:.1%} of "
                     f"{cluster.gpu_flops / 1e12:,.0f} TFLOP/s peak, attention at "
                     f"{ATTENTION_EFFICIENCY * speed:.0%}, memory-bound work at "
                     f"{MEMORY_EFFICIENCY * speed:.0%} of {cluster.memory_bandwidth / 1e12:.2f} TB/s "
                     f"({cluster.efficiency_source}); {cluster.comm_overlap:.0%} of data-parallel "
                     f"communication hidden behind compute: compute {p.compute_s:.3f} s + exposed "
                     f"communication {p.exposed_comm_s:.3f} s (--explain shows the arithmetic)")
    return facts + [f"note: {note}" for note in p.departures]


def _parameters_how(pc: ParamCount) -> str:
    head = f"output {pc.head_matrix + pc.head_vector:,}"
    if pc.moe is None:
        return (f"embedding {pc.embedding:,} + {pc.n_layers} blocks x "
                f"{pc.block_matrix + pc.block_vector:,} + {head}")
    moe = pc.moe
    dense = (f"{pc.first_moe_layer} dense blocks x {pc.dense.total:,} + "
             if pc.first_moe_layer else "")
    return (f"embedding {pc.embedding:,} + {dense}{pc.moe_layers} MoE blocks x {moe.total:,} "
            f"(attention and norms {moe.matrix + moe.vector:,}, router and shared experts "
            f"{moe.replicated:,}, routed experts {moe.experts:,}) + {head}")


def _axis_how(s: _Setup, dims: ParallelDims, axis: str) -> str:
    """How the volume of EP's all-to-alls and CP's K/V all-gathers comes (explain_table)."""
    tcfg, args = s.config.training, s.args
    micro = tcfg.grad_accum_steps * dims.microbatches_per_step
    mb = tcfg.micro_batch_size // dims.microbatches_per_step
    if axis == "ep":
        m = args.moe_args
        return (f"{micro} micro-batches x MoE blocks x (dispatch + combine, forward and backward, "
                f"again where recomputed) x {mb * s.seq_shard(dims) // dims.tp:,} tokens x top_k {m.top_k} "
                f"x dim {args.dim} x {s.residual_bytes(dims)} bytes x (ep-1)/ep ({dims.ep - 1}/{dims.ep}) = ")
    if axis == "cp":
        return (f"{micro} micro-batches x blocks x (all-gather forward, reduce-scatter backward, "
                f"again where attention is recomputed) x K and V of {mb} x {tcfg.seq_len:,} tokens "
                f"x {args.kv_heads * args.head_dim // dims.tp} (kv heads x head_dim / tp) x "
                f"{s.act_bytes} bytes x (cp-1)/cp ({dims.cp - 1}/{dims.cp}) = ")
    if axis == "efsdp":
        return (f"the routed experts' FSDP over the {_state_shards(s, dims)[1]} ranks holding "
                "the same experts: all-gathers and gradient reduce-scatters, ")
    return ""


def explain_table(p: LayoutPlan, cluster: Cluster, config: RunConfig,
                  recipe: Recipe = GOODPUT) -> str:
    """goodput plan --explain: each figure of one layout's plan with the arithmetic behind it,
    as a markdown table a reviewer can check by hand (quantity | how | value)."""
    if p.memory is None:
        return "no estimate: " + "; ".join(str(problem) for problem in p.problems)
    s = _setup(config, cluster, recipe)
    args, tcfg, pc, mem = s.args, config.training, p.params, p.memory
    d = p.degrees
    dims = _resolve(config, cluster, d)
    noun = _device_noun(cluster)
    seq, tokens = tcfg.seq_len, p.tokens_per_step
    flops_token = model_flops_per_token(args, seq)
    rows = [("parameters", _parameters_how(pc), f"{pc.total:,}")]
    if pc.moe is not None:
        m = args.moe_args
        rows.append(("active parameters", f"all but the {m.num_experts - m.top_k} of "
                     f"{m.num_experts} routed experts a token is not sent to, in each of "
                     f"{pc.moe_layers} MoE blocks: {pc.total:,} - {pc.inactive:,}", f"{pc.active:,}"))
    rows += [("FLOPs per token", f"6 x {pc.matmul:,} matmul parameters"
              f"{' (active)' if pc.moe is not None else ''} + 12 x {args.n_layers} layers x "
              f"{attention_width(args)} (heads x head_dim) x {seq} seq", f"{flops_token:.4g}"),
             ("tokens per step", f"{tcfg.micro_batch_size} sequences x {tcfg.grad_accum_steps} "
              f"micro-steps x {seq} tokens x {dims.dp_size} data-parallel ranks"
              + (f" (the {dims.cp} context-parallel ranks of each share its sequences)"
                 if dims.cp > 1 else ""), f"{tokens:,}"),
             (f"model FLOPs per {noun} per step", f"{flops_token:.4g} x {tokens:,} / "
              f"{cluster.world_size} {noun}s", f"{flops_token * tokens / cluster.world_size:.4g}")]
    n, k = mem.local_params, mem.state_shard
    whole = recipe.bf16_weights and s.bf16
    e, ek = mem.expert_params, mem.expert_shard
    dense = n - e
    # Under EP the experts' states are sharded over other ranks (efsdp) than the rest's.
    local = (f"({dense:,.0f} / {k} + {e:,.0f} experts / {ek})" if e
             else f"{n:,.0f} / {k}")
    rows += [(f"memory: {name}", how, f"{_gib(value)} GiB") for name, how, value in (
        ("weights", (f"2 (bf16, whole) x {n:,.0f}" if whole else f"4 (fp32) x {local}")
         + " parameters (this pipeline rank's, after TP" + (", experts after EP" if e else "")
         + ")", mem.weights),
        ("gradients", f"4 (fp32) x " + (f"{n:,.0f}" if whole else local), mem.gradients),
        ("optimizer", f"{12 if whole else 8} (AdamW's fp32 moments"
         f"{' and master weights' if whole else ''}) x {local}", mem.optimizer),
        ("buffers", "FSDP's gathered weights and unsharded gradients, DDP buckets, autocast copies",
         mem.buffers),
        ("activations", f"{mem.inflight} stage-forwards in flight x {_gib(mem.stage_bytes)} GiB "
         "(the heaviest stage's blocks, one micro-batch) + the loss's", mem.activations),
        ("workspace", "max(loss gradient, one block recomputed)", mem.workspace),
        ("peak", "weights + optimizer + buffers + max(backward, update)", mem.peak))]
    if cluster.host_processes:
        async_mode = config.checkpoint.async_mode
        rows += [(f"memory: {name}", how, f"{_gib(value)} GiB") for name, how, value in (
            ("process", "the worker's interpreter, torch, gloo and data loader (measured on a "
             "64-dim model's trainer)", mem.process),
            ("checkpoint staging", f"checkpoint.async_mode={async_mode}: "
             + ("weights + optimizer, over the ranks holding the same" if async_mode != "sync"
                else "none (synchronous saves write from the live tensors)"), mem.staging),
            ("allocator's kept memory", f"freed memory glibc keeps (training/allocator.py: up to "
             f"{_gib(THRESHOLD_BYTES)} GiB, no more than peak + staging)", mem.allocator_kept),
            ("flow and verifier processes", f"(flow {_gib(mem.flow_process)} + verifier "
             f"{_gib(mem.verifier_process)}) / {cluster.gpus_per_node} workers", mem.machine_share),
            ("per worker on this machine", "peak + process + checkpoint staging + allocator's kept "
             "memory + flow and verifier processes", mem.need))]
    if cluster.memory_bandwidth and p.work is not None:
        w, speed = p.work, cluster.compute_efficiency / MATMUL_EFFICIENCY
        peak = cluster.gpu_flops
        rows += [
            ("matmuls", f"6 x (block matrices / tp x layers x (1 + recomputed share) + output "
             f"layer / tp) x {tcfg.grad_accum_steps * tcfg.micro_batch_size * seq:,} tokens = "
             f"{w.matmul_flops:.4g} FLOPs / ({cluster.compute_efficiency:.2f} x "
             f"{peak / 1e12:.0f} TFLOP/s)", f"{w.seconds['matmuls']:.3f} s"),
            ("float8 matmuls", f"{w.float8_flops:.4g} FLOPs / ({FLOAT8_SPEEDUP} x "
             f"{cluster.compute_efficiency:.2f} x {peak / 1e12:.0f} TFLOP/s)",
             f"{w.seconds['float8 matmuls']:.3f} s"),
            ("attention", f"{w.attention_flops:.4g} FLOPs (causal: 6 x heads x head_dim x seq per "
             f"token and layer) / ({ATTENTION_EFFICIENCY * speed:.2f} x {peak / 1e12:.0f} TFLOP/s)",
             f"{w.seconds['attention']:.3f} s"),
            ("memory-bound", f"{w.memory_bytes:.4g} bytes / ({MEMORY_EFFICIENCY * speed:.2f} x "
             f"{cluster.memory_bandwidth / 1e12:.2f} TB/s)", f"{w.seconds['memory-bound']:.3f} s"),
            ("tp exposed", f"{w.tp_bytes:.4g} bytes / ({LINK_EFFICIENCY} x "
             f"{_link(cluster, d, 'tp') / 1e9:.0f} GB/s)", f"{w.seconds['tp exposed']:.3f} s"),
            ("bubble", f"(pp-1)/(v x microbatches + pp-1) = ({d['pp']}-1)/({dims.stages_per_rank} x "
             f"{dims.microbatches_per_step} + {d['pp']}-1)", f"{p.bubble:.1%}"),
            ("compute", "the busiest rank's sum above / (1 - bubble)", f"{p.compute_s:.3f} s")]
        for axis, volume in p.comm.items():
            if axis == "tp":
                continue
            link = _bandwidth(cluster, p.crosses_nodes[axis])
            rows.append((f"{axis} communication", _axis_how(s, dims, axis)
                         + f"{volume:.4g} bytes / ({LINK_EFFICIENCY} x {link / 1e9:.0f} GB/s, "
                         f"{'inter' if p.crosses_nodes[axis] else 'intra'}-node)",
                         f"{p.comm_seconds[axis]:.3f} s"))
        rows += [("exposed communication", f"data-parallel (and efsdp) less "
                  f"{cluster.comm_overlap:.0%} hidden"
                  + (", pipeline sends hidden" if recipe.pp_overlap else ", pipeline sends whole")
                  + ("" if "ep" not in p.comm else ", all-to-alls hidden" if recipe.ep_overlap
                     else ", all-to-alls whole") + (", K/V all-gathers whole" if "cp" in p.comm else ""),
                  f"{p.exposed_comm_s:.3f} s"),
                 ("step", "compute + exposed communication", f"{p.step_time_s:.3f} s"),
                 ("tokens/s", f"{tokens:,} / {p.step_time_s:.3f} s",
                  f"{p.tokens_per_s:,.0f} ({p.tokens_per_s / cluster.world_size:,.0f} per {noun})"),
                 ("MFU", f"model FLOPs per {noun} / ({peak / 1e12:.0f} TFLOP/s x step)", f"{p.mfu:.1%}")]
    lines = [f"Layout {p.name}, recipe {recipe.name}: the busiest pipeline rank's step", "",
             "| quantity | how | value |", "|---|---|---|"]
    lines += [f"| {name} | {how} | {value} |" for name, how, value in rows]
    return "\n".join(lines)
