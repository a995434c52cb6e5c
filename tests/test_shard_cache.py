"""Training reads a dataset that is only in the store: shards fetched on demand into a
bounded local cache, verified once, shared by the processes of a node."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from core.errors import ConfigError, DataError
from goodput.data import prepare as prep
from storage.manifests import DatasetManifest
from storage.store import store_from_config
from tests.helpers import REPO
from tests.test_prepare import DOCS, make_config, write_source
from training.data import DistributedSampleLoader, TokenStream
from training.shard_cache import ShardCache, check_cache_limit, disk_usage

LIMIT = 37_400  # bytes: a few of the ~5 kB shards below, far from all of them


@pytest.fixture
def prepared(tmp_path):
    """A dataset of many small shards, in the store; and a trainer's config on another
    machine (a fresh data_dir) that streams it with a cache of LIMIT bytes."""
    source = write_source(tmp_path / "in", "jsonl", DOCS * 20)
    overrides = (f"data.source={source}", "data.max_docs=null", "data.shard_tokens=2048",
                 "tokenizer.vocab_size=300", f"storage.uri={tmp_path / 'store'}",
                 "training.shuffle_window_tokens=2048")
    manifest = prep.prepare_dataset(make_config(tmp_path / "prep", *overrides))
    trainer = make_config(tmp_path / "trainer", *overrides, f"data.cache_limit={LIMIT}")
    return manifest, make_config(tmp_path / "prep", *overrides), trainer


def test_a_stream_through_the_cache_reads_what_the_local_copy_reads_within_its_limit(prepared):
    manifest, local_config, config = prepared
    assert len(manifest.splits["train"]) >= 10 and sum(s.size for s in manifest.splits["train"]) > LIMIT
    store = store_from_config(config.storage)
    cache_dir = prep.dataset_for_training(config, store)
    assert cache_dir.parent.name == "cache" and not list(cache_dir.glob("*.arrow"))  # nothing yet

    local_dir = prep.dataset_for_training(local_config, store)
    assert local_dir == prep.plan_dataset(local_config).dir  # prepared here: read in place
    local = DistributedSampleLoader(TokenStream(local_dir, manifest, "train"), 32, 4, 0, 1, seed=3,
                                    shuffle_window_tokens=2048)
    streamed_stream = TokenStream(cache_dir, DatasetManifest.load(cache_dir), "train")
    streamed = DistributedSampleLoader(streamed_stream, 32, 4, 0, 1, seed=3, shuffle_window_tokens=2048)
    for _ in range(3 * streamed_stream.num_samples(32) // 4):  # three epochs
        assert np.array_equal(streamed.next_batch()[0], local.next_batch()[0])
        assert disk_usage(cache_dir) <= LIMIT
    # Evicted and fetched again each epoch; within an epoch a shard comes at most once per
    # window that reads it: once, or twice where a window boundary falls inside it.
    shards, windows = len(manifest.splits["train"]), streamed.sources[0].order.full_windows + 1
    assert shards < streamed_stream.cache.fetched <= 3 * (shards + windows)


def test_what_a_killed_fetch_left_behind_is_removed_by_the_next(prepared):
    manifest, _, config = prepared
    cache_dir = prep.dataset_for_training(config, store_from_config(config.storage))
    stale = cache_dir / f".{manifest.splits['train'][0].path}.12345.partial"
    stale.write_bytes(b"x" * 1000)
    ShardCache(cache_dir, manifest).path(manifest.splits["train"][1])
    assert not stale.exists()


def test_a_damaged_shard_in_the_store_is_an_error_naming_it(prepared):
    manifest, _, config = prepared
    store = store_from_config(config.storage)
    cache_dir = prep.dataset_for_training(config, store)
    shard = manifest.splits["train"][0]
    key = f"datasets/{manifest.dataset_id}/{shard.path}"
    store.put_bytes(key, store.get_bytes(key)[:-10] + b"0123456789")
    # The same wrong bytes twice: a data error (never retried), not a transfer's
    with pytest.raises(DataError, match=f"shard {shard.path} .*fetched twice.*prepare it again"):
        TokenStream(cache_dir, manifest, "train").window(0, 10)
    assert not (cache_dir / shard.path).exists()  # never entered the cache


def test_a_cache_too_small_for_two_windows_is_refused_naming_the_fields(prepared):
    _, _, config = prepared
    small = config.model_copy(update={"data": config.data.model_copy(update={"cache_limit": 5000})})
    with pytest.raises(ConfigError, match=r"data.cache_limit=5,000 .*raise data.cache_limit to at "
                                          r"least [\d,]+ bytes \(data.cache_limit=\d+MiB\) or lower "
                                          "training.shuffle_window_tokens"):
        prep.dataset_for_training(small, store_from_config(config.storage))


def test_the_processes_of_a_node_fetch_each_shard_once(prepared):
    manifest, _, config = prepared
    unlimited = config.model_copy(update={"data": config.data.model_copy(update={"cache_limit": None})})
    cache_dir = prep.dataset_for_training(unlimited, store_from_config(config.storage))
    code = f"""
