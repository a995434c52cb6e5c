"""The trainer's checkpointing, behind a narrow interface.

    start = resolve_resume(spec, run_dir)   before the model is built: resume, or initialise it
    checkpointer = Checkpointer(config, model_parts, optimizers, progress, loader, ...)
    checkpointer.load(start)          the model, optimizer, progress, data order and RNG saved there
    checkpointer.before_update()      before optimizer.step(): a background save has copied the weights
    checkpointer.maybe_save(loss)     after the step: save when the schedule says so
    checkpointer.settle()             once the step is recorded: every rank waits for its commit
    checkpointer.emergency_save(loss) on preemption: save this step now, and wait for it
    checkpointer.close()              after the last step: the last save is committed, on every rank

How a save is written (saving.Saver), which checkpoint to resume (resume.resolve_resume) and
when to save (CheckpointSchedule) are each in one place behind it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from core.config import RunConfig, trajectory_conflicts
from core.errors import ConfigError
from core.protocol import ResumeSpec
from training.checkpoint.errors import CheckpointFailed
from training.checkpoint.reader import StoreReader, load_into, open_reader
from training.checkpoint.saving import Saver
from training.distributed import any_rank, from_every_rank, max_over_ranks
from training.logs import get_logger
from training.metrics import young_daly_interval_s
from training.model import ModelArgs, shape_differences

log = get_logger("checkpoint")

@dataclass
class Progress:
    """What the loop has done: saved in every checkpoint, restored on resume."""

    step: int = 0
    tokens_seen: int = 0


class CheckpointSchedule:
    """When to save: every `checkpoint.every_steps`, or with `checkpoint.interval: auto` the
    Young/Daly interval sqrt(2 x C x MTBF) converted to steps, re-planned after every save
    from the measured blocking cost C and step time, and capped at every_steps.

    `mtbf_s` comes from the supervisor (faults.mtbf_hours, else the failures observed in the
    run so far; 0: nothing to plan for, every_steps holds). All ranks agree on the interval
    (the slowest rank's numbers).
    """

    def __init__(self, config: RunConfig, mtbf_s: float = 0.0):
        self.cfg = config.checkpoint
        self.every = self.cfg.every_steps
        self.last_saved = 0
        self.mtbf_s = mtbf_s
        self.step_times: deque[float] = deque(maxlen=50)
        self.save_costs: deque[float] = deque(maxlen=5)

    def due(self, step: int, max_steps: int) -> bool:
        # A fixed interval saves at its multiples, as torchtitan does, also after a resume from
        # an emergency checkpoint between them (step 140, every 50: then 150, 200, ...). An
        # auto one counts from the last save (its interval changes as it re-plans).
        aligned = self.cfg.interval != "auto" and step % self.every == 0
        return (aligned or step - self.last_saved >= self.every
                or (step == max_steps and self.cfg.save_at_end))

    def saved(self, step: int, blocked_s: float) -> str:
        """Record a save; returns a note when the interval changed."""
        self.last_saved = step
        self.save_costs.append(blocked_s)
        if self.cfg.interval != "auto" or not self.step_times:
            return ""
        step_time = sum(self.step_times) / len(self.step_times)
        cost = sum(self.save_costs) / len(self.save_costs)
        cost, step_time, mtbf = max_over_ranks([cost, step_time, self.mtbf_s])
        if mtbf <= 0:
            return ""
        every = max(1, min(self.cfg.every_steps, round(young_daly_interval_s(cost, mtbf) / step_time)))
        if every == self.every:
            return ""
        self.every = every
        return (f"auto interval: every {every} steps (save cost {cost:.3f}s, step {step_time:.3f}s, "
                f"MTBF {mtbf:.0f}s)")


class Checkpointer:
    """See the module docstring. `fault_hook(point, step)` lets fault injection fail or kill a
    save at each point of saving.Saver's (staging to after_manifest); `announce()` tells
    the supervisor a save (or a wait for one) is under way, which gives it a save's allowance
    before it counts as a hang, not a step's."""

    def __init__(self, config: RunConfig, model_parts: list, optimizers: list, progress: Progress,
                 loader, manifest_fields: dict, *, mtbf_s: float = 0.0,
                 fault_hook: Callable[[str, int], None] | None = None,
                 announce: Callable[[float], None] = lambda loss: None,
                 record_steps: Callable[[], None] = lambda: None):
        self.config, self.run_dir = config, config.run_dir
        self.model_parts, self.optimizers = model_parts, optimizers
        self.progress, self.loader = progress, loader
        self.manifest_fields = manifest_fields  # what every save's manifest records besides progress
        self.announce = announce
        self.record_steps = record_steps  # the metrics record of the steps since the last one
        self.saver = Saver(config.checkpoint.async_mode, fault_hook=fault_hook)
        self.schedule = CheckpointSchedule(config, mtbf_s)
        self.saved_step = 0
        self._replan_cost: float | None = None  # the blocking cost of the save settle() re-plans from
        self.save_next = False  # save the next step whatever the schedule (the time limit's)

    # -- resume ---------------------------------------------------------------------------
    def load(self, start: ResumeSpec | None) -> str | None:
        """Load the checkpoint at `start` (a directory or a step in the store, as
        resume.resolve_resume answers; None: from scratch) into the model parts, optimizers,
        progress, data order and RNG. Returns where it came from."""
        if start is None:
            return None
        reader = open_reader(self.run_dir, self.config.storage, start)
        differences = shape_differences(reader.manifest.model_args,
                                        ModelArgs(**self.manifest_fields["model_args"]))
        if differences:  # loading would fail the same way in every attempt
            raise ConfigError(
                f"{reader} holds another model than this config builds ({'; '.join(differences)}); "
                "resume with the model settings it was saved with (a vocabulary saved unpadded: "
                "model.vocab_multiple_of=1), or train from scratch under a new run.run_id")
        saved, now = reader.manifest, self.manifest_fields
        conflicts = trajectory_conflicts(saved.trajectory or {}, now["trajectory"], "the checkpoint")
        if conflicts:
            raise ConfigError(
                f"{reader} was saved under another data/tokenizer/model/training config than "
                f"this one ({'; '.join(conflicts[:4])}): continuing it would change its "
                "trajectory (a longer training.max_steps stretches the learning-rate schedule, "
                f"say). Continue the run with its own config (--config {self.run_dir.config_file}, "
                "without overrides of those sections), or train another run.run_id (from this "
                "one's weights: goodput export --format hf, then model.init_from=<the export>)")
        if saved.tokenizer_sha256 and now["tokenizer_sha256"] \
                and saved.tokenizer_sha256 != now["tokenizer_sha256"]:
            # Its embeddings would be read by other token ids: the loss jumps, and the model
            # trained so far is lost without an error (a corpus that grew, its tokenizer
            # trained again from the new sample).
            raise ConfigError(
                f"{reader} was trained on dataset {saved.dataset_id}, whose tokenizer "
                f"(sha256 {saved.tokenizer_sha256[:12]}) is not this attempt's dataset "
                f"{now['dataset_id']}'s ({now['tokenizer_sha256'][:12]}): its token ids mean "
                "other text. The run's sources or tokenizer files changed since it began (a "
                "tokenizer trained from the sources is trained again when they change): restore "
                "them, or train the new data under a new run.run_id")
        if saved.dataset_id != now["dataset_id"] and self.saver.rank == 0:
            # The same config can prepare other data (its sources or tokenizer files changed):
            # allowed, the run goes on, but nobody should learn it from the loss curve.
            eos = (f", whose documents end with token {now['eos_id']} where the checkpoint's "
                   f"ended with {saved.eos_id}" if saved.eos_id not in (None, now["eos_id"]) else "")
            log.warning("%s was trained on dataset %s; this attempt reads dataset %s%s (the run's "
                        "sources, tokenizer files or data settings changed since): the data "
                        "order continues at sample %d of the new data", reader, saved.dataset_id,
                        now["dataset_id"], eos, saved.data_position)
        extras = load_into(reader, self.model_parts, self.optimizers, self._extras())
        self.progress.step = extras["progress"]["step"]
        self.progress.tokens_seen = extras["progress"]["tokens_seen"]
        self.loader.load_state_dict(extras["data"])
        torch.set_rng_state(extras["rng"]["torch"])
        self.schedule.last_saved = self.saved_step = self.progress.step
        if isinstance(reader, StoreReader):
            log.info("rank %d fetched %s of %d files from %s", self.saver.rank,
                     ", ".join(reader.fetched) or "nothing new", len(reader.sha256), reader)
        return str(reader)

    # -- saving ---------------------------------------------------------------------------
    def before_update(self) -> float:
        """Wait until a background save has copied the state (call before optimizer.step());
        returns the seconds waited, which count as checkpoint stall."""
        return self.saver.before_update()

    def maybe_save(self, loss: float, step_time_s: float) -> float:
        """Save the step just taken when it is due; returns the seconds training was blocked."""
        step = self.progress.step
        self.schedule.step_times.append(step_time_s)
        if not (self.save_next or self.schedule.due(step, self.config.training.max_steps)):
            return 0.0
        self.save_next = False
        blocked = self._save(loss)
        self._replan_cost = blocked
        return blocked

    def settle(self) -> None:
        """Call once the step's record is written: the ranks wait for rank 0's commit of a
        synchronous save here (Saver.settle), then agree on the next interval (interval: auto,
        a collective). No collective runs between a commit and the record of its step."""
        self.saver.settle()
        if self._replan_cost is not None:
            note = self.schedule.saved(self.progress.step, self._replan_cost)
            self._replan_cost = None
            if note and self.saver.rank == 0:
                log.info("%s", note)

    def emergency_save(self, loss: float) -> None:
        """Preempted: save this step now (unless it is saved), within the launcher's grace
        period, at normal priority; wait until it is committed. Raises CheckpointFailed."""
        self.announce(loss)
        # Recorded before the save commits them: the next attempt resumes after these steps,
        # and a rank lost at the commit fails this one in the barrier after it (under NCCL
        # it never returns from there).
        self.record_steps()
        if self.saved_step != self.progress.step:
            self._save(loss, urgent=True)
        self.saver.wait()
        self.saver.settle()
        if self.saver.failures:
            raise CheckpointFailed("emergency save failed: " + "; ".join(self.saver.failures),
                                   self.saver.disk_full)

    def _save(self, loss: float, urgent: bool = False) -> float:
        step = self.progress.step
        self.announce(loss)
        fields = {**self.manifest_fields, "step": step, "tokens_seen": self.progress.tokens_seen,
                  "data_position": self.loader.sample_index, "loss": loss}
        blocked = self.saver.save(self.run_dir.checkpoint(step), self.model_parts, self.optimizers,
                                  self._extras(), fields, urgent=urgent)
        self.saved_step = step
        return blocked

    def _extras(self) -> dict:
        return {"progress": {"step": self.progress.step, "tokens_seen": self.progress.tokens_seen},
                "data": self.loader.state_dict(), "rng": {"torch": torch.get_rng_state()}}

    # -- failures and the end -------------------------------------------------------------
    @property
    def failed(self) -> bool:
        """A save failed on this rank (the ranks vote on it after every step)."""
        return bool(self.saver.failures)

    @property
    def in_flight(self) -> bool:
        return self.saver.in_flight

    def wait(self, loss: float | None = None) -> None:
        """Block until the save in flight is committed (announced to the supervisor first
        when `loss` is given: a wait for a save counts as one)."""
        if loss is not None:
            self.announce(loss)
        self.saver.wait()

    def raise_failure(self) -> None:
        """A save failed on some rank: a run that cannot checkpoint must not go on losing its
        progress. Gathers every rank's reasons and raises CheckpointFailed on all."""
        # Bounded: where the save failed on some ranks only (their staging copy), the others'
        # writes wait in a collective those ranks never join.
        settled = self.saver.wait(timeout_s=self.config.checkpoint.failed_save_wait_s)
        reports = from_every_rank((self.saver.failures, self.saver.disk_full))
        failures = [f"rank {rank}: {failure}" for rank, (failed, _) in enumerate(reports)
                    for failure in failed]
        raise CheckpointFailed("; ".join(failures[:4]), any(full for _, full in reports),
                               writes_stuck=not settled)

    def close(self) -> None:
        """The last checkpoint is committed before the job reports success; raises
        CheckpointFailed on every rank when it failed on any."""
        self.saver.close()
        failed, disk_full = any_rank(bool(self.saver.failures), self.saver.disk_full)
        if failed:
            raise CheckpointFailed("; ".join(self.saver.failures) or "the final save failed on "
                                   "another rank", disk_full)

