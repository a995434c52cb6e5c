"""The training loop that runs in every torchrun worker.

    torchrun --nproc-per-node 2 -m training --config run.yaml --dataset DATASET_DIR

Reads like nanoGPT's train.py: set up, build the model, resume, then per step: learning
rate, micro-batches with gradient accumulation, clip, guard, optimizer step, checkpoint,
metrics. The layout (training.parallelize), checkpointing (training.checkpoint) and what
keeps a run safe (training.resilience) each sit beside the loop; nothing here knows about
Prefect.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from core.config import RunConfig, trajectory_json
from core.errors import ConfigError, DataError
from core.layout import ParallelDims
from core.protocol import (ENV_LEASE_HOLDER, ENV_MTBF_S, ENV_ORPHAN_AFTER_S, ENV_RESTART_WAIT_S,
                           ENV_STOP_AFTER, TIME_LIMIT, LeaseWatch, ResumeSpec, attempt_of_worker)
from training.checkpoint.component import Checkpointer, Progress
from training.checkpoint.resume import resolve_resume
from training.data import DistributedSampleLoader, open_training_data
from training.distributed import Dist, init_distributed
from training.hf_weights import load_hf_weights
from training.logs import get_logger
from training.metrics import MetricsWriter, StepMetrics, peak_flops, peak_resident_bytes, read_metrics
from training.model import Transformer, cross_entropy, model_args_from_config
from training.moe import set_loss_scale
from training.moe_balance import ExpertBalance
from training.parallelize import Layout, clip_grad_norm_, parallelize
from training.profiling import StepProfiler
from training.resilience import FaultInjector, Preempted, Resilience
from training.tracking import open_trackers

log = get_logger("train")


def train(config: RunConfig, dataset_dir: Path, resume: ResumeSpec = ResumeSpec.newest_committed()) -> dict:
    """Run (or continue) training to config.training.max_steps, or to the checkpoint saved
    just past the flow run's deadline (GOODPUT_STOP_AFTER). Returns a small summary."""
    tcfg = config.training
    env = init_distributed(config.parallelism)
    dims, accum = layout_dims(config, env)  # an elastic job's world may have shrunk or grown
    cuda_graphs = config.parallelism.cuda_graphs and env.device.type == "cuda"
    if cuda_graphs and accum > 1:  # the config refuses it; an elastic shrink can come to it
        raise ConfigError(f"parallelism.compile_mode={config.parallelism.compile_mode} (CUDA "
                          f"graphs) on {env.world_size} workers needs gradient accumulation "
                          f"{accum} to keep the global batch, which CUDA graphs cannot run; "
                          "use parallelism.compile_mode=default")
    torch.manual_seed(tcfg.seed)

    data = open_training_data(dataset_dir)
    names = [source.name for source in config.data.mix()]
    if [source.name for source in data.sources] != names:
        raise ConfigError(f"--dataset {dataset_dir} holds the sources "
                          f"{', '.join(s.name for s in data.sources)}, the config mixes {', '.join(names)}; "
                          "pass the directory the train flow located for this config")
    # On the meta device: parallelize allocates and initialises only this rank's part of it
    # (the single-process model's weights in every layout, from training.seed).
    with torch.device("meta"):
        model = Transformer(model_args_from_config(config.model, data.vocab_size))
    args = model.args
    model_args, n_params = vars(args), model.num_params(non_embedding=False)
    flops_per_token = model.flops_per_token(tcfg.seq_len)
    start = resolve_resume(resume, config.run_dir, float(os.environ.get(ENV_RESTART_WAIT_S, "0")))
    # Every weight comes from the checkpoint when resuming, and from model.init_from's files
    # when starting from a Hugging Face model: drawing initial values first would only
    # lengthen the start. A resumed run has moved on from init_from; its checkpoint wins.
    init_from = config.model.init_from if start is None else None
    layout = parallelize(model, config.parallelism, dims, env.device,
                         pipeline_loss(accum * dims.microbatches_per_step),
                         seed=tcfg.seed if start is None and init_from is None else None,
                         microbatch=(tcfg.micro_batch_size // dims.microbatches_per_step, tcfg.seq_len))
    del model  # from here on the layout's parts are the model
    if init_from is not None:
        load_hf_weights(layout.model_parts, init_from, config.model.tie_embeddings)
    optimizers = [build_optimizer(part, tcfg, env.device) for part in layout.model_parts]
    balance = None
    if args.moe is not None:  # the balance loss shares each forward's part of the step's loss
        for part in layout.model_parts:
            set_loss_scale(part, 1 / (accum * dims.microbatches_per_step))
        balance = ExpertBalance(args, layout, env.device, env.is_main)
    loader = DistributedSampleLoader({source.name: source.stream("train") for source in data.sources},
                                     tcfg.seq_len, tcfg.micro_batch_size, layout.dp_rank, layout.dp_size,
                                     tcfg.seed, tcfg.shuffle_window_tokens, config.mix_stages())
    tokens_per_step = tcfg.micro_batch_size * accum * tcfg.seq_len * layout.dp_size  # the same on any world
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    metrics = StepMetrics(MetricsWriter(config.run_dir, enabled=env.is_main), attempt=attempt_of_worker(),
                          max_steps=tcfg.max_steps, log_every=tcfg.log_every,
                          tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                          world_size=env.world_size,
                          device_peak_flops=peak_flops(device_name, tcfg.peak_flops_per_device),
                          device_memory=lambda: device_memory(env.device))
    progress = Progress()
    faults = FaultInjector.for_config(config, env.rank)
    checkpointer = Checkpointer(
        config, layout.model_parts, optimizers, progress, loader,
        {"world_size": env.world_size, "layout": dims.degrees, "config_hash": config.config_hash(),
         "dataset_id": data.dataset_id, "eos_id": data.eos_id,
         "tokenizer_sha256": data.tokenizer_sha256, "trajectory": trajectory_json(config),
         "model_args": model_args,
         "seq_len": tcfg.seq_len},
        # The supervisor passes the run's MTBF so far; a plain run has only the configured one.
        mtbf_s=float(os.environ.get(ENV_MTBF_S) or (config.faults.mtbf_hours or 0) * 3600),
        fault_hook=faults.in_save,
        announce=lambda loss: metrics.saving(progress.step, loss), record_steps=metrics.log_window)
    resumed_from = checkpointer.load(start)
    if resumed_from and env.is_main:
        log.info("resumed from %s at step %d", resumed_from, progress.step)
    loader.skip_windows(skipped_data(config))
    if env.is_main:  # the steps after progress.step are redone: the trackers mark or hide them
        earlier = ({r["step"]: r for r in read_metrics(config.run_dir) if r["step"] <= progress.step}
                   if config.tracking.mlflow_uri else {})  # what MLflow may lack of earlier attempts
        metrics_file = config.run_dir.metrics_file
        retried = metrics_file.is_file() and metrics_file.stat().st_size > 0  # an attempt logged before
        metrics.writer.trackers = open_trackers(config.tracking, config.run_dir.path, config.run.run_id,
                                                progress.step if retried else None, flat_config(config),
                                                [earlier[step] for step in sorted(earlier)])
    validation = HeldOutInLoop(config, data, layout, env.device, accum, eager=cuda_graphs)
    stop_after = os.environ.get(ENV_STOP_AFTER)
    holder, orphan_after = os.environ.get(ENV_LEASE_HOLDER), os.environ.get(ENV_ORPHAN_AFTER_S)
    lease = (LeaseWatch(config.run_dir, holder, float(orphan_after))
             if holder and orphan_after and env.is_main else None)
    resilience = Resilience(config, env.rank, checkpointer, faults,
                            stop_after=float(stop_after) if stop_after else None, lease=lease)
    if env.is_main:
        stages = (f" (layers per stage {dims.stage_layers(model_args['n_layers'])})"
                  if dims.pp > 1 else "")
        log.info("%s parameters, world size %d, layout %s%s, %s tokens/step, %s",
                 f"{n_params:,}", env.world_size, dims.name, stages, f"{tokens_per_step:,}",
                 f"steps {progress.step + 1}..{tcfg.max_steps}" if progress.step < tcfg.max_steps
                 else f"trained to step {progress.step}")
        if env.world_size != config.parallelism.world_size:
            log.info("elastic: %d of %d workers, gradient accumulation %d (configured %d): "
                     "the global batch of %d samples is kept", env.world_size,
                     config.parallelism.world_size, accum, tcfg.grad_accum_steps, config.global_batch)
        if progress.step >= tcfg.max_steps:
            log.info("step %d is training.max_steps: nothing to train (a longer run is another "
                     "run.run_id: its schedule is another one)", progress.step)

    profiler = StepProfiler.for_config(config.profiling, config.run_dir, env.rank, env.device,
                                       env.is_main)
    loss = float("nan")
    stage = loader.stage
    if env.is_main and len(data.sources) > 1:
        staged = len(config.mix_stages()) - 1  # data.stages: 0 without a curriculum
        log.info("[data] mix%s from step %d on: weights %s", f" stage {stage} of {staged}" if staged else "",
                 progress.step + 1, loader.stage_weights(stage))
    try:
        if profiler is not None:
            profiler.start(progress.step)
        while progress.step < tcfg.max_steps:
            if profiler is not None:  # a profile that ended with the step before is saved here
                profiler.step(progress.step + 1)
            step_start = time.perf_counter()
            lr = set_lr(optimizers, lr_at(progress.step + 1, tcfg))
            loss_sum = torch.zeros((), device=env.device)
            if cuda_graphs:  # the blocks' graphs' outputs of the step before are not read again
                torch.compiler.cudagraph_mark_step_begin()
            for micro in range(accum):
                inputs, targets = to_device(loader.next_batch(), env.device)
                loss_sum += forward_backward(layout, inputs, targets, env.device,
                                             last_micro=micro == accum - 1, accum=accum)
            mean_loss = global_loss(layout, faults.poison_loss(progress.step + 1, loss_sum))
            norm = clip_grad_norm_(layout, tcfg.grad_clip)
            # The step's one host read: loss and norm together (each read waits for the device).
            loss, grad_norm = torch.stack([mean_loss, norm.to(mean_loss)]).tolist()
            resilience.check(progress.step + 1, loss, grad_norm, loader.sample_index)
            stall = checkpointer.before_update()  # a background save may still be copying the weights
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            moe_stats = balance.after_step() if balance is not None else {}  # the routing biases
            progress.step += 1
            progress.tokens_seen += tokens_per_step
            step_time = time.perf_counter() - step_start - stall  # checkpoint stall kept out
            # The held-out losses before the save: from rank 0's commit of a checkpoint to its
            # record of the step, no collective runs (a node lost then must not take the record
            # of a step the next attempt will not train again); checkpointer.settle() below.
            validated = validation.maybe_run(progress.step)
            stall += checkpointer.maybe_save(loss, step_time)
            metrics.step(progress.step, loss=loss, lr=lr, grad_norm=grad_norm,
                         tokens_seen=progress.tokens_seen, step_time_s=step_time, checkpoint_s=stall,
                         data_wait_s=loader.take_wait_s(), save_in_flight=checkpointer.in_flight,
                         validation=validated, checkpointed=checkpointer.saved_step == progress.step,
                         model_stats={**moe_stats, **loader.mix_figures()})
            if loader.stage != stage:  # the next step draws by new weights
                stage = loader.stage
                # A record at a stage's last step: the summary's shares per stage are exact.
                metrics.log_window()
                if env.is_main:
                    log.info("[data] mix stage %d from step %d on: weights %s", stage,
                             progress.step + 1, loader.stage_weights(stage))
            checkpointer.settle()
            if resilience.after_step(progress.step, loss):
                if env.is_main:
                    log.info("time limit: stopping after the checkpoint of step %d", progress.step)
                # Announced: the supervisor then allows a save's time (checkpoint_timeout_s),
                # not a step's, for a background save still committing.
                checkpointer.wait(loss)
                break

        if profiler is not None:
            profiler.stop()  # a profile the run's end cut short is saved
        checkpointer.close()  # the last checkpoint is committed before the job reports success
    except BaseException as stop:  # the trackers still send or flush what they hold of the steps done
        # (Every step a checkpoint keeps is recorded by now: a checkpointed step at once, the
        # steps an emergency save keeps before it commits them.)
        with contextlib.suppress(Exception):  # never in place of the failure itself
            metrics.writer.close("KILLED" if isinstance(stop, (Preempted, KeyboardInterrupt))
                                 else "FAILED")
        raise
    metrics.writer.close()
    summary = {"final_step": progress.step, "tokens_seen": progress.tokens_seen, "final_loss": loss,
               "stopped": TIME_LIMIT if progress.step < tcfg.max_steps else None}
    # Clean shutdown: without it gloo workers sometimes abort at exit (STACK_NOTES).
    del layout, optimizers, checkpointer, resilience
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def lr_at(step: int, cfg) -> float:
    """Linear warmup to the peak, then cosine down to min_lr_ratio * peak at max_steps.

    A pure function of the step, so the schedule needs no state of its own in a checkpoint.
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> float:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
    return lr


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights), as in GPT-2/Llama recipes.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel per parameter on either device. On the CPU the default (a loop of
    # single-tensor ops) took 1.5-2.1 s a step for a 124M model's AdamW on one thread, the
    # fused kernel 0.22 s (RESULTS.md, issue 37); the two agree to float32 rounding and
    # keep the same state (checkpoints load either way).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=device.type in ("cuda", "cpu"))


class HeldOutInLoop:
    """In-loop validation (eval.every_steps): the held-out loss of each source and of the mix
    over the first eval.in_loop_batches validation batches of each source, split over the
    data-parallel ranks; every rank takes part (FSDP gathers, pipeline stages pass activations)."""

    def __init__(self, config: RunConfig, data, layout: Layout, device: torch.device, accum: int,
                 eager: bool = False):
        self.every, self.data, self.layout, self.device = config.eval.every_steps, data, layout, device
        # Under CUDA graphs the blocks run their own code here: a forward with no backward
        # after it would start a new generation of graphs over the training step's buffers.
        self.eager = eager
        self.seq_len, self.micro_batch = config.training.seq_len, config.training.micro_batch_size
        self.batches, self.accum = config.eval.in_loop_batches, accum  # pipeline_loss's share
        # Opened and sized now: a split too small fails before training, not at step every_steps.
        self.streams = ({s.name: s.stream("validation") for s in data.sources} if self.every else {})
        self.per_rank = {name: self._batches_per_rank(stream) for name, stream in self.streams.items()}

    def maybe_run(self, step: int) -> dict | None:
        if not self.every or step % self.every:
            return None
        started = time.perf_counter()
        with torch.compiler.set_stance("force_eager") if self.eager else nullcontext():
            losses = {name: self._loss(stream, self.per_rank[name]) for name, stream in self.streams.items()}
        found = {"val_loss": self.data.weighted_by_mix(losses)}
        if len(losses) > 1:
            found.update({f"val_loss/{name}": loss for name, loss in losses.items()})
        return {**found, "val_time_s": time.perf_counter() - started}

    def _batches_per_rank(self, stream) -> int:
        dp = self.layout.dp_size
        # The same number of batches on every data-parallel rank: their forwards are collective.
        per_rank = min(max(1, self.batches // dp), stream.num_samples(self.seq_len) // (self.micro_batch * dp))
        if per_rank == 0:
            raise DataError(f"the validation split has {stream.n_tokens} tokens: fewer than one "
                            f"batch of {self.micro_batch} x {self.seq_len} per data-parallel rank "
                            "for eval.every_steps; add data, raise data.validation_fraction or "
                            "set eval.every_steps=0")
        return per_rank

    @torch.no_grad()
    def _loss(self, stream, per_rank: int) -> float:
        layout = self.layout
        first = layout.dp_rank * per_rank * self.micro_batch
        total = torch.zeros((), device=self.device)
        for b in range(per_rank):
            rows = [stream.window((first + b * self.micro_batch + i) * self.seq_len, self.seq_len + 1)
                    for i in range(self.micro_batch)]
            batch = torch.from_numpy(np.stack(rows)).to(self.device)
            total += batch_loss(layout, batch[:, :-1], batch[:, 1:], self.device, self.accum)
        return (global_loss(layout, total) / per_rank).item()


def batch_loss(layout: Layout, inputs, targets, device, accum: int) -> torch.Tensor:
    """The mean loss of one batch, forward only (the last pipeline stage's, or 0 elsewhere;
    under context parallelism, of this rank's part of the sequences)."""
    inputs, targets = layout.sequence_part(inputs, targets)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=layout.autocast)
    with autocast:
        if layout.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if layout.first_stage else ()
            kwargs = {"target": targets, "losses": losses} if layout.last_stage else {}
            layout.schedule.eval(*args, **kwargs)
            if not layout.last_stage:
                return torch.zeros((), device=device)
            # pipeline_loss gives each micro-batch its share of a step's mean: undo the steps'
            return torch.stack(losses).sum().float() * accum
        return layout.mean_loss(layout.model_parts[0], inputs, targets).float()


def flat_config(config: RunConfig) -> dict:
    """The config as `section.field` parameters, for a tracking backend's run."""
    flat = {}
    for section, fields in config.model_dump(mode="json").items():
        for name, value in fields.items():
            flat[f"{section}.{name}"] = value
    return flat


def pipeline_loss(share: int):
    """The loss of one pipeline micro-batch: its share of the step's mean (`share` = pipeline
    micro-batches x accumulation micro-steps)."""
    def loss_fn(logits, targets):
        return cross_entropy(logits, targets) / share
    return loss_fn


def layout_dims(config: RunConfig, env: Dist) -> tuple[ParallelDims, int]:
    """The layout and gradient accumulation of the world torchrun started: the configured
    ones on parallelism.nnodes; on fewer or more nodes of an elastic range, the layout that
    keeps the global batch (RunConfig.layout_on). A plain single process (no torchrun) runs
    the model whole."""
    if not dist.is_initialized():
        return ParallelDims(), config.training.grad_accum_steps
    par, (low, high) = config.parallelism, config.node_range
    nodes, extra = divmod(env.world_size, par.nproc_per_node)
    if extra or not low <= nodes <= high:
        wanted = (f"parallelism.nnodes x nproc_per_node = {par.world_size}" if low == high else
                  f"{low} to {high} nodes (elastic.min_nodes to parallelism.nnodes) x "
                  f"{par.nproc_per_node} (parallelism.nproc_per_node)")
        raise ConfigError(f"torchrun started {env.world_size} workers but the config asks for "
                          f"{wanted}")
    try:
        return config.layout_on(nodes)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def skipped_data(config: RunConfig) -> list[tuple[int, int]]:
    """The data windows rollbacks recorded in the ledger: never handed out again."""
    from storage.ledger import Ledger

    return [(w.start, w.end) for w in Ledger(config.run_dir).read().data_skips]


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":  # from pageable memory the copy would wait for the GPU
        batch = tuple(t.pin_memory() for t in batch)
    return tuple(t.to(device, non_blocking=True) for t in batch)


def forward_backward(layout: Layout, inputs, targets, device, last_micro: bool, accum: int
                     ) -> torch.Tensor:
    """One micro-batch through this rank's part of the model; returns its share of the loss.

    Gradients are synchronised across data-parallel ranks once per step, on the last
    micro-batch.
    """
    inputs, targets = layout.sequence_part(inputs, targets)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=layout.autocast)
    if layout.schedule is not None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if layout.first_stage else ()
        kwargs = {"target": targets, "losses": losses} if layout.last_stage else {}
        with autocast:  # forward and backward of every micro-batch run inside step()
            layout.schedule.step(*args, **kwargs)
        if not layout.last_stage:
            return torch.zeros((), device=device)
        return torch.stack(losses).sum().detach()  # shares of the mean: they add up
    model = layout.model_parts[0]
    if layout.fsdp:
        model.set_requires_gradient_sync(last_micro)
    sync = model.no_sync() if (layout.ddp and not last_micro) else nullcontext()
    with sync:
        with autocast:
            loss = layout.mean_loss(model, inputs, targets) / accum
        loss.backward()
    return loss.detach()


def global_loss(layout: Layout, local: torch.Tensor) -> torch.Tensor:
    """The step's mean loss over the global batch, identical on every rank (a 0-d tensor on
    the device: the caller reads it together with the gradient norm).

    One rank per data-parallel replica reports (last pipeline stage, TP rank 0), or under
    context parallelism each of its cp ranks, the mean over its part of the sequences.
    """
    if not dist.is_initialized():
        return local
    reported = local if layout.reports_loss else torch.zeros_like(local)
    dist.all_reduce(reported)
    return reported / layout.dims.loss_shares


def device_memory(device: torch.device) -> dict:
    """Peak memory so far, read once per metrics record: on GPU what tensors held (the
    allocator's own count: no device sync); on CPU the worker's peak resident set (the
    kernel's VmHWM): tensors, staging copies, the allocator's kept memory and the process
    itself, what goodput plan estimates per worker."""
    if device.type != "cuda":
        return {"max_rss_gb": peak_resident_bytes() / 2**30}
    return {"max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
