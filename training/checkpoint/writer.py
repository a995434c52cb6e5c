"""How a checkpoint's files reach the disk: DCP's file writer, hashing every file as it is
written; the stager that copies the state off the live tensors; the writer process of
`checkpoint.async_mode: process`, which ignores the signals that stop its worker."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import queue
import sys
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.utils.serialization import config as serialization_config

from core.cpu_priority import lower_thread_priority
from core.files import write_atomic
from storage.manifests import FileEntry


class _KeptStateDictStager(StateDictStager):
    """DCP's state-dict stager, kept open across saves so its (pinned) buffers are reused, and
    released only when the checkpointer closes. Some torch versions (2.11) close it after
    every stage, which empties its type dispatch table and fails the next save (STACK_NOTES)."""

    def close(self):
        pass  # DefaultStager._stage's close, on torch 2.11

    def release(self):
        super().close()


class CpuStager(DefaultStager):
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
        self._state_dict_stager = _KeptStateDictStager(pin_memory=on_gpu, share_memory=shared_memory)
        self.before_copy = before_copy

    def stage(self, state_dict, **kwargs):
        try:
            self.before_copy()
        except OSError as e:
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        return super().stage(state_dict, **kwargs)

    def close(self) -> None:
        super().close()  # waits for the staging in flight
        self._state_dict_stager.release()


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


# What each rank's save writes: the model's weights in one file, the rest of the training
# state (optimizer, schedule, RNG, data position) in another, `__<rank>_model.distcp` and
# `__<rank>_training.distcp` (DCP's own writer puts both in `__<rank>_0.distcp`). Whoever
# needs the weights alone (evaluation, export, from the store) fetches a third of the bytes
# with AdamW; DCP's reader finds every entry through `.metadata`, whatever the file names.
MODEL_PREFIX = "model."


def shard_file_name(prefix: str, holds_weights: bool) -> str:
    """The file a rank's entries go to (`prefix`: DCP's `__<rank>_`)."""
    return f"{prefix}{'model' if holds_weights else 'training'}{DEFAULT_SUFFIX}"


class ShardWriter(dcp.FileSystemWriter):
    """DCP's file writer, changed in three ways:

    - The model's weights and the rest of the state go to files of their own
      (shard_file_name): what evaluation and export fetch from the store is the weights.

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
        if not hasattr(self, "_write_data"):
            raise RuntimeError("this torch's DCP FileSystemWriter has no _write_data, which "
                               "training.checkpoint.writer.ShardWriter writes through; install "
                               "a torch the project supports (pyproject.toml)")
        self.fs = _HashingFileSystem()

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.fs.written.clear()

    def write_data(self, plan, planner):
        # DCP's write_data, with the files chosen by what they hold (it splits by size for
        # thread_count > 1, which stays 1 here); its _write_data (torch 2.11-2.14) writes the
        # queued files, each with the writer's threads, transforms and fsync.
        files: queue.Queue = queue.Queue()
        for holds_weights in (True, False):
            items = [item for item in plan.items
                     if item.index.fqn.startswith(MODEL_PREFIX) == holds_weights]
            if items:
                name = shard_file_name(plan.storage_data.prefix, holds_weights)
                files.put((self.fs.concat_path(self.path, name), name, items))
        with serialization_config.patch({"save.compute_crc32": False}):
            results = self._write_data(planner, files).wait()  # one thread: written here
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
    idle (core.cpu_priority). The threads it starts for more files inherit that priority."""

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
# closes, or by SIGKILL (kill_writer_processes; torchrun's after its shutdown timeout).
WRITER_LAUNCHER = Path(__file__).with_name("writer_ignoring_stop_signals.sh")


def start_writers_ignoring_stop_signals() -> None:
    """Make the processes multiprocessing spawns (DCP's writer) start through WRITER_LAUNCHER."""
    if not os.access(WRITER_LAUNCHER, os.X_OK):
        raise RuntimeError(f"{WRITER_LAUNCHER} is missing or not executable (checkpoint.async_mode="
                           "process starts its writer through it); reinstall goodput or chmod +x it")
    os.environ["GOODPUT_WRITER_PYTHON"] = sys.executable
    multiprocessing.set_executable(str(WRITER_LAUNCHER))


def kill_writer_processes() -> None:
    """At the worker's exit, before multiprocessing's own exit handler, which would SIGTERM
    the writer (ignored) and then wait for it forever: SIGKILL. By then nothing is in flight
    that could still commit: the worker waited for its saves, or is dying without them."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)
