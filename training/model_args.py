"""The model's shape, without torch: what the planner and the flows need to know of
training/model.py's Transformer (and training/moe.py's experts) before, or without,
building one. The flow process imports it: importing torch there took a second of every
command's start, and the flows run the model only in processes of their own (training,
the verifiers, evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.config import ffn_hidden_width
from core.errors import ConfigError

# Tokens per chunk of the output layer and loss (training.model.linear_cross_entropy) where
# no config sets it: held-out losses use it, the planner suggests it for a layout out of
# memory. GPT-2's head at 8 x 1024 tokens on CPU: 0.11x the memory at 0.96x the time
# (benchmarks/loss_chunks_bench.py).
LOSS_CHUNK_TOKENS = 1024


@dataclass
class MoEArgs:
    num_experts: int
    top_k: int = 2
    expert_dim: int | None = None  # width of each routed expert's SwiGLU; None: the dense width
    shared_experts: int = 0  # experts every token passes through (one SwiGLU this many times wide)
    first_dense_layers: int = 0  # the first blocks keep a dense feed-forward (DeepSeek-V3: 3)
    score_func: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    route_norm: bool = False  # the top-k scores divided by their sum (Qwen3's norm_topk_prob)
    route_scale: float = 1.0  # the weights of the routed outputs scaled by this (DeepSeek-V3: 2.5)
    aux_loss_coeff: float = 0.0  # alpha of the sequence-wise balance loss; 0: off
    bias_update_rate: float = 0.0  # gamma of the aux-loss-free bias update; 0: off
    collapse_steps: int = 100  # an expert without tokens this many steps in a row: a warning


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None  # the SwiGLU width exactly (e.g. a checkpoint's); wins
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1's frequency-dependent RoPE scaling: {factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings}; None: plain RoPE.
    rope_scaling: dict | None = None
    max_seq_len: int = 256
    tie_embeddings: bool = False  # the output layer uses the embedding matrix (Llama 3.2 1B/3B)
    # Mixture-of-Experts feed-forwards (training.moe.MoEArgs' fields); None: dense.
    moe: dict | None = None
    head_dim: int | None = None  # width of a head; None: dim // n_heads (Qwen3 sets its own)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    qkv_bias: bool = False  # a bias on wq, wk and wv (Qwen2); wo stays bias-free

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return ffn_hidden_width(self.dim, self.ffn_multiple_of, self.ffn_dim_multiplier,
                                self.ffn_hidden_dim)

    @property
    def moe_args(self) -> MoEArgs | None:
        return MoEArgs(**self.moe) if self.moe is not None else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe_args.first_dense_layers

    @property
    def expert_hidden(self) -> int:
        """The SwiGLU width of one expert: model.moe.expert_dim, else the dense width."""
        return self.moe_args.expert_dim or self.ffn_hidden


def hf_architecture(args: ModelArgs) -> str:
    """The transformers model_type a model exports as: llama, qwen2 (with model.qkv_bias) or
    qwen3 (with model.qk_norm); for a mixture of experts qwen3_moe (with model.qk_norm) or
    mixtral. (hf_export_problems says which combinations none of them has.)"""
    if args.moe is None:
        return "qwen2" if args.qkv_bias else "qwen3" if args.qk_norm else "llama"
    return "qwen3_moe" if args.qk_norm else "mixtral"


def hf_export_problems(args: ModelArgs, routing_bias: str | None = None) -> list[str]:
    """Why the model has no form transformers loads, if so: a mixture of experts exports as
    Mixtral or Qwen3-MoE, whose routing is fixed; neither has a routing bias (`routing_bias`:
    the name of a tensor holding one, if the weights have it). Without torch: the command's
    export hint asks it too."""
    from core.hf_llama import MIXTRAL_ROUTING, QWEN3_MOE_ROUTING

    architecture = hf_architecture(args)
    if args.qkv_bias and (args.qk_norm or args.moe is not None):
        # Qwen3's attention_bias would put a bias on the output projection too.
        return ["model.qkv_bias=true with " + ("model.qk_norm" if args.qk_norm else "model.moe")
                + " (Qwen2 has q/k/v biases but neither q/k norms nor experts)"]
    if architecture in ("llama", "qwen2", "qwen3"):
        return []
    fixed, label = ((MIXTRAL_ROUTING, "Mixtral") if architecture == "mixtral"
                    else (QWEN3_MOE_ROUTING, "Qwen3-MoE"))
    moe = vars(args.moe_args)
    problems = [f"model.moe.{k}={moe[k]} ({label}: {v})" for k, v in fixed.items() if moe[k] != v]
    if routing_bias:
        problems.append(f"a routing bias (model.moe.bias_update_rate, e.g. {routing_bias}), "
                        f"which {label}'s router does not have")
    return problems


def hf_exportable_overrides(args: ModelArgs, routing_bias: str | None = None) -> list[str]:
    """For a model with no transformers form (hf_export_problems): the fewest overrides with
    which the same model would have trained into one, Qwen3-MoE's or Mixtral's, e.g.
    ["model.qk_norm=true", "model.moe.bias_update_rate=0"] for configs/tiny-moe.yaml, whose
    first dense block and unnormalised top-k Mixtral lacks. [] where it has one."""
    from core.hf_llama import MIXTRAL_ROUTING, QWEN3_MOE_ROUTING

    if not hf_export_problems(args, routing_bias):
        return []
    fixes = ["model.qkv_bias=false"] if args.qkv_bias else []
    if args.moe is None:
        return fixes
    moe = vars(args.moe_args)
    # Mixtral first: of two as near, the one that adds no weights (q/k norms) to the model.
    routes = [] if args.qk_norm else [(MIXTRAL_ROUTING, [])]  # Mixtral has no q/k norms
    routes.append((QWEN3_MOE_ROUTING, [] if args.qk_norm else ["model.qk_norm=true"]))

    def value(v) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return min((fixes + first + [f"model.moe.{k}={value(v)}" for k, v in fixed.items() if moe[k] != v]
                + (["model.moe.bias_update_rate=0"] if routing_bias else [])
                for fixed, first in routes), key=len)


def moe_facts(a: ModelArgs) -> dict:
    """What of model.moe gives weights their shapes and meaning (routing settings may change)."""
    moe = a.moe_args
    if moe is None:
        return {"model.moe": "none"}
    return {"model.moe.num_experts": moe.num_experts, "expert width": a.expert_hidden,
            "model.moe.shared_experts": moe.shared_experts,
            "model.moe.first_dense_layers": moe.first_dense_layers}


def _own_tokenizer_size(init_from: str | None) -> int | None:
    """The number of tokens of model.init_from's own tokenizer.json (None: none there)."""
    if not init_from or not (Path(init_from) / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(init_from) / "tokenizer.json")).get_vocab_size()


