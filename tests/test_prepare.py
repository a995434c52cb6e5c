"""The prepare stage on real files, real tokenizers and real datasets (no mocks)."""

from __future__ import annotations

import gc
import logging
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from core.config import RunConfig, load_config
from core.errors import DataError
from core.files import sha256_file
from goodput.data import prepare as prep
from goodput.data.corpus import build_builtin_corpus
from goodput.data.sources import SourcesNotHere
from storage.manifests import DatasetManifest
from storage.shards import read_documents, read_tokens, shard_size, token_dtype, write_shard
from tests.helpers import REPO, flip_bytes, logs_of, subflow_runs, wait_for
from training.tokenizer import load_tokenizer, read_tokenizer, train_tokenizer


def make_config(root: Path, *overrides: str) -> RunConfig:
    return load_config(None, [
        f"data.data_dir={root / 'data'}", f"storage.uri={root / 'store'}",
        f"run.runs_dir={root / 'runs'}",  # a summary.json of its own: tests run side by side
        "data.max_docs=300", "data.shard_tokens=16384", "tokenizer.vocab_size=512",
        "prepare.progress=false", *overrides])


def decoded_splits(config: RunConfig, manifest: DatasetManifest) -> dict[str, list[str]]:
    """Every document of every shard, decoded, checking that each ends with one EOS."""
    directory = prep.plan_dataset(config).dir
    tokenizer = read_tokenizer(directory / manifest.tokenizer)
    texts = {}
    for split, shards in manifest.splits.items():
        texts[split] = []
        for shard in shards:
            for doc in read_documents(directory / shard.path):
                assert doc.dtype == manifest.dtype and doc[-1] == manifest.eos_id
                assert manifest.eos_id not in doc[:-1]
                texts[split].append(tokenizer.decode(doc[:-1].tolist()))
    return texts


def split_by_hash(docs: list[str], fraction: float) -> dict[str, list[str]]:
    """The split the stage must make: each document by the hash of its text, order kept."""
    validation = [prep.is_validation(d, fraction) for d in docs]
    return {"train": [d for d, v in zip(docs, validation) if not v],
            "validation": [d for d, v in zip(docs, validation) if v]}


def source_splits(config: RunConfig) -> dict[str, list[str]]:
    """The builtin corpus's documents read here independently (plain json), then split."""
    lines = build_builtin_corpus(prep.sources_dir(config)).read_text().splitlines()
    docs = [t for t in (json.loads(line)["text"] for line in lines) if t.strip()]
    return split_by_hash(docs[:config.data.max_docs], config.data.validation_fraction)


def file_times(*roots: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for root in roots for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """The builtin corpus (300 documents) prepared once by the library: (config, manifest)."""
    config = make_config(tmp_path_factory.mktemp("builtin"))
    return config, prep.prepare_dataset(config)


# -- shard format ---------------------------------------------------------------------------

def test_the_builtin_corpus_is_built_once_per_installation_and_copied_into_each_data_dir(
        tmp_path, monkeypatch):
    from goodput.data import corpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = build_builtin_corpus(tmp_path / "a" / "sources")
    assert first.parent == tmp_path / "a" / "sources"
    assert (tmp_path / "cache" / "goodput" / first.name).read_bytes() == first.read_bytes()

    def parsed_again(stdlib):
        raise AssertionError("the stdlib was parsed again")

    monkeypatch.setattr(corpus, "builtin_texts", parsed_again)
    second = build_builtin_corpus(tmp_path / "b" / "sources")  # another data directory: a copy
    assert second.name == first.name and second.read_bytes() == first.read_bytes()
    assert not second.is_symlink()

    # A cache that cannot be written (here a file where its folder would be): built in place.
    monkeypatch.setattr(corpus, "builtin_texts", lambda stdlib: iter(["a document"]))
    (tmp_path / "blocked").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "blocked"))
    third = build_builtin_corpus(tmp_path / "c" / "sources")
    assert third.read_text() == '{"text": "a document"}\n'


def test_writing_a_shard_does_not_import_pandas(tmp_path):
    """pa.array() of a NumPy array imports pandas to ask whether it is one: 0.5 s of every
    process that writes shards, on the way to training."""
    script = ("import sys; from storage.shards import write_shard; "
              f"write_shard({str(tmp_path / 's.arrow')!r}, [[1, 2, 0], [3, 0]], 'uint16'); "
              "print('pandas' in sys.modules)")
    imported = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    assert imported == "False"


def test_token_dtype_is_the_smallest_that_fits():
    assert [token_dtype(n) for n in (256, 257, 65536, 65537)] == ["uint8", "uint16", "uint16", "uint32"]


def test_shard_round_trip_is_a_view_of_the_mapped_file(tmp_path):
    docs = [np.array([5, 6, 7, 0]), [70000, 0], [1, 2, 0]]
    path = tmp_path / "s.arrow"
    assert write_shard(path, docs, "uint32") == (9, 3)
    assert pa.ipc.open_file(path).schema.field("tokens").type == pa.list_(pa.uint32())
    assert [d.tolist() for d in read_documents(path)] == [[5, 6, 7, 0], [70000, 0], [1, 2, 0]]
    assert shard_size(path) == (9, 3)

    tokens = read_tokens(path)
    gc.collect()  # the reader is gone; the array alone must keep the mapping alive
    address = tokens.__array_interface__["data"][0]
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    mapped = [m for m in maps if len(m) > 5 and m[5] == str(path)]
    assert any(int(m[0].split("-")[0], 16) <= address < int(m[0].split("-")[1], 16) for m in mapped)
    assert tokens.tolist() == [5, 6, 7, 0, 70000, 0, 1, 2, 0] and not tokens.flags.writeable


def test_shard_writer_packs_documents_as_they_come_into_the_shards_write_shard_makes(tmp_path, monkeypatch):
    import storage.shards as shards

    monkeypatch.setattr(shards, "_SLACK_TOKENS", 8)  # a closing document longer than that: room is made
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=n, dtype=np.uint16) for n in (5, 700, 3, 1200, 40, 9, 2000, 1)]
    writer = shards.ShardWriter(tmp_path, lambda k: f"w-{k}.arrow", "uint16", 1024, {"made": "here"})
    writer.add(docs[:3])
    writer.add([d.tolist() for d in docs[3:]])  # lists of ids as well as arrays
    written = writer.close()
    # Each shard closes at the first document that brings it to 1024 tokens or beyond.
    expected = [docs[0:4], docs[4:7], docs[7:]]
    assert [(n_tokens, n_docs) for _, n_tokens, n_docs in written] == [
        (sum(map(len, group)), len(group)) for group in expected]
    for (name, _, _), group in zip(written, expected):
        write_shard(tmp_path / "reference.arrow", group, "uint16", {"made": "here"})
        assert (tmp_path / name).read_bytes() == (tmp_path / "reference.arrow").read_bytes()

    for out_of_range in (np.array([1, 70000]), [1, -1]):  # refused, never wrapped
        with pytest.raises(ValueError, match="does not fit uint16"):
            writer.add([out_of_range])


# -- the builtin corpus, end to end ---------------------------------------------------------

def test_shards_decode_to_the_original_documents(builtin):
    config, manifest = builtin
    assert decoded_splits(config, manifest) == source_splits(config)
    assert sum(s.n_docs for shards in manifest.splits.values() for s in shards) == 300
    assert manifest.vocab_size == 512 and manifest.dtype == "uint16" and manifest.eos_id == 0
    # Shards of data.shard_tokens: each closes at the document that reaches the size; only
    # the last of a split may be smaller.
    train = manifest.splits["train"]
    assert len(train) >= 2 and len(manifest.splits["validation"]) == 1
    directory = prep.plan_dataset(config).dir
    for shard in train[:-1]:
        docs = read_documents(directory / shard.path)
        assert shard.n_tokens >= 16384 > shard.n_tokens - len(docs[-1])


def test_manifest_checksums_match_local_and_stored_files(builtin):
    config, manifest = builtin
    local = prep.plan_dataset(config).dir
    stored = Path(config.storage.uri) / "datasets" / manifest.dataset_id
    for directory in (local, stored):
        listed = [s.path for shards in manifest.splits.values() for s in shards]
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            ["manifest.json", "tokenizer.json", *listed])
        assert listed[:2] == ["train-00000-0000.arrow", "train-00000-0001.arrow"]
        assert sha256_file(directory / "tokenizer.json") == manifest.tokenizer_sha256
        for shard in manifest.splits["train"] + manifest.splits["validation"]:
            path = directory / shard.path
            assert (sha256_file(path), path.stat().st_size) == (shard.sha256, shard.size)
            assert read_tokens(path).size == shard.n_tokens


