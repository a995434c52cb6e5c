"""The training loop that runs in every torchrun worker.

    torchrun --nproc-per-node 2 -m training --config run.yaml --dataset DATASET_DIR

Reads like nanoGPT's train.py: set up, build the model, resume, loop (micro-batches with
gradient accumulation, clip, AdamW with warmup + cosine), checkpoint every N steps. The
launch task adds supervision around it; nothing here knows about Prefect.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from goodput.config import RunConfig
from storage.checksums import fsync_dir
from storage.ledger import Ledger
from storage.manifests import DatasetManifest
from training.checkpoint import (CheckpointFailed, Checkpointer, StoreReader, VerifiedReader,
                                 checkpoint_path, committed_checkpoints, load_checkpoint)
from training.data import DistributedSampleLoader, TokenStream
from training.metrics import MetricsWriter, peak_flops, young_daly_interval_s
from training.model import Transformer, cross_entropy, model_args_from_config, shape_differences
from training.parallelize import Layout, clip_grad_norm_, parallelize

T = TypeVar("T")


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(config: RunConfig) -> Dist:
    """Join the process group torchrun set up (or run as a single process without one)."""
    want_cuda = config.parallelism.device == "cuda" or (
        config.parallelism.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
        if config.parallelism.mixed_precision != "fp32":
            # Matmuls left in fp32 (outside autocast) may use TF32 tensor cores.
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    if "RANK" in os.environ:
        backend = config.parallelism.backend
        if backend == "auto":
            backend = "nccl" if want_cuda else "gloo"
        if backend == "nccl":
            # gloo beside nccl: the few CPU-tensor collectives (flags the ranks agree on, DCP's
            # planning) need a CPU backend on GPU machines too.
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend=backend, device_id=device if want_cuda else None)
        return Dist(dist.get_rank(), local_rank, dist.get_world_size(), device)
    return Dist(0, 0, 1, device)


def lr_at(step: int, cfg) -> float:
    """Linear warmup to the peak, then cosine down to min_lr_ratio * peak at max_steps.

    A pure function of the step, so the schedule needs no state of its own in a checkpoint.
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights), as in GPT-2/Llama recipes.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=device.type == "cuda")


def resolve_resume(resume: str, run_dir: Path) -> str | None:
    """Where training starts, as a checkpoint location (a directory, or 'store:STEP'; None:
    from scratch). `resume` is 'none', 'auto' (the newest committed checkpoint of this run),
    a location, or 'validated[:LOCATION]': the newest checkpoint on local disk that the
    run's ledger marks validated (or uploaded), else LOCATION, else scratch.

    'store:STEP' is the uploaded checkpoint of STEP, read straight from the store (the
    launch task passes it when the local tier lacks the checkpoint to resume from).

    The launch task passes 'validated:<the checkpoint it resumes from>' when torchrun may
    restart the workers in-job (launch.max_restarts): the command line is fixed for the
    attempt, but restarted workers must resume from the newest checkpoint validated since,
    and never from one nobody has verified. They first wait (GOODPUT_RESTART_WAIT_S, set by
    the launch task, whose validate task judges checkpoints while training runs) for the
    verdict on checkpoints committed before the failure. Rank 0 decides and broadcasts, so
    every rank loads the same checkpoint.
    """
    if resume == "none":
        return None
    if resume == "auto":
        def newest_committed() -> str | None:
            committed = committed_checkpoints(run_dir)
            return str(committed[-1]) if committed else None
        return _decided_by_rank_0(newest_committed)
    if resume == "validated" or resume.startswith("validated:"):
        fallback = resume.partition(":")[2] or None
        wait_s = float(os.environ.get("GOODPUT_RESTART_WAIT_S", "0"))
        location, error = _decided_by_rank_0(lambda: _newest_validated(Path(run_dir), fallback, wait_s))
        if error:
            raise FileNotFoundError(error)
        return location
    if not resume.startswith("store:") and not Path(resume).is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    return resume


def store_step(location: str) -> int | None:
    """STEP of a 'store:STEP' location; None for a directory."""
    if not location.startswith("store:"):
        return None
    try:
        return int(location.removeprefix("store:"))
    except ValueError:
        raise FileNotFoundError(f"--resume {location}: expected store:STEP with an integer step") from None