import json
from pathlib import Path
from storage.manifests import DatasetManifest
from training.shard_cache import ShardCache
directory = Path({str(cache_dir)!r})
manifest = DatasetManifest.load(directory)
cache = ShardCache(directory, manifest)
for shard in manifest.splits["train"] + manifest.splits["validation"]:
    cache.path(shard)
print(json.dumps(cache.fetched))
"""
    ranks = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    fetched = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks)
    assert sum(fetched) == len(manifest.splits["train"]) + len(manifest.splits["validation"])
    for shards in manifest.splits.values():
        for shard in shards:
            assert (cache_dir / shard.path).stat().st_size == shard.size
    assert isinstance(ShardCache(cache_dir, manifest).path(shards[0]), type(cache_dir))


def test_a_cache_as_large_as_the_dataset_serves_any_shuffle_window(prepared, tmp_path):
    """A window larger than the dataset reads the dataset: a cache of all its shards' bytes
    is enough, however large training.shuffle_window_tokens is (the default is 2**28)."""
    manifest, _, config = prepared
    dataset_bytes = sum(s.size for shards in manifest.splits.values() for s in shards)
    huge_window = config.model_copy(update={
        "training": config.training.model_copy(update={"shuffle_window_tokens": 2**28}),
        "data": config.data.model_copy(update={"cache_limit": dataset_bytes})})
    store = store_from_config(config.storage)
    cache_dir = prep.dataset_for_training(huge_window, store)
    stream = TokenStream(cache_dir, DatasetManifest.load(cache_dir), "train")
    loader = DistributedSampleLoader(stream, 32, 4, 0, 1, seed=3, shuffle_window_tokens=2**28)
    for _ in range(2 * stream.num_samples(32) // 4):  # two epochs, nothing evicted
        loader.next_batch()
        assert disk_usage(cache_dir) <= dataset_bytes
    assert stream.cache.fetched == len(manifest.splits["train"])

    one_byte_short = huge_window.model_copy(update={
        "data": huge_window.data.model_copy(update={"cache_limit": dataset_bytes - 1,
                                                    "data_dir": str(tmp_path / "other")})})
    with pytest.raises(ConfigError, match=rf"data.cache_limit={dataset_bytes - 1:,} bytes cannot hold "
                                          rf".*the whole of dataset .*raise data.cache_limit to at "
                                          rf"least {dataset_bytes:,} bytes"):
        prep.dataset_for_training(one_byte_short, store)


def test_a_mix_s_share_of_the_cache_limit_is_named_as_a_share_not_multiplied_back(prepared):
    """data.cache_limit=1GiB over three streamed sources is 357,913,941 bytes each; three
    times that is one byte short of what the user set, so it is never echoed as theirs."""
    manifest, _, _ = prepared
    dataset_bytes = sum(s.size for shards in manifest.splits.values() for s in shards)
    share = dataset_bytes // 3 * 3 // 3 - 1  # too small for this source
    with pytest.raises(ConfigError) as refused:
        check_cache_limit(share, manifest, 2**28, sharers=3)
    message = str(refused.value)
    assert f"data.cache_limit gives each of 3 streamed sources {share:,} bytes" in message
    assert f"{share * 3:,}" not in message
    assert f"raise data.cache_limit to at least {dataset_bytes * 3:,} bytes" in message
    check_cache_limit(dataset_bytes, manifest, 2**28, sharers=3)  # the share holds the source