def test_second_prepare_does_no_work(builtin):
    config, manifest = builtin
    before = file_times(Path(config.data.data_dir), Path(config.storage.uri))
    assert prep.prepare_dataset(config) == manifest
    assert file_times(Path(config.data.data_dir), Path(config.storage.uri)) == before


def test_a_lost_local_copy_is_found_in_the_store_not_restored(builtin):
    from storage.store import store_from_config

    config, manifest = builtin
    local = prep.plan_dataset(config).dir
    shutil.rmtree(local)
    # Equal down to created_at: the stored manifest was found, none was written anew (a
    # rebuild writes its manifest after tokenizing); nothing came back here.
    assert prep.prepare_dataset(config) == manifest
    assert not local.exists()
    store = store_from_config(config.storage)
    store.download_dir(prep.plan_dataset(config).store_prefix, local)  # for the next tests
    assert DatasetManifest.load(local) == manifest


def test_training_publishes_to_its_store_only_what_the_store_lacks(builtin, tmp_path):
    """A run whose store lacks the dataset gets it (the train flow says so); a store that
    has the dataset but not the pointer from these settings gets the pointer, and nothing
    is said to have been published."""
    from storage.store import store_from_config

    config, manifest = builtin
    other = config.model_copy(update={"storage": config.storage.model_copy(
        update={"uri": str(tmp_path / "other")})})
    store = store_from_config(other.storage)
    [url] = prep.publish_for_training(other, store)
    assert url == store.url(f"datasets/{manifest.dataset_id}")
    assert prep.publish_for_training(other, store) == []
    pointer = f"datasets/{prep.BY_SETTINGS}/{prep.plan_dataset(other).settings_key}.json"
    store.delete(pointer)
    assert prep.publish_for_training(other, store) == []  # the pointer alone: sent, not counted
    assert store.exists(pointer)


def test_damaged_local_shard_is_replaced(builtin, tmp_path):
    config, manifest = builtin
    # A store without the dataset: the damaged file is tokenized again here.
    config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"uri": str(tmp_path / "store")})})
    shard = prep.plan_dataset(config).dir / manifest.splits["train"][1].path
    flip_bytes(shard)
    again = prep.prepare_dataset(config)
    assert again.model_dump(exclude={"created_at"}) == manifest.model_dump(exclude={"created_at"})
    assert sha256_file(shard) == manifest.splits["train"][1].sha256


def test_a_dataset_in_the_store_is_found_there_and_never_downloaded(tmp_path, caplog):
    """Trained from the store on another machine (the shard cache holds what training read),
    `prepare` reruns with nothing to do: it checks the manifest where it lies, says so, and
    copies nothing into data.data_dir. Likewise where the local copy is damaged."""
    from storage.store import store_from_config
    from training.data import TokenStream

    source = write_source(tmp_path / "in", "jsonl", DOCS * 4)
    overrides = (f"data.source={source}", "data.max_docs=null", "data.shard_tokens=2048",
                 f"storage.uri={tmp_path / 'store'}")
    manifest = prep.prepare_dataset(make_config(tmp_path / "prep", *overrides))
    config = make_config(tmp_path / "trainer", *overrides)  # another machine: a fresh data_dir
    store = store_from_config(config.storage)
    plan = prep.plan_dataset(config)
    cache = prep.dataset_for_training(config, store)
    assert len(TokenStream(cache, manifest, "train").window(0, 100)) == 100  # a shard read
    data_dir = Path(config.data.data_dir)
    before = sorted(p.relative_to(data_dir) for p in data_dir.rglob("*"))
    caplog.set_level(logging.DEBUG, logger=prep.__name__)  # the prepare flow says it at INFO
    assert prep.prepare_dataset(config) == manifest
    assert not plan.dir.exists() and sorted(p.relative_to(data_dir) for p in data_dir.rglob("*")) == before
    assert f"dataset {manifest.dataset_id} is prepared in {store.url(plan.store_prefix)}" in caplog.text

    # A local copy with a damaged shard: its files are dropped, the store's copy is used.
    local = make_config(tmp_path / "prep", *overrides)
    shard = prep.plan_dataset(local).dir / manifest.splits["train"][0].path
    flip_bytes(shard)
    caplog.clear()
    assert prep.prepare_dataset(local) == manifest
    assert not shard.exists() and not (shard.parent / "manifest.json").exists()
    assert f"is prepared in {store.url(plan.store_prefix)}" in caplog.text
    assert prep.dataset_for_training(local, store).parent.name == "cache"  # training streams it


def test_training_is_told_whether_a_dataset_was_never_prepared_or_is_damaged(tmp_path, monkeypatch):
    """What train and evaluate ask (require_prepared): a missing dataset and a damaged one
    (with no store copy to restore) are configuration errors that say which, never retried.
    A missing one names where it was looked for; with relative paths (a run's config.yaml
    given from another directory), that they start where the command runs."""
    from core.config import ConfigError
    from storage.store import store_from_config

    config = make_config(tmp_path)
    plan, store = prep.plan_dataset(config), store_from_config(config.storage)
    with pytest.raises(ConfigError, match=re.escape(
            f"is not prepared (not in {plan.dir}, nor in the store at "
            f"{store.url(plan.store_prefix)}); run `goodput prepare` (or the pipeline) first")
            + "$"):
        prep.require_prepared(plan, store)
    monkeypatch.chdir(tmp_path)
    relative = make_config(Path("elsewhere"))
    with pytest.raises(ConfigError, match=re.escape(
            f"not in {tmp_path / 'elsewhere' / 'data' / plan.dataset_id}, nor in the store at "
            f"file://{tmp_path / 'elsewhere' / 'store'}/datasets/{plan.dataset_id}); run "
            "`goodput prepare` (or the pipeline) first, or run the command where the config's "
            "relative paths start")):
        prep.require_prepared(prep.plan_dataset(relative), store_from_config(relative.storage))
    manifest = prep.prepare_dataset(config)
    assert prep.require_prepared(plan, store) == manifest
    shutil.rmtree(config.storage.uri)  # no copy in the store to restore from
    flip_bytes(plan.dir / manifest.splits["train"][0].path)
    with pytest.raises(ConfigError, match="is damaged: its files no longer match its manifest"):
        prep.require_prepared(plan, store)


def test_rerun_after_a_crash_redoes_only_unfinished_units(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}", "tokenizer.vocab_size=300",
                         "data.max_docs=null", "data.unit_bytes=1KiB")
    plan = prep.plan_dataset(config)
    units = prep.plan_units(plan, config)
    assert len(units) >= 3  # byte ranges of the one file
    prep.build_tokenizer(plan, config, units)
    finished = prep.tokenize_unit(plan, units[1], config.data, config.storage)
    written_at = {s.path: (plan.dir / s.path).stat().st_mtime_ns for s in finished.shards["train"]}
    # A unit that died half way: a partial shard of unit 2 and no record of it.
    (plan.dir / "train-00002-0000.arrow").write_bytes(b"half a shard")
    # ...the run dies here; the next one finds the tokenizer and unit 1 done.
    manifest = prep.prepare_dataset(config)
    assert {s.path: (plan.dir / s.path).stat().st_mtime_ns for s in finished.shards["train"]} == written_at
    assert [s for s in manifest.splits["train"] if s.path.startswith("train-00001-")] == finished.shards["train"]
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS)
    assert not (plan.dir / prep.UNITS_DIR).exists()


