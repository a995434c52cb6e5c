"""The prepare stage on real files, real tokenizers and real datasets (no mocks)."""

from __future__ import annotations

import gc
import json
import shutil
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
from goodput.data.corpus import load_documents, resolve_files, split_documents
from storage.manifests import DatasetManifest
from storage.shards import read_documents, read_tokens, shard_size, token_dtype, write_shard
from tests.helpers import flip_bytes
from training.tokenizer import load_tokenizer, train_tokenizer


def make_config(root: Path, *overrides: str) -> RunConfig:
    return load_config(None, [
        f"data.data_dir={root / 'data'}", f"storage.uri={root / 'store'}",
        "data.max_docs=300", "data.num_shards=2", "tokenizer.vocab_size=512", *overrides])


def decoded_splits(config: RunConfig, manifest: DatasetManifest) -> dict[str, list[str]]:
    """Every document of every shard, decoded, checking that each ends with one EOS."""
    directory = prep.plan_dataset(config).dir
    tokenizer = load_tokenizer(directory / manifest.tokenizer)
    texts = {}
    for split, shards in manifest.splits.items():
        texts[split] = []
        for shard in shards:
            for doc in read_documents(directory / shard.path):
                assert doc.dtype == manifest.dtype and doc[-1] == manifest.eos_id
                assert manifest.eos_id not in doc[:-1]
                texts[split].append(tokenizer.decode(doc[:-1].tolist()))
    return texts


def source_splits(config: RunConfig) -> dict[str, list[str]]:
    """The documents as the corpus module reads and splits them, for comparison."""
    docs = load_documents(config.data, prep.sources_dir(config))
    docs = docs.select(range(min(len(docs), config.data.max_docs or len(docs))))
    train, validation = split_documents(docs, config.data.validation_fraction)
    return {"train": train["text"], "validation": validation["text"]}


def file_times(*roots: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for root in roots for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """The builtin corpus (300 documents) prepared once by the library: (config, manifest)."""
    config = make_config(tmp_path_factory.mktemp("builtin"))
    return config, prep.prepare_dataset(config)


# -- shard format ---------------------------------------------------------------------------

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


# -- the builtin corpus, end to end ---------------------------------------------------------

def test_shards_decode_to_the_original_documents(builtin):
    config, manifest = builtin
    assert decoded_splits(config, manifest) == source_splits(config)
    assert sum(s.n_docs for shards in manifest.splits.values() for s in shards) == 300
    assert len(manifest.splits["train"]) == 2 and len(manifest.splits["validation"]) == 1
    assert manifest.vocab_size == 512 and manifest.dtype == "uint16" and manifest.eos_id == 0


def test_manifest_checksums_match_local_and_stored_files(builtin):
    config, manifest = builtin
    local = prep.plan_dataset(config).dir
    stored = Path(config.storage.uri) / "datasets" / manifest.dataset_id
    for directory in (local, stored):
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            ["manifest.json", "tokenizer.json", "train-00000.arrow", "train-00001.arrow",
             "validation-00000.arrow"])
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


def test_lost_local_copy_is_restored_from_the_store(builtin):
    config, manifest = builtin
    local = prep.plan_dataset(config).dir
    shutil.rmtree(local)
    # Equal down to created_at: the stored manifest came back, none was written anew (a
    # rebuild writes its manifest after tokenizing).
    assert prep.prepare_dataset(config) == manifest
    assert DatasetManifest.load(local) == manifest


def test_damaged_local_shard_is_replaced(builtin):
    config, manifest = builtin
    shard = prep.plan_dataset(config).dir / manifest.splits["train"][1].path
    flip_bytes(shard)
    assert prep.prepare_dataset(config) == manifest
    assert sha256_file(shard) == manifest.splits["train"][1].sha256


def test_training_is_told_whether_a_dataset_was_never_prepared_or_is_damaged(tmp_path):
    """What train and evaluate ask (require_prepared): a missing dataset and a damaged one
    (with no store copy to restore) are configuration errors that say which, never retried."""
    from core.config import ConfigError
    from storage.store import store_from_config

    config = make_config(tmp_path)
    plan, store = prep.plan_dataset(config), store_from_config(config.storage)
    with pytest.raises(ConfigError, match="is not prepared; run `goodput prepare`"):
        prep.require_prepared(plan, store)
    manifest = prep.prepare_dataset(config)
    assert prep.require_prepared(plan, store) == manifest
    shutil.rmtree(config.storage.uri)  # no copy in the store to restore from
    flip_bytes(plan.dir / manifest.splits["train"][0].path)
    with pytest.raises(ConfigError, match="is damaged: its files no longer match its manifest"):
        prep.require_prepared(plan, store)