def _decided_by_rank_0(decide: Callable[[], T]) -> T:
    """`decide()` on rank 0, broadcast: every rank resumes from the same checkpoint even where
    the ranks' views of a shared filesystem differ for a moment (NFS attribute caches)."""
    choice: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice = [decide()]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _newest_validated(run_dir: Path, fallback: str | None, wait_s: float
                      ) -> tuple[str | None, str | None]:
    """resolve_resume('validated[:LOCATION]') on rank 0: (location or None for scratch, error)."""
    from storage.ledger import RESUMABLE
    from storage.manifests import CheckpointManifest
    from training.checkpoint import copy_id, is_committed, step_of

    ledger = Ledger(run_dir, run_dir.name)
    deadline, told = time.monotonic() + wait_s, False
    while True:
        entries = ledger.read().entries
        committed = {step_of(p): p for p in committed_checkpoints(run_dir)}

        def judged(s: int) -> bool:  # the ledger's verdict is on the copy on disk now
            # (a step saved again since is another copy, not judged yet)
            return s in entries and entries[s].is_about(copy_id(committed[s]))

        good = [s for s in committed if judged(s) and entries[s].state in RESUMABLE]
        newest = max(good, default=0)
        pending = sorted(s for s in committed if s > newest
                         and (not judged(s) or entries[s].state == "committed"))
        if not pending or time.monotonic() >= deadline:
            break
        if not told:
            print(f"[train] waiting up to {wait_s:.0f}s for the verdict on checkpoint(s) "
                  f"{pending} before resuming", flush=True)
            told = True
        time.sleep(0.5)
    if pending:
        print(f"[train] no verdict yet on checkpoint(s) {pending}: not resuming from them",
              flush=True)
    candidates = {s: str(committed[s]) for s in good}
    if fallback is not None:
        in_store = store_step(fallback)
        if in_store is not None:
            candidates.setdefault(in_store, fallback)
        elif is_committed(Path(fallback)):
            candidates.setdefault(CheckpointManifest.load(Path(fallback)).step, fallback)
        elif not candidates:
            return None, f"--resume validated:{fallback}: no such committed checkpoint"
    return (candidates[max(candidates)] if candidates else None), None


def open_checkpoint(config: RunConfig, location: str) -> VerifiedReader:
    """A reader of the checkpoint at `location` (see resolve_resume). From the store it
    caches what this node fetches, for the node's other ranks and for in-job restarts."""
    from storage.ledger import checkpoint_key

    step = store_step(location)
    if step is None:
        return VerifiedReader(location)
    cache = config.run_dir / "checkpoints" / ".from-store" / f"step-{step:08d}"
    return StoreReader(config.storage.open(), checkpoint_key(config.run.run_id, step), cache)


class RollbackRequested(Exception):
    """A bad step (non-finite or spiking loss): resume from before it and skip its data."""

    def __init__(self, step: int, sample_end: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step, self.sample_end, self.reason = step, sample_end, reason


class Preempted(Exception):
    """SIGTERM or SIGHUP arrived; an emergency checkpoint at `step` is committed."""

    def __init__(self, step: int):
        super().__init__(f"preempted (SIGTERM or SIGHUP): emergency checkpoint at step {step}")
        self.step = step


class LossGuard:
    """Flags a step whose loss or gradient norm is non-finite, or whose loss spikes above
    `factor` x the mean of the last `window` good steps (in the spirit of llm-foundry's
    loss-spike intervention). Every rank sees the same all-reduced loss, so all agree."""

    def __init__(self, factor: float | None, window: int):
        self.factor, self.recent = factor, deque(maxlen=window)

    def check(self, loss: float, grad_norm: float) -> str:
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm}"
        if self.factor and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return f"loss spike {loss:.4f} > {self.factor} x rolling mean {mean:.4f}"
        self.recent.append(loss)
        return ""