def test_units_of_any_size_give_the_same_documents_in_the_same_splits(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    splits = {}
    for unit_bytes in ("1KiB", "256MiB"):
        config = make_config(tmp_path / unit_bytes, f"data.source={source}", "data.max_docs=null",
                             "tokenizer.vocab_size=300", f"data.unit_bytes={unit_bytes}",
                             f"tokenizer.path={given_tokenizer(tmp_path)}")
        splits[unit_bytes] = decoded_splits(config, prep.prepare_dataset(config))
    assert splits["1KiB"] == splits["256MiB"] == split_by_hash(DOCS, 0.05)


def test_a_process_loads_a_datasets_tokenizer_once_for_all_its_units(tmp_path, monkeypatch):
    """A pool process tokenizes unit after unit: the tokenizer is loaded once (its BPE cache
    stays warm); another dataset's tokenizer (another sha256) is loaded anew."""
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}", "data.max_docs=null",
                         "tokenizer.vocab_size=300", "data.unit_bytes=1KiB",
                         f"tokenizer.path={given_tokenizer(tmp_path)}")
    loads = []
    monkeypatch.setattr(prep, "load_tokenizer",
                        lambda path, eos=None: loads.append(path) or load_tokenizer(path, eos))
    monkeypatch.setattr(prep, "_loaded_tokenizers", {})
    plan = prep.plan_dataset(config)
    units = prep.plan_units(plan, config)
    prep.build_tokenizer(plan, config, units)
    loads.clear()
    for unit in units:
        prep.tokenize_unit(plan, unit, config.data, config.storage)
    assert len(units) >= 3 and loads == [plan.tokenizer_path]
    other = tmp_path / "other-tokenizer.json"
    train_tokenizer(DOCS[::-1], 280, 2).save(str(other))
    prep._unit_tokenizer(other, sha256_file(other))
    assert loads == [plan.tokenizer_path, other]


def given_tokenizer(tmp_path: Path) -> Path:
    path = tmp_path / "given-tokenizer.json"
    if not path.exists():
        train_tokenizer(DOCS, 300, 2).save(str(path))
    return path


def test_dataset_id_follows_the_listing_or_the_content(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    by_listing = make_config(tmp_path, f"data.source={source}")
    by_content = make_config(tmp_path, f"data.source={source}", "data.fingerprint=content")
    before = prep.plan_dataset(by_listing).dataset_id, prep.plan_dataset(by_content).dataset_id
    source.write_bytes(source.read_bytes())  # the same bytes, a new modification time
    after = prep.plan_dataset(by_listing).dataset_id, prep.plan_dataset(by_content).dataset_id
    assert after[0] != before[0] and after[1] == before[1]


def test_training_finds_the_dataset_when_the_sources_are_gone(tmp_path):
    """Train, evaluate and validation locate the dataset by its data settings (the pointer
    prepare left in the store): the raw sources and the local copy may both be gone."""
    from storage.store import store_from_config

    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}")
    manifest = prep.prepare_dataset(config)
    shutil.rmtree(tmp_path / "in")
    shutil.rmtree(config.data.data_dir)
    store = store_from_config(config.storage)
    plan = prep.locate(config, store)
    assert plan.dataset_id == manifest.dataset_id
    assert prep.require_prepared(plan, store) == manifest
    # Preparing again (the pipeline's first stage) finds it the same way, in the store.
    assert prep.prepare_dataset(config) == manifest
    assert not plan.dir.exists()
    store.delete_prefix(f"datasets/{manifest.dataset_id}")
    with pytest.raises(DataError, match="not listable here, and the dataset.*neither in"):
        prep.prepare_dataset(config)
    # Another data setting was never prepared: it says so and what it looked for.
    other = make_config(tmp_path, f"data.source={source}", "data.validation_fraction=0.2")
    with pytest.raises(DataError, match="does not exist.*no dataset was prepared from these"):
        prep.locate(other, store)


def test_sources_here_in_part_are_not_taken_for_their_earlier_dataset(tmp_path, monkeypatch):
    """Only sources that are not here at all are found by their data settings: where a part
    is here (and may have changed), an earlier dataset of the whole is not used for it."""
    from storage.store import store_from_config

    monkeypatch.chdir(tmp_path)
    write_source(tmp_path / "in" / "web", "jsonl", DOCS)
    write_source(tmp_path / "in" / "books", "jsonl", DOCS[::-1])
    config = make_config(tmp_path, "data.source=in/web/*.jsonl,in/books/*.jsonl")
    manifest = prep.prepare_dataset(config)
    store = store_from_config(config.storage)
    shutil.move(tmp_path / "in" / "books", tmp_path / "books-away")
    with pytest.raises(DataError, match="in/books.*The rest of data.source is here") as e:
        prep.locate(config, store)
    assert not isinstance(e.value, SourcesNotHere)
    shutil.move(tmp_path / "in", tmp_path / "in-away")  # nothing here: the earlier dataset
    assert prep.locate(config, store).dataset_id == manifest.dataset_id


def test_a_relative_source_means_the_files_of_its_directory(tmp_path, monkeypatch):
    """Two machines (working directories) sharing a store, each with its own `corpus/`:
    neither's dataset stands for the other's sources, and a third without any finds none.
    A pointer an earlier version wrote (keyed by the source as typed) still serves."""
    from core.files import canonical_json
    from storage.store import store_from_config

    prepared = {}
    for machine, docs in (("a", DOCS), ("d", DOCS[:40])):
        (tmp_path / machine).mkdir()
        monkeypatch.chdir(tmp_path / machine)
        write_source(tmp_path / machine / "corpus", "jsonl", docs)
        config = make_config(tmp_path / machine, "data.source=corpus/docs.jsonl",
                             f"storage.uri={tmp_path / 'store'}")
        prepared[machine] = prep.prepare_dataset(config).dataset_id
    assert prepared["a"] != prepared["d"]
    store = store_from_config(config.storage)
    shutil.rmtree(tmp_path / "a" / "corpus")
    monkeypatch.chdir(tmp_path / "a")
    config = make_config(tmp_path / "a", "data.source=corpus/docs.jsonl", f"storage.uri={tmp_path / 'store'}")
    assert prep.locate(config, store).dataset_id == prepared["a"]  # its own, not d's (the last)
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    config = make_config(tmp_path / "b", "data.source=corpus/docs.jsonl", f"storage.uri={tmp_path / 'store'}")
    with pytest.raises(DataError, match="does not exist.*no dataset was prepared from these"):
        prep.locate(config, store)
    store.put_bytes(f"datasets/{prep.BY_SETTINGS}/{prep.settings_key(config, as_typed=True)}.json",
                    canonical_json({"dataset_id": prepared["a"], "source": "corpus/docs.jsonl"}))
    assert prep.locate(config, store).dataset_id == prepared["a"]


def test_prepare_again_mends_a_dataset_the_store_lost_files_of(tmp_path):
    """Training stops on a shard the store lost and says to prepare again: prepare uploads
    it again from a complete copy here, or tokenizes again where there is none."""
    from storage.store import store_from_config

    source = write_source(tmp_path / "in", "jsonl", DOCS * 4)
    config = make_config(tmp_path, f"data.source={source}", "data.max_docs=null",
                         "data.shard_tokens=2048")
    manifest = prep.prepare_dataset(config)
    store, plan = store_from_config(config.storage), prep.plan_dataset(config)
    lost = plan.store_key(manifest.splits["train"][1].path)
    store.delete(lost)
    assert prep.store_lacks(plan, manifest, store) == [manifest.splits["train"][1].path]
    assert prep.nothing_to_prepare(config, store) is None and prep.unpublished(plan, store) == ["dataset"]
    prep.prepare_dataset(config)
    assert store.exists(lost) and prep.nothing_to_prepare(config, store) is not None
    held = store.path(lost)  # cut short (an interrupted copy by hand): lacking too
    held.write_bytes(held.read_bytes()[:100])
    assert prep.store_lacks(plan, manifest, store) == [manifest.splits["train"][1].path]
    store.delete(lost)
    shutil.rmtree(plan.dir)  # and no copy here: tokenized again
    again = prep.prepare_dataset(config)
    assert again.model_dump(exclude={"created_at"}) == manifest.model_dump(exclude={"created_at"})
    assert store.exists(lost)
    assert prep.local_dataset_dir(config, again) == plan.dir
    (plan.dir / "manifest.json").unlink()  # what training's check leaves of a damaged copy
    assert prep.local_dataset_dir(config, again) is None


# -- local files ----------------------------------------------------------------------------

DOCS = [f"Document {i}: naïve café, {i * 7} tokens \t <|endoftext|> ok 🙂 " + "word " * (i % 13)
        for i in range(60)]


def write_source(directory: Path, fmt: str, docs: list[str], column: str = "text") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = directory / "docs.jsonl"
        path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif fmt == "json":
        path = directory / "docs.json"
        path.write_text(json.dumps([{column: d} for d in docs]))
    elif fmt == "parquet":
        path = directory / "docs.parquet"
        pq.write_table(pa.table({column: docs}), path)
    else:
        path = directory / "docs.txt"
        path.write_text("".join(d + "\n" for d in docs))  # one document per line
    return path


