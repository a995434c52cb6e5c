"""Checkpoints: a torch.distributed.checkpoint (DCP) directory plus a manifest written last.

Layout: `<run_dir>/checkpoints/step-00000050/` holds the DCP files (`*.distcp`,
`.metadata`) and `manifest.json`. Every rank writes its shards, hashing them on their way
to disk; once all are durable, rank 0 writes the manifest (sizes and sha256 of every file)
atomically from those digests. A directory without a manifest is
what a crash mid-save leaves behind: it is never loaded and is cleared before reuse.

The same save loads at any world size (DCP reshards), and `verify_checkpoint` reloads a
checkpoint in one process with no model or layout given, to prove it is whole.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor
from torch.utils.serialization import config as serialization_config

from storage.background import lower_thread_priority
from storage.checksums import exclusive_lock, sha256_bytes, sha256_file, write_atomic
from storage.manifests import (CHECKPOINT_MANIFEST, CheckpointManifest, FileEntry, list_files,
                               verify_files)

STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step-{step:08d}"


def step_of(path: str | Path) -> int:
    match = STEP_DIR.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory (expected step-XXXXXXXX)")
    return int(match.group(1))


def is_committed(path: Path) -> bool:
    return (path / CHECKPOINT_MANIFEST).is_file()


def step_lock(path: Path):
    """Exclusive lock on checkpoint directory `path` (a file beside it): the flow's
    validation, upload and download of a step, and the trainer moving a committed copy of
    it aside to save the step again, never overlap."""
    return exclusive_lock(path.parent / f".{path.name}.lock")


def copy_id(path: Path) -> str | None:
    """Identity of the committed copy at `path` (None: not committed): a save of the same
    step again is another copy, judged and uploaded on its own."""
    manifest = path / CHECKPOINT_MANIFEST
    return sha256_file(manifest)[:16] if manifest.is_file() else None


def committed_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories with a manifest, oldest first. Others are crash debris."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and is_committed(p)]
    return sorted(found, key=step_of)


# -- saving and loading inside the training job (collective: every rank calls) ---------------

# Flattened optimizer state is keyed by parameter name, so the states of several pipeline
# stages merge into one dict and load under any other layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _part_states(model_parts, optimizers) -> list[tuple[dict, dict]]:
    return [get_state_dict(part, opt, options=_OPTIONS) for part, opt in zip(model_parts, optimizers)]


def _train_state(parts: list[tuple[dict, dict]], extra: dict) -> dict:
    model_state, optim_state = {}, {}
    for m, o in parts:
        model_state.update(m)
        optim_state.update(o)
    return {"model": model_state, "optim": optim_state, **extra}


# -- each rank stages and writes only its share of replicated tensors ----------------------------
#
# DCP writes one copy of a tensor several ranks hold (DDP's replicas, HSDP's replicate axis),
# but only after every rank has staged (copied off the live tensors) everything it holds:
# under DDP each of a node's 8 ranks would keep a whole copy of the model and optimizer in
# host memory and spend the CPU to fill it. Ranks that hold identical tensors (the same
# names, chunks and sizes: DDP's replicas, HSDP's replicate axis, within a pipeline stage)
# split them before staging instead; each leaves out what a peer writes. Finding the peers
# takes one all-gather of a digest per rank, not of what every rank holds.

_Unit = tuple[str, str, tuple[int, ...]]  # (section, key, global offset of the chunk)


def _tensor_units(state: dict) -> dict[_Unit, int]:
    """The tensors of the model and optimizer sections as DCP writes them (a DTensor by its
    local chunk's global offset), with their bytes. Other values are small and stay on every
    rank (DCP writes them once)."""
    units = {}
    for section in ("model", "optim"):
        for key, value in state[section].items():
            if isinstance(value, DTensor):
                if value.device_mesh.get_coordinate() is None:
                    continue  # not on this rank's mesh: DCP writes nothing of it here either
                offsets = tuple(value.__create_chunk_list__()[0].offsets)
                units[(section, key, offsets)] = value.to_local().nbytes
            elif isinstance(value, torch.Tensor):
                units[(section, key, ())] = value.nbytes
    return units


def holdings_digest(units: dict[_Unit, int]) -> str:
    """Equal on two ranks exactly when they hold the same tensors (names, chunks, sizes)."""
    return sha256_bytes(repr(sorted(units.items())).encode())


def my_share(units: dict[_Unit, int], digests: list[str], me: int) -> set[_Unit]:
    """The units rank `me` stages and writes, given every rank's holdings_digest: the ranks
    that hold exactly what it holds split them, each unit (largest first) to the peer with
    the fewest bytes so far (ties: the lowest rank). Every peer computes the same split from
    its own identical units, so each unit is kept by exactly one of them."""
    peers = [rank for rank, digest in enumerate(digests) if digest == digests[me]]
    load = dict.fromkeys(peers, 0)
    mine = set()
    for unit in sorted(units, key=lambda u: (-units[u], u)):
        rank = min(peers, key=lambda r: (load[r], r))
        load[rank] += units[unit]
        if rank == me:
            mine.add(unit)
    return mine


class _ReplicaSplit:
    """`share(state)`: `state` less the tensors a peer writes (collective on `group`)."""

    def __init__(self, group):
        self.group = group
        self.reported: str | None = None

    def share(self, state: dict) -> dict:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return state
        units = _tensor_units(state)
        digests = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, holdings_digest(units), group=self.group)
        me = dist.get_rank(self.group)
        mine = my_share(units, digests, me)
        if me == 0 and self.reported != digests[0]:  # once, unless the holdings change
            self.reported = digests[0]
            print(f"[checkpoint] rank 0 stages and writes {sum(units[u] for u in mine) / 1e6:.3f} "
                  f"MB of the {sum(units.values()) / 1e6:.3f} MB of tensors it holds; "
                  f"{digests.count(digests[0])} ranks hold the same and split them", flush=True)
        others = {(section, key) for section, key, _ in units.keys() - mine}
        return {name: ({k: v for k, v in value.items() if (name, k) not in others}
                       if name in ("model", "optim") else value)
                for name, value in state.items()}


# DCP gathers every rank's error into a CheckpointException, which is a BaseException.
SAVE_ERRORS = (Exception, CheckpointException)


class CheckpointFailed(RuntimeError):
    """A save did not complete (it is never committed). `disk_full` when the cause was ENOSPC:
    retrying cannot help until someone frees space, so that class is not retried."""

    def __init__(self, message: str, disk_full: bool = False, writes_stuck: bool = False):
        super().__init__(message)
        self.disk_full = disk_full
        # A write of this rank is blocked in a collective with a rank whose save failed
        # earlier: its (non-daemon) thread would keep the process from exiting.
        self.writes_stuck = writes_stuck


def _causes(error: BaseException) -> list[BaseException]:
    """The underlying errors: DCP gathers each rank's into one CheckpointException."""
    if isinstance(error, CheckpointException):
        return [exc for exc, _trace in error.failures.values()]
    return [error]


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                         for rank, (exc, _trace) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def _is_disk_full(error: BaseException, path: Path) -> bool:
    """ENOSPC somewhere in the error, or (as torch.save's zip writer turns ENOSPC into a bare
    RuntimeError) less than 1 MiB left on the checkpoint filesystem after the failure."""
    try:
        stats = os.statvfs(path.parent)
        if stats.f_bavail * stats.f_frsize < 1 << 20:
            return True
    except OSError:
        pass
    for cause in _causes(error):
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                return True
            cause = cause.__cause__ or cause.__context__
    return False


class _CpuStager(DefaultStager):
    """A DefaultStager kept across saves (it reuses its staging buffers) that copies the state
    off the live tensors in a background thread: `async_save` returns at once and training
    only has to wait for the copy before the optimizer next changes the weights. Pinned
    memory speeds the device-to-host copy on GPU; non-blocking copies need an accelerator.

    `before_copy()` may raise OSError (fault injection): the staging then fails as a full
    /dev/shm or pinned-memory limit would make it fail, on this rank only."""

    def __init__(self, shared_memory: bool, before_copy: Callable[[], None]):
        on_gpu = torch.cuda.is_available()
        super().__init__(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=shared_memory,
                                        use_async_staging=True, use_non_blocking_copy=on_gpu))
        self.before_copy = before_copy

    def stage(self, state_dict, **kwargs):
        try:
            self.before_copy()
        except OSError as e:
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        return super().stage(state_dict, **kwargs)