class PreemptionFlag:
    """SIGTERM (a scheduler preempting or cancelling the job; torchrun passes it on) or
    SIGHUP (an ssh node's connection closed: its torchrun passes the hangup on) sets a flag;
    ranks agree on it at a step boundary so they save together."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True



def agree(*flags: bool) -> list[bool]:
    """Each flag true on any rank is true on all (one small all-reduce per step), so every
    rank takes the same branch at a step boundary."""
    values = torch.tensor([1.0 if f else 0.0 for f in flags])
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


# How long a rank waits for its own write of a save that failed elsewhere to end.
SAVE_FAILED_WAIT_S = 30.0


def gather_from_all(value) -> list:
    """`value` of every rank, by rank (a small object; all ranks call it at the same point)."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class CheckpointSchedule:
    """When to save: every `checkpoint.every_steps`, or with `checkpoint.interval: auto` the
    Young/Daly interval sqrt(2 x C x MTBF) converted to steps, re-planned after every save
    from the measured blocking cost C and step time, and capped at every_steps.

    MTBF is faults.mtbf_hours, else the attempts of this run that failed so far (their
    outcome records), else there is nothing to plan for and every_steps holds. All ranks
    agree on the interval (the slowest rank's numbers, rank 0's MTBF).
    """

    def __init__(self, config: RunConfig, rank: int):
        self.cfg, self.rank = config.checkpoint, rank
        self.every = self.cfg.every_steps
        self.last_saved = 0
        self.mtbf_s = _mtbf_s(config) if rank == 0 else 0.0
        self.step_times: deque[float] = deque(maxlen=50)
        self.save_costs: deque[float] = deque(maxlen=5)

    def due(self, step: int, max_steps: int) -> bool:
        return step - self.last_saved >= self.every or (step == max_steps and self.cfg.save_at_end)

    def saved(self, step: int, blocked_s: float) -> str:
        """Record a save; returns a note when the interval changed."""
        self.last_saved = step
        self.save_costs.append(blocked_s)
        if self.cfg.interval != "auto" or not self.step_times:
            return ""
        step_time = sum(self.step_times) / len(self.step_times)
        cost = sum(self.save_costs) / len(self.save_costs)
        cost, step_time, mtbf = _agree_max([cost, step_time, self.mtbf_s])
        if mtbf <= 0:
            return ""
        every = max(1, min(self.cfg.every_steps, round(young_daly_interval_s(cost, mtbf) / step_time)))
        if every == self.every:
            return ""
        self.every = every
        return (f"auto interval: every {every} steps (save cost {cost:.3f}s, step {step_time:.3f}s, "
                f"MTBF {mtbf:.0f}s)")


def _agree_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _mtbf_s(config: RunConfig) -> float:
    """Configured, or observed: wall time of this run's attempts over their failures."""
    if config.faults.mtbf_hours:
        return config.faults.mtbf_hours * 3600
    failures, wall = 0, 0.0
    for path in (config.run_dir / "attempts").glob("attempt-*/outcome.json"):
        try:
            outcome = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        wall += outcome.get("wall_time_s") or 0.0
        failures += (outcome.get("class") != "done") + (outcome.get("restarts") or 0)
    return wall / failures if failures else 0.0


