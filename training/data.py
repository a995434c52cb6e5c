"""Reading token shards for training and evaluation.

A split's shards, in manifest order, form one token stream (memory-mapped, never loaded
whole), read from a complete dataset directory or, shard by shard, from the store through a
bounded local cache (training.shard_cache). The stream is cut into samples of `seq_len + 1`
tokens that overlap by one token (inputs and shifted targets).

Training draws from a mix of such datasets (a mix of one without data.sources): `MixSchedule`
decides which source each sample of the *global* order comes from, by weight and stage, and
which of that source's samples it is; each source visits its samples in a seeded order per
epoch (`WindowedShuffle`: a shuffle within windows of consecutive samples, the windows in a
shuffled order, computed per sample in constant memory). The position in the global order
and the samples taken from each source are the loader's whole state, so a run resumes on any
number of ranks without repeating or skipping a sample: at each micro-step the data-parallel
ranks together take the next `micro_batch * dp_size` global samples, rank r the r-th slice.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.config import SINGLE_SOURCE
from core.errors import ConfigError, DataError
from storage.manifests import DATASET_MANIFEST, MIXTURE_MANIFEST, DatasetManifest, MixtureManifest
from storage.shards import read_tokens
from training.shard_cache import ShardCache, is_cache


@dataclass
class SourceData:
    """One prepared dataset of the mix, where this machine reads it."""

    name: str
    weight: float  # its share from the start (data.sources), for the mix's held-out loss
    dir: Path
    manifest: DatasetManifest

    def stream(self, split: str) -> "TokenStream":
        return TokenStream(self.dir, self.manifest, split)


@dataclass
class TrainingData:
    """What `--dataset DIR` names: a prepared dataset (a mix of one) or a mixture of them."""

    dataset_id: str
    sources: list[SourceData]

    @property
    def vocab_size(self) -> int:
        return self.sources[0].manifest.vocab_size

    @property
    def eos_id(self) -> int:
        """The token that ends every document of the shards."""
        return self.sources[0].manifest.eos_id

    @property
    def doc_prefix_ids(self) -> list[int]:
        """The ids every document of the shards starts with (a BOS, or none)."""
        return self.sources[0].manifest.doc_prefix_ids

    @property
    def tokenizer_sha256(self) -> str:
        return self.sources[0].manifest.tokenizer_sha256

    @property
    def tokenizer_path(self) -> Path:
        first = self.sources[0]
        return first.dir / first.manifest.tokenizer

    def mix_weights(self) -> dict[str, float]:
        """The sources' weights as shares of the mix (those of its first stage)."""
        total = sum(s.weight for s in self.sources)
        return {s.name: s.weight / total for s in self.sources}

    def weighted_by_mix(self, per_source: dict[str, float],
                        weights: dict[str, float] | None = None) -> float:
        """The mix's figure of a per-source held-out measure (loss, bits per byte): the
        sources' figures weighted by their shares, or by `weights` (those of a curriculum
        stage: a source they leave out counts for nothing)."""
        if weights is None:
            shares = self.mix_weights()
        else:
            total = sum(weights.values())
            shares = {name: weights.get(name, 0.0) / total for name in per_source}
        return sum(shares[name] * value for name, value in per_source.items())


def open_training_data(directory: str | Path) -> TrainingData:
    """The dataset or mixture in `directory` (a mixture.json lists its datasets' dirs)."""
    directory = Path(directory)
    if (directory / MIXTURE_MANIFEST).is_file():
        mix = MixtureManifest.load(directory)
        sources = []
        for source in mix.sources:
            if not (Path(source.dir) / DATASET_MANIFEST).is_file():
                raise ConfigError(f"{directory / MIXTURE_MANIFEST}: source {source.name}'s dataset "
                                  f"is not in {source.dir}; locate the mix again (the train flow "
                                  "does) on this machine")
            manifest = DatasetManifest.load(source.dir)
            if manifest.tokenizer_sha256 != mix.tokenizer_sha256:
                raise ConfigError(f"source {source.name} ({source.dir}) was tokenized with another "
                                  "tokenizer than the mix's; prepare it again with the mix")
            sources.append(SourceData(source.name, source.weight, Path(source.dir), manifest))
        return TrainingData(mix.dataset_id, sources)
    if (directory / DATASET_MANIFEST).is_file():
        manifest = DatasetManifest.load(directory)
        return TrainingData(manifest.dataset_id, [SourceData(SINGLE_SOURCE, 1.0, directory, manifest)])
    raise ConfigError(f"--dataset {directory}: no prepared dataset there (no {DATASET_MANIFEST} "
                      f"or {MIXTURE_MANIFEST}); prepare it (goodput prepare) and pass the "
                      "dataset_dir it prints (data.data_dir/<dataset_id>; a mixture of "
                      "data.sources: data.data_dir/mixes/<id>)")