# Sizes and sha256 of a save's files as their writers wrote them: the coordinator writes it
# after `.metadata`, and the commit builds the manifest from it instead of reading every
# rank's files back (and removes it just before the manifest commits the directory).
WRITTEN_DIGESTS = "written.json"
_DIGEST_FQN = "__goodput_sha256__/"  # marks the write results that carry a file's digest


def written_digests(path: Path) -> dict[str, FileEntry]:
    """The WRITTEN_DIGESTS of the save at `path`, by file name (list_files' `known`)."""
    return {name: FileEntry.model_validate(entry)
            for name, entry in json.loads((Path(path) / WRITTEN_DIGESTS).read_text()).items()}


class _HashedFile(io.RawIOBase):
    """A file being written whose bytes are hashed on their way in. No seeking: the digest
    holds only for bytes written in order (DCP and torch.save write that way)."""

    def __init__(self, file):
        super().__init__()
        self._file, self._sha256, self.size = file, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written = self._file.write(data)
        view = memoryview(data).cast("B")
        self._sha256.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        # DCP fsyncs the descriptor without flushing first (`.metadata`): flush, so the
        # fsync covers every byte written.
        self._file.flush()
        return self._file.fileno()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        super().close()  # flushes first
        self._file.close()

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, recording size and sha256 of each file written through it."""

    def __init__(self):
        self.written: dict[str, FileEntry] = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashed = _HashedFile(stream)
            yield hashed
        name = Path(path).name  # a save's files lie side by side in its directory
        self.written[name] = FileEntry(path=name, size=hashed.size, sha256=hashed.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        entry = self.written.pop(Path(path).name, None)
        if entry is not None:
            self.written[Path(new_path).name] = entry.model_copy(update={"path": Path(new_path).name})


class ShardWriter(dcp.FileSystemWriter):
    """DCP's file writer, changed in two ways that take work off the save:

    - Each rank hashes its files as it writes them, and the digests travel to the
      coordinator with DCP's write results; the coordinator writes them to WRITTEN_DIGESTS
      after `.metadata`. The commit then builds the manifest without reading any shard back:
      hashing a whole checkpoint on rank 0 cost as much CPU as writing it (one rank's share
      of the bytes, on a shared filesystem every rank's), and the ranks now share that work.
      The manifest holds the bytes as written; validation rereads the files against it.
    - No zip CRC-32 for each tensor record (torch.save computes one unless told not to).
      Nothing reads it (torch.load does not check it) and the sha256 covers every byte; it
      was a third to over half of the writer's CPU (benchmarks/save_cpu_bench.py). It is off
      only while this writer writes; torch keeps the setting per thread (2.13), and where it
      is the process's, a torch.save elsewhere meanwhile would only lose that unread CRC too.
    """

    def __init__(self, path):
        super().__init__(path)
        self.fs = _HashingFileSystem()

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.fs.written.clear()

    def write_data(self, plan, planner):
        with serialization_config.patch({"save.compute_crc32": False}):
            results = super().write_data(plan, planner).wait()  # one thread: written here
        digests = [WriteResult(index=MetadataIndex(_DIGEST_FQN + name), size_in_bytes=entry.size,
                               storage_data=entry)
                   for name, entry in self.fs.written.items()]
        done = torch.futures.Future()
        done.set_result(results + digests)
        return done

    def finish(self, metadata, results) -> None:
        written = {r.storage_data.path: r.storage_data for rank in results for r in rank
                   if r.index.fqn.startswith(_DIGEST_FQN)}
        super().finish(metadata, [[r for r in rank if not r.index.fqn.startswith(_DIGEST_FQN)]
                                  for rank in results])
        written.update(self.fs.written)  # and `.metadata`, written just now
        write_atomic(Path(self.path) / WRITTEN_DIGESTS, json.dumps(
            {name: entry.model_dump() for name, entry in sorted(written.items())}).encode())


class BackgroundWriter(ShardWriter):
    """The writer for background saves: the thread that runs the save (DCP's executor
    thread, or the writer process's) drops to background priority as DCP sets the writer up,
    before planning, so that on busy cores the whole save takes the cycles training leaves
    idle (storage.background). The threads it starts for more files inherit that priority."""

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        lower_thread_priority()
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


# DCP's writer process (process mode) starts through this script, which ignores the stop
# signals and then execs Python in its place (an ignored signal stays ignored across exec).
# The writer is a child the worker spawns on its first background save, in the worker's
# process group, which torchrun signals as a whole (Slurm signals every process of a step, a
# terminal's Ctrl-C its foreground group): the SIGTERM that asks the worker for an emergency
# save would otherwise kill the writer first, and the save in flight and the emergency save
# with it. The worker decides when to stop; the writer ends when the worker's pipe to it
# closes, or by SIGKILL (_kill_writer_processes; torchrun's after its shutdown timeout).
WRITER_LAUNCHER = Path(__file__).with_name("writer_ignoring_stop_signals.sh")


def _start_writers_ignoring_stop_signals() -> None:
    """Make the processes multiprocessing spawns (DCP's writer) start through WRITER_LAUNCHER."""
    if not os.access(WRITER_LAUNCHER, os.X_OK):
        raise RuntimeError(f"{WRITER_LAUNCHER} is missing or not executable (checkpoint.async_mode="
                           "process starts its writer through it); reinstall goodput or chmod +x it")
    os.environ["GOODPUT_WRITER_PYTHON"] = sys.executable
    multiprocessing.set_executable(str(WRITER_LAUNCHER))


def _kill_writer_processes() -> None:
    """At the worker's exit, before multiprocessing's own exit handler, which would SIGTERM
    the writer (ignored) and then wait for it forever: SIGKILL. By then nothing is in flight
    that could still commit: the worker waited for its saves, or is dying without them."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)


class Checkpointer:
    """Saves checkpoints synchronously or in the background, and commits each when whole.

    In the background modes training blocks only to start the save: the state is copied off
    the live tensors by a staging thread while the next step's forward and backward run, and
    `before_update` waits for that copy before the optimizer changes the weights. Each rank
    copies (and writes) only its share of the tensors several ranks hold (_ReplicaSplit).
    The write runs on its own gloo process group (on the default group it deadlocks against
    FSDP's collectives), in a thread or in a separate process; each rank hashes its files as
    it writes them (ShardWriter), and rank 0 writes the manifest from those digests in a
    background thread once every rank's shards are durable. The write and the
    hashing run at the lowest CPU priority (storage.background). At most one save is
    in flight; one that fails is reported (`failed`) and never committed. Never overwrites a
    committed checkpoint: one found at the target path (from an abandoned attempt that went
    further) is moved aside first.

    `fault_hook(point, step)` is called at "staging" (it may raise OSError to fail the copy),
    "writing", "before_manifest" and "after_manifest" so chaos tests can fail or kill the
    process at each point of a save.
    """

    def __init__(self, mode: str = "sync", fault_hook: Callable[[str, int], None] | None = None):
        self.mode = mode
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = (dist.new_group(backend="gloo")
                      if mode != "sync" and dist.is_initialized() else None)
        self.fault_hook = fault_hook or (lambda point, step: None)
        self._saving_step = 0
        self.stager = (_CpuStager(shared_memory=mode == "process",
                                  before_copy=lambda: self.fault_hook("staging", self._saving_step))
                       if mode != "sync" else None)
        self.replicas = _ReplicaSplit(self.group)
        if mode == "process":
            _start_writers_ignoring_stop_signals()
            # Registered after multiprocessing's exit handler, so it runs first.
            atexit.unregister(_kill_writer_processes)
            atexit.register(_kill_writer_processes)
        self._pending: threading.Thread | None = None
        self._staging: Future | None = None
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
            _clear_for_save(path)
        _barrier()
        state = _train_state(_part_states(model_parts, optimizers), extra)
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
            _barrier()
            return time.perf_counter() - started
        # Only what this rank writes is staged (a synchronous save stages nothing: DCP's own
        # dedup picks the writers there).
        state = self.replicas.share(state)
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
        self._pending = threading.Thread(target=self._finish,
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

    def _finish(self, written: Future, path: Path, manifest_fields: dict, background: bool) -> None:
        if background:  # the manifest (and any file without a digest to hash) too
            lower_thread_priority()
        try:
            written.result()
            self._commit(path, manifest_fields)
        except SAVE_ERRORS as e:  # reported, never committed: the directory stays debris
            self._failed(path, e)

    def _failed(self, path: Path, error: BaseException) -> None:
        full = _is_disk_full(error, path)
        self.disk_full = self.disk_full or full
        # torch.save's zip writer reports ENOSPC as "unexpected pos": say what it means.
        self.failures.append(f"{path.name}: {_describe(error)[:400]}"
                             + (" (no space left on the checkpoint filesystem)" if full else ""))
        print(f"[checkpoint] save of {path.name} failed, not committed: {self.failures[-1]}",
              flush=True)

    def _commit(self, path: Path, manifest_fields: dict) -> None:
        if self.rank != 0:
            return
        step = manifest_fields["step"]
        self.fault_hook("before_manifest", step)
        files = list_files(path, exclude=(CHECKPOINT_MANIFEST, WRITTEN_DIGESTS),
                           known=written_digests(path))
        manifest = CheckpointManifest(files=files, created_at=time.time(), **manifest_fields)
        # Before the commit: a committed directory holds its listed files only.
        (path / WRITTEN_DIGESTS).unlink()
        manifest.save(path)  # (its directory fsync makes the unlink durable too)
        print(f"[checkpoint] committed {path.name} (loss {manifest.loss:.4f})", flush=True)
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

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffers."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class CheckpointCorrupt(Exception):
    """A file of a committed checkpoint no longer matches its manifest when a rank loads it:
    damaged after validation (disk, a stray write) or in the store. Never loaded; the launch
    task sets that copy aside and the next attempt resumes from another."""

    def __init__(self, step: int, source: str, reason: str, from_store: bool):
        super().__init__(f"checkpoint step {step} at {source}: {reason}")
        self.step, self.source, self.reason, self.from_store = step, source, reason, from_store

    def __reduce__(self):  # DCP pickles each rank's error to every rank
        return type(self), (self.step, self.source, self.reason, self.from_store)


class VerifiedReader(dcp.FileSystemReader):
    """Reads a committed checkpoint directory, first checking each file this rank's DCP read
    plan touches against the manifest's sha256.

    Validation proved the checkpoint whole once; the hash at load proves it still is, for
    the files this rank reads (the read warms the page cache DCP then reads from).
    """

    from_store = False

    def __init__(self, path: str | Path, manifest: CheckpointManifest | None = None):
        super().__init__(str(path))
        self.source = str(path)
        if manifest is None:
            if not is_committed(Path(path)):
                raise FileNotFoundError(f"{path} has no {CHECKPOINT_MANIFEST}: not a committed checkpoint")
            manifest = CheckpointManifest.load(Path(path))
        self.manifest = manifest
        self.sha256 = {f.path: f.sha256 for f in manifest.files}
        self.local_dir = Path(path)

    def __str__(self) -> str:
        return self.source

    def corrupt(self, reason: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(self.manifest.step, self.source, reason, self.from_store)

    def _whole(self, relative: str) -> bool:
        """`relative` is under local_dir and matches the manifest."""
        if relative not in self.sha256:
            raise self.corrupt(f"{relative} is not in its manifest")
        path = self.local_dir / relative
        return path.is_file() and sha256_file(path) == self.sha256[relative]

    def _obtain(self, relative: str) -> None:
        """Make `relative` available under local_dir, matching the manifest."""
        if not self._whole(relative):
            raise self.corrupt(f"{relative} is missing" if not (self.local_dir / relative).is_file()
                               else f"{relative}: sha256 differs from the manifest")

    def read_metadata(self, *args, **kwargs):
        self._obtain(".metadata")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        for relative in sorted({self.storage_data[item.storage_index].relative_path
                                for item in plan.items}):
            self._obtain(relative)
        return super().read_data(plan, planner)


class StoreReader(VerifiedReader):
    """Loads an uploaded checkpoint straight from the object store, each rank fetching only
    the files its own part of the state lives in.

    DCP tells each rank which stored items it needs (its read plan) once the metadata is
    known; this reader fetches `.metadata`, then exactly the `.distcp` files that plan
    touches, each checked against the manifest's sha256, into `cache_dir` (shared by the
    ranks of a node: a file another rank fetched is reused). Used where the nodes do not share
    the disk the checkpoint was downloaded to, and where most of a large checkpoint belongs to
    other ranks (FSDP, PP). `fetched` lists what this rank downloaded.
    """

    from_store = True

    def __init__(self, store, prefix: str, cache_dir: str | Path):
        prefix = prefix.rstrip("/")
        manifest_key = f"{prefix}/{CHECKPOINT_MANIFEST}"
        if not store.exists(manifest_key):
            raise FileNotFoundError(f"{store.url(manifest_key)} not found: the checkpoint was "
                                    "never uploaded completely")
        super().__init__(cache_dir, CheckpointManifest.model_validate_json(store.get_bytes(manifest_key)))
        self.store, self.prefix, self.source = store, prefix, store.url(prefix)
        self.fetched: list[str] = []

    def _obtain(self, relative: str) -> None:
        if self._whole(relative):
            return  # another rank of this node fetched it
        dest = self.local_dir / relative
        for _ in range(2):  # a second fetch tells a bad transfer from a bad stored copy
            self.store.get_file(f"{self.prefix}/{relative}", dest)
            if self._whole(relative):
                self.fetched.append(relative)
                return
            dest.unlink(missing_ok=True)
        raise self.corrupt(f"{relative}: sha256 differs from the manifest (fetched twice)")


def load_checkpoint(reader: VerifiedReader, model_parts, optimizers, extra_template: dict) -> dict:
    """Load a committed checkpoint (a local directory, or the store: see `VerifiedReader` and
    `StoreReader`) into this rank's model parts and optimizers, whatever layout saved it
    (DCP reshards); returns the extras. Raises CheckpointCorrupt on every rank when any
    rank found a file that no longer matches the manifest."""
    parts = _part_states(model_parts, optimizers)
    state = _train_state(parts, extra_template)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:  # every rank's errors, gathered by DCP (a BaseException)
        corrupt = [c for c in _causes(e) if isinstance(c, CheckpointCorrupt)]
        if corrupt:
            raise corrupt[0] from None
        raise RuntimeError(f"loading {reader} failed: {_describe(e)}") from None
    for (m, o), part, opt in zip(parts, model_parts, optimizers):
        set_state_dict(part, opt, options=_OPTIONS,
                       model_state_dict={k: state["model"][k] for k in m},
                       optim_state_dict={k: state["optim"][k] for k in o})
    return {k: v for k, v in state.items() if k not in ("model", "optim")}


def set_aside(path: Path, why: str) -> Path | None:
    """Move a checkpoint directory out of reach of resume into `checkpoints/<why>/`, kept
    for inspection; returns where it went (None when there was nothing to move)."""
    if not path.exists():
        return None
    aside = path.parent / why / f"{path.name}-{time.time_ns()}"
    aside.parent.mkdir(parents=True, exist_ok=True)
    path.rename(aside)
    return aside


def _clear_for_save(path: Path) -> None:
    with step_lock(path):  # waits while the flow validates or uploads the copy there
        if is_committed(path):
            aside = set_aside(path, "superseded")
            print(f"[checkpoint] moved committed {path.name} aside to {aside}", flush=True)
        elif path.exists():
            shutil.rmtree(path)  # debris of a save that never committed


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# -- verification in a fresh single process ---------------------------------------------------

def load_all_tensors(path: Path, prefix: str = "") -> dict:
    """Every entry (under `prefix`) of a DCP checkpoint, loaded in this process whatever
    layout saved it."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        if isinstance(meta, TensorStorageMetadata):
            state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            state[fqn] = None  # a pickled object; DCP puts the loaded value here
    with warnings.catch_warnings():  # single-process load is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def model_state_from(flat: dict) -> dict:
    prefix = "model."
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def verify_checkpoint(path: str | Path, dataset_dir: str | Path | None = None,
                      eval_batches: int = 0, loss_tolerance: float = 0.5) -> dict:
    """Checks a committed checkpoint; returns {"ok": bool, "reason": str, ...}.

    Checksums against the manifest, a full reload, every floating tensor finite, and the
    model weights loading strictly into a freshly built model of the recorded shape. With
    `eval_batches` and a dataset: the held-out loss on that many validation batches must not
    exceed the training loss recorded at the step by more than `loss_tolerance` (relative) —
    weights that are finite but wrong (a bad write, a bad reshard) fail here.
    """
    from training.model import ModelArgs, Transformer

    path = Path(path)
    if not is_committed(path):
        return {"ok": False, "reason": f"no {CHECKPOINT_MANIFEST}: incomplete save"}
    try:
        manifest = CheckpointManifest.load(path)
    except Exception as e:  # a manifest that does not parse is as bad as none
        return {"ok": False, "reason": f"unreadable manifest: {e}"}
    if manifest.step != step_of(path):
        return {"ok": False, "reason": f"manifest step {manifest.step} != directory {path.name}"}
    problems = verify_files(path, manifest.files)
    if problems:
        return {"ok": False, "reason": "checksum: " + "; ".join(problems[:5])}
    try:
        state = load_all_tensors(path)
    except MemoryError:
        raise  # this machine's limit, not the checkpoint's fault: no verdict
    except Exception as e:
        return {"ok": False, "reason": f"reload failed: {type(e).__name__}: {e}"}
    non_finite = [k for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]
    if non_finite:
        return {"ok": False, "reason": f"non-finite values in {', '.join(non_finite[:5])}"}
    try:
        model = Transformer.with_weights(ModelArgs(**manifest.model_args), model_state_from(state))
    except Exception as e:
        return {"ok": False, "reason": f"weights do not fit the model: {e}"}
    n_tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    result = {"ok": True, "reason": "", "step": manifest.step, "tensors": n_tensors,
              "loss": manifest.loss if manifest.loss is None or math.isfinite(manifest.loss) else None}
    if eval_batches and dataset_dir is not None and result["loss"] is not None:
        # At the length training measured its loss at: positions past it were never trained.
        seq_len = manifest.seq_len or model.args.max_seq_len
        held_out = _held_out_loss(model, Path(dataset_dir), eval_batches, seq_len)
        result["held_out_loss"] = held_out
        limit = result["loss"] * (1 + loss_tolerance)
        if not held_out <= limit:
            return {**result, "ok": False, "reason":
                    f"held-out loss {held_out:.4f} over {eval_batches} batches exceeds the training "
                    f"loss {result['loss']:.4f} at step {manifest.step} by more than "
                    f"{loss_tolerance:.0%} (checkpoint.validate_loss_tolerance)"}
    return result


def _held_out_loss(model, dataset_dir: Path, batches: int, seq_len: int) -> float:
    from storage.manifests import DatasetManifest
    from training.data import TokenStream
    from training.evaluate import held_out_loss

    stream = TokenStream(dataset_dir, DatasetManifest.load(dataset_dir), "validation")
    model.eval()
    loss, _tokens = held_out_loss(model, stream, seq_len, 4, batches,
                                  torch.device("cpu"))
    return loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.checkpoint",
                                     description="Verify a checkpoint in this process; prints JSON.")
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("path")
    parser.add_argument("--dataset", help="prepared dataset: also check the held-out loss")
    parser.add_argument("--eval-batches", type=int, default=0,
                        help="validation batches for the held-out loss check (0: off)")
    parser.add_argument("--loss-tolerance", type=float, default=0.5,
                        help="held-out loss may exceed the training loss by this fraction")
    parser.add_argument("--background", action="store_true",
                        help="run at the lowest CPU priority (beside training)")
    args = parser.parse_args(argv)
    if args.background:  # before torch starts its intra-op threads, which inherit it
        lower_thread_priority()
    result = verify_checkpoint(args.path, args.dataset, args.eval_batches, args.loss_tolerance)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
