"""The order training visits samples in: a windowed shuffle of constant memory, the same on
any number of ranks, reshuffled each epoch; and the loader's data-wait accounting."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from core.errors import ConfigError
from storage.manifests import DatasetManifest
from tests.helpers import REPO, synthetic_dataset
from training.data import DistributedSampleLoader, SeededPermutation, TokenStream, WindowedShuffle


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 1000, 4097])
def test_a_seeded_permutation_is_a_bijection_and_depends_on_its_key(n):
    first = [SeededPermutation(n, (1, 2))(i) for i in range(n)]
    assert sorted(first) == list(range(n))
    assert first == [SeededPermutation(n, (1, 2))(i) for i in range(n)]
    if n > 3:
        assert first != [SeededPermutation(n, (1, 3))(i) for i in range(n)]


@pytest.mark.parametrize("n,window", [(1, 1), (10, 3), (100, 7), (999, 10), (1000, 1000), (500, 2000)])
def test_each_epoch_visits_every_sample_once_a_window_at_a_time(n, window):
    order = WindowedShuffle(n, window, seed=5)
    epochs = [[order(e * n + i) for i in range(n)] for e in range(2)]
    for visit in epochs:
        assert sorted(visit) == list(range(n))
        full = min(window, n)
        for start in range(0, n - n % full, full):  # each stretch of a window's length ...
            windows = {sample // full for sample in visit[start:start + full]}
            assert len(windows) == 1  # ... comes from one window of consecutive samples
    if n > 3:
        assert epochs[0] != epochs[1]  # reshuffled


def test_the_order_takes_the_same_memory_at_a_thousand_samples_and_at_a_trillion_tokens():
    """Measured in a process of its own: tracemalloc there sees the order alone."""
    code = """
import json, tracemalloc
from training.data import WindowedShuffle

def memory(n):
    tracemalloc.start()
    order = WindowedShuffle(n, 2**28 // 2048, seed=1)
    for i in range(0, 10 * n, max(1, n // 1000)):
        order(i)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak

print(json.dumps([memory(1000), memory(10**12 // 2048)]))  # 1T tokens of seq 2048
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    small, huge = json.loads(out.splitlines()[-1])
    assert huge < 16 * 1024 and huge < 2 * small + 4096, (small, huge)


def _stream(tmp_path) -> TokenStream:
    directory = synthetic_dataset(tmp_path / "ds", docs_per_shard=20)
    return TokenStream(directory, DatasetManifest.load(directory), "train")


def test_ranks_together_see_what_one_rank_sees_and_resume_at_another_world_size(tmp_path):
    stream = _stream(tmp_path)
    one = DistributedSampleLoader(stream, 16, 4, 0, 1, seed=3, shuffle_window_tokens=320)
    seen_alone = [one.next_batch()[0] for _ in range(6)]
    two = [DistributedSampleLoader(stream, 16, 2, r, 2, seed=3, shuffle_window_tokens=320)
           for r in range(2)]
    for step in range(3):
        together = np.concatenate([loader.next_batch()[0] for loader in two])
        assert np.array_equal(together, seen_alone[step])
    # Resume the two ranks' position on one rank: it continues the same sequence.
    resumed = DistributedSampleLoader(stream, 16, 4, 0, 1, seed=3, shuffle_window_tokens=320)
    resumed.load_state_dict(two[0].state_dict())
    for step in range(3, 6):
        assert np.array_equal(resumed.next_batch()[0], seen_alone[step])
    other = DistributedSampleLoader(stream, 16, 4, 0, 1, seed=3, shuffle_window_tokens=640)
    with pytest.raises(ConfigError, match="shuffle_window_tokens"):
        other.load_state_dict(one.state_dict())


def test_the_loader_reports_the_time_steps_waited_for_batches(tmp_path):
    loader = DistributedSampleLoader(_stream(tmp_path), 16, 4, 0, 1, seed=3)
    assert loader.take_wait_s() == 0.0
    loader.next_batch()
    loader.next_batch()
    waited = loader.take_wait_s()
    assert waited > 0 and loader.take_wait_s() == 0.0
