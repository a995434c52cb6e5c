"""Content checksums: one definition of "the same bytes" for shards, checkpoints, uploads and
configs; and the file primitives that keep them true (atomic writes, fsync, an exclusive
lock, a folder read by some while others may delete it)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_CHUNK = 4 * 1024 * 1024


def user_cache_dir() -> Path:
    """Where goodput keeps what it derives once per user and installation (lm-eval's task
    names, the builtin corpus): $XDG_CACHE_HOME/goodput, else ~/.cache/goodput."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "goodput"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks so large shards never sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj) -> bytes:
    """Stable JSON bytes for hashing (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` so readers see either the old file or the whole new one, never a part."""
    with atomic_file(path) as f:
        f.write(data)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write whole that appears under `path` only once complete.

    The bytes go to a temporary file in the same directory, are fsynced, and are renamed
    over the target; the directory is fsynced so the rename itself survives a power loss. On
    an error the temporary file goes and `path` keeps what it held.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def reading_folder(path: str | os.PathLike) -> Iterator[None]:
    """Hold a shared flock on the folder `path` (created if missing) while files in it are
    read: delete_folder_unless_read leaves it alone meanwhile."""
    path = Path(path)
    while True:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:  # not the folder a deleter removed while this waited for the lock
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def delete_folder_unless_read(path: str | os.PathLike) -> bool:
    """Delete the folder `path` unless something reads in it (reading_folder); whether it did."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


@contextmanager
def exclusive_lock(path: str | os.PathLike, on_wait: Callable[[float, str], None] | None = None,
                   holder: Callable[[], str] | None = None, remind_s: float = 300.0) -> Iterator[None]:
    """Hold an exclusive flock on the file `path` (created with its folder). Per open file, so
    threads of one process exclude each other as processes do. `holder()` (who takes it: a
    process, a host, since when) is written into the file once it is held. `on_wait(waited_s, holder)`
    is called if another holds it, before this waits for it, and every `remind_s` of waiting
    after that, with what the other wrote as its holder ("" if nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:  # not "w": taking the lock leaves the file as it was
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            else:
                _wait_for_lock(lock, on_wait, remind_s)
        if holder is not None:
            lock.truncate(0)
            lock.write(holder())
            lock.flush()
        yield


def _wait_for_lock(lock, on_wait: Callable[[float, str], None], remind_s: float) -> None:
    started, said = time.monotonic(), None
    while True:
        waited = time.monotonic() - started
        if said is None or waited - said >= remind_s:
            lock.seek(0)
            on_wait(waited, lock.read().strip())
            said = waited
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(min(1.0, remind_s))