def compress(path: Path, codec: str) -> Path:
    """`path` compressed as `path.gz` / `path.zst` (the original removed)."""
    data = path.read_bytes()
    if codec == "gz":
        import gzip

        packed = gzip.compress(data)
    else:
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write(data)
        packed = sink.getvalue().to_pybytes()
    target = path.with_name(path.name + "." + codec)
    target.write_bytes(packed)
    path.unlink()
    return target


@pytest.mark.parametrize("fmt,codec", [("json", ""), ("jsonl", ""), ("parquet", ""), ("txt", ""),
                                       ("jsonl", "gz"), ("jsonl", "zst"), ("txt", "gz")])
def test_local_files_round_trip(tmp_path, fmt, codec):
    docs = [d + "\nsecond line" if fmt != "txt" else d for d in DOCS]
    column = "content" if fmt == "parquet" else "text"
    source = write_source(tmp_path / "in", fmt, docs, column)
    if codec:
        source = compress(source, codec)
    config = make_config(tmp_path, f"data.source={source}", f"data.text_column={column}",
                         "tokenizer.vocab_size=300", "data.validation_fraction=0.1")
    manifest = prep.prepare_dataset(config)
    decoded = decoded_splits(config, manifest)
    expected = split_by_hash(docs, 0.1)
    assert decoded == expected and len(expected["validation"]) > 0


def test_given_tokenizer_is_used(tmp_path):
    # A tokenizer made elsewhere, with "</s>" as its end-of-document token.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCS, trainer)
    given = tmp_path / "given.json"
    tokenizer.save(str(given))
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}", f"tokenizer.path={given}")

    manifest = prep.prepare_dataset(config)
    assert manifest.tokenizer_sha256 == sha256_file(given)
    assert (manifest.eos_id, manifest.vocab_size) == (1, 280)
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS)

    # The same tokenizer as a Hugging Face tokenizer directory (save_pretrained).
    from transformers import PreTrainedTokenizerFast

    saved = tmp_path / "hf-tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(given)),
                            eos_token="</s>").save_pretrained(str(saved))
    from_dir = prep.prepare_dataset(make_config(tmp_path / "dir", f"data.source={source}",
                                                f"tokenizer.path={saved}"))
    assert (from_dir.eos_id, from_dir.vocab_size) == (1, 280)
    assert [s.n_tokens for s in from_dir.splits["train"]] == [s.n_tokens for s in manifest.splits["train"]]


def _tokenizer_with(special_tokens: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCS, trainer)
    return tokenizer


def test_the_eos_token_a_tokenizer_directory_declares_ends_documents(tmp_path):
    """A save_pretrained directory's tokenizer_config.json names its end-of-document token,
    whatever else the vocabulary holds; tokenizer.eos_token names it for a bare file."""
    from transformers import PreTrainedTokenizerFast

    from training.export import _tokenizer_files

    source = write_source(tmp_path / "in", "jsonl", DOCS)
    # Both <|endoftext|> and </s> in the vocabulary; the directory declares </s>.
    both = tmp_path / "both"
    PreTrainedTokenizerFast(tokenizer_object=_tokenizer_with(["<|endoftext|>", "</s>"]),
                            eos_token="</s>").save_pretrained(str(both))
    config = make_config(tmp_path / "a", f"data.source={source}", f"tokenizer.path={both}")
    manifest = prep.prepare_dataset(config)
    assert manifest.eos_id == 1  # </s>, not <|endoftext|> (0)
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS)

    # DeepSeek's: none of the usual names, declared as an AddedToken object.
    eos = "<｜end▁of▁sentence｜>"
    bare = _tokenizer_with(["<｜begin▁of▁sentence｜>", eos])
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    bare.save(str(deepseek / "tokenizer.json"))
    (deepseek / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"__type": "AddedToken", "content": eos, "special": True},
         "tokenizer_class": "LlamaTokenizerFast"}))
    config = make_config(tmp_path / "b", f"data.source={source}", f"tokenizer.path={deepseek}")
    manifest = prep.prepare_dataset(config)
    assert manifest.eos_id == bare.token_to_id(eos) == 1
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS)
    # Export's tokenizer_config.json names it too (from the dataset's manifest).
    assert _tokenizer_files(prep.plan_dataset(config).dir, 290)[1:3] == (eos, 1)
    # The prepared dataset's tokenizer.json, given for another corpus: the manifest says its EOS.
    reused = make_config(tmp_path / "b2", f"data.source={source}",
                         f"tokenizer.path={prep.plan_dataset(config).tokenizer_path}")
    assert prep.prepare_dataset(reused).eos_id == 1
    # A directory declaring a token its tokenizer.json lacks: the error names the file.
    (deepseek / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    message = prepare_error(make_config(tmp_path / "b3", f"data.source={source}",
                                        f"tokenizer.path={deepseek}"))
    assert "tokenizer_config.json" in message and "'</s>'" in message and "tokenizer.eos_token" in message

    # The bare file states none: refused, naming the setting that gives it ...
    bare_file = tmp_path / "bare.json"
    bare.save(str(bare_file))
    message = prepare_error(make_config(tmp_path / "c", f"data.source={source}",
                                        f"tokenizer.path={bare_file}"))
    assert "no end-of-document token" in message and "tokenizer.eos_token" in message
    # ... which then gives it: the same shards as the declaring directory's.
    named = make_config(tmp_path / "d", f"data.source={source}", f"tokenizer.path={bare_file}",
                        f"tokenizer.eos_token={eos}")
    assert [s.sha256 for s in prep.prepare_dataset(named).splits["train"]] == \
        [s.sha256 for s in manifest.splits["train"]]
    # A token it does not have, or one without a given tokenizer: errors naming the field.
    wrong = make_config(tmp_path / "e", f"data.source={source}", f"tokenizer.path={bare_file}",
                        "tokenizer.eos_token=</s>")
    assert "'</s>' is not in its vocabulary" in prepare_error(wrong)
    with pytest.raises(ValueError, match="tokenizer.eos_token='</s>' names the end-of-document"):
        make_config(tmp_path / "f", f"data.source={source}", "tokenizer.eos_token=</s>")


def test_a_declared_eos_token_changes_the_dataset_id_only_where_it_changes_the_shards(tmp_path):
    """Before declared tokens were read, the first of EOS_CANDIDATES ended documents: a
    directory declaring that same token (</s>, as save_pretrained of most tokenizers writes)
    names the same dataset as before, lest every such dataset be prepared again; one that
    declares another token names another dataset."""
    from transformers import PreTrainedTokenizerFast

    source = write_source(tmp_path / "in", "jsonl", DOCS)
    tokenizer = _tokenizer_with(["<|endoftext|>", "</s>", "<eos>"])
    declaring = {}
    for eos in ["<|endoftext|>", "</s>", "<eos>"]:
        declaring[eos] = tmp_path / f"declares-{eos.strip('<|>/')}"
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos).save_pretrained(
            str(declaring[eos]))
    bare = tmp_path / "bare" / "tokenizer.json"  # states nothing: <|endoftext|> (0), as before
    bare.parent.mkdir()
    bare.write_bytes((declaring["</s>"] / "tokenizer.json").read_bytes())

    def plan(path: Path, *overrides: str) -> prep.DatasetPlan:
        return prep.plan_dataset(make_config(tmp_path, f"data.source={source}",
                                             f"tokenizer.path={path}", *overrides))

    before = plan(bare).dataset_id
    for eos, same in [("<|endoftext|>", True), ("</s>", False), ("<eos>", False)]:
        assert (declaring[eos] / "tokenizer.json").read_bytes() == bare.read_bytes()
        declared = plan(declaring[eos])
        assert declared.eos_token == eos
        assert (declared.dataset_id == before) is same, eos
        assert (plan(bare, f"tokenizer.eos_token={eos}").dataset_id == before) is same, eos
    assert plan(declaring["</s>"]).dataset_id != plan(declaring["<eos>"]).dataset_id


