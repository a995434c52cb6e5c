"""Token shards: the format the prepare stage writes and the training data loader reads.

A shard is an Arrow IPC *file* (random access, memory-mappable) holding one record batch
with one column, `tokens`, of type `list<uint8|uint16|uint32>`: one row per document, each
row the document's token ids followed by the EOS id. The value type is the smallest that
holds every id of the vocabulary, so a 50k vocabulary costs 2 bytes per token.

Readers map the file and view the ids in place: `read_tokens` returns a numpy array over the
mapped pages (no copy, no parsing), so a loader can sample windows from shards much larger
than memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from core.files import atomic_file

COLUMN = "tokens"
_MAX_LIST_OFFSET = 2**31 - 1  # `list` (not `large_list`) offsets are int32
_SLACK_TOKENS = 2**20  # see ShardWriter


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned integer type that holds ids 0 .. vocab_size-1."""
    for dtype in ("uint8", "uint16", "uint32"):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"vocab_size={vocab_size} does not fit in uint32 token ids")


def write_shard(path: str | os.PathLike, docs: Sequence[Sequence[int] | np.ndarray], dtype: str,
                metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """Write `docs` (token ids, EOS already appended) as a shard; return (n_tokens, n_docs).

    `metadata` goes into the file's schema (what made the shard, for checks on reuse). The
    file appears whole or not at all (temporary file, fsync, rename), so a crash while
    writing never leaves a shard that looks complete.
    """
    arrays = [np.asarray(doc) for doc in docs]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    values = np.concatenate(arrays) if arrays else np.empty(0)
    del arrays
    _check_ids_fit(values, dtype)
    return write_packed_shard(path, values.astype(dtype, copy=False), lengths, metadata)


def _check_ids_fit(ids: np.ndarray, dtype: str) -> None:
    """Refuse ids that `dtype` cannot hold (a cast would wrap them silently)."""
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids range {ids.min()}..{ids.max()} does not fit {dtype}")


def write_packed_shard(path: str | os.PathLike, values: np.ndarray, lengths: Sequence[int] | np.ndarray,
                       metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """`write_shard` of documents already packed: their ids back to back in `values` (of the
    shard's dtype, written as they are, not copied) and each one's length in `lengths`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n_tokens = int(lengths.sum())
    if n_tokens != len(values):
        raise ValueError(f"the documents' lengths add up to {n_tokens} tokens, not {len(values)}")
    if n_tokens > _MAX_LIST_OFFSET:
        raise ValueError(f"{n_tokens} tokens do not fit in one shard (limit {_MAX_LIST_OFFSET}); "
                         "write more, smaller shards (lower data.shard_tokens)")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = pa.ListArray.from_arrays(_arrow_view(offsets), _arrow_view(values))
    batch = pa.record_batch([tokens], names=[COLUMN], metadata=metadata)

    # Streamed into the file, not built in memory first: a shard of hundreds of MB then
    # costs its tokens once, not twice.
    with atomic_file(path) as f, pa.ipc.new_file(f, batch.schema) as writer:
        writer.write_batch(batch)
    return n_tokens, len(lengths)


def _arrow_view(array: np.ndarray) -> pa.Array:
    """`array` as an Arrow array over the same memory (a contiguous one is not copied).
    Not pa.array(): given a NumPy array, it imports pandas to ask whether it is one (0.5 s
    of each process that writes shards, 1.0 s of a unit's tokenization on a busy machine)."""
    array = np.ascontiguousarray(array)
    return pa.Array.from_buffers(pa.from_numpy_dtype(array.dtype), len(array),
                                 [None, pa.py_buffer(array)])


class ShardWriter:
    """Writes a stream of documents as shards of about `shard_tokens` tokens each.

    Documents are never split: a shard closes at the first document that brings it to
    `shard_tokens` or beyond. Each document's ids are copied, as they come, into one buffer
    that the shard is written from (`write_packed_shard`), so memory is one shard's tokens,
    not twice that for a copy made at the end. Shards are named `name_of(k)` for the k-th;
    `written` lists (name, n_tokens, n_docs) of those written so far.
    """

    def __init__(self, directory: str | os.PathLike, name_of, dtype: str, shard_tokens: int,
                 metadata: dict[str, str] | None = None):
        self.directory, self.name_of, self.dtype = os.fspath(directory), name_of, dtype
        self.shard_tokens, self.metadata = shard_tokens, metadata
        self.written: list[tuple[str, int, int]] = []
        # Room for a shard and the document that closes it, reserved, not touched: pages the
        # ids never reach take no memory (a validation split's writer fills a sliver of its
        # buffer). Only a closing document of over _SLACK_TOKENS needs more.
        self._values = np.empty(shard_tokens + _SLACK_TOKENS, dtype)
        self._lengths: list[int] = []
        self._tokens = 0

    def add(self, docs: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append documents (token ids, EOS already appended; out-of-range ids for the dtype
        are refused, never wrapped)."""
        for doc in docs:
            doc = np.asarray(doc)
            if doc.dtype != self._values.dtype:
                _check_ids_fit(doc, self.dtype)
            end = self._tokens + len(doc)
            if end > len(self._values):
                grown = np.empty(end, self.dtype)
                grown[:self._tokens] = self._values[:self._tokens]
                self._values = grown
            self._values[self._tokens:end] = doc
            self._lengths.append(len(doc))
            self._tokens = end
            if self._tokens >= self.shard_tokens:
                self._flush()

    def close(self) -> list[tuple[str, int, int]]:
        if self._lengths:
            self._flush()
        return self.written

    def _flush(self) -> None:
        name = self.name_of(len(self.written))
        n_tokens, n_docs = write_packed_shard(os.path.join(self.directory, name),
                                              self._values[:self._tokens], self._lengths, self.metadata)
        self.written.append((name, n_tokens, n_docs))
        self._lengths, self._tokens = [], 0


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The key/value metadata `write_shard` was given (empty if none)."""
    schema = pa.ipc.open_file(pa.memory_map(os.fspath(path), "r")).schema
    return {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}


def _read_column(path: str | os.PathLike) -> pa.ListArray:
    """The `tokens` column of a shard, its buffers pointing into a memory map of the file."""
    reader = pa.ipc.open_file(pa.memory_map(os.fspath(path), "r"))
    if reader.num_record_batches != 1 or reader.schema.names != [COLUMN]:
        raise ValueError(f"{path} is not a token shard: expected one record batch with one "
                         f"column {COLUMN!r}, found {reader.num_record_batches} batches of "
                         f"columns {reader.schema.names}")
    return reader.get_batch(0).column(0)


def _view(array: pa.Array) -> np.ndarray:
    """A read-only numpy view of an arrow array of integers without nulls: its data buffer
    (the memory-mapped file itself), never a copy, which would silently read a whole shard
    into memory. Not `Array.to_numpy`: it imports pandas, seconds in every worker, verifier
    and evaluator that reads a shard."""
    if array.null_count or not pa.types.is_integer(array.type):
        raise ValueError(f"expected integers without nulls, got {array.type} "
                         f"({array.null_count} nulls)")
    dtype = np.dtype(str(array.type))
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """All token ids of a shard, documents back to back, as a read-only view of the file.

    The array's buffer is the memory-mapped file itself; the array keeps the mapping alive,
    so it stays valid after the reader is gone.
    """
    return _view(_read_column(path).flatten())


def shard_size(path: str | os.PathLike) -> tuple[int, int]:
    """(n_tokens, n_docs) of a shard, from its offsets alone."""
    offsets = _read_column(path).offsets
    return offsets[-1].as_py() - offsets[0].as_py(), len(offsets) - 1


def read_documents(path: str | os.PathLike) -> list[np.ndarray]:
    """Each document of a shard (ids followed by EOS) as a view into the mapped file."""
    column = _read_column(path)
    values = _view(column.values)
    offsets = _view(column.offsets)
    return [values[start:stop] for start, stop in zip(offsets[:-1], offsets[1:])]