def test_rerun_after_a_crash_keeps_finished_shards(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}", "tokenizer.vocab_size=300")
    plan = prep.plan_dataset(config)
    corpus = prep.stage_corpus(plan, config)
    prep.build_tokenizer(plan, config)
    finished = prep.tokenize_shard(plan, prep.shard_specs(plan, corpus)[0])
    written_at = (plan.dir / finished.path).stat().st_mtime_ns
    # ...the run dies here; the next one finds the tokenizer and the first shard done.
    manifest = prep.prepare_dataset(config)
    assert manifest.splits["train"][0] == finished
    assert (plan.dir / finished.path).stat().st_mtime_ns == written_at
    assert not plan.staging_dir.exists()


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


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet", "txt"])
def test_local_files_round_trip(tmp_path, fmt):
    docs = [d + "\nsecond line" if fmt != "txt" else d for d in DOCS]
    column = "content" if fmt == "parquet" else "text"
    source = write_source(tmp_path / "in", fmt, docs, column)
    config = make_config(tmp_path, f"data.source={source}", f"data.text_column={column}",
                         "tokenizer.vocab_size=300", "data.validation_fraction=0.1")
    manifest = prep.prepare_dataset(config)
    decoded = decoded_splits(config, manifest)
    assert len(decoded["validation"]) == 6
    assert sorted(decoded["train"] + decoded["validation"]) == sorted(docs)


def test_directories_globs_and_lists_resolve_to_sorted_files(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", ".hidden.jsonl", "notes.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    found = [tmp_path / n for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    assert resolve_files(str(tmp_path)) == found
    assert resolve_files(f"{tmp_path}/**/*.jsonl") == found
    assert resolve_files(f"{tmp_path}/b.jsonl, {tmp_path}/sub") == found[1:]
    assert resolve_files("HuggingFaceFW/fineweb") is None  # a hub name


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


# -- errors the user can fix ----------------------------------------------------------------

def prepare_error(config: RunConfig) -> str:
    with pytest.raises(DataError) as info:
        prep.prepare_dataset(config)
    return str(info.value)


def test_empty_corpus_is_an_error(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", ["", "   ", "\n\t"])
    assert "holds no text" in prepare_error(make_config(tmp_path, f"data.source={source}"))


def test_missing_text_column_names_the_columns_there(tmp_path):
    source = write_source(tmp_path / "in", "jsonl", DOCS, column="body")
    message = prepare_error(make_config(tmp_path, f"data.source={source}"))
    assert "no column 'text'" in message and "['body', 'id']" in message
    assert "data.text_column=" in message


def test_unreadable_file_is_named(tmp_path):
    good = write_source(tmp_path / "in", "jsonl", DOCS)
    bad = tmp_path / "in" / "zbad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops\n')
    message = prepare_error(make_config(tmp_path, f"data.source={good},{bad}"))
    assert f"cannot read {bad} as json" in message
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    assert f"cannot read {corrupt} as parquet" in prepare_error(
        make_config(tmp_path, f"data.source={corrupt}"))


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


def test_prefect_flow_fails_bad_input_without_retries(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.prepare import prepare

    source = write_source(tmp_path / "in", "jsonl", DOCS, column="body")
    state = prepare(make_config(tmp_path, f"data.source={source}"), return_state=True)
    assert state.is_failed()
    with pytest.raises(DataError, match="no column 'text'"):
        state.result()
    import time

    deadline = time.monotonic() + 30  # task states reach the server in the background
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        stage = [run for run in runs if run.name.startswith("stage-corpus")]
        if (stage and stage[0].state.is_final()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(stage) == 1 and stage[0].run_count == 1 and stage[0].state.is_failed()


# -- an S3 store ----------------------------------------------------------------------------

@pytest.mark.s3
def test_publishes_to_and_restores_from_s3(tmp_path, s3_uri):
    source = write_source(tmp_path / "in", "jsonl", DOCS)
    config = make_config(tmp_path, f"data.source={source}", f"storage.uri={s3_uri}")
    manifest = prep.prepare_dataset(config)
    shutil.rmtree(prep.plan_dataset(config).dir)
    assert prep.prepare_dataset(config) == manifest
    assert sorted(sum(decoded_splits(config, manifest).values(), [])) == sorted(DOCS)