def test_tokenizer_is_trained_on_a_bounded_sample(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    small = make_config(tmp_path / "small", f"data.source={source}", "tokenizer.vocab_size=400",
                        "tokenizer.sample_bytes=200")
    whole = make_config(tmp_path / "whole", f"data.source={source}", "tokenizer.vocab_size=400")
    plans = {name: prep.plan_dataset(c) for name, c in (("small", small), ("whole", whole))}
    assert plans["small"].dataset_id != plans["whole"].dataset_id  # the sample size counts
    for name, config in (("small", small), ("whole", whole)):
        plan = plans[name]
        prep.build_tokenizer(plan, config, prep.plan_units(plan, config))
    learned = {name: load_tokenizer(plans[name].tokenizer_path).get_vocab() for name in plans}
    reserved = {name: sum(t.startswith("<|reserved_") for t in vocab) for name, vocab in learned.items()}
    # ~200 bytes of text teach far fewer merges than the whole corpus: more ids stay reserved.
    assert reserved["small"] > reserved["whole"]
    again = prep.plan_dataset(small)
    shutil.rmtree(again.dir)
    prep.build_tokenizer(again, small, prep.plan_units(again, small))
    assert load_tokenizer(again.tokenizer_path).get_vocab() == learned["small"]  # deterministic


# -- errors the user can fix ----------------------------------------------------------------

def prepare_error(config: RunConfig) -> str:
    with pytest.raises(DataError) as info:
        prep.prepare_dataset(config)
    return str(info.value)


def test_empty_corpus_is_an_error(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", ["", "   ", "\n\t"])
    message = prepare_error(make_config(tmp_path, f"data.source={source}"))
    assert "holds no text" in message and "3 records without text" in message


def test_records_without_text_are_dropped_and_counted(tmp_path):
    """Empty, whitespace and null texts (common in exported tables) are not documents, and
    not bad records either: dropped, counted in the manifest apart from skipped ones."""
    source = tmp_path / "in" / "nulls.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*DOCS, None, "", " \n", None])
                      + '{"text": 7}\n')
    table = tmp_path / "in" / "nulls.parquet"
    pq.write_table(pa.table({"text": [*DOCS, None, ""]}), table)
    config = make_config(tmp_path, f"data.source={source},{table}", "data.on_bad_record=skip",
                         "tokenizer.vocab_size=300")
    manifest = prep.prepare_dataset(config)
    assert (manifest.empty_records, manifest.skipped_records) == (6, 1)
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS + DOCS)


def test_missing_text_column_names_the_file_and_the_fix(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS, column="body")
    message = prepare_error(make_config(tmp_path, f"data.source={source}"))
    assert str(source) in message and "'text'" in message and "data.text_column" in message
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": DOCS, "id": list(range(len(DOCS)))}), table)
    message = prepare_error(make_config(tmp_path, f"data.source={table}"))
    assert "'text'" in message and "body" in message and "data.text_column=" in message


def test_bad_records_are_named_or_skipped_and_counted(tmp_path):
    good = write_source(tmp_path / "in", "jsonl", DOCS)
    bad = tmp_path / "in" / "zbad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops\n{"text": "also fine"}\n')
    message = prepare_error(make_config(tmp_path, f"data.source={good},{bad}"))
    assert str(bad) in message and "line 2" in message and "data.on_bad_record=skip" in message
    skipping = make_config(tmp_path, f"data.source={good},{bad}", "data.on_bad_record=skip",
                           "tokenizer.vocab_size=300")
    manifest = prep.prepare_dataset(skipping)
    assert manifest.skipped_records == 1
    assert sorted(sum(decoded_splits(skipping, manifest).values(), [])) == sorted(
        DOCS + ["fine", "also fine"])


