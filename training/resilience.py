"""What keeps a run safe, beside the training loop.

- LossGuard: a step whose loss or gradient norm is non-finite, or whose loss spikes, is not
  applied: the run rolls back past its data (RollbackRequested).
- PreemptionFlag: SIGTERM or SIGHUP asks for an emergency checkpoint and a clean stop
  (Preempted); the ranks agree on it at a step boundary, so they save together.
- A save that failed on any rank stops the run (a run that cannot checkpoint must not go on
  losing its progress).
- A flow run's time limit (GOODPUT_STOP_AFTER) ends the run, as done: the first step past
  it is followed by a checkpoint of the next one, whatever the cadence, and the workers stop
  after it. No step is lost, the overshoot is about a step and a save (not a checkpoint
  interval), and the stop waits on no supervisor polling.
- FaultInjector: `faults.*_at_step`, each firing once per run, to watch all this recover.
  With no fault configured the loop gets `NO_FAULTS`, which does nothing.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from core.files import fsync_dir
from core.protocol import FailureClass, attempt_of_worker, write_exit_record
from training.distributed import any_rank
from training.logs import get_logger

log = get_logger("faults")

# faults.sigterm_at_step: how long rank 0 waits for torchrun to pass the injected signal on.
PASSED_ON_WITHIN_S = 10.0


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


class Orphaned(Preempted):
    """The supervisor is gone (no renewal of the run's lease): an emergency checkpoint at
    `step` is committed and the workers stop rather than train on unwatched."""

    def __init__(self, step: int, why: str):
        Exception.__init__(self, f"orphaned ({why}): emergency checkpoint at step {step}")
        self.step = step


class LossGuard:
    """Flags a step whose loss or gradient norm is non-finite, or whose loss spikes above
    `factor` x the mean of the last `window` good steps (in the spirit of llm-foundry's
    loss-spike intervention). Every rank sees the same all-reduced loss, so all agree."""

    def __init__(self, factor: float | None, window: int):
        self.factor, self.recent = factor, deque(maxlen=window)

    def problem(self, loss: float, grad_norm: float) -> str | None:
        """What is wrong with this step, or None for a good one (which joins the window)."""
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm}"
        if self.factor and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return f"loss spike {loss:.4f} > {self.factor} x rolling mean {mean:.4f}"
        self.recent.append(loss)
        return None


class PreemptionFlag:
    """SIGTERM (a scheduler preempting or cancelling the job; torchrun passes it on) or
    SIGHUP (an ssh node's connection closed: its torchrun passes the hangup on) sets a flag."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True


class Resilience:
    """The loop's two calls: `check(step, loss, grad_norm)` before the update is applied,
    `after_step(step, loss)` after it. Holds the guard, the preemption flag, the vote on
    failed saves and on the time limit, and the fault hooks.

    `stop_after`: the flow run's deadline (Unix time), or None for none. `lease`: rank 0's
    watch on the supervisor (core.protocol.LeaseWatch), None on other ranks and unsupervised."""

    def __init__(self, config, rank: int, checkpointer, faults: FaultInjector | None = None,
                 stop_after: float | None = None, lease=None):
        self.guard = LossGuard(config.faults.spike_factor, config.faults.spike_window)
        self.preemption = PreemptionFlag()
        self.checkpointer = checkpointer
        self.faults = faults or FaultInjector.for_config(config, rank)
        self.stop_after = stop_after
        self.lease = lease

    def check(self, step: int, loss: float, grad_norm: float, sample_end: int) -> None:
        """Raises RollbackRequested for a bad step `step` (not applied; its data ends before
        global sample `sample_end`), once the checkpoint to roll back to is committed."""
        problem = self.guard.problem(loss, grad_norm)
        if problem is not None:
            self.checkpointer.wait(loss)  # the checkpoint to roll back to may still be in flight
            raise RollbackRequested(step, sample_end, problem)

    def after_step(self, step: int, loss: float) -> bool:
        """Fault hooks, then one vote of the ranks: stop on a failed save or a preemption
        (raising), or at the time limit (returns True: this step's checkpoint is the last).

        Past the time limit the next step is saved whatever checkpoint.every_steps says, and
        training stops after it, as Megatron's --exit-duration-in-mins does: a scheduled run
        ends about a step and a save past its budget, not up to a checkpoint interval past
        it (the next tick, cancelled while it still trained, waited a whole period)."""
        self.faults.after_step(step, self.preemption)
        # Every rank saves the same steps; one rank's clock past the deadline is enough.
        past_deadline = self.stop_after is not None and time.time() >= self.stop_after
        orphaned = self.lease.orphaned() if self.lease is not None else ""
        preempted, save_failed, time_up, unsupervised = any_rank(
            self.preemption.received, self.checkpointer.failed, past_deadline, bool(orphaned))
        if save_failed:
            self.checkpointer.raise_failure()
        if preempted or unsupervised:
            # (a job the scheduler signalled stays RUNNING meanwhile, and the supervisor polls)
            self.checkpointer.emergency_save(loss)
            if preempted:
                raise Preempted(step)
            log.warning("stopping: %s", orphaned or "rank 0 found the supervisor gone")
            raise Orphaned(step, orphaned or "rank 0 found the supervisor gone")
        if time_up and self.checkpointer.saved_step != step:
            self.checkpointer.save_next = True  # the vote is every rank's: all save that step
            return False
        return time_up


class FaultInjector:
    """faults.*_at_step: each injection fires once per run; a marker file remembers it fired."""

    FAULTS = ("crash_at_step", "nan_at_step", "hang_at_step", "sigterm_at_step", "save_crash_at_step")

    def __init__(self, config, rank: int):
        self.faults, self.rank = config.faults, rank
        self.marker_dir: Path = config.run_dir.fault_markers
        self.run_dir = config.run_dir

    @classmethod
    def for_config(cls, config, rank: int) -> FaultInjector:
        """The injector, or NO_FAULTS when no fault is configured."""
        if any(getattr(config.faults, name) is not None for name in cls.FAULTS):
            return cls(config, rank)
        return NO_FAULTS

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

    def _kill_self(self, fault: str, step: int) -> None:
        """SIGKILL this worker, as the kernel's OOM killer or a lost host would. It first
        leaves the exit record a killed worker cannot, so that the attempt's end names the
        injected fault instead of sending the user to look for an OOM kill in `dmesg`."""
        write_exit_record(self.run_dir, attempt_of_worker(), self.rank, FailureClass.RETRYABLE,
                          f"killed by SIGKILL, injected by faults.{fault}", step)
        os.kill(os.getpid(), signal.SIGKILL)

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
        rank = self.faults.crash_rank if point in ("staging", "writing", "while_committing") else 0
        if point == self.faults.save_crash_point and self._fire_once(
                f"save_crash_{point}", self.faults.save_crash_at_step, step, rank):
            if point == "staging":
                log.info("failing the staging copy of rank %d for step %d", self.rank, step)
                raise OSError(f"injected: rank {self.rank} could not stage step {step} "
                              "(as with /dev/shm or pinned memory exhausted)")
            log.info("killing rank %d during the save of step %d (%s)", self.rank, step, point)
            self._kill_self(f"save_crash_at_step={step} (save_crash_point={point})", step)

    def after_step(self, step: int, preemption: PreemptionFlag) -> None:
        if self._fire_once("crash_at_step", self.faults.crash_at_step, step, self.faults.crash_rank):
            log.info("killing rank %d (pid %d) at step %d", self.rank, os.getpid(), step)
            self._kill_self(f"crash_at_step={step}", step)
        if self._fire_once("hang_at_step", self.faults.hang_at_step, step, self.faults.crash_rank):
            log.info("freezing rank %d (SIGSTOP) at step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._fire_once("sigterm_at_step", self.faults.sigterm_at_step, step):
            # As a scheduler preempting the job would: SIGTERM to torchrun, which forwards it
            # to every worker (or to this process when it runs without torchrun).
            target = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
            log.info("SIGTERM to pid %d at step %d", target, step)
            os.kill(target, signal.SIGTERM)
            # Waited for here, so that the ranks learn of it in this step's vote: the emergency
            # checkpoint is this step's, not the next one's when torchrun passes the signal on
            # slowly (a fault that fires during that save, save_crash_at_step, needs its step).
            deadline = time.monotonic() + PASSED_ON_WITHIN_S
            while not preemption.received and time.monotonic() < deadline:
                time.sleep(0.01)
            if not preemption.received:
                log.warning("the injected SIGTERM has not reached rank %d %.0f s after it was "
                            "sent: the ranks learn of it at a later step", self.rank,
                            PASSED_ON_WITHIN_S)


class _NoFaults:
    """No fault configured: every hook is a no-op."""

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def in_save(self, point: str, step: int) -> None:
        pass

    def after_step(self, step: int, preemption: PreemptionFlag) -> None:
        pass


NO_FAULTS = _NoFaults()
