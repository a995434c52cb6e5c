"""The prepare stage: text source -> tokenizer -> token shards -> manifest -> object store.

Each step is a plain function the Prefect tasks in `tasks/prepare.py` wrap one to one;
`prepare_dataset` runs them in order without Prefect.

A dataset is named by its content: `dataset_id` hashes the source's content, the tokenizer
settings and the preparation parameters. Its directory `<data.data_dir>/<dataset_id>/`
holds the shards, tokenizer.json and, written last, manifest.json, whose presence (with
checksums that verify) means the dataset is complete. The same files live in the store
under `datasets/<dataset_id>/`. So preparing twice with the same inputs finds the first
result and does nothing, on this machine or any other that sees the store; and a run that
crashed half way stages the texts again but keeps its tokenizer and finished shards.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from pydantic import BaseModel

from core.config import RunConfig
from core.errors import ConfigError, DataError
from core.files import canonical_json, sha256_bytes, sha256_file, write_atomic
from goodput.data.corpus import describe_source, load_documents, source_fingerprint, split_documents
from storage.manifests import DATASET_MANIFEST, DatasetManifest, ShardInfo
from storage.shards import read_metadata, shard_size, token_dtype, write_shard
from storage.store import Store, store_from_config
from training.tokenizer import eos_id, load_tokenizer, train_tokenizer

log = logging.getLogger(__name__)

PREPARE_VERSION = 1  # bump when the same inputs would give different shards
SPLITS = ("train", "validation")
TOKENIZER_FILE = "tokenizer.json"
_ENCODE_BATCH_DOCS = 1024  # documents per encode_batch call: bounds the Encoding objects alive


class DatasetPlan(BaseModel):
    """What to prepare and where it goes; everything after planning follows from it."""

    dataset_id: str
    source: str  # one line for humans
    local_dir: str
    store_prefix: str
    num_shards: int  # train shards asked for (fewer if there are fewer documents)

    @property
    def dir(self) -> Path:
        return Path(self.local_dir)

    @property
    def staging_dir(self) -> Path:
        return self.dir / "staging"

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER_FILE

    def staged_texts(self, split: str) -> Path:
        return self.staging_dir / f"{split}.arrow"


class CorpusInfo(BaseModel):
    """Documents per split, staged as Arrow files of text under the plan's staging dir."""

    n_docs: dict[str, int]


class ShardSpec(BaseModel):
    """One shard to tokenize: documents [start, stop) of a split's staged texts."""

    split: str
    index: int
    start: int
    stop: int

    @property
    def filename(self) -> str:
        return f"{self.split}-{self.index:05d}.arrow"


# -- planning -------------------------------------------------------------------------------

def sources_dir(config: RunConfig) -> Path:
    """Where loading keeps what it derives from sources: builtin corpus, `datasets` cache."""
    return Path(config.data.data_dir) / "sources"


def plan_dataset(config: RunConfig) -> DatasetPlan:
    """Name the dataset by its inputs' content and place it locally and in the store."""
    data, tok = config.data, config.tokenizer
    if tok.path is not None and not Path(tok.path).is_file():
        raise DataError(f"tokenizer.path={tok.path} is not a file; point it at a tokenizer.json "
                        "or leave it unset to train one")
    inputs = {
        "source": source_fingerprint(data, sources_dir(config)),
        "tokenizer": {"sha256": sha256_file(tok.path)} if tok.path else
        {"vocab_size": tok.vocab_size, "min_frequency": tok.min_frequency},
        "prep": {"num_shards": data.num_shards, "validation_fraction": data.validation_fraction,
                 "max_docs": data.max_docs, "text_column": data.text_column,
                 "format": data.format, "version": PREPARE_VERSION},
    }
    dataset_id = sha256_bytes(canonical_json(inputs))[:16]
    return DatasetPlan(dataset_id=dataset_id, source=describe_source(data),
                       local_dir=str(Path(data.data_dir) / dataset_id),
                       store_prefix=f"datasets/{dataset_id}", num_shards=data.num_shards)


# -- reuse ----------------------------------------------------------------------------------

def find_prepared(plan: DatasetPlan, store: Store) -> DatasetManifest | None:
    """The complete dataset of `plan`, found locally or restored from the store; else None."""
    manifest = _verified_manifest(plan.dir)
    if manifest is not None:
        log.info("dataset %s is prepared in %s", plan.dataset_id, plan.dir)
        return manifest
    if not store.exists(f"{plan.store_prefix}/{DATASET_MANIFEST}"):
        return None
    log.info("restoring dataset %s from %s", plan.dataset_id, store.url(plan.store_prefix))
    store.download_dir(plan.store_prefix, plan.dir)
    return _verified_manifest(plan.dir)