def test_corrupt_files_are_named(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    assert str(corrupt) in prepare_error(make_config(tmp_path, f"data.source={corrupt}"))
    packed = compress(write_source(tmp_path / "in", "jsonl", DOCS), "gz")
    data = bytearray(packed.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = b"\0" * 16
    packed.write_bytes(bytes(data))
    assert str(packed) in prepare_error(make_config(tmp_path, f"data.source={packed}"))


def test_no_matching_files_is_an_error(tmp_path):
    message = prepare_error(make_config(tmp_path, f"data.source={tmp_path}/nothing/*.jsonl"))
    assert "no files match" in message


def test_unreachable_hub_says_to_use_local_files(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    # Offline mode fails at once, the same way a machine without network does after retries.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = prepare_error(make_config(tmp_path, "data.source=someone/some-corpus"))
    assert "hub is unreachable" in message and "local files" in message


def test_too_few_documents_to_split(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", ["only one"])
    assert "data.validation_fraction" in prepare_error(make_config(tmp_path, f"data.source={source}"))


def test_tokenizer_without_eos_is_refused(tmp_path):
    tokenizer = train_tokenizer(DOCS, 280, 2)
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    data = json.loads(path.read_text())
    data["added_tokens"] = []
    del data["model"]["vocab"]["<|endoftext|>"]
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match="no end-of-document token"):
        load_tokenizer(path)


def test_a_small_corpus_still_gives_the_configured_vocabulary(tmp_path):
    # Too little text to learn 1,000 merges: the rest of the ids are reserved tokens, so the
    # model (and the layout checked before preparation) gets tokenizer.vocab_size exactly.
    tokenizer = train_tokenizer(DOCS, 1000, 2)
    assert tokenizer.get_vocab_size() == 1000
    reserved = [tokenizer.token_to_id(f"<|reserved_{i}|>") for i in range(3)]
    assert None not in reserved and max(reserved) < 1000
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    reloaded = load_tokenizer(path)
    assert reloaded.get_vocab_size() == 1000
    # No document encodes to a reserved id, not even one that spells one out.
    text = DOCS[0] + " <|reserved_0|>"
    ids = reloaded.encode(text).ids
    assert not set(ids) & set(reserved)
    assert reloaded.decode(ids) == text


def test_units_writing_to_the_store_resume_and_seal_the_dataset_there(tmp_path):
    """Units of a cluster (to_store) share only the store: they leave nothing on this disk,
    record themselves done there (a rerun skips them; one whose shard went missing is redone),
    and the dataset is sealed there with the bytes a local run writes."""
    from storage.store import store_from_config

    source = write_source(tmp_path / "in", "jsonl", DOCS * 20)
    overrides = (f"data.source={source}", "data.max_docs=null", "data.unit_bytes=16KiB",
                 "data.shard_tokens=2048", "tokenizer.vocab_size=300")
    config = make_config(tmp_path / "cluster", *overrides)
    store = store_from_config(config.storage)
    plan = prep.plan_dataset(config)
    units = prep.plan_units(plan, config)
    tokenizer_path = prep.build_tokenizer(plan, config, units, store)
    first = [prep.tokenize_unit(plan, unit, config.data, config.storage, to_store=True) for unit in units]
    assert len(units) >= 3 and not list(plan.dir.glob("*.arrow"))
    again = [prep.tokenize_unit(plan, unit, config.data, config.storage, to_store=True) for unit in units]
    assert all(r.reused for r in again) and not any(r.reused for r in first)
    assert [r.model_copy(update={"reused": False}) for r in again] == first  # recorded: not redone (same timings)

    lost = f"{plan.store_prefix}/{first[1].shards['train'][0].path}"
    store.delete(lost)
    with pytest.raises(FileNotFoundError, match="run prepare again"):
        prep.write_manifest(plan, first, tokenizer_path, store)
    redone = prep.tokenize_unit(plan, units[1], config.data, config.storage, to_store=True)
    assert redone.seconds != first[1].seconds and store.exists(lost)

    manifest = prep.write_manifest(plan, first, tokenizer_path, store)
    listed = [manifest.tokenizer] + [s.path for shards in manifest.splits.values() for s in shards]
    assert store.list(plan.store_prefix) == sorted(f"{plan.store_prefix}/{rel}"
                                                   for rel in listed + ["manifest.json"])
    assert not plan.dir.exists()
    assert prep.find_prepared(plan, store) == manifest and not plan.dir.exists()

    local = prep.prepare_dataset(make_config(tmp_path / "local", *overrides))
    assert manifest.model_dump(exclude={"created_at"}) == local.model_dump(exclude={"created_at"})


# -- the Prefect flow -----------------------------------------------------------------------

def test_prefect_flow_matches_the_library_and_reruns_for_free(prefect_api, builtin, tmp_path):
    from flows.prepare import prepare

    library_config, library_manifest = builtin
    config = make_config(tmp_path)  # same inputs, fresh data dir and store
    manifest = prepare(config)
    assert manifest.dataset_id == library_manifest.dataset_id
    assert manifest.model_dump(exclude={"created_at"}) == library_manifest.model_dump(exclude={"created_at"})

    before = file_times(Path(config.data.data_dir), Path(config.storage.uri))
    assert prepare(config) == manifest
    assert file_times(Path(config.data.data_dir), Path(config.storage.uri)) == before


def test_prefect_flow_runs_units_in_processes_and_writes_the_library_s_bytes(prefect_api, tmp_path):
    """Many work units through the flow's process pool: the same shards, byte for byte, as
    the library's one-at-a-time run, tokenized in processes other than the flow's, and what
    the library logs there in the flow run's log; the second run finds it all done, and says
    so."""
    from flows.prepare import prepare

    write_source(tmp_path / "in", "jsonl", DOCS * 20)
    bad = tmp_path / "in" / "bad.jsonl"
    bad.write_text(json.dumps({"text": DOCS[0]}) + "\n{not json\n")
    overrides = (f"data.source={tmp_path / 'in'}", "data.max_docs=null", "data.unit_bytes=16KiB",
                 "data.shard_tokens=2048", "tokenizer.vocab_size=300", "prepare.workers=2",
                 "data.on_bad_record=skip")
    library = prep.prepare_dataset(make_config(tmp_path / "library", *overrides))
    config = make_config(tmp_path / "flow", *overrides)
    state = prepare(config, return_state=True)
    manifest = state.result()
    assert manifest.model_dump(exclude={"created_at"}) == library.model_dump(exclude={"created_at"})
    assert len({s.path.split("-")[1] for s in manifest.splits["train"]}) >= 4  # units
    assert manifest.skipped_records == 1
    summary = json.loads(config.run_dir.summary_file.read_text())["prepare"]
    assert summary["tokens"]["train"] == manifest.n_tokens("train") and summary["tokenize_s"] > 0
    workers = {int(worker.rsplit(":", 1)[1]) for worker in summary["workers"]}
    assert len(workers) == 2 and os.getpid() not in workers, summary["workers"]
    # The warning was logged in a unit's process: it is in the flow run's log all the same.
    said = f"skipping bad records in {bad}"
    parent = state.state_details.flow_run_id
    runs = subflow_runs(parent)
    wait_for(lambda: any(said in line for line in logs_of(*(run.id for run in subflow_runs(
        runs["prepare-source"].id).values()))), timeout_s=30, what=repr(said), every_s=0.5)
    again = prepare(config, return_state=True)
    assert again.result() == manifest
    said = f"dataset {manifest.dataset_id} is already prepared"
    parent = again.state_details.flow_run_id
    wait_for(lambda: any(said in line for line in logs_of(parent, *(
        run.id for run in subflow_runs(parent).values()))), timeout_s=30, what=repr(said), every_s=0.5)


def test_a_mix_whose_last_source_is_missing_fails_before_the_first_is_tokenized(prefect_api, tmp_path):
    """The flow lists every source of a mix first: a missing third source used to be found
    only after the first two were tokenized (hours on a real corpus)."""
    from flows.prepare import prepare

    first = write_source(tmp_path / "in" / "a", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.sources=[{{name: a, weight: 1, source: {first}}}, "
                                   f"{{name: gone, weight: 1, source: {tmp_path / 'gone'}}}]")
    with pytest.raises(DataError, match=r"data.sources\[gone\].source"):
        prepare(config)
    assert not any(Path(config.data.data_dir).glob("*/manifest.json"))  # the first untouched
    assert not any(Path(config.data.data_dir).glob("*/*.arrow"))


def test_a_corpus_of_thousands_of_files_goes_through_the_flow(prefect_api, tmp_path):
    """Prefect records a flow run's parameters and refuses more than 512 KiB of them: the
    listing of 3000 files, passed whole to prepare-source and its units to tokenize-units,
    failed the flow before any was read (422 Unprocessable Entity). The listing stays out of
    the recorded plan (n_files stands for it) and the units go by reference."""
    from prefect.client.orchestration import get_client

    from flows.prepare import prepare

    corpus = tmp_path / "in"
    for i in range(3000):
        (corpus / f"part{i // 500}").mkdir(parents=True, exist_ok=True)
        (corpus / f"part{i // 500}" / f"doc{i:05d}.txt").write_text(DOCS[i % len(DOCS)] + "\n")
    config = make_config(tmp_path, f"data.source={corpus}", "data.max_docs=null", "data.unit_bytes=64KiB")
    state = prepare(config, return_state=True)
    assert state.is_completed(), state
    assert state.result().n_tokens("train") > 0
    source_run = subflow_runs(state.state_details.flow_run_id)["prepare-source"]
    units_run = subflow_runs(source_run.id)["tokenize-units"]
    with get_client(sync_client=True) as client:
        recorded = {name: client.read_flow_run(run.id).parameters
                    for name, run in (("prepare-source", source_run), ("tokenize-units", units_run))}
    assert recorded["prepare-source"]["plan"]["n_files"] == 3000
    assert "files" not in recorded["prepare-source"]["plan"]
    with pytest.raises(ValueError, match="leaves the listing out"):  # not read back as a plan without files
        prep.DatasetPlan.model_validate(recorded["prepare-source"]["plan"])
    assert recorded["tokenize-units"]["units"] == "<PrefectConcurrentFuture>"
    assert all(len(json.dumps(parameters)) < 20_000 for parameters in recorded.values()), recorded


def test_what_the_library_logs_is_in_the_flow_run_s_log(prefect_api, tmp_path):
    """A deployed flow run has no console anyone reads: the library's records (a file of the
    folder left out, the tokenizer trained) are in the flow run's log, where the UI shows it."""
    from flows.prepare import prepare

    folder = write_source(tmp_path / "in", "jsonl", DOCS).parent
    (folder / "README.md").write_text("# not a corpus\n")
    state = prepare(make_config(tmp_path, f"data.source={folder}"), return_state=True)
    assert state.is_completed(), state
    parent = state.state_details.flow_run_id
    said = ("left out 1 file(s) of no known format (README.md)", "trained a 512-token BPE")
    wait_for(lambda: all(any(s in line for line in logs_of(parent, *(
        run.id for run in subflow_runs(parent).values()))) for s in said),
        timeout_s=30, what=f"{said} in the flow runs' logs", every_s=0.5)

    # Also from the threads the library's transfers run in (a checkpoint upload, a store's
    # parallel parts): their records know the flow run they work for.
    from prefect import flow

    from core.cpu_priority import at_background_priority
    from storage.store import _run_parallel

    @flow
    def logs_from_threads():
        at_background_priority(logging.getLogger("storage.store").warning, "from a background thread")
        _run_parallel([lambda: logging.getLogger("storage.store").warning("from a pool thread")], 2)

    run = logs_from_threads(return_state=True).state_details.flow_run_id
    wait_for(lambda: {"from a background thread", "from a pool thread"} <= set(logs_of(run)),
             timeout_s=30, what="the threads' records in the flow run's log", every_s=0.5)


def test_the_progress_of_a_rerun_counts_as_speed_only_what_it_tokenized(prefect_api, tmp_path):
    """Units an earlier run finished return at once: the progress counts them done and says
    so (tests/test_reporting.py checks that its speed and ETA leave them out)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.prepare import prepare

    source = write_source(tmp_path / "in", "jsonl", DOCS * 20)
    config = make_config(tmp_path, f"data.source={source}", "data.max_docs=null",
                         "data.unit_bytes=16KiB", "tokenizer.vocab_size=300", "prepare.workers=1")
    plan = prep.plan_dataset(config)
    units = prep.plan_units(plan, config)
    prep.build_tokenizer(plan, config, units)
    for unit in units[:2]:  # an earlier run's
        prep.tokenize_unit(plan, unit, config.data, config.storage)
    state = prepare(config, return_state=True)
    assert state.is_completed(), state
    source_run = subflow_runs(state.state_details.flow_run_id)["prepare-source"]
    units_run = subflow_runs(source_run.id)["tokenize-units"]
    with get_client(sync_client=True) as client:
        [progress] = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[units_run.id]))) if a.type == "progress"]
    assert progress.data == 100.0
    said = progress.description
    assert f"{len(units)} / {len(units)} units" in said and "2 done before" in said, said


def test_prefect_flow_fails_bad_input_without_retries(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    from flows.prepare import prepare

    source = write_source(tmp_path / "in", "jsonl", DOCS, column="body")
    state = prepare(make_config(tmp_path, f"data.source={source}"), return_state=True)
    assert state.is_failed()
    with pytest.raises(DataError, match="data.text_column"):
        state.result()
    import time

    deadline = time.monotonic() + 30  # task states reach the server in the background
    while True:
        with get_client(sync_client=True) as client:  # the tasks of its prepare-source subflow
            source_run = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])))
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[run.id for run in source_run])))
        stage = [run for run in runs if run.name.startswith("build-tokenizer")]
        if (stage and stage[0].state.is_final()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(stage) == 1 and stage[0].run_count == 1 and stage[0].state.is_failed()


# -- an S3 store ----------------------------------------------------------------------------

@pytest.mark.s3
def test_reads_an_s3_prefix_of_compressed_files(tmp_path, s3_server, s3_uri):
    """data.source=s3://bucket/prefix: listed and streamed through the store's client (the
    credentials chain), never downloaded whole; the id follows the objects' ETags."""
    from storage.store import open_store

    bucket_prefix = s3_uri.removeprefix(f"s3://{s3_server.bucket}/")
    client = s3_server.client()
    halves = {"a.jsonl.zst": DOCS[:30], "sub/b.jsonl.gz": DOCS[30:]}
    for name, docs in halves.items():
        path = write_source(tmp_path / "src" / name.split(".")[0], "jsonl", docs)
        packed = compress(path, name.rsplit(".", 1)[1])
        client.put_object(Bucket=s3_server.bucket, Key=f"{bucket_prefix}/corpus/{name}",
                          Body=packed.read_bytes())
    config = make_config(tmp_path, f"data.source={s3_uri}/corpus", "tokenizer.vocab_size=300",
                         f"storage.uri={s3_uri}/store")
    manifest = prep.prepare_dataset(config)
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS)
    assert open_store(s3_uri).exists(f"store/datasets/{manifest.dataset_id}/manifest.json")
    first_id = manifest.dataset_id
    client.put_object(Bucket=s3_server.bucket, Key=f"{bucket_prefix}/corpus/c.jsonl",
                      Body=b'{"text": "one more"}\n')
    assert prep.plan_dataset(config).dataset_id != first_id


@pytest.mark.s3
def test_publishes_to_s3_and_finds_it_there_without_downloading(tmp_path, s3_uri, caplog):
    """The dataset in S3 and not here: a rerun of prepare reads its manifest in the bucket and
    downloads nothing; training reads the shards through the cache, the documents intact."""
    from storage.store import store_from_config
    from training.data import TokenStream

    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}", f"storage.uri={s3_uri}")
    manifest = prep.prepare_dataset(config)
    plan = prep.plan_dataset(config)
    shutil.rmtree(plan.dir)
    caplog.set_level(logging.DEBUG, logger=prep.__name__)  # the prepare flow says it at INFO
    assert prep.prepare_dataset(config) == manifest
    store = store_from_config(config.storage)
    assert f"dataset {manifest.dataset_id} is prepared in {store.url(plan.store_prefix)}" in caplog.text
    assert not plan.dir.exists()
    cache = prep.dataset_for_training(config, store)
    tokenizer = read_tokenizer(cache / manifest.tokenizer)
    texts = []
    for split in manifest.splits:
        stream = TokenStream(cache, manifest, split)
        tokens = stream.window(0, stream.n_tokens)
        ends = np.flatnonzero(tokens == manifest.eos_id)
        texts += [tokenizer.decode(doc.tolist()) for doc in np.split(tokens, ends + 1)[:-1]]
    assert sorted(texts) == sorted(DOCS)


def test_plain_errors_are_not_retried_as_if_transient():
    """Bad data and a full or read-only disk fail the task at once; a flaky network, a vanished
    object or anything unforeseen gets the retries."""
    import errno

    from prefect.states import Failed

    from tasks.retries import retry_if_transient

    def retried(error: BaseException) -> bool:
        return retry_if_transient(None, None, Failed(data=error))

    assert not retried(DataError("line 3 of x.jsonl is not JSON"))
    assert not retried(OSError(errno.ENOSPC, "No space left on device"))
    assert not retried(OSError(errno.EROFS, "Read-only file system"))
    assert not retried(PermissionError("upload of s3://b/k: no AWS credentials found"))
    assert retried(ConnectionError("s3 endpoint unreachable"))
    assert retried(FileNotFoundError(errno.ENOENT, "s3://b/x.jsonl vanished after it was listed"))
    assert retried(RuntimeError("unforeseen"))


def test_a_small_corpus_is_cut_into_enough_units_for_every_core():
    """Units follow from the listing alone (the dataset id must not depend on the machine):
    at most data.unit_bytes each, and a corpus of fewer than 32 such units is cut into 32,
    none below 16 MiB."""
    from goodput.data.sources import SourceFile

    def files(*sizes: int) -> list[SourceFile]:
        return [SourceFile(uri=f"/c/{i}.jsonl", size=n, version="1", format="json")
                for i, n in enumerate(sizes)]

    MiB = 2**20
    assert prep.unit_target_bytes(files(64 * MiB, 36 * MiB), 256 * MiB) == 16 * MiB
    assert prep.unit_target_bytes(files(*[1024 * MiB] * 2), 256 * MiB) == 64 * MiB
    assert prep.unit_target_bytes(files(*[1024 * MiB] * 100), 256 * MiB) == 256 * MiB
    assert prep.unit_target_bytes(files(64 * MiB), 1024) == 1024  # asked for: kept


_POOL_OF_UNITS_THAT_NEVER_END = """
import sys, threading, time
from multiprocessing import active_children, forkserver
from goodput.data.unit_processes import UnitProcesses

with UnitProcesses(2) as pool:
    for _ in range(2):  # units that work on for longer than any test
        threading.Thread(target=pool.run, args=(time.sleep, 600), daemon=True).start()
    while len(active_children()) < 2:
        time.sleep(0.05)
    print(forkserver._forkserver._forkserver_pid, *[p.pid for p in active_children()], flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Whether a process has ended (a zombie no one reaped has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_unit_pool_s_processes_die_with_a_flow_killed_outright():
    """`kill -9` (or the OOM killer) of `goodput prepare` left its pool's processes running
    forever, re-parented to PID 1 with ~500 MB each: now they end with it, and the fork
    server they were forked from after them."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    flow_process = subprocess.Popen([sys.executable, "-c", _POOL_OF_UNITS_THAT_NEVER_END], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        import select

        assert select.select([flow_process.stdout], [], [], 120)[0], "the pool did not start in 120 s"
        line = flow_process.stdout.readline()
        assert line, flow_process.stderr.read()[-3000:]
        workers = [int(pid) for pid in line.split()]  # the fork server, then the pool's two
        assert len(workers) == 3 and all(not _gone(pid) for pid in workers)
        flow_process.kill()  # SIGKILL: no handler, no exit code of its own runs
        flow_process.wait(10)
        wait_for(lambda: all(_gone(pid) for pid in workers), 5, "pool processes gone", every_s=0.2)
    finally:
        flow_process.kill()
        for pid in workers:  # a failed run leaves none behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_unit_processes_run_the_library_where_it_was_called_from_and_log_here(tmp_path, monkeypatch, caplog):
    """The pool's processes come from a fork server started earlier, maybe by another flow in
    another directory: a unit runs with the environment and directory of the pool's owner at
    the pool's start, its records come back to the caller's loggers, its errors as they were."""
    import multiprocessing

    from goodput.data.unit_processes import UnitProcesses, UnitTraceback, warm_up

    warm_up()  # before the directory and the environment change
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "loaded-from-a-block")
    with UnitProcesses(2) as pool, caplog.at_level(logging.INFO, logger="goodput"):
        assert pool.run(os.getpid) in {p.pid for p in multiprocessing.active_children()}
        assert pool.run(os.getcwd) == str(tmp_path)
        assert pool.run(os.getenv, "AWS_ACCESS_KEY_ID") == "loaded-from-a-block"
        assert pool.run(os.getenv, "TOKENIZERS_PARALLELISM") == "false"  # one core each
        pool.run(logging.getLogger("goodput.data.sources").warning, "skipping %d bad records", 3)
        assert ("goodput.data.sources", logging.WARNING, "skipping 3 bad records") in caplog.record_tuples
        with pytest.raises(ValueError, match="invalid literal") as raised:
            pool.run(int, "x")
        assert isinstance(raised.value.__cause__, UnitTraceback)
        assert "invalid literal" in str(raised.value.__cause__)  # its process's traceback


