"""Reading token shards for training and evaluation.

A split's shards, in manifest order, form one token stream (memory-mapped, never loaded
whole). The stream is cut into samples of `seq_len + 1` tokens that overlap by one token
(inputs and shifted targets). Training visits samples in a seeded permutation per epoch;
the position in that *global* order is the loader's whole state, so a run resumes on any
number of ranks without repeating or skipping a sample: at each micro-step the data-parallel
ranks together take the next `micro_batch * dp_size` global samples, rank r the r-th slice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from core.errors import ConfigError, DataError
from storage.manifests import DatasetManifest
from storage.shards import read_tokens


class TokenStream:
    """The concatenated tokens of one split, served from memory-mapped Arrow shards."""

    def __init__(self, dataset_dir: str | Path, manifest: DatasetManifest, split: str):
        if split not in manifest.splits or not manifest.splits[split]:
            raise DataError(f"dataset {manifest.dataset_id} has no '{split}' shards; prepare it "
                            "again (goodput prepare)")
        dataset_dir = Path(dataset_dir)
        self.shards = [read_tokens(dataset_dir / s.path) for s in manifest.splits[split]]
        lengths = [len(s) for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self.n_tokens = int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream as int64, crossing shards if needed."""
        pieces, pos, end = [], start, start + length
        shard = int(np.searchsorted(self.starts, pos, side="right")) - 1
        while pos < end:
            lo = pos - self.starts[shard]
            hi = min(end, self.starts[shard + 1]) - self.starts[shard]
            pieces.append(self.shards[shard][lo:hi])
            pos = self.starts[shard] + hi
            shard += 1
        return np.concatenate(pieces).astype(np.int64)

    def num_samples(self, seq_len: int) -> int:
        return (self.n_tokens - 1) // seq_len


class DistributedSampleLoader:
    """Yields this rank's micro-batches (inputs, targets) in a resumable global order."""

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int):
        self.stream, self.seq_len, self.micro_batch = stream, seq_len, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.samples_per_epoch = stream.num_samples(seq_len)
        if self.samples_per_epoch < micro_batch * dp_size:
            raise DataError(
                f"the train split has {stream.n_tokens} tokens, {self.samples_per_epoch} samples "
                f"of seq_len={seq_len}: fewer than one micro-batch across ranks "
                f"({micro_batch} x {dp_size}); add data or lower training.seq_len")
        self.sample_index = 0  # next global sample to hand out, across all ranks
        self.skips: list[tuple[int, int]] = []  # [start, end) windows never handed out
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def skip_windows(self, windows: list[tuple[int, int]]) -> None:
        """Never hand out global samples in these windows (each starts on a step boundary)."""
        self.skips = sorted(windows)

    def _sample_position(self, global_index: int) -> int:
        epoch, offset = divmod(global_index, self.samples_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.samples_per_epoch)
        return int(self._order[offset])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        for start, end in self.skips:
            if start <= self.sample_index < end:
                self.sample_index = end
        first = self.sample_index + self.dp_rank * self.micro_batch
        rows = [self.stream.window(self._sample_position(first + i) * self.seq_len, self.seq_len + 1)
                for i in range(self.micro_batch)]
        self.sample_index += self.micro_batch * self.dp_size
        batch = torch.from_numpy(np.stack(rows))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"sample_index": self.sample_index, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len or state["seed"] != self.seed:
            raise ConfigError(
                f"checkpoint data order was seq_len={state['seq_len']} seed={state['seed']}, "
                f"this run has seq_len={self.seq_len} seed={self.seed}; resuming would change "
                "which samples are seen — start a new run id instead")
        self.sample_index = int(state["sample_index"])


def sequential_batches(stream: TokenStream, seq_len: int, batch_size: int, max_batches: int):
    """Validation batches: consecutive non-overlapping samples from the start of the stream."""
    n = min(stream.num_samples(seq_len), batch_size * max_batches)
    for first in range(0, n, batch_size):
        rows = [stream.window(i * seq_len, seq_len + 1) for i in range(first, min(first + batch_size, n))]
        batch = torch.from_numpy(np.stack(rows))
        yield batch[:, :-1], batch[:, 1:]