def require_prepared(plan: DatasetPlan, store: Store) -> DatasetManifest:
    """For training and evaluation: the prepared dataset of `plan` (local, or restored from
    the store), or a ConfigError that says whether it was never prepared or is damaged."""
    had_manifest = (plan.dir / DATASET_MANIFEST).is_file()
    manifest = find_prepared(plan, store)
    if manifest is None:
        state = ("is damaged: its files no longer match its manifest (the log names them)"
                 if had_manifest else "is not prepared")
        raise ConfigError(f"dataset {plan.dataset_id} of this config {state}; run `goodput "
                          "prepare` (or the pipeline) first")
    return manifest


def _verified_manifest(directory: Path) -> DatasetManifest | None:
    """The manifest in `directory` if every file it lists checks out.

    A damaged dataset loses its manifest and its damaged files, so the steps that make
    them run again while the intact files are kept.
    """
    if not (directory / DATASET_MANIFEST).is_file():
        return None
    try:
        manifest = DatasetManifest.load(directory)
    except ValueError as e:
        log.warning("%s is unreadable (%s); preparing the dataset again", directory / DATASET_MANIFEST, e)
        (directory / DATASET_MANIFEST).unlink()
        return None
    expected = {manifest.tokenizer: manifest.tokenizer_sha256}
    expected |= {shard.path: shard.sha256 for shards in manifest.splits.values() for shard in shards}
    damaged = [rel for rel, sha256 in expected.items()
               if not (directory / rel).is_file() or sha256_file(directory / rel) != sha256]
    if not damaged:
        return manifest
    log.warning("dataset in %s is damaged (%s); preparing those files again", directory, ", ".join(damaged))
    (directory / DATASET_MANIFEST).unlink()
    for rel in damaged:
        (directory / rel).unlink(missing_ok=True)
    return None


# -- corpus ---------------------------------------------------------------------------------

def stage_corpus(plan: DatasetPlan, config: RunConfig) -> CorpusInfo:
    """Load, cap at data.max_docs, split, and stage each split's texts as an Arrow file.

    Shard tasks memory-map the staged file and read only their slice of documents.
    """
    docs = load_documents(config.data, sources_dir(config))
    if config.data.max_docs is not None and config.data.max_docs < len(docs):
        docs = docs.select(range(config.data.max_docs))
    splits = dict(zip(SPLITS, split_documents(docs, config.data.validation_fraction)))
    plan.staging_dir.mkdir(parents=True, exist_ok=True)
    for split, ds in splits.items():
        _write_texts(ds, plan.staged_texts(split))
    return CorpusInfo(n_docs={split: len(ds) for split, ds in splits.items()})


def _write_texts(ds: datasets.Dataset, path: Path) -> None:
    # large_string: 64-bit offsets, so a split may hold more than 2 GiB of text.
    schema = pa.schema([("text", pa.large_string())])
    tmp = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for table in ds.with_format("arrow").iter(batch_size=10_000):
            writer.write_table(table.select(["text"]).cast(schema))
    os.replace(tmp, path)


def _read_texts(path: Path, start: int, stop: int) -> list[str]:
    """Documents [start, stop) of a staged split; only their pages of the file are read."""
    table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    return table.column("text").slice(start, stop - start).to_pylist()


def _iter_texts(path: Path) -> Iterator[str]:
    """Every document of a staged split, one record batch in memory at a time."""
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    for i in range(reader.num_record_batches):
        yield from reader.get_batch(i).column("text").to_pylist()


# -- tokenizer ------------------------------------------------------------------------------

def build_tokenizer(plan: DatasetPlan, config: RunConfig) -> str:
    """tokenizer.json in the dataset dir: trained on the train split, or the one given.

    An existing one is kept: shards already written by a crashed run used it.
    """
    path = plan.tokenizer_path
    if path.is_file():
        return str(path)
    if config.tokenizer.path is not None:
        load_tokenizer(config.tokenizer.path)  # validate before adopting it
        write_atomic(path, Path(config.tokenizer.path).read_bytes())
        return str(path)
    start = time.perf_counter()
    tokenizer = train_tokenizer(_iter_texts(plan.staged_texts("train")),
                                config.tokenizer.vocab_size, config.tokenizer.min_frequency)
    log.info("trained a %d-token BPE in %.1fs", tokenizer.get_vocab_size(), time.perf_counter() - start)
    write_atomic(path, tokenizer.to_str().encode())
    return str(path)


# -- shards ---------------------------------------------------------------------------------

def shard_specs(plan: DatasetPlan, corpus: CorpusInfo) -> list[ShardSpec]:
    """Train into `num_shards` shards; validation into shards no larger on average."""
    n_train = corpus.n_docs["train"]
    train_shards = min(plan.num_shards, n_train)
    validation_shards = math.ceil(corpus.n_docs["validation"] * train_shards / n_train)
    specs = []
    for split, n_shards in (("train", train_shards), ("validation", validation_shards)):
        n_docs = corpus.n_docs[split]
        bounds = [round(i * n_docs / n_shards) for i in range(n_shards + 1)]
        specs += [ShardSpec(split=split, index=i, start=bounds[i], stop=bounds[i + 1])
                  for i in range(n_shards)]
    return specs


