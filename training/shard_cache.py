"""The shards of a dataset in the store, read through a bounded cache on local disk.

A node then needs disk for `data.cache_limit`, not for the dataset. A shard is fetched from
the store when first needed (or ahead of use, by `prefetch` in a background thread), checked
against the manifest's size and sha256 once, as it enters the cache, and the least recently
used shards are evicted to keep the cache under its limit. The ranks of a node share one
cache directory and fetch one shard at a time between them (a lock file): the ranks read the
same windows at the same time, so one fetches a shard while the others wait for it, and the
room a fetch makes is not taken by another.

A cache directory holds the dataset's manifest.json and tokenizer.json, so it serves as the
dataset directory the trainer, the verifier and the evaluator are given, plus `cache.json`
(the store and the limit) and the cached shards. Evicting a shard another process still has
memory-mapped is safe: its mapping stays valid, and the disk is freed when it is unmapped.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.config import StorageConfig
from core.errors import ConfigError, DataError
from core.files import sha256_file, write_atomic
from storage.manifests import DatasetManifest, ShardInfo
from storage.store import IntegrityError, store_from_config

CACHE_FILE = "cache.json"


def write_cache_settings(directory: Path, storage: StorageConfig, store_prefix: str,
                         limit_bytes: int | None) -> None:
    """Mark `directory` (holding the dataset's manifest) as a cache of `store_prefix`."""
    settings = {"storage": storage.model_dump(mode="json"), "store_prefix": store_prefix,
                "limit_bytes": limit_bytes}
    write_atomic(directory / CACHE_FILE, json.dumps(settings, indent=1).encode())


def is_cache(directory: Path) -> bool:
    return (directory / CACHE_FILE).is_file()


class ShardCache:
    """Local paths of a dataset's shards, fetched from the store on demand.

    Shards handed out by `path`, and those the reader says it keeps (`keep_only`: what it
    has mapped and the window it reads), are never evicted by this process. Prefetching runs
    in a daemon thread: a process that ends stops it, leaving at most a partial file, which
    the next fetch on the node removes.
    """

    def __init__(self, directory: Path, manifest: DatasetManifest):
        settings = json.loads((directory / CACHE_FILE).read_text())
        self.directory, self.manifest = directory, manifest
        self.store = store_from_config(StorageConfig(**settings["storage"]))
        self.prefix, self.limit = settings["store_prefix"], settings["limit_bytes"]
        self._queue: queue.Queue[ShardInfo] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._prefetcher: threading.Thread | None = None
        self.fetched = 0  # shards this process brought into the cache
        self.kept: set[str] = set()  # never evicted by this process (see keep_only)

    def path(self, shard: ShardInfo) -> Path:
        """The shard's file in the cache, fetched and verified first if it is not there, and
        kept (never evicted by this process) until `keep_only` leaves it out. Another process
        may still evict it before the caller opens it: a caller that finds it gone asks again."""
        with self._lock:
            pending = self._pending.get(shard.path)
        if pending is not None:
            pending.done.wait()
            if pending.error is not None:  # a failed prefetch raises where the shard is needed
                raise pending.error
        self.kept.add(shard.path)
        local = self.directory / shard.path
        try:
            if self._cached(shard):
                os.utime(local)  # most recently used
                return local
        except FileNotFoundError:  # evicted just now by another process
            pass
        return self._fetch(shard)

    def keep_only(self, shards: list[ShardInfo]) -> None:
        """Keep these shards from eviction by this process, and no others: the reader's
        mapped shards and those of the window it reads, mapped one by one as it goes."""
        self.kept = {s.path for s in shards}

    def prefetch(self, shards: list[ShardInfo]) -> None:
        """Fetch these shards in the background (those not cached or on their way)."""
        with self._lock:
            for shard in shards:
                if shard.path not in self._pending and not self._cached(shard):
                    self._pending[shard.path] = _Pending()
                    self._queue.put(shard)
            if self._prefetcher is None and self._pending:
                self._prefetcher = threading.Thread(target=self._prefetch_loop, daemon=True,
                                                    name="shard-prefetch")
                self._prefetcher.start()

    def _prefetch_loop(self) -> None:
        while True:
            shard = self._queue.get()
            pending = self._pending[shard.path]
            try:
                self._fetch(shard)
            except BaseException as e:  # kept for the reader, which raises it
                pending.error = e
            with self._lock:
                del self._pending[shard.path]
            pending.done.set()

    def _cached(self, shard: ShardInfo) -> bool:
        # A shard enters the cache by a rename after it was verified: present means whole.
        try:
            return (self.directory / shard.path).stat().st_size == shard.size
        except FileNotFoundError:
            return False

    def _fetch(self, shard: ShardInfo) -> Path:
        local = self.directory / shard.path
        with _locked(self.directory / ".fetch.lock"):  # one fetch at a time on this node
            if not self._cached(shard):  # another rank of this node may have fetched it
                self._make_room(shard.size)
                self._download(shard, local)
            os.utime(local)  # most recently used
        return local

    def _download(self, shard: ShardInfo, local: Path) -> None:
        key = f"{self.prefix}/{shard.path}"
        partial = local.with_name(f".{shard.path}.{os.getpid()}.partial")
        try:
            try:
                self.store.get_file(key, partial)
            except FileNotFoundError as gone:
                raise DataError(
                    f"shard {shard.path} of dataset {self.manifest.dataset_id} is gone from "
                    f"{self.store.url(key)}: the dataset in the store is damaged; prepare it "
                    "again (goodput prepare)") from gone
            size, sha256 = partial.stat().st_size, sha256_file(partial)
            if (size, sha256) != (shard.size, shard.sha256):  # a transfer's fault, or the store's
                self.store.get_file(key, partial)
                again = partial.stat().st_size, sha256_file(partial)
                if again != (shard.size, shard.sha256):
                    # Twice the same wrong bytes: the store's copy is damaged, and another
                    # attempt reads them again (three were retried, 1.5 minutes): a data error.
                    error = DataError if again == (size, sha256) else IntegrityError
                    raise error(
                        f"shard {shard.path} of dataset {self.manifest.dataset_id} from "
                        f"{self.store.url(key)} is {again[0]} bytes with sha256 {again[1][:12]}..., "
                        f"its manifest says {shard.size} bytes, {shard.sha256[:12]}... (fetched "
                        "twice): the dataset in the store is damaged; prepare it again "
                        "(goodput prepare)")
            os.replace(partial, local)
            self.fetched += 1
        finally:
            partial.unlink(missing_ok=True)

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used shards until `incoming` more bytes fit under the limit.
        Called under the fetch lock, when no fetch is under way on this node: a partial file
        is what a killed process left behind."""
        for stale in self.directory.glob(".*.partial"):
            stale.unlink(missing_ok=True)
        if self.limit is None:
            return
        cached = _files(self.directory, "*.arrow")
        total = sum(size for _, size, _ in cached)
        for _, size, path in sorted(cached):
            if total + incoming <= self.limit:
                break
            if path.name not in self.kept:
                path.unlink(missing_ok=True)
                total -= size


def disk_usage(directory: Path) -> int:
    """Bytes of a cache directory's shards, those being fetched included.

    One listing of the directory, taken while a fetch may be under way: two listings (the
    shards, then the partial files) could count a shard evicted before the first and the
    partial file of the fetch that made room for it after, which never lay on disk together."""
    total = 0
    for entry in list(os.scandir(directory)):
        if entry.name.endswith(".arrow") or (entry.name.startswith(".") and entry.name.endswith(".partial")):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # evicted, or renamed into the cache, since the listing
                pass
    return total


def _files(directory: Path, pattern: str) -> list[tuple[int, int, Path]]:
    """(mtime_ns, size, path) of the files matching `pattern`; one evicted meanwhile is left out."""
    found = []
    for path in directory.glob(pattern):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        found.append((stat.st_mtime_ns, stat.st_size, path))
    return found


def cache_bytes_needed(manifest: DatasetManifest, window_tokens: int) -> int:
    """The bytes a cache of `manifest`'s dataset must hold to serve training: two shuffle
    windows' shards (the one being read and the next, fetched ahead; each may straddle a
    shard at either end), plus the validation split's shard being read; never more than all
    of the dataset's shards, which a cache of their size holds without evicting any (a
    window larger than the dataset reads the dataset)."""
    shards = [s for split in manifest.splits.values() for s in split]
    largest = max(s.size for s in shards)
    bytes_per_token = max(s.size / max(1, s.n_tokens) for s in shards)
    reading = int(2 * window_tokens * bytes_per_token) + 4 * largest
    return min(reading, sum(s.size for s in shards))


def check_cache_limit(limit_bytes: int | None, manifest: DatasetManifest, window_tokens: int,
                      sharers: int = 1) -> None:
    """Refuse a cache that cannot hold what training reads at once (cache_bytes_needed).
    `limit_bytes` is data.cache_limit's share when `sharers` streamed sources of a mix share
    it evenly: each source's share must hold that source's needs."""
    if limit_bytes is None:
        return
    needed = cache_bytes_needed(manifest, window_tokens)
    if limit_bytes >= needed:
        return
    dataset_bytes = sum(s.size for split in manifest.splits.values() for s in split)
    if needed == dataset_bytes:
        what = (f"the whole of dataset {manifest.dataset_id}, {dataset_bytes:,} bytes of shards, "
                f"no more than two windows of training.shuffle_window_tokens={window_tokens:,} "
                "and a few shards read")
    else:
        largest = max(s.size for split in manifest.splits.values() for s in split)
        what = (f"two windows of training.shuffle_window_tokens={window_tokens:,} and a few "
                f"shards of up to {largest:,} bytes of dataset {manifest.dataset_id}")
    # A share is echoed as it is: data.cache_limit // sharers times sharers is not what was set.
    given = (f"data.cache_limit gives each of {sharers} streamed sources {limit_bytes:,} bytes, "
             "which" if sharers > 1 else f"data.cache_limit={limit_bytes:,} bytes")
    raise ConfigError(
        f"{given} cannot hold what training reads at once ({what}): raise data.cache_limit to "
        f"at least {needed * sharers:,} bytes{' (an even share for each source)' if sharers > 1 else ''} "
        f"(data.cache_limit={math.ceil(needed * sharers / 2**20)}MiB) or lower "
        "training.shuffle_window_tokens")


class _Pending:
    """A prefetch under way: set when done, with the error it met, if any."""

    def __init__(self):
        self.done, self.error = threading.Event(), None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