def model_args_from_config(model_cfg, vocab_size: int) -> ModelArgs:
    """ModelConfig (core.config) + the tokenizer's vocabulary -> ModelArgs: the vocabulary
    rounded up to a multiple of model.vocab_multiple_of, or model.vocab_size where the config
    fixes it (a model.init_from checkpoint's embedding rows)."""
    fields = model_cfg.model_dump(exclude={"vocab_multiple_of", "vocab_size", "init_from",
                                           "init_from_fingerprint"})
    if model_cfg.vocab_size is None:
        multiple = model_cfg.vocab_multiple_of
        return ModelArgs(vocab_size=-(-vocab_size // multiple) * multiple, **fields)
    if vocab_size > model_cfg.vocab_size and _own_tokenizer_size(model_cfg.init_from) == vocab_size:
        directory = model_cfg.init_from
        raise ConfigError(
            f"model.init_from={directory}: the checkpoint's own tokenizer ({directory}/"
            f"tokenizer.json) has {vocab_size} tokens but its config.json's vocab_size is "
            f"{model_cfg.vocab_size}, so the model has embeddings for only that many: the two "
            "files are not of one model. Save the model and its tokenizer together again "
            "(save_pretrained; resize_token_embeddings first if tokens were added), or set "
            "tokenizer.path to the tokenizer the model was trained with")
    if vocab_size > model_cfg.vocab_size:
        source = (f"model.init_from={model_cfg.init_from} (its config.json)" if model_cfg.init_from
                  else "the config")
        fix = ("train on data tokenized with the model's own tokenizer (leave tokenizer.path "
               "unset with model.init_from: the checkpoint fixes model.vocab_size)"
               if model_cfg.init_from else "raise model.vocab_size, or leave it unset (the "
               "tokenizer's size, padded to model.vocab_multiple_of)")
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but model.vocab_size={model_cfg.vocab_size} "
            f"({source}) gives the model only that many embeddings; {fix}")
    return ModelArgs(vocab_size=model_cfg.vocab_size, **fields)