def tokenize_shard(plan: DatasetPlan, spec: ShardSpec) -> ShardInfo:
    """Encode the spec's documents, each followed by EOS, into one token shard.

    A shard already written from the same documents with the same tokenizer is kept.
    """
    path = plan.dir / spec.filename
    made_from = {"tokenizer_sha256": sha256_file(plan.tokenizer_path),
                 "documents": f"{spec.split}[{spec.start}:{spec.stop}]"}
    if _written_from(path) != made_from:
        tokenizer = load_tokenizer(plan.tokenizer_path)
        eos, dtype = eos_id(tokenizer), token_dtype(tokenizer.get_vocab_size())
        texts = _read_texts(plan.staged_texts(spec.split), spec.start, spec.stop)
        docs = []
        for i in range(0, len(texts), _ENCODE_BATCH_DOCS):
            # add_special_tokens=False: no BOS/EOS templates a given tokenizer may carry;
            # the shard format puts exactly one EOS after each document.
            encodings = tokenizer.encode_batch(texts[i:i + _ENCODE_BATCH_DOCS], add_special_tokens=False)
            docs += [np.array(encoding.ids + [eos], dtype=dtype) for encoding in encodings]
        write_shard(path, docs, dtype, metadata=made_from)
    n_tokens, n_docs = shard_size(path)
    return ShardInfo(path=spec.filename, n_tokens=n_tokens, n_docs=n_docs,
                     size=path.stat().st_size, sha256=sha256_file(path))


def _written_from(path: Path) -> dict[str, str]:
    """What an existing shard says it was made from; empty if it is missing or unreadable."""
    try:
        return read_metadata(path)
    except (FileNotFoundError, pa.ArrowInvalid):
        return {}


# -- manifest and publishing ----------------------------------------------------------------

def write_manifest(plan: DatasetPlan, shard_infos: list[ShardInfo], tokenizer_path: str,
                   ) -> DatasetManifest:
    """Seal the dataset: drop what it does not list (staged texts), then write the manifest."""
    tokenizer = load_tokenizer(tokenizer_path)
    splits: dict[str, list[ShardInfo]] = {split: [] for split in SPLITS}
    for info in sorted(shard_infos, key=lambda info: info.path):
        splits[info.path.rsplit("-", 1)[0]].append(info)
    manifest = DatasetManifest(
        dataset_id=plan.dataset_id,
        source=plan.source,
        tokenizer=Path(tokenizer_path).name,
        tokenizer_sha256=sha256_file(tokenizer_path),
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos_id(tokenizer),
        dtype=token_dtype(tokenizer.get_vocab_size()),
        splits=splits,
        created_at=time.time(),
    )
    _remove_unlisted(plan.dir, {manifest.tokenizer} | {info.path for info in shard_infos})
    manifest.save(plan.dir)
    return manifest


def _remove_unlisted(directory: Path, keep: set[str]) -> None:
    # The dataset dir ends up holding exactly what the manifest lists, so it can be uploaded
    # as it is: no staged texts, no temporary files of crashed writes.
    for path in directory.iterdir():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def publish(plan: DatasetPlan, manifest: DatasetManifest, store: Store) -> None:
    """Upload the dataset dir to `datasets/<dataset_id>/`, manifest last.

    Nothing is sent when the store already holds this very manifest: it is uploaded last,
    so everything it lists is there already.
    """
    key = f"{plan.store_prefix}/{DATASET_MANIFEST}"
    local_manifest = (plan.dir / DATASET_MANIFEST).read_bytes()
    if store.exists(key) and store.get_bytes(key) == local_manifest:
        return
    # The manifest's digests spare a hashing pass over every shard; the upload checks them.
    known = {shard.path: shard.sha256 for shards in manifest.splits.values() for shard in shards}
    if manifest.tokenizer_sha256:
        known[manifest.tokenizer] = manifest.tokenizer_sha256
    store.upload_dir(plan.dir, plan.store_prefix, last=(DATASET_MANIFEST,), known_sha256=known)
    log.info("published dataset %s to %s (%d train tokens)", manifest.dataset_id,
             store.url(plan.store_prefix), manifest.n_tokens("train"))


# -- the whole stage ------------------------------------------------------------------------

def prepare_dataset(config: RunConfig) -> DatasetManifest:
    """Prepare (or find) the dataset `config` describes, without Prefect."""
    plan = plan_dataset(config)
    store = store_from_config(config.storage)
    manifest = find_prepared(plan, store)
    if manifest is None:
        corpus = stage_corpus(plan, config)
        tokenizer_path = build_tokenizer(plan, config)
        shards = [tokenize_shard(plan, spec) for spec in shard_specs(plan, corpus)]
        manifest = write_manifest(plan, shards, tokenizer_path)
    publish(plan, manifest, store)
    return manifest
