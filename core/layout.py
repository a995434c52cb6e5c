"""The parallel layout of a run, in one object (torchtitan's ParallelDims is the model).

A layout is dp_replicate x dp_shard x cp x tp x pp = world size, laid out on a device mesh
named MESH_DIMS in row-major order with TP innermost, so TP groups are consecutive ranks on
the fastest links, and context parallelism (cp) next to them: its ranks exchange every
layer's keys and values. The ranks of a cp group hold the same samples, each a part of every
sequence (ParallelDims.cp); the weights are sharded by FSDP over dp_shard x cp. Expert parallelism (ep) adds no ranks: it splits dp_shard x tp into (efsdp,
ep), ep inner, and the experts of a mixture-of-experts model are sharded over ep (and by
FSDP over efsdp) while every other weight is sharded over dp_shard (and tp)
(ParallelDims.expert_mesh_shape). `ParallelDims` resolves a `-1` degree, says which data parallelism the trainer
applies (DDP for pure replication, FSDP2 otherwise), how layers split into pipeline stages
(`stage_layers`: the one stage rule, an explicit list or default_split with the ends
weighted), and, in `problems`, every rule a layout must satisfy,
each with its fix. The config's validation, the planner (goodput.planner) and
training.parallelize all ask it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# The degrees one -1 may fill (and the planner's search ranks). Context parallelism (cp) is
# set outright, never filled: its degree follows from the sequence length, not the cluster.
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")
LESS_FIRST, LESS_LAST = "pp_first_stage_less_layers", "pp_last_stage_less_layers"  # config fields
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # row-major: TP innermost


@dataclass(frozen=True)
class Problem:
    """Why a layout cannot run, and the change that makes it run."""

    reason: str
    fix: str
    # Advice: the trainer runs such a layout (the config accepts it); the planner warns about
    # it, and refuses it only when asked to be strict (parallelism.strict_layout, --strict).
    advice: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{self.reason}; fix: {self.fix}"


class LayoutError(ValueError):
    """Degrees that do not make a layout of the world size at all."""

    def __init__(self, problem: Problem):
        super().__init__(f"{problem.reason}; {problem.fix}")
        self.problem = problem


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b
    microbatches: int | None = None  # pipeline micro-batches per step; None: 2 x pp
    # Layers of each pipeline stage, in stage order (parallelism.pp_layers_per_stage); None:
    # the default split of stage_layers.
    layers_per_stage: tuple[int, ...] | None = None
    # The default split counts the first stage (embedding) and the last (final norm, output
    # layer, loss) as holding this many more layers (parallelism.pp_first_stage_less_layers,
    # pp_last_stage_less_layers): they get that many fewer. 0 and 0: the plain even split.
    first_stage_less_layers: int = 0
    last_stage_less_layers: int = 0
    # Stages per pipeline rank under interleaved-1f1b (parallelism.pp_virtual_stages); None: 2.
    virtual_stages: int | None = None
    # Expert parallelism (parallelism.ep): ranks of dp_shard that split each MoE layer's experts.
    ep: int = 1
    # Context parallelism (parallelism.cp): ranks that split every sequence, each holding two
    # of its 2 x cp chunks (i and 2cp-1-i, so that causal attention costs each the same).
    cp: int = 1

    @property
    def splits_output_layer(self) -> bool:
        """The output layer and loss are split their own way: over the vocabulary by TP, into
        the last pipeline stage's schedule by PP (so not in chunks: loss_chunk_tokens)."""
        return self.tp > 1 or self.pp > 1

    @classmethod
    def resolve(cls, degrees: dict[str, int], world_size: int, world: str = "",
                **pipeline) -> ParallelDims:
        """The layout of `degrees` (at most one of DEGREES -1: whatever the others leave;
        "cp" given outright, 1 when left out) on `world_size` ranks (`world` names them in
        errors). Raises LayoutError."""
        world = world or f"world size {world_size}"
        named = {d: degrees[d] for d in DEGREES}
        cp = degrees.get("cp", 1)
        if cp < 1:
            raise LayoutError(Problem(f"parallelism.cp={cp} must be a positive number of ranks "
                                      "(it is never filled by -1)", "set parallelism.cp=1 or more"))
        free = [d for d, v in named.items() if v == -1]
        if len(free) > 1 or any(v == 0 or v < -1 for v in named.values()):
            raise LayoutError(Problem(f"parallelism degrees must be positive, with at most one -1 "
                                      f"(got {named})", "give the others as numbers"))
        fixed = cp * math.prod(v for v in named.values() if v != -1)
        if free:
            if world_size % fixed:
                raise LayoutError(_fixed_degrees_problem({**named, "cp": cp}, free[0],
                                                         world_size, world))
            named[free[0]] = world_size // fixed
        elif fixed != world_size:
            raise LayoutError(Problem(f"dp_replicate*dp_shard*cp*tp*pp = {fixed} does not match {world}",
                                      "make the product equal it, or set one degree to -1 to fill "
                                      "the rest"))
        return cls(**named, cp=cp, **pipeline)

    @property
    def degrees(self) -> dict[str, int]:
        """Every degree, in the order of the layout's name: DEGREES with cp before tp."""
        return {d: getattr(self, d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}

    @property
    def name(self) -> str:
        """The degrees, and "x ep=N" after them under expert parallelism (which adds no ranks)."""
        ep = {"ep": self.ep} if self.ep > 1 else {}
        return " x ".join(f"{k}={v}" for k, v in {**self.degrees, **ep}.items())

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int]:
        """The ranks of a pipeline stage as expert parallelism splits them: (dp_replicate,
        efsdp, ep), dp_shard x tp = efsdp x ep with ep inner; experts are sharded over ep and
        by FSDP over efsdp (training.parallelize.build_expert_mesh). TP ranks hold different
        parts of the sequences, so to the experts they are ranks with tokens of their own."""
        return self.dp_replicate, self.dp_shard * self.tp // self.ep, self.ep

    # -- data parallelism ---------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: groups of ranks with samples of their own (the ranks of a cp
        group share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def loss_shares(self) -> int:
        """Ranks whose losses, each the mean over its own tokens, average to the step's loss:
        each data-parallel rank's cp ranks hold equal parts of its sequences."""
        return self.dp_size * self.cp

    @property
    def pure_replication(self) -> bool:
        return self.dp_shard == 1 and self.cp == 1 and self.tp == 1 and self.pp == 1

    @property
    def ddp(self) -> bool:
        """DDP: data parallelism is pure replication (nothing sharded, no CP, TP or PP)."""
        return self.dp_size > 1 and self.pure_replication

    @property
    def fsdp(self) -> bool:
        """FSDP2 (HSDP with dp_replicate > 1) for every other data-parallel layout, and under
        context parallelism: its ranks hold the same weights and average their gradients, so
        FSDP shards the weights over dp_shard x cp (as torchtitan does) at the cost of the
        all-reduce it replaces."""
        return self.loss_shares > 1 and not self.pure_replication

    # -- pipeline -----------------------------------------------------------------------------
    @property
    def stages_per_rank(self) -> int:
        """v: the stages each pipeline rank holds (interleaved-1f1b: parallelism.pp_virtual_stages,
        default 2; other schedules 1). More stages shrink the bubble v-fold and multiply the
        point-to-point transfers by v."""
        if self.pp == 1 or self.pp_schedule != "interleaved-1f1b":
            return 1
        return self.virtual_stages or 2

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def microbatches_per_step(self) -> int:
        """Pipeline micro-batches each micro-step is cut into (1 without PP)."""
        return (self.microbatches or 2 * self.pp) if self.pp > 1 else 1

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds (looping placement: r, r + pp, ...)."""
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def stage_problem(self, n_layers: int) -> Problem | None:
        """Why `n_layers` cannot be split into this layout's stages (stage_layers), if so."""
        where = f"pp={self.pp}, {self.pp_schedule}"
        given = self.layers_per_stage
        first, last = self.first_stage_less_layers, self.last_stage_less_layers
        weights = {f"parallelism.{LESS_FIRST}": first, f"parallelism.{LESS_LAST}": last}
        weighted = {name: value for name, value in weights.items() if value}
        if given is not None and weighted:
            named = " and ".join(f"{name}={value}" for name, value in weighted.items())
            return Problem(f"parallelism.pp_layers_per_stage={list(given)} and {named} both set "
                           "the pipeline split: the list gives every stage's layers, the "
                           "weights lighten the first and last stages of the default split",
                           "keep one: drop parallelism.pp_layers_per_stage, or set "
                           f"{' and '.join(f'{name}=0' for name in weighted)}")
        if self.virtual_stages is not None and self.virtual_stages != self.stages_per_rank:
            return Problem(f"parallelism.pp_virtual_stages={self.virtual_stages} needs "
                           f"pp_schedule=interleaved-1f1b and pp > 1 ({where})",
                           "set parallelism.pp_schedule=interleaved-1f1b, or drop "
                           "parallelism.pp_virtual_stages")
        if self.virtual_stages is not None and self.virtual_stages < 2:
            return Problem(f"parallelism.pp_virtual_stages={self.virtual_stages}: interleaving "
                           "needs at least 2 stages per pipeline rank",
                           "set it to 2 or more, or use pp_schedule=1f1b")
        if min(first, last) < 0:
            return Problem(f"{' and '.join(f'{n}={v}' for n, v in weights.items() if v < 0)} "
                           "must not be negative", "use 0 (no weight) or more")
        if self.pp == 1 and given is None:
            return None  # one stage holds the embedding, every layer and the output layer
        if given is not None:
            if len(given) != self.n_stages:
                per_rank = (f" ({self.stages_per_rank} per pipeline rank)" if self.stages_per_rank > 1
                            else "")
                return Problem(f"parallelism.pp_layers_per_stage lists {len(given)} stages, but "
                               f"{where} has {self.n_stages}{per_rank}",
                               f"list {self.n_stages} layer counts, or drop the field for the "
                               "default split")
            if min(given) < 1 or sum(given) != n_layers:
                example = (f", e.g. {default_split(n_layers, self.n_stages)}"
                           if n_layers >= self.n_stages else "")
                return Problem(f"parallelism.pp_layers_per_stage={list(given)} must give every "
                               f"stage at least one layer and sum to model.n_layers={n_layers} "
                               f"(it sums to {sum(given)})",
                               f"list {self.n_stages} counts of at least 1 summing to {n_layers}"
                               + example)
            return None
        if n_layers < self.n_stages:
            return Problem(f"{self.n_stages} pipeline stages ({where}) exceed n_layers={n_layers}: "
                           "each stage needs at least one layer", self._fewer_stages_fix(n_layers))
        sizes = default_split(n_layers, self.n_stages, first_less=first, last_less=last)
        if min(sizes) >= 1:
            return None
        # Only an end can run dry: the others get at least n_layers // n_stages >= 1.
        fit = _weights_that_fit(n_layers, self.n_stages, first, last)
        dry = [(name, value, end, fitted) for (name, value), end, size, fitted
               in zip(weights.items(), ("first", "last"), (sizes[0], sizes[-1]), fit) if size < 1]
        return Problem(
            f"{' and '.join(f'{name}={value}' for name, value, _, _ in dry)} "
            f"leave{'s' if len(dry) == 1 else ''} the "
            f"{' and the '.join(end for _, _, end, _ in dry)} pipeline stage without a layer: "
            f"model.n_layers={n_layers} on {self.n_stages} stages ({where}) would split {sizes}",
            f"set {' and '.join(f'{name}={fitted}' for name, _, _, fitted in dry)} or less "
            f"(split {default_split(n_layers, self.n_stages, first_less=fit[0], last_less=fit[1])})"
            ", or lower parallelism.pp")

    def _fewer_stages_fix(self, n_layers: int) -> str:
        """The changes that give each of the stages a layer: fewer pipeline ranks, fewer
        stages per rank (only under interleaving), or more layers."""
        v = self.stages_per_rank
        most = max(1, n_layers // v)
        fixes = ["set parallelism.pp=1" if most == 1 else f"lower parallelism.pp to {most} or less"]
        if v > 1:
            if n_layers // self.pp >= 2:
                fixes.append(f"parallelism.pp_virtual_stages to {n_layers // self.pp} or less")
            if n_layers >= self.pp:
                fixes.append("use a non-interleaved parallelism.pp_schedule (1f1b or gpipe: "
                             "one stage per pipeline rank)")
        return ", or ".join(fixes) + f", or raise model.n_layers to {self.n_stages} or more"

    def stage_layers(self, n_layers: int) -> list[int]:
        """Layers per pipeline stage: the one stage rule, which the config's validation, the
        planner and training.parallelize all follow. parallelism.pp_layers_per_stage when
        given, else default_split with the first and last stages lightened by
        parallelism.pp_first_stage_less_layers and pp_last_stage_less_layers. Raises
        LayoutError when `n_layers` cannot fill the stages."""
        problem = self.stage_problem(n_layers)
        if problem is not None:
            raise LayoutError(problem)
        if self.layers_per_stage is not None:
            return list(self.layers_per_stage)
        return default_split(n_layers, self.n_stages, first_less=self.first_stage_less_layers,
                             last_less=self.last_stage_less_layers)

    def stage_bounds(self, n_layers: int) -> list[int]:
        """Stage s holds layers [bounds[s], bounds[s + 1])."""
        bounds = [0]
        for size in self.stage_layers(n_layers):
            bounds.append(bounds[-1] + size)
        return bounds

    @property
    def bubble(self) -> float:
        """Idle share of a pipelined step: (pp-1)/(m+pp-1); interleaving v stages per rank
        shrinks it to (pp-1)/(v*m+pp-1)."""
        return pipeline_bubble(self.pp, self.microbatches_per_step, self.stages_per_rank)

    # -- the rules ----------------------------------------------------------------------------
    def problems(self, *, n_heads: int, n_kv_heads: int, n_layers: int, seq_len: int,
                 micro_batch_size: int, vocab_size: int | None = None,
                 gpus_per_node: int | None = None, tied_embeddings: bool = False,
                 num_experts: int | None = None) -> list[Problem]:
        """Every rule this layout breaks for this model and batch, each with its fix.
        `vocab_size` and `gpus_per_node`, where known, add the vocabulary and TP-within-a-node
        rules; `num_experts` (a mixture-of-experts model's) the expert-parallel ones. Problems
        marked `advice` are the planner's: the trainer would run the layout."""
        tp, pp, m, v = self.tp, self.pp, self.microbatches_per_step, self.stages_per_rank
        limit = gpus_per_node  # TP beyond a node is ruled out above
        problems = []
        if gpus_per_node is not None and (tp > gpus_per_node or gpus_per_node % tp):
            problems.append(Problem(
                f"tp={tp} does not fit inside a node of {gpus_per_node} GPUs (TP all-reduces every "
                "layer and needs the fast intra-node links)",
                f"choose tp in {_divisors(gpus_per_node)} and move the rest to dp_shard or pp"))
        head_tp = math.gcd(n_heads, n_kv_heads)
        if head_tp % tp:
            # Each TP rank holds whole heads: tp divides the query heads and the key/value ones.
            heads = {"model.n_heads": n_heads, "model.n_kv_heads": n_kv_heads}
            undivided = [f"{name}={value}" for name, value in heads.items() if value % tp]
            if n_kv_heads == n_heads:
                undivided = undivided[:1]  # no GQA: n_kv_heads is n_heads
            problems.append(Problem(
                f"parallelism.tp={tp} does not divide {' and '.join(undivided)}: each tensor-"
                "parallel rank holds whole attention heads",
                f"choose parallelism.tp in {_divisors(head_tp, limit)}"))
        if vocab_size is not None and vocab_size % tp:
            problems.append(Problem(
                f"tp={tp} does not divide the vocabulary ({vocab_size}) that TP splits",
                f"choose tp in {_divisors(math.gcd(vocab_size, head_tp), limit)}, or a "
                f"model.vocab_multiple_of divisible by {tp}"))
        problems += self.context_problems(seq_len, num_experts)
        if seq_len % self.cp == 0 and (seq_len // self.cp) % tp:
            # Sequence parallelism splits every sequence (under CP, this rank's part of it)
            # over the TP ranks: uneven parts give the ranks different shapes and the
            # collectives fail or hang.
            held = (f"training.seq_len={seq_len}" if self.cp == 1 else
                    f"the {seq_len // self.cp} tokens of training.seq_len={seq_len} each of "
                    f"cp={self.cp} ranks holds")
            multiple = self.sequence_multiple
            problems.append(Problem(
                f"tp={tp} does not divide {held}, which sequence parallelism splits over the TP "
                "ranks",
                f"choose tp in {_divisors(math.gcd(seq_len // self.cp, head_tp), limit)}, or a "
                f"seq_len divisible by {multiple}, e.g. {multiple * -(-seq_len // multiple)}"))
        problems += self.expert_problems(num_experts)
        stages = self.stage_problem(n_layers)
        if stages is not None:
            problems.append(stages)
        if pp == 1:
            return problems
        if tied_embeddings:
            # One matrix would live on the first stage (embedding) and the last (output):
            # its two gradients would have to be summed across stages every step, and its
            # two copies kept equal; the pipeline split does not do that.
            problems.append(Problem(
                f"model.tie_embeddings=true shares the embedding matrix with the output layer, "
                f"but pp={pp} puts them on different pipeline stages",
                "set parallelism.pp=1 and split the model with parallelism.dp_shard or tp instead"
                " (or model.tie_embeddings=false for a model not loaded with model.init_from)"))
        if self.pp_schedule == "1f1b" and m < pp:
            # torch.distributed.pipelining.Schedule1F1B refuses fewer micro-batches than stages:
            # its warm-up sends one micro-batch into every stage before the first backward.
            problems.append(Problem(
                f"pp_schedule=1f1b needs at least as many micro-batches as stages: "
                f"microbatches={m} < pp={pp}",
                f"set parallelism.microbatches={pp} or more (2*pp={2 * pp} keeps the bubble "
                "small), or pp_schedule=gpipe"))
        elif m < 2 * pp:
            bubble = pipeline_bubble(pp, m, v)
            problems.append(Problem(
                f"microbatches={m} < 2*pp={2 * pp}: the pipeline bubble "
                f"(pp-1)/({f'{v}*' if v > 1 else ''}microbatches+pp-1) = {bubble:.1%} of the step "
                "idles every GPU",
                f"set parallelism.microbatches={2 * pp} (or more) and training.micro_batch_size "
                f"to a multiple of it (bubble {pipeline_bubble(pp, 2 * pp, v):.1%})", advice=True))
        if micro_batch_size % m:
            problems.append(self._microbatch_split_problem(micro_batch_size))
        if v > 1 and m % max(1, m // pp):  # the schedule runs m in rounds of equal size
            problems.append(Problem(
                f"microbatches={m} do not split into equal rounds of interleaved-1f1b over pp={pp}",
                f"set parallelism.microbatches to a multiple of {pp}, or at most {pp}"))
        return problems

    def _microbatch_split_problem(self, micro_batch_size: int) -> Problem:
        """training.micro_batch_size does not split into the pipeline micro-batches: either
        side may change (parallelism.microbatches to a divisor the schedule runs)."""
        pp, m, v = self.pp, self.microbatches_per_step, self.stages_per_rank
        source = ("parallelism.microbatches" if self.microbatches else
                  f"parallelism.microbatches' default 2*pp={2 * pp}")
        runs = [d for d in _divisors(micro_batch_size)
                if (self.pp_schedule != "1f1b" or d >= pp) and (v == 1 or d % max(1, d // pp) == 0)]
        fix = f"set training.micro_batch_size to a multiple of {m} (e.g. {m * -(-micro_batch_size // m)})"
        if len(runs) == 1:
            fix += f", or parallelism.microbatches={runs[0]}"
        elif runs:
            fix += (f", or parallelism.microbatches to one of {runs} (the divisors of "
                    f"training.micro_batch_size={micro_batch_size}"
                    + (" that pp_schedule=1f1b runs" if self.pp_schedule == "1f1b" else "") + ")")
        else:  # 1f1b needs at least pp micro-batches, and the micro-batch has fewer samples
            fix += (f", or parallelism.microbatches={pp} (pp_schedule=1f1b needs at least pp) "
                    f"with training.micro_batch_size a multiple of {pp}")
        if min(runs or [pp]) < 2 * pp:
            fix += (f"; fewer than 2*pp={2 * pp} micro-batches run, with a larger pipeline "
                    "bubble (goodput plan says how much)")
        return Problem(f"training.micro_batch_size={micro_batch_size} does not split into {m} "
                       f"pipeline micro-batches ({source})", fix)

    @property
    def sequence_multiple(self) -> int:
        """What training.seq_len must be a multiple of: 2 x cp chunks, each rank's part (or
        the whole sequence) split evenly over tp by sequence parallelism."""
        return self.cp * math.lcm(2, self.tp) if self.cp > 1 else self.tp

    def context_problems(self, seq_len: int, num_experts: int | None) -> list[Problem]:
        """The rules of context parallelism: the sequence splits into 2 x cp equal chunks, and
        what it does not carry yet is refused. It has no rule on the heads: each rank
        all-gathers the keys and values of every head (training.context_parallel), where an
        all-to-all over heads (DeepSpeed-Ulysses) would need cp to divide them."""
        cp, problems = self.cp, []
        if cp == 1:
            return problems
        if seq_len % (2 * cp):
            multiple = self.sequence_multiple
            # Degrees of CP this sequence splits for, among those the world has room for.
            fitting = [d for d in _divisors(seq_len // 2) if d > 1 and self.world_size % d == 0]
            problems.append(Problem(
                f"training.seq_len={seq_len} does not split into 2 x cp = {2 * cp} equal chunks: "
                f"parallelism.cp={cp} gives each rank two chunks of every sequence (the i-th and "
                "the i-th from the end, which balances causal attention)",
                f"set training.seq_len to a multiple of {multiple}, e.g. "
                f"{multiple * -(-seq_len // multiple)}"
                + (f", or parallelism.cp to one of {fitting}" if fitting else "")))
        if num_experts is not None:
            # An MoE layer's balance loss and routing statistics are computed per sequence,
            # which CP would cut into parts; expert parallelism borrows dp_shard x tp, not cp.
            problems.append(Problem(
                f"parallelism.cp={cp} with a mixture-of-experts model (model.moe) is not "
                "supported: the balance loss and the routing statistics are per sequence, and "
                "each cp rank holds only parts of its sequences",
                "set parallelism.cp=1 (shard the model with dp_shard, tp or ep instead), or "
                "train a dense model"))
        if self.pp > 1:
            problems.append(Problem(
                f"parallelism.cp={cp} with pp={self.pp} is not supported: pipeline stages "
                "would exchange the parts of sequences CP splits, which is not built",
                "set parallelism.pp=1 and lay the model out with dp_shard and tp beside cp"))
        return problems

    def expert_problems(self, num_experts: int | None) -> list[Problem]:
        """The rules of expert parallelism and of mixture-of-experts models."""
        ep, problems = self.ep, []
        if num_experts is None:
            if ep > 1:
                problems.append(Problem(f"parallelism.ep={ep} splits the experts of a "
                                        "mixture-of-experts model, and this model has none",
                                        "set parallelism.ep=1, or give the model model.moe"))
            return problems
        ranks = self.dp_shard * self.tp  # the ranks EP may use: each has tokens of its own
        named = f"parallelism.dp_shard={self.dp_shard}" + (f" x tp={self.tp}" if self.tp > 1 else "")
        if ranks % ep:
            problems.append(Problem(
                f"parallelism.ep={ep} does not divide {named}: expert parallelism splits the "
                "experts over the ranks of dp_shard (and of tp, whose ranks hold other parts "
                "of the sequences)",
                f"set parallelism.dp_shard so that dp_shard x tp is a multiple of {ep}, or ep "
                f"to one of {_divisors(ranks)}"))
        if num_experts % ep:
            problems.append(Problem(
                f"parallelism.ep={ep} does not divide model.moe.num_experts={num_experts}: each "
                "EP rank holds an equal share of the experts",
                f"choose ep in {[d for d in _divisors(num_experts) if ranks % d == 0]}"))
        return problems


# -- elastic worlds ----------------------------------------------------------------------------

def follow_world(dims: ParallelDims, grad_accum_steps: int, world_size: int,
                 world: str = "") -> tuple[ParallelDims, int]:
    """The layout and the gradient accumulation that train `dims` (the full world's layout,
    accumulating `grad_accum_steps` micro-steps) on `world_size` ranks: the world an elastic
    job gets once nodes have left or joined.

    tp and pp stay as they are (they live inside a node or a pipeline stage); the
    data-parallel degree absorbs the change (dp_replicate, or dp_shard where the data
    parallelism is sharding only; under HSDP dp_shard stays and dp_replicate changes); and
    accumulation keeps the global batch exactly: dp x accumulation stays the same product,
    so 4 ranks x accumulation 1 become 2 ranks x accumulation 2. The data order is global
    (training.data), so the samples of each step are the same ones in any such layout.
    Raises LayoutError when `world_size` cannot keep the global batch."""
    world = world or f"world size {world_size}"
    if world_size == dims.world_size:
        return dims, grad_accum_steps
    inner = dims.tp * dims.pp
    if world_size % inner:
        raise LayoutError(Problem(
            f"{world} is not a multiple of tp x pp = {inner}, which stay fixed when the world "
            "changes", "choose nodes whose workers make a multiple of tp x pp"))
    dp = world_size // inner
    per_step = dims.dp_size * grad_accum_steps  # micro-batches of one optimizer step
    if per_step % dp:
        raise LayoutError(Problem(
            f"{world} gives a data-parallel degree of {dp}, which does not divide the "
            f"{per_step} micro-batches of a step (data-parallel degree {dims.dp_size} x "
            f"accumulation {grad_accum_steps} on the full world): the global batch cannot be "
            "kept", f"make dp x training.grad_accum_steps a multiple of {dp}"))
    if dims.dp_shard == 1:
        degrees = {**dims.degrees, "dp_replicate": dp}
    elif dims.dp_replicate == 1:
        degrees = {**dims.degrees, "dp_shard": dp}
    elif dp % dims.dp_shard:
        raise LayoutError(Problem(
            f"{world} gives a data-parallel degree of {dp}, which HSDP's dp_shard="
            f"{dims.dp_shard} does not divide (dp_shard stays; dp_replicate changes)",
            "choose nodes whose data-parallel degree is a multiple of dp_shard"))
    else:
        degrees = {**dims.degrees, "dp_replicate": dp // dims.dp_shard}
    shrunk = replace(dims, **degrees)
    return shrunk, per_step // dp


def default_split(n_layers: int, n_stages: int, *, first_less: int = 0,
                  last_less: int = 0) -> list[int]:
    """As even as possible; when uneven, the lighter stages are the first and the last (then
    the second and the second-to-last, ...): they also hold the embedding, and the output
    layer with the loss. Llama 3 405B's 126 layers on 16 stages: [7, 8 x 14, 7], the split
    Meta trained it with (The Llama 3 Herd of Models, section 3.3.2).

    `first_less` and `last_less` weigh the ends: the first stage counts as holding that many
    layers more (its embedding), the last that many more (final norm, output layer, loss).
    n_layers + first_less + last_less layers are split as above, and the ends give up their
    weight: 126 on 16 with 2 and 2 splits 130 as [8 x 7, 9, 9, 8 x 7], so [6, 8 x 6, 9, 9,
    8 x 6, 6]. With interleaved stages the ends are the first stage of the first pipeline
    rank and the last stage of the last rank. 0 and 0 is the plain split; the result may hold
    stages without a layer (ParallelDims.stage_problem says so)."""
    total = n_layers + first_less + last_less
    base, extra = divmod(total, n_stages)
    sizes = [base + 1] * n_stages
    ends = [i for pair in zip(range(n_stages), reversed(range(n_stages))) for i in pair]
    lighter = list(dict.fromkeys(ends))[:n_stages - extra]
    for i in lighter:
        sizes[i] = base
    sizes[0] -= first_less
    sizes[-1] -= last_less
    return sizes


def _weights_that_fit(n_layers: int, n_stages: int, first: int, last: int) -> tuple[int, int]:
    """Weights at most `first` and `last` that leave every stage a layer: each lowered while
    its end runs dry (with n_layers >= n_stages an end of weight 0 never does)."""
    while True:
        sizes = default_split(n_layers, n_stages, first_less=first, last_less=last)
        if min(sizes) >= 1:
            return first, last
        if sizes[0] < 1 and first:
            first -= 1
        if sizes[-1] < 1 and last:
            last -= 1


def pipeline_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def _fixed_degrees_problem(degrees: dict[str, int], free: str, world_size: int,
                           world: str) -> Problem:
    """The degrees given (all but `free`, the -1 that takes the rest) multiply to a number
    that does not divide the world: name them, and the values of each that would fit."""
    given = {d: v for d, v in degrees.items() if d != free and v != 1}
    fixed = math.prod(given.values())
    named = " x ".join(f"parallelism.{d}={v}" for d, v in given.items())
    product = named if len(given) == 1 else f"{named} = {fixed}"
    choices = []
    for d, v in given.items():
        others = fixed // v
        if world_size % others == 0:
            choices.append(f"parallelism.{d} in {_divisors(world_size // others)}")
    fix = ("choose " + ", or ".join(choices) if choices else
           "choose degrees whose product divides it")
    return Problem(f"{product} (the degrees given; parallelism.{free}=-1 takes the rest) does "
                   f"not divide {world}", fix + ", or change the world size")


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]