class FaultInjector:
    """faults.*_at_step: each injection fires once per run; a marker file remembers it fired."""

    def __init__(self, config: RunConfig, rank: int):
        self.faults, self.rank = config.faults, rank
        self.marker_dir = config.run_dir / "faults"

    def _fire_once(self, name: str, step: int | None, at: int, rank: int | None = 0) -> bool:
        if step is None or step != at or (rank is not None and self.rank != rank):
            return False
        marker = self.marker_dir / f"{name}-{step}.fired"
        if marker.exists():
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as f:
            f.write(str(time.time()))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.marker_dir)
        return True

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        # Every rank checks the marker before rank 0 writes it: all ranks see the same NaN.
        marker = self.marker_dir / f"nan_at_step-{step}.fired"
        if self.faults.nan_at_step == step and not marker.exists():
            if dist.is_initialized():
                dist.barrier()
            self._fire_once("nan_at_step", self.faults.nan_at_step, step)
            return loss + float("nan")
        return loss

    def in_save(self, point: str, step: int) -> None:
        """Checkpointer fault hook: kill this worker at `point` of the save of `step` (or,
        at "staging", fail its copy of the state)."""
        rank = self.faults.crash_rank if point in ("staging", "writing") else 0
        if point == self.faults.save_crash_point and self._fire_once(
                f"save_crash_{point}", self.faults.save_crash_at_step, step, rank):
            if point == "staging":
                print(f"[faults] failing the staging copy of rank {self.rank} for step {step}",
                      flush=True)
                raise OSError(f"injected: rank {self.rank} could not stage step {step} "
                              "(as with /dev/shm or pinned memory exhausted)")
            print(f"[faults] killing rank {self.rank} during the save of step {step} ({point})",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int) -> None:
        if self._fire_once("crash_at_step", self.faults.crash_at_step, step, self.faults.crash_rank):
            print(f"[faults] killing rank {self.rank} (pid {os.getpid()}) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fire_once("hang_at_step", self.faults.hang_at_step, step, self.faults.crash_rank):
            print(f"[faults] freezing rank {self.rank} (SIGSTOP) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._fire_once("sigterm_at_step", self.faults.sigterm_at_step, step):
            # As a scheduler preempting the job would: SIGTERM to torchrun, which forwards it
            # to every worker (or to this process when it runs without torchrun).
            target = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
            print(f"[faults] SIGTERM to pid {target} at step {step}", flush=True)
            os.kill(target, signal.SIGTERM)


def train(config: RunConfig, dataset_dir: Path, resume: str = "auto") -> dict:
    """Run (or continue) training to config.training.max_steps. Returns a small summary."""
    tcfg = config.training
    run_dir = config.run_dir
    env = init_distributed(config)
    degrees = layout_degrees(config, env)
    torch.manual_seed(tcfg.seed)

    manifest = DatasetManifest.load(dataset_dir)
    # On the meta device: parallelize allocates and initialises only this rank's part of it
    # (the single-process model's weights in every layout, from training.seed).
    with torch.device("meta"):
        model = Transformer(model_args_from_config(config.model, manifest.vocab_size))
    args = model.args
    model_args, n_params = vars(args), model.num_params(non_embedding=False)
    flops_per_token = model.flops_per_token(tcfg.seq_len)

    share = tcfg.grad_accum_steps * config.parallelism.pipeline_microbatches

    def pipeline_loss(logits, targets):  # one pipeline micro-batch's share of the step's mean
        return cross_entropy(logits, targets) / share

    location = resolve_resume(resume, run_dir)
    # Resuming, every weight comes from the checkpoint: drawing initial values first would
    # only lengthen the restart.
    layout = parallelize(model, config.parallelism, degrees, env.device, pipeline_loss,
                         seed=tcfg.seed if location is None else None)
    del model  # from here on the layout's parts are the model
    optimizers = [build_optimizer(part, tcfg, env.device) for part in layout.model_parts]
    loader = DistributedSampleLoader(TokenStream(dataset_dir, manifest, "train"), tcfg.seq_len,
                                     tcfg.micro_batch_size, layout.dp_rank, layout.dp_size, tcfg.seed)
    metrics = MetricsWriter(run_dir, enabled=env.is_main)
    attempt = os.environ.get("GOODPUT_ATTEMPT", "0")

    step, tokens_seen = 0, 0
    if location is not None:
        resume_from = open_checkpoint(config, location)
        if differences := shape_differences(resume_from.manifest.model_args, args):
            # Loading would fail on every attempt with a shape error: a config error, not a crash.
            raise ValueError(
                f"{resume_from} holds another model than this config builds ({'; '.join(differences)}); "
                "resume with the model settings it was saved with (a vocabulary saved unpadded: "
                "model.vocab_multiple_of=1), or train from scratch under a new run.run_id")
        extras = load_checkpoint(resume_from, layout.model_parts, optimizers, {
            "progress": {"step": 0, "tokens_seen": 0}, "data": loader.state_dict(),
            "rng": {"torch": torch.get_rng_state()}})
        step, tokens_seen = extras["progress"]["step"], extras["progress"]["tokens_seen"]
        loader.load_state_dict(extras["data"])
        torch.set_rng_state(extras["rng"]["torch"])
        if isinstance(resume_from, StoreReader):
            print(f"[train] rank {env.rank} fetched {', '.join(resume_from.fetched) or 'nothing new'} "
                  f"of {len(resume_from.sha256)} files from {resume_from}", flush=True)
        if env.is_main:
            print(f"[train] resumed from {resume_from} at step {step}", flush=True)

    loader.skip_windows([(w.start, w.end) for w in Ledger(run_dir, config.run.run_id).read().data_skips])
    tokens_per_step = tcfg.tokens_per_rank_step * layout.dp_size
    device_peak = peak_flops(torch.cuda.get_device_name(env.device) if env.device.type == "cuda"
                             else "cpu", tcfg.peak_flops_per_device)
    faults = FaultInjector(config, env.rank)
    guard = LossGuard(config.faults.spike_factor, config.faults.spike_window)
    preemption = PreemptionFlag()
    if env.is_main:
        print(f"[train] {n_params:,} parameters, world size {env.world_size}, layout "
              f"{' x '.join(f'{k}={v}' for k, v in degrees.items())}, {tokens_per_step:,} tokens/step, "
              f"steps {step + 1}..{tcfg.max_steps}", flush=True)

    checkpointer = Checkpointer(config.checkpoint.async_mode, fault_hook=faults.in_save)
    schedule = CheckpointSchedule(config, env.rank)
    schedule.last_saved = step

    def save(step: int, loss: float, urgent: bool = False) -> float:
        return checkpointer.save(
            checkpoint_path(run_dir, step), layout.model_parts, optimizers,
            {"progress": {"step": step, "tokens_seen": tokens_seen},
             "data": loader.state_dict(), "rng": {"torch": torch.get_rng_state()}},
            {"step": step, "tokens_seen": tokens_seen, "data_position": loader.sample_index,
             "world_size": env.world_size, "layout": degrees,
             "config_hash": config.config_hash(), "dataset_id": manifest.dataset_id,
             "model_args": model_args, "loss": loss, "seq_len": tcfg.seq_len}, urgent=urgent)

    def announce_save(step: int, loss: float) -> None:
        """Tell the supervisor a save, or a wait for one, is under way: it gets a save's
        allowance (run.checkpoint_timeout_s) before it counts as a hang, not a step's."""
        metrics.heartbeat(step=step, loss=loss, attempt=attempt, phase="checkpoint",
                          max_steps=tcfg.max_steps)

    last_loss, saved_step = float("nan"), step
    # Steps since the last metrics record (training.log_every): each record accounts for them
    # all, so goodput counts every step's time, not only the logged ones.
    window_steps, window_time_s, window_checkpoint_s = 0, 0.0, 0.0
    while step < tcfg.max_steps:
        step_start = time.perf_counter()
        checkpoint_s = 0.0  # this step's checkpoint stall, kept out of its step time
        lr = lr_at(step + 1, tcfg)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        loss_sum = torch.zeros((), device=env.device)
        for micro in range(tcfg.grad_accum_steps):
            batch = loader.next_batch()
            if env.device.type == "cuda":  # from pageable memory the copy would wait for the GPU
                batch = tuple(t.pin_memory() for t in batch)
            inputs, targets = (t.to(env.device, non_blocking=True) for t in batch)
            loss_sum += forward_backward(layout, inputs, targets, env.device,
                                         last_micro=micro == tcfg.grad_accum_steps - 1,
                                         accum=tcfg.grad_accum_steps)
        loss_sum = faults.poison_loss(step + 1, loss_sum)
        mean_loss = global_loss(layout, loss_sum)
        norm = clip_grad_norm_(layout, tcfg.grad_clip)
        # The step's one host read: loss and norm together (each read waits for the device).
        loss, grad_norm = torch.stack([mean_loss, norm.to(mean_loss)]).tolist()
        verdict = guard.check(loss, grad_norm)
        if verdict:  # the update is not applied; the next attempt rolls back past this data
            announce_save(step, loss)  # the checkpoint to roll back to may still be in flight
            checkpointer.wait()
            raise RollbackRequested(step + 1, loader.sample_index, verdict)
        # A background save may still be copying the weights: let it finish before they change.
        checkpoint_s += checkpointer.before_update()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        last_loss = loss
        step_time = time.perf_counter() - step_start - checkpoint_s
        tokens_per_s = tokens_per_step / step_time
        schedule.step_times.append(step_time)

        if schedule.due(step, tcfg.max_steps):
            announce_save(step, loss)
            blocked = save(step, loss)
            checkpoint_s, saved_step = checkpoint_s + blocked, step
            note = schedule.saved(step, blocked)
            if note and env.is_main:
                print(f"[checkpoint] {note}", flush=True)
        window_steps, window_time_s = window_steps + 1, window_time_s + step_time
        window_checkpoint_s += checkpoint_s
        if env.is_main and (step % tcfg.log_every == 0 or step == tcfg.max_steps):
            achieved = flops_per_token * tokens_per_s / env.world_size
            metrics.log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                         "tokens_seen": tokens_seen, "tokens_per_s": tokens_per_s,
                         "step_time_s": step_time, "checkpoint_s": window_checkpoint_s,
                         # rank 0's background save was still writing or hashing when this
                         # step ended: the step shared the CPU with it (benchmarks/ measures it)
                         "save_in_flight": checkpointer.in_flight,
                         # this record stands for steps (step - window_steps, step]
                         "window_steps": window_steps, "window_time_s": window_time_s,
                         "flops_per_s_per_device": achieved,
                         "mfu": achieved / device_peak if device_peak else None,
                         "attempt": attempt, **device_memory(env.device)})
            window_steps, window_time_s, window_checkpoint_s = 0, 0.0, 0.0
        metrics.heartbeat(step=step, loss=loss, tokens_per_s=tokens_per_s, step_time_s=step_time,
                          max_steps=tcfg.max_steps, attempt=attempt, phase="step")
        faults.after_step(step)
        preempted, save_failed = agree(preemption.received, bool(checkpointer.failures))
        if save_failed:  # a run that cannot checkpoint must not go on losing its progress
            # Bounded: where the save failed on some ranks only (their staging copy), the
            # others' writes wait in a collective those ranks never join.
            settled = checkpointer.wait(timeout_s=SAVE_FAILED_WAIT_S)
            reports = gather_from_all((checkpointer.failures, checkpointer.disk_full))
            failures = [f"rank {rank}: {failure}" for rank, (failed, _) in enumerate(reports)
                        for failure in failed]
            raise CheckpointFailed("; ".join(failures[:4]), any(full for _, full in reports),
                                   writes_stuck=not settled)
        if preempted:
            # (a job the scheduler signalled stays RUNNING meanwhile, and the supervisor polls)
            announce_save(step, loss)
            if saved_step != step:  # within the launcher's grace: not in idle cycles
                save(step, loss, urgent=True)
            checkpointer.wait()
            if checkpointer.failures:
                raise CheckpointFailed("emergency save failed: " + "; ".join(checkpointer.failures),
                                       checkpointer.disk_full)
            raise Preempted(step)

    checkpointer.close()  # the last checkpoint is committed before the job reports success
    final_failed, disk_full = agree(bool(checkpointer.failures), checkpointer.disk_full)
    if final_failed:
        raise CheckpointFailed("; ".join(checkpointer.failures) or "the final save failed on "
                               "another rank", disk_full)

    metrics.close()
    summary = {"final_step": step, "tokens_seen": tokens_seen, "final_loss": last_loss}
    # Clean shutdown: without it gloo workers sometimes abort at exit (STACK_NOTES).
    del layout, optimizers
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def layout_degrees(config: RunConfig, env: Dist) -> dict[str, int]:
    """The configured degrees; a plain single process (no torchrun) runs the model whole."""
    if not dist.is_initialized():
        return {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}
    if env.world_size != config.parallelism.world_size:
        raise ValueError(f"torchrun started {env.world_size} workers but the config asks for "
                         f"parallelism.nnodes x nproc_per_node = {config.parallelism.world_size}")
    return config.parallelism.degrees()


def forward_backward(layout: Layout, inputs, targets, device, last_micro: bool, accum: int
                     ) -> torch.Tensor:
    """One micro-batch through this rank's part of the model; returns its share of the loss.

    Gradients are synchronised across data-parallel ranks once per step, on the last
    micro-batch.
    """
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
            loss = layout.loss_fn(model(inputs), targets) / accum
        loss.backward()
    return loss.detach()


def global_loss(layout: Layout, local: torch.Tensor) -> torch.Tensor:
    """The step's mean loss over the global batch, identical on every rank (a 0-d tensor on
    the device: the caller reads it together with the gradient norm).

    Exactly one rank per data-parallel replica reports (last pipeline stage, TP rank 0).
    """
    if not dist.is_initialized():
        return local
    reported = local if layout.reports_loss else torch.zeros_like(local)
    dist.all_reduce(reported)
    return reported / layout.dp_size


def device_memory(device: torch.device) -> dict:
    """Peak GPU memory held by tensors so far (the allocator's own count: no device sync)."""
    if device.type != "cuda":
        return {}
    return {"max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