_A_DEPLOYMENT_S_MAIN = """
import prefect.engine  # a deployment's flow run is `python -m prefect.engine`
from goodput.data.unit_processes import UnitProcesses
from tests.helpers import imported_here

if __name__ == "__main__":
    with UnitProcesses(1) as pool:
        print(pool.run(imported_here, "prefect"), pool.run(imported_here, "goodput.data.prepare"))
"""


def test_unit_processes_import_the_library_not_the_caller_s_main(tmp_path):
    """multiprocessing has a new process import its caller's __main__ first; in a deployment's
    flow run that is Prefect (seconds per process). A unit process leaves it out."""
    import subprocess
    import sys

    from tests.helpers import REPO

    (tmp_path / "deployment_main.py").write_text(_A_DEPLOYMENT_S_MAIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "deployment_main"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]


def _unit_in_flight(pool, tmp_path: Path, name: str) -> tuple[list, object]:
    """A unit that reads a FIFO no one writes: it is in flight once the FIFO has a reader (the
    unit's process, blocked in it). Returns what its run raised (filled in once it ends) and
    the FIFO's write end, to close when done."""
    import threading
    import time

    fifo = tmp_path / name
    os.mkfifo(fifo)
    outcome = []

    def run():
        try:
            pool.run(Path.read_bytes, fifo)
        except Exception as e:
            outcome.append(e)

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 30
    while True:  # opening a FIFO's write end without blocking succeeds once a reader has it
        try:
            return outcome, os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            assert time.monotonic() < deadline, f"{name}: no unit process read it in 30 s"
            time.sleep(0.05)