class TokenStream:
    """The concatenated tokens of one split, served from memory-mapped Arrow shards.

    From a complete dataset directory every shard is mapped at once; from a cache directory
    (shard_cache.is_cache) a shard is fetched when first read, `focus` names the stretch being
    read (its shards stay cached, the others are unmapped), the mapped shards take at most
    half of the cache's limit, and `prefetch` brings the shards of a coming stretch ahead.
    """

    def __init__(self, dataset_dir: str | Path, manifest: DatasetManifest, split: str):
        if split not in manifest.splits or not manifest.splits[split]:
            raise DataError(f"dataset {manifest.dataset_id} has no '{split}' shards; prepare it "
                            "again (goodput prepare)")
        self.dir, self.infos = Path(dataset_dir), manifest.splits[split]
        self.cache = ShardCache(self.dir, manifest) if is_cache(self.dir) else None
        self.mapped_limit = None  # bytes of mapped shards, beyond those of the focus
        if self.cache is not None and self.cache.limit is not None:
            self.mapped_limit = self.cache.limit // 2
        self._mapped: OrderedDict[int, np.ndarray] = OrderedDict()
        self._focus: set[int] = set()
        if self.cache is None:  # all at once: a missing shard fails now, not mid-run
            for index in range(len(self.infos)):
                self._shard(index)
        self.starts = np.concatenate([[0], np.cumsum([s.n_tokens for s in self.infos])])
        self.n_tokens = int(self.starts[-1])

    def _shard(self, index: int) -> np.ndarray:
        tokens = self._mapped.get(index)
        if tokens is not None:
            self._mapped.move_to_end(index)
            return tokens
        info = self.infos[index]
        if self.cache is None:
            tokens = read_tokens(self.dir / info.path)
        else:
            try:
                tokens = read_tokens(self.cache.path(info))
            except FileNotFoundError:  # evicted by another process before it was opened
                tokens = read_tokens(self.cache.path(info))
        if len(tokens) != info.n_tokens:
            raise DataError(f"shard {info.path} of {self.dir} holds {len(tokens)} tokens, its "
                            f"manifest says {info.n_tokens}; prepare the dataset again")
        self._mapped[index] = tokens
        if self.mapped_limit is not None:
            self._unmap_beyond(self.mapped_limit)
        return tokens

    def _unmap_beyond(self, limit: int) -> None:
        """Unmap least recently read shards outside the focus while the mapped ones exceed
        `limit` bytes (the newest one stays)."""
        mapped = sum(self.infos[i].size for i in self._mapped)
        unmapped = []
        for index in list(self._mapped)[:-1]:
            if mapped <= limit:
                break
            if index not in self._focus:
                unmapped.append(index)
                mapped -= self.infos[index].size
        self._unmap(unmapped)

    def _unmap(self, indexes: list[int]) -> None:
        """Let these shards go; the cache keeps only what is still mapped and the focus."""
        for index in indexes:
            del self._mapped[index]
        if indexes:
            self.cache.keep_only([self.infos[i] for i in set(self._mapped) | self._focus])

    def _shards_of(self, start: int, length: int) -> range:
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, min(start + length, self.n_tokens) - 1, side="right")) - 1
        return range(max(0, first), last + 1)

    def focus(self, start: int, length: int) -> None:
        """Tokens [start, start + length) are being read now (a shuffle window): their shards
        stay in the cache; mapped shards outside it are let go (a cache only)."""
        if self.cache is None:
            return
        self._focus = set(self._shards_of(start, length))
        self.cache.keep_only([self.infos[i] for i in set(self._mapped) | self._focus])
        self._unmap([i for i in self._mapped if i not in self._focus])

    def prefetch(self, start: int, length: int) -> None:
        """Fetch the shards of tokens [start, start + length) ahead of use (a cache only)."""
        if self.cache is None:
            return
        self.cache.prefetch([self.infos[i] for i in self._shards_of(start, length)])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream as int64, crossing shards if needed."""
        pieces, pos, end = [], start, start + length
        shard = int(np.searchsorted(self.starts, pos, side="right")) - 1
        while pos < end:
            lo = pos - self.starts[shard]
            hi = min(end, self.starts[shard + 1]) - self.starts[shard]
            pieces.append(self._shard(shard)[lo:hi])
            pos = self.starts[shard] + hi
            shard += 1
        return np.concatenate(pieces).astype(np.int64)

    def num_samples(self, seq_len: int) -> int:
        return (self.n_tokens - 1) // seq_len


_MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a fast, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SeededPermutation:
    """A pseudo-random bijection of [0, n) chosen by `key`, evaluated one index at a time in
    constant memory: a four-round Feistel network on the smallest even number of bits that
    covers n, with cycle walking (a value that lands outside [0, n) is mapped again) to keep
    it a permutation of [0, n)."""

    ROUNDS = 4

    def __init__(self, n: int, key: tuple[int, ...]):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8 * self.ROUNDS).digest()
        self.round_keys = [int.from_bytes(digest[8 * r:8 * r + 8], "big") for r in range(self.ROUNDS)]

    def __call__(self, index: int) -> int:
        x = index
        while True:
            left, right = x >> self.half, x & self.mask
            for round_key in self.round_keys:
                left, right = right, left ^ (_mix64(right ^ round_key) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


class WindowedShuffle:
    """The order in which an epoch visits `n` samples: windows of `window` consecutive samples
    in a shuffled order, the samples of each window shuffled, both anew each epoch (seeded).

    Memory and state do not depend on `n` (no permutation array: 4 GB per rank at 1T tokens
    of seq 2048), and an epoch reads one window's stretch of the dataset at a time. A last,
    shorter window is visited last.
    """

    def __init__(self, n: int, window: int, seed: int):
        self.n, self.window, self.seed = n, max(1, min(window, n)), seed
        self.full_windows = n // self.window
        self._cache: dict[str, tuple[tuple, SeededPermutation]] = {}  # one per kind: constant

    def __call__(self, index: int) -> int:
        """The sample at position `index` of the global order (epochs follow one another)."""
        epoch, offset = divmod(index, self.n)
        slot, within = divmod(offset, self.window)
        if slot == self.full_windows:  # the shorter last window
            return slot * self.window + self._permutation("tail", epoch)(within)
        chosen = self._permutation("windows", epoch)(slot)
        return chosen * self.window + self._permutation("window", epoch, chosen)(within)

    def window_span(self, index: int) -> tuple[int, int]:
        """(first sample, samples) of the window that position `index` falls in."""
        epoch, offset = divmod(index, self.n)
        slot = offset // self.window
        if slot == self.full_windows:
            return slot * self.window, self.n - slot * self.window
        return self._permutation("windows", epoch)(slot) * self.window, self.window

    def _permutation(self, kind: str, *key: int) -> SeededPermutation:
        cached = self._cache.get(kind)
        if cached is None or cached[0] != key:
            size = {"windows": self.full_windows, "window": self.window,
                    "tail": self.n - self.full_windows * self.window}[kind]
            cached = self._cache[kind] = (key, SeededPermutation(size, (self.seed, kind, *key)))
        return cached[1]


class MixSchedule:
    """Which source each sample of the global order comes from, and which of its samples.

    Within a stage (weights w, normalised), source s's k-th sample of the stage falls at time
    (k + 1/2) / w_s, and the global order takes every source's samples by time (a tie: the
    source listed first). That is stride scheduling (Sainte-Lague's apportionment): every
    prefix of the order holds each source's share to within about a sample, deterministically,
    and the order is the same however it is cut into batches. The state is the position and
    the samples taken from each source (in all and since the stage began): a few integers
    per source, whatever the dataset's size or the layout.
    """

    CHUNK = 2**16  # samples decided at once (a skipped window may span millions)

    def __init__(self, names: list[str], stages: list[tuple[int, dict[str, float]]]):
        self.names = list(names)
        self.starts = [start for start, _ in stages]
        self.weights = []
        for start, weights in stages:
            shares = np.array([float(weights.get(name, 0.0)) for name in self.names])
            if not shares.sum() > 0:
                raise ConfigError(f"the mix's weights from sample {start} on give none of its "
                                  f"sources ({', '.join(self.names)}) a positive weight")
            self.weights.append(shares / shares.sum())
        self.position = 0
        self.taken = np.zeros(len(names), np.int64)  # samples taken from each source
        self.stage_base = np.zeros(len(names), np.int64)  # `taken` when the stage began

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next `n` global samples: each one's source (an index into names) and its
        index among that source's samples (counting from the run's start)."""
        sources, indexes = [], []
        while n > 0:
            stage = int(np.searchsorted(self.starts, self.position, side="right")) - 1
            end = self.starts[stage + 1] if stage + 1 < len(self.starts) else None
            m = min(n, self.CHUNK, end - self.position if end is not None else n)
            chosen = self._merge(self.weights[stage], self.taken - self.stage_base, m)
            index = np.empty(m, np.int64)
            for source in np.unique(chosen):
                mine = chosen == source
                index[mine] = self.taken[source] + np.arange(int(mine.sum()))
            self.taken += np.bincount(chosen, minlength=len(self.names))
            self.position += m
            n -= m
            if self.position == end:
                self.stage_base = self.taken.copy()
            sources.append(chosen)
            indexes.append(index)
        return np.concatenate(sources), np.concatenate(indexes)

    @staticmethod
    def _merge(weights: np.ndarray, taken_in_stage: np.ndarray, m: int) -> np.ndarray:
        times, owners = [], []
        for source in np.flatnonzero(weights > 0):
            k = taken_in_stage[source] + np.arange(m, dtype=np.float64)
            times.append((k + 0.5) / weights[source])
            owners.append(np.full(m, source, np.int64))
        times, owners = np.concatenate(times), np.concatenate(owners)
        return owners[np.lexsort((owners, times))[:m]]

    def state_dict(self) -> dict:
        return {"taken": dict(zip(self.names, self.taken.tolist())),
                "stage_base": dict(zip(self.names, self.stage_base.tolist()))}

    def load_state_dict(self, position: int, state: dict) -> None:
        if sorted(state["taken"]) != sorted(self.names):
            raise ConfigError(f"checkpoint data mix was {', '.join(state['taken'])}, this run's is "
                              f"{', '.join(self.names)}; resuming would change which samples are "
                              "seen — start a new run id instead")
        self.position = position
        self.taken = np.array([state["taken"][n] for n in self.names], np.int64)
        self.stage_base = np.array([state["stage_base"][n] for n in self.names], np.int64)


class _Source:
    """A source as the loader reads it: its stream and its own order of samples."""

    def __init__(self, name: str, stream: TokenStream, seq_len: int, window_tokens: int, seed):
        self.name, self.stream = name, stream
        self.samples = stream.num_samples(seq_len)
        self.order = WindowedShuffle(self.samples, max(1, window_tokens // seq_len), seed) \
            if self.samples else None
        self.window: tuple[int, int] | None = None


class DistributedSampleLoader:
    """Yields this rank's micro-batches (inputs, targets) in a resumable global order.

    `streams`: each source's train stream by name (a single stream: a mix of one); `stages`:
    RunConfig.mix_stages(), the weights from each stage's first global sample on.
    """

    def __init__(self, streams: TokenStream | dict[str, TokenStream], seq_len: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle_window_tokens: int = 2**28,
                 stages: list[tuple[int, dict[str, float]]] | None = None):
        if isinstance(streams, TokenStream):
            streams = {SINGLE_SOURCE: streams}
        stages = stages or [(0, {name: 1.0 for name in streams})]
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.shuffle_window_tokens = shuffle_window_tokens
        # A mix of one keeps the order it had before mixtures; each source of a mix its own.
        self.sources = [_Source(name, stream, seq_len, shuffle_window_tokens,
                                seed if len(streams) == 1 else (seed, name))
                        for name, stream in streams.items()]
        # A mix of one must fill a micro-batch of every rank; a source of a mix, one sample.
        needed, what = ((micro_batch * dp_size, f"one micro-batch across ranks ({micro_batch} x "
                         f"{dp_size})") if len(streams) == 1 else (1, "one sample"))
        for source in self.sources:
            drawn = any(weights.get(source.name, 0) > 0 for _, weights in stages)
            if drawn and source.samples < needed:
                raise DataError(
                    f"the train split of {source.name} has {source.stream.n_tokens} tokens, "
                    f"{source.samples} samples of seq_len={seq_len}: fewer than {what}; add "
                    "data or lower training.seq_len")
        self.schedule = MixSchedule(list(streams), stages)
        self.wait_s = 0.0  # time the trainer spent in next_batch since take_wait_s
        self.skips: list[tuple[int, int]] = []  # [start, end) windows never handed out

    @property
    def sample_index(self) -> int:
        """The next global sample to hand out, across all ranks."""
        return self.schedule.position

    @property
    def stage(self) -> int:
        """The mix stage (0: data.sources' weights, i: data.stages[i - 1]) of the next sample."""
        return int(np.searchsorted(self.schedule.starts, self.schedule.position, side="right")) - 1

    def stage_weights(self, stage: int) -> dict[str, float]:
        return {name: round(float(w), 6) for name, w in zip(self.schedule.names,
                                                            self.schedule.weights[stage]) if w > 0}

    def mix_figures(self) -> dict[str, int]:
        """For a mix: the samples drawn from each source so far, across all ranks
        (`samples/<source>`), the realized shares on every record; nothing for one source."""
        if len(self.schedule.names) == 1:
            return {}
        return {f"samples/{name}": int(n) for name, n in zip(self.schedule.names, self.schedule.taken)}

    def skip_windows(self, windows: list[tuple[int, int]]) -> None:
        """Never hand out global samples in these windows (each starts on a step boundary)."""
        self.skips = sorted(windows)

    def take_wait_s(self) -> float:
        """Seconds the trainer waited for batches since the last call: the step's data wait."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        for start, end in self.skips:
            if start <= self.sample_index < end:  # the window's samples are taken, unseen
                self.schedule.take(end - self.sample_index)
        sources, indexes = self.schedule.take(self.micro_batch * self.dp_size)
        mine = slice(self.dp_rank * self.micro_batch, (self.dp_rank + 1) * self.micro_batch)
        sources, indexes = sources[mine], indexes[mine]
        for s in np.unique(sources):
            self._read_ahead(self.sources[s], int(indexes[np.argmax(sources == s)]))
        rows = []
        for s, k in zip(sources.tolist(), indexes.tolist()):
            source = self.sources[s]
            rows.append(source.stream.window(source.order(k) * self.seq_len, self.seq_len + 1))
        batch = torch.from_numpy(np.stack(rows))
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        self.wait_s += time.perf_counter() - started
        return inputs, targets

    def _read_ahead(self, source: _Source, index: int) -> None:
        """Keep the window of `source`'s sample `index` in its cache; fetch the next ahead."""
        window = source.order.window_span(index)
        if window != source.window:  # a new window: its shards are what the cache must keep
            source.window = window
            source.stream.focus(window[0] * self.seq_len, window[1] * self.seq_len + 1)
        coming, samples = source.order.window_span(index + source.order.window)
        source.stream.prefetch(coming * self.seq_len, samples * self.seq_len + 1)

    def state_dict(self) -> dict:
        return {"sample_index": self.sample_index, "seed": self.seed, "seq_len": self.seq_len,
                "shuffle_window_tokens": self.shuffle_window_tokens, **self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # Checkpoints from before the windowed shuffle have no window: their order differs.
        window = state.get("shuffle_window_tokens")
        if (state["seq_len"], state["seed"], window) != (self.seq_len, self.seed, self.shuffle_window_tokens):
            raise ConfigError(
                f"checkpoint data order was seq_len={state['seq_len']} seed={state['seed']} "
                f"shuffle_window_tokens={window}, this run has seq_len={self.seq_len} "
                f"seed={self.seed} shuffle_window_tokens={self.shuffle_window_tokens}; resuming "
                "would change which samples are seen — start a new run id instead")
        position = int(state["sample_index"])
        if "taken" not in state:  # from before mixtures: one source, every sample its own
            state = {"taken": {SINGLE_SOURCE: position}, "stage_base": {SINGLE_SOURCE: 0}}
        self.schedule.load_state_dict(position, state)


def sequential_batches(stream: TokenStream, seq_len: int, batch_size: int, max_batches: int):
    """Validation batches: consecutive non-overlapping samples from the start of the stream."""
    n = min(stream.num_samples(seq_len), batch_size * max_batches)
    for first in range(0, n, batch_size):
        rows = [stream.window(i * seq_len, seq_len + 1) for i in range(first, min(first + batch_size, n))]
        batch = torch.from_numpy(np.stack(rows))
        yield batch[:, :-1], batch[:, 1:]
