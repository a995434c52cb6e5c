"""One save at a time, synchronously or in the background, committed only when whole.

A save is committed by its manifest (sizes and sha256 of every file), which rank 0 writes
last, after every rank's shards are durable; a directory without one is crash debris.
"""

from __future__ import annotations

import atexit
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from core.cpu_priority import lower_thread_priority
from core.protocol import CHECKPOINT_MANIFEST, checkpoint_lock, is_committed, set_aside
from storage.manifests import CheckpointManifest, list_files
from training.checkpoint.errors import SAVE_ERRORS, CheckpointFailed, describe, is_disk_full
from training.checkpoint.replicas import ReplicaSplit
from training.checkpoint.state import part_states, train_state
from training.checkpoint.writer import (
    WRITTEN_DIGESTS,
    BackgroundWriter,
    CpuStager,
    ShardWriter,
    kill_writer_processes,
    start_writers_ignoring_stop_signals,
    written_digests,
)
from training.logs import get_logger

log = get_logger("checkpoint")


class Saver:
    """Saves checkpoints synchronously or in the background, and commits each when whole.

    In the background modes training blocks only to start the save: the state is copied off
    the live tensors by a staging thread while the next step's forward and backward run, and
    `before_update` waits for that copy before the optimizer changes the weights. Each rank
    copies (and writes) only its share of the tensors several ranks hold (replicas.ReplicaSplit).
    The write runs on its own gloo process group (on the default group it deadlocks against
    FSDP's collectives), in a thread or in a separate process; each rank hashes its files as
    it writes them (ShardWriter), and rank 0 writes the manifest from those digests in a
    background thread once every rank's shards are durable. The write and the
    hashing run at the lowest CPU priority (core.cpu_priority). At most one save is
    in flight; one that fails is reported (`failed`) and never committed. Never overwrites a
    committed checkpoint: one found at the target path (from an abandoned attempt that went
    further) is moved aside first.

    `fault_hook(point, step)` is called at "staging" (it may raise OSError to fail the copy),
    "writing", "before_manifest", "while_committing" (on the other ranks) and "after_manifest"
    so chaos tests can fail or kill the process at each point of a save.
    """

    def __init__(self, mode: str = "sync", fault_hook: Callable[[str, int], None] | None = None):
        self.mode = mode
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = (dist.new_group(backend="gloo")
                      if mode != "sync" and dist.is_initialized() else None)
        self.fault_hook = fault_hook or (lambda point, step: None)
        self._saving_step = 0
        self.stager = (CpuStager(shared_memory=mode == "process",
                                  before_copy=lambda: self.fault_hook("staging", self._saving_step))
                       if mode != "sync" else None)
        self.replicas = ReplicaSplit(self.group)
        if mode == "process":
            start_writers_ignoring_stop_signals()
            # Registered after multiprocessing's exit handler, so it runs first.
            atexit.unregister(kill_writer_processes)
            atexit.register(kill_writer_processes)
        self._pending: threading.Thread | None = None
        self._staging: Future | None = None
        self._unsettled = False  # a synchronous save's commit not yet waited for by every rank
        self.failures: list[str] = []
        self.disk_full = False

    def save(self, path: Path, model_parts, optimizers, extra: dict, manifest_fields: dict,
             urgent: bool = False) -> float:
        """Start (or do) a save; returns the seconds training was blocked. `urgent` (the
        emergency save, within the launcher's grace period): written and hashed at normal
        priority, not in idle cycles."""
        started = time.perf_counter()
        self.wait()
        if self.rank == 0:
            clear_for_save(path)
        _barrier()
        state = train_state(part_states(model_parts, optimizers), extra)
        step = self._saving_step = manifest_fields["step"]
        if self.mode == "sync":
            try:
                dcp.save(state, storage_writer=ShardWriter(path))
            except SAVE_ERRORS as e:  # DCP raised it on every rank: all stop together
                self._failed(path, e)
                raise CheckpointFailed(self.failures[-1], self.disk_full) from e
            _barrier()  # every rank's shards are durable (FileSystemWriter fsyncs) before the commit
            try:
                self._commit(path, manifest_fields)
            except Exception as e:  # rank 0 alone: reported, and the ranks agree on it next step
                self._failed(path, e)
            self._unsettled = True  # the other ranks wait for the commit in settle()
            return time.perf_counter() - started
        # Only what this rank writes is staged (a synchronous save stages nothing: DCP's own
        # dedup picks the writers there).
        state = self.replicas.own_share(state)
        kind = (AsyncCheckpointerType.PROCESS if self.mode == "process"
                else AsyncCheckpointerType.THREAD)
        if torch.cuda.is_initialized():
            # The stager copies on a CUDA stream of its own, which does not wait for this one:
            # the optimizer step's kernels must be done before it reads the weights. (Under
            # torchrun with nccl the barrier above waits too; alone or with gloo nothing would.)
            torch.cuda.current_stream().synchronize()
        writer = ShardWriter(path) if urgent else BackgroundWriter(path)
        response = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                  async_checkpointer_type=kind, async_stager=self.stager)
        if isinstance(response, AsyncSaveResponse):
            self._staging, written = response.staging_completion, response.upload_completion
        else:
            written = response
        blocked = time.perf_counter() - started
        self.fault_hook("writing", step)
        # The coordinator's future completes after it gathered every rank's write results
        # and wrote .metadata: then, and only then, the checkpoint may be committed.
        self._pending = threading.Thread(target=self._commit_when_written,
                                         args=(written, path, manifest_fields, not urgent),
                                         name=f"commit-{path.name}", daemon=True)
        self._pending.start()
        return blocked

    @property
    def in_flight(self) -> bool:
        """A background save is still being written, hashed or committed."""
        return self._pending is not None and self._pending.is_alive()

    def before_update(self) -> float:
        """Wait until the save in flight has copied the state (call before optimizer.step());
        returns the seconds waited, which count as checkpoint stall."""
        if self._staging is None:
            return 0.0
        started = time.perf_counter()
        try:
            self._staging.result()
        except SAVE_ERRORS:  # the write fails with it and reports it
            pass
        self._staging = None
        return time.perf_counter() - started

    def _commit_when_written(self, written: Future, path: Path, manifest_fields: dict,
                             background: bool) -> None:
        if background:  # the manifest (and any file without a digest to hash) too
            lower_thread_priority()
        try:
            written.result()
            self._commit(path, manifest_fields)
        except SAVE_ERRORS as e:  # reported, never committed: the directory stays debris
            self._failed(path, e)

    def _failed(self, path: Path, error: BaseException) -> None:
        full = is_disk_full(error, path)
        self.disk_full = self.disk_full or full
        # torch.save's zip writer reports ENOSPC as "unexpected pos": say what it means.
        self.failures.append(f"{path.name}: {describe(error)[:400]}"
                             + (" (no space left on the checkpoint filesystem)" if full else ""))
        log.error("save of %s failed, not committed: %s", path.name, self.failures[-1])

    def _commit(self, path: Path, manifest_fields: dict) -> None:
        step = manifest_fields["step"]
        if self.rank != 0:
            self.fault_hook("while_committing", step)
            return
        self.fault_hook("before_manifest", step)
        files = list_files(path, exclude=(CHECKPOINT_MANIFEST, WRITTEN_DIGESTS),
                           known=written_digests(path))
        manifest = CheckpointManifest(files=files, created_at=time.time(), **manifest_fields)
        # Before the commit: a committed directory holds its listed files only.
        (path / WRITTEN_DIGESTS).unlink()
        manifest.save(path)  # (its directory fsync makes the unlink durable too)
        log.info("committed %s (loss %.4f)", path.name, manifest.loss)
        self.fault_hook("after_manifest", step)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the save in flight (if any) is written and committed, or at most
        `timeout_s`; returns whether nothing is left in flight."""
        self.before_update()
        if self._pending is not None:
            self._pending.join(timeout_s)
            if self._pending.is_alive():
                return False
            self._pending = None
        return True

    def settle(self) -> None:
        """After a synchronous save: every rank waits here until rank 0 committed it, so no
        rank goes on (a fault, an exit) while the commit may still be lost.

        Apart from `save` so that rank 0 records the step first (metrics.jsonl; the trainer
        runs no collective between the save and this): a node lost once the checkpoint is
        committed fails rank 0 in its next collective, and had that been here the step's record
        would be lost with it, while the next attempt resumes after the step and never trains
        it again."""
        if self._unsettled:
            self._unsettled = False
            _barrier()

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffers."""
        self.settle()
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def clear_for_save(path: Path) -> None:
    """Make room for a save at `path`: a committed copy there (from an abandoned attempt that
    went further) is moved aside, never overwritten; debris of a save that never committed is
    removed."""
    with checkpoint_lock(path):  # waits while the flow validates or uploads the copy there
        if is_committed(path):
            aside = set_aside(path, "superseded")
            log.info("moved committed %s aside to %s", path.name, aside)
        elif path.exists():
            shutil.rmtree(path)  # debris of a save that never committed


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