def test_a_unit_whose_process_dies_fails_alone_and_its_retry_runs_in_a_new_process(tmp_path):
    """A unit's process killed (the OOM killer) fails that unit, retried like any transient
    failure, in a new process; the others run on (concurrent.futures' pool failed every unit
    in flight, and Prefect's stayed broken for every unit after). Units stopped on purpose
    (Ctrl-C: stop_units) fail without a retry, in flight or not started."""
    import multiprocessing
    import signal
    import time
    from types import SimpleNamespace

    from goodput.data.unit_processes import UnitProcessDied, UnitProcesses, UnitsStopped, stop_units
    from tasks.retries import retry_if_transient

    def failed_with(error: BaseException) -> SimpleNamespace:
        def result():
            raise error
        return SimpleNamespace(result=result)

    others = {p.pid for p in multiprocessing.active_children()}
    writers = []
    try:
        with UnitProcesses(3) as pool:
            (first, w1), (second, w2) = (_unit_in_flight(pool, tmp_path, n) for n in ("a", "b"))
            writers += [w1, w2]
            ours = [p.pid for p in multiprocessing.active_children() if p.pid not in others]
            assert len(ours) == 2
            os.kill(ours[0], signal.SIGKILL)
            [died] = wait_for(lambda: first + second, 30, "a unit failed", every_s=0.05)
            assert isinstance(died, UnitProcessDied), died
            assert "was killed by SIGKILL (the OOM killer?)" in str(died) and "prepare.workers" in str(died)
            assert retry_if_transient(None, None, failed_with(died))
            assert pool.run(os.getpid) not in ours  # the retry's new process
            time.sleep(0.5)
            assert len(first + second) == 1  # the other unit runs on

            stop_units()
            [stopped] = wait_for(lambda: [e for e in first + second if e is not died], 30,
                                 "the other unit stopped", every_s=0.05)
            assert isinstance(stopped, UnitsStopped), stopped
            assert not retry_if_transient(None, None, failed_with(stopped))
            with pytest.raises(UnitsStopped):  # and none starts after it
                pool.run(os.getpid)
    finally:
        for writer in writers:
            os.close(writer)


def test_units_stop_even_after_the_fork_server_died_and_bad_arguments_are_an_error(tmp_path):
    """multiprocessing learns a unit process's end through the fork server, and took every
    one for ended once that server died: Ctrl-C then left the units running (minutes). An
    argument the process cannot rebuild is the unit's error, not its process's death."""
    import multiprocessing
    import signal
    from multiprocessing import forkserver

    from goodput.data.unit_processes import UnitProcesses, UnitsStopped
    from tests.helpers import RebuiltNowhereElse

    writers = []
    try:
        with UnitProcesses(2) as pool:
            first_pid = pool.run(os.getpid)
            with pytest.raises(RuntimeError, match="cannot be rebuilt in another process"):
                pool.run(str, RebuiltNowhereElse())
            assert pool.run(os.getpid) == first_pid  # the same process serves on

            stopped, writer = _unit_in_flight(pool, tmp_path, "a")
            writers.append(writer)
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
            pool.stop()
            [error] = wait_for(lambda: stopped, 30, "the unit stopped", every_s=0.05)
            assert isinstance(error, UnitsStopped), error
        assert not multiprocessing.active_children() or all(
            not p.name.startswith("goodput-unit-process") for p in multiprocessing.active_children())
    finally:
        for writer in writers:
            os.close(writer)
    with UnitProcesses(1) as pool:  # a new fork server serves the next pool
        assert pool.run(os.getpid) != first_pid


def test_the_install_hints_for_extras_name_this_checkout_not_a_package_on_pypi():
    """`pip install 'goodput[ray]'` installs someone else's "goodput" from PyPI."""
    from tests.helpers import REPO

    readme = (REPO / "README.md").read_text()
    assert "goodput[" not in readme
    assert "pip install -e '.[ray]'" in readme and "pip install -e '.[tracking]'" in readme
    for path in ("tasks/prepare.py", "core/config.py"):
        source = (REPO / path).read_text()
        assert "goodput[" not in source, path


def test_two_prepares_of_one_dataset_at_once_tokenize_it_once(tmp_path, monkeypatch, caplog):
    """A second prepare of a dataset being prepared waits for the first (the dataset's lock in
    data.data_dir), then finds it prepared: eight pipelines triggered together each tokenized
    the whole corpus."""
    import threading
    import time

    config = make_config(tmp_path)
    tokenized = []
    tokenize_unit = prep.tokenize_unit

    def slow_tokenize_unit(*args, **kwargs):
        tokenized.append(args[1])
        time.sleep(0.5)  # the second prepare starts while the first tokenizes
        return tokenize_unit(*args, **kwargs)

    monkeypatch.setattr(prep, "tokenize_unit", slow_tokenize_unit)
    manifests = []
    with caplog.at_level(logging.INFO, logger="goodput.data.prepare"):
        first = threading.Thread(target=lambda: manifests.append(prep.prepare_dataset(config)))
        first.start()
        wait_for(lambda: tokenized, 60, "a unit tokenized", every_s=0.05)
        manifests.append(prep.prepare_dataset(config))
        first.join()
    units = prep.plan_units(prep.plan_dataset(config), config)
    assert len(tokenized) == len(units)  # once, by the first
    assert manifests[0] == manifests[1]
    # The waiting one says who holds the dataset (written into the lock by its holder).
    assert f"is being prepared by process {os.getpid()} on {socket.gethostname()}, since " in caplog.text


def test_a_prepare_waiting_behind_another_says_so_again_while_it_waits(tmp_path):
    """A prepare that hangs (a dead Ray cluster) holds its dataset's lock without end; the one
    waiting behind it says again, every remind_s, whom it waits for and what to do."""
    import subprocess
    import sys

    from core.files import exclusive_lock

    lock = tmp_path / ".d.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from core.files import exclusive_lock\n"
        f"with exclusive_lock({str(lock)!r}, holder=lambda: 'process 42 on elsewhere'):\n"
        "    print('held', flush=True); time.sleep(2.5)")], cwd=Path(__file__).parents[1],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        said = []
        with exclusive_lock(lock, on_wait=lambda waited, who: said.append((round(waited), who)),
                            holder=lambda: "me", remind_s=1.0):
            assert lock.read_text() == "me"
        assert said[0] == (0, "process 42 on elsewhere") and len(said) >= 2
        assert all(who == "process 42 on elsewhere" for _, who in said)
    finally:
        holder.kill()
        holder.wait()


def test_an_unreadable_dataset_manifest_is_said_in_one_line(tmp_path, caplog):
    """An empty manifest.json: one line naming it and what happens next, not pydantic's
    report with its URL, nor "preparing the dataset again" where the store's copy serves."""
    (tmp_path / "manifest.json").write_text("")
    with caplog.at_level(logging.WARNING, logger="goodput.data.prepare"):
        assert prep._verified_manifest(tmp_path) is None
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"{tmp_path / 'manifest.json'} is unreadable (") and "\n" not in said
    assert "pydantic.dev" not in said and "read from the store" in said
    assert not (tmp_path / "manifest.json").exists()
