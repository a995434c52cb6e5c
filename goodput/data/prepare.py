"""The prepare stage: sources -> work units -> token shards -> manifest -> object store.

Each step is a plain function the Prefect tasks in `tasks/prepare.py` wrap one to one;
`prepare_dataset` runs them in order without Prefect.

A dataset is named by its inputs: `dataset_id` hashes the source *listing* (each file's path,
size and modification time; ETag on S3; revision on the hub; or, with
`data.fingerprint=content`, every byte), the tokenizer settings and the preparation settings.
Nothing is staged: each work unit (a group of files, a byte range of a large file, parquet
row groups, hub shards) streams its documents through the tokenizer in bounded batches and
writes fixed-size token shards as it goes, then records itself as done
(`units/unit-NNNNN.json`), so a rerun redoes only unfinished units. Each document goes to
train or validation by a hash of its text. The dataset directory
`<data.data_dir>/<dataset_id>/` ends up holding the shards, tokenizer.json and, written
last, manifest.json, whose presence means the dataset is complete. The same files go to the
store under `datasets/<dataset_id>/`, with a pointer from the data settings to the id
(`datasets/by-settings/`), so training and evaluation find the dataset when the raw sources
are gone.

Units that run on other machines (a Ray cluster) share no disk with this one: they write
straight to the store (`to_store`), recording themselves done there, and the manifest is
sealed there; nothing of the dataset stays on this machine.

A mixture (data.sources) is a dataset per source, each prepared as above and reused by every
mix that lists it; they share one tokenizer (`mix_plans`). Training reads a mixture.json that
names where each source's dataset is (`dataset_for_training`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field, ValidationError, computed_field, model_validator
from tokenizers import Tokenizer

from core.config import SINGLE_SOURCE, DataConfig, RunConfig, SourceConfig, StorageConfig, parse_bytes
from core.errors import ConfigError, DataError
from core.files import canonical_json, exclusive_lock, sha256_bytes, sha256_file, write_atomic
from core.hf_llama import given_tokenizer_file
from goodput.data.corpus import BUILTIN, build_builtin_corpus, builtin_description
from goodput.data.sources import (
    Piece,
    SourceFile,
    SourcesNotHere,
    absolute_source,
    content_fingerprint,
    fingerprint,
    list_source,
    read_documents,
    split_into_pieces,
)
from goodput.runs import update_summary
from storage.manifests import DATASET_MANIFEST, DatasetManifest, MixSource, MixtureManifest, ShardInfo
from storage.shards import ShardWriter, token_dtype
from storage.store import Store, store_from_config, usable_anywhere
from training.shard_cache import check_cache_limit, write_cache_settings
from training.tokenizer import (HF_TOKENIZER_SIDE_FILES, document_prefix, eos_id, load_tokenizer,
                                read_tokenizer, stated_eos_token, tokenizer_side_files,
                                train_tokenizer)

log = logging.getLogger(__name__)

PREPARE_VERSION = 3  # bump when the same inputs would give different shards
SPLITS = ("train", "validation")
TOKENIZER_FILE = "tokenizer.json"
UNITS_DIR = "units"
BY_SETTINGS = "by-settings"
CACHE_DIR = "cache"  # <data_dir>/cache/<dataset_id>: shards read from the store for training
MIXES_DIR = "mixes"  # <data_dir>/mixes/<mix id>/mixture.json: where a mix's sources are read
# Text per encode_batch call. With one shard, all a unit holds; the batch's encodings (tens of
# bytes a token while they live) are most of it: 4 MiB cost a unit process 58 MiB more at
# its peak than 1 MiB, for the same speed (benchmarks/RESULTS.md, session 33).
_BATCH_BYTES = 2**20
_SAMPLE_UNITS = 64  # the tokenizer's sample comes from at most this many units, spread out
_UNITS_AT_LEAST, _MIN_UNIT_BYTES = 32, 16 * 2**20  # see unit_target_bytes
_SPLIT_KEY = b"goodput-split-v1"


class DatasetPlan(BaseModel):
    """What to prepare and where it goes; everything after planning follows from it."""

    dataset_id: str
    source: str  # one line for humans
    listed_from: str = ""  # data.source with its local paths absolute (absolute_source)
    local_dir: str
    store_prefix: str
    settings_key: str  # names the data settings, whatever the files hold: the pointer's key
    # The listing (empty when found through the pointer). Left out of the plan's JSON form,
    # which is what Prefect records of a flow run's parameters: it refuses more than 512 KiB,
    # a listing of about 2,500 files. n_files stands for it there.
    files: list[SourceFile] = Field(default=[], exclude=True)
    tokenizer_from: str | None = None  # a mix's later source: the first source's dataset id
    field_prefix: str = "data"  # how errors name the source's fields (DataConfig.field_prefix)
    # A given tokenizer's end-of-document token (given_eos_token); None: the first of
    # EOS_CANDIDATES it has. Set where the plan comes from the listing, as prepare's does.
    eos_token: str | None = None

    @computed_field
    @property
    def n_files(self) -> int:
        return len(self.files)

    @model_validator(mode="before")
    @classmethod
    def _not_from_its_json(cls, data):
        """A plan's JSON form stands for its listing with n_files: read back, it would be a
        plan of no files."""
        if isinstance(data, dict) and data.get("n_files") and not data.get("files"):
            raise ValueError("a plan's JSON form leaves the listing out (n_files stands for it): "
                             "it cannot be read back as a plan; plan the dataset again")
        return data

    @property
    def dir(self) -> Path:
        return Path(self.local_dir)

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER_FILE

    def without_listing(self) -> DatasetPlan:
        """The plan a work unit needs: its own pieces come with it, the listing would not."""
        return self.model_copy(update={"files": []})

    def store_key(self, rel: str) -> str:
        """The store key of a file of the dataset (`rel`: its path in the dataset dir)."""
        return f"{self.store_prefix}/{rel}"

    @staticmethod
    def unit_record(index: int) -> str:
        """Where a finished unit is recorded, relative to the dataset (dir or store prefix)."""
        return f"{UNITS_DIR}/unit-{index:05d}.json"


class WorkUnit(BaseModel):
    """One Prefect task's share of the corpus: pieces of files read in order."""

    index: int
    pieces: list[Piece]
    max_docs: int | None = None  # data.max_docs: the one unit stops there

    def describe(self) -> str:
        shown = ", ".join(p.describe() for p in self.pieces[:3])
        return shown + (f" and {len(self.pieces) - 3} more" if len(self.pieces) > 3 else "")

    def key(self, data: DataConfig, tokenizer_sha256: str) -> str:
        """What the unit's shards depend on: a record with another key is redone."""
        return sha256_bytes(canonical_json([self.model_dump(mode="json"), _shard_settings(data),
                                            tokenizer_sha256]))[:16]


class UnitResult(BaseModel):
    """What a finished unit wrote: small metadata, never data."""

    index: int
    key: str
    shards: dict[str, list[ShardInfo]]
    docs: int
    skipped: int
    bytes_read: int
    seconds: float
    empty: int = 0  # records without text (empty, whitespace, null), dropped
    worker: str = ""  # host:pid where the unit ran, for the log of a cluster run
    reused: bool = False  # recorded done by an earlier run: nothing tokenized now

    @property
    def tokens(self) -> int:
        return sum(s.n_tokens for shards in self.shards.values() for s in shards)


# -- planning -------------------------------------------------------------------------------

def sources_dir(config: RunConfig) -> Path:
    """Where preparation keeps what it derives from sources: the builtin corpus."""
    return Path(config.data.data_dir) / "sources"


def list_files(config: RunConfig) -> list[SourceFile]:
    """The source's files (the builtin corpus is built first); reads no file's content."""
    data = config.data
    source = str(build_builtin_corpus(sources_dir(config))) if data.source == BUILTIN else data.source
    files = list_source(source, data.format, storage=config.storage, hub_config=data.hub_config,
                        hub_split=data.hub_split, revision=data.revision,
                        field_prefix=data.field_prefix)
    if not files:
        raise DataError(f"{data.field_prefix}.source={data.source!r} lists no files of a known "
                        "format (.jsonl/.json/.parquet/.txt, also .gz/.zst); point it at your corpus")
    return files


def plan_dataset(config: RunConfig, tokenizer_from: str | None = None) -> DatasetPlan:
    """Name the dataset by its inputs (the listing, not the bytes, unless asked) and place it.

    `tokenizer_from`: the dataset whose tokenizer this one uses (a mix trains one tokenizer,
    on its first source, unless tokenizer.path gives it)."""
    data = config.data
    files = list_files(config)
    if data.source == BUILTIN:  # its file's name holds what determines it; its place does not
        listing = [[Path(f.uri).name, f.size] for f in files]
    elif data.fingerprint == "content":
        listing = content_fingerprint(files, storage=config.storage)
    else:
        listing = fingerprint(files)
    if any(f.format == "hub" for f in files):  # the listing names the dataset, not its part
        listing = [listing, data.hub_config, data.hub_split]
    eos_token = given_eos_token(config)
    tokenizer = _tokenizer_settings(config, tokenizer_from)
    if eos_token is not None and _eos_changes_shards(config, eos_token):
        tokenizer["eos_token"] = eos_token
    if config.tokenizer.path is not None:
        # A given tokenizer whose template starts texts with a BOS: its documents start with
        # it (datasets prepared before without it keep their id; these are other shards).
        prefix = document_prefix(read_tokenizer(given_tokenizer_file(config.tokenizer.path)))
        if prefix:
            tokenizer["doc_prefix"] = prefix
    inputs = {"source": listing, "tokenizer": tokenizer,
              "prep": _shard_settings(data) | {"version": PREPARE_VERSION}}
    return _plan(config, sha256_bytes(canonical_json(inputs))[:16], files, tokenizer_from, eos_token)


def _plan(config: RunConfig, dataset_id: str, files: list[SourceFile],
          tokenizer_from: str | None, eos_token: str | None = None) -> DatasetPlan:
    source = builtin_description() if config.data.source == BUILTIN else config.data.source
    listed_from = BUILTIN if config.data.source == BUILTIN else absolute_source(config.data.source)
    return DatasetPlan(dataset_id=dataset_id, source=source, listed_from=listed_from,
                       local_dir=str(dataset_dir(config, dataset_id)),
                       store_prefix=dataset_store_prefix(dataset_id),
                       settings_key=settings_key(config, tokenizer_from), files=files,
                       tokenizer_from=tokenizer_from, field_prefix=config.data.field_prefix,
                       eos_token=eos_token)


def given_eos_token(config: RunConfig) -> str | None:
    """The end-of-document token the given tokenizer states: tokenizer.eos_token, else the
    eos_token of its Hugging Face directory (tokenizer_config.json), or, for the tokenizer of
    a prepared dataset, the one its manifest records. None: none is stated (or the tokenizer
    is trained), and the first of EOS_CANDIDATES it has ends documents."""
    tok = config.tokenizer
    if tok.eos_token is not None or tok.path is None:
        return tok.eos_token
    path = given_tokenizer_file(tok.path)
    declared = stated_eos_token(path)
    if declared is not None and read_tokenizer(path).token_to_id(declared) is None:
        raise DataError(f"{path.parent} declares the end-of-document token {declared!r} (eos_token "
                        f"of its tokenizer_config.json), which its {path.name} does not have; "
                        "set tokenizer.eos_token to the token that ends its documents")
    return declared


def _eos_changes_shards(config: RunConfig, eos_token: str) -> bool:
    """Whether `eos_token` ends documents with another id than the first of EOS_CANDIDATES
    the given tokenizer has, which ended them before a declared one was read. Only then is
    it part of the dataset id: a dataset whose shards stay the same (a directory declaring
    </s> or <|end_of_text|>, as most do) keeps its id, so it is neither prepared again nor,
    where only its id is known, missing."""
    tokenizer = read_tokenizer(given_tokenizer_file(config.tokenizer.path))
    try:
        found = eos_id(tokenizer)
    except DataError:  # none of EOS_CANDIDATES: such a tokenizer was refused before
        return True
    return tokenizer.token_to_id(eos_token) != found


def _tokenizer_settings(config: RunConfig, tokenizer_from: str | None = None) -> dict:
    tok = config.tokenizer
    if tok.path is not None:
        return {"sha256": sha256_file(given_tokenizer_file(tok.path))}
    if tokenizer_from is not None:  # that dataset's id names its tokenizer's inputs
        return {"dataset": tokenizer_from}
    return {"vocab_size": tok.vocab_size, "min_frequency": tok.min_frequency,
            "sample_bytes": parse_bytes(tok.sample_bytes)}


def _shard_settings(data: DataConfig) -> dict:
    return {"shard_tokens": data.shard_tokens, "unit_bytes": parse_bytes(data.unit_bytes),
            "validation_fraction": data.validation_fraction, "max_docs": data.max_docs,
            "text_column": data.text_column, "format": data.format,
            "on_bad_record": data.on_bad_record}


def settings_key(config: RunConfig, tokenizer_from: str | None = None, as_typed: bool = False) -> str:
    """The data and tokenizer settings of one source (not what the files hold), its local
    paths absolute: a relative data.source names other files from another directory, and
    another machine's dataset must not stand for them. `as_typed`: the key of pointers
    written before, from data.source as it was typed."""
    unset = {"eos_token"} if config.tokenizer.eos_token is None else set()  # as before it was
    tree = config.model_dump(include={"data", "tokenizer"},
                             exclude={"data": {"data_dir", "cache_limit", "sources", "stages"},
                                      "tokenizer": {"sha256", *unset}})
    if not as_typed and config.data.source != BUILTIN:
        tree["data"]["source"] = absolute_source(config.data.source)
    if tokenizer_from is not None:
        tree["tokenizer_from"] = tokenizer_from
    return sha256_bytes(canonical_json(tree))[:16]


def plan_units(plan: DatasetPlan, config: RunConfig) -> list[WorkUnit]:
    """Cut the listing into work units of about data.unit_bytes of input each."""
    data = config.data
    if data.max_docs is not None:  # the first max_docs documents: one unit reads them in order
        pieces = [p for unit in split_into_pieces(plan.files, 2**62, storage=config.storage)
                  for p in unit]
        return [WorkUnit(index=0, pieces=pieces, max_docs=data.max_docs)]
    groups = split_into_pieces(plan.files, unit_target_bytes(plan.files, parse_bytes(data.unit_bytes)),
                               storage=config.storage)
    return [WorkUnit(index=i, pieces=pieces) for i, pieces in enumerate(groups)]


def unit_target_bytes(files: list[SourceFile], unit_bytes: int) -> int:
    """data.unit_bytes, or less for a corpus of fewer than 32 such units: then 32 units (of
    16 MiB at least), so every core has work and the last ones end close together, while
    each unit's few seconds of work still dwarf its ~0.1 s as a Prefect task. Follows from
    the listing alone, as the dataset id must, never from the machine."""
    total = sum(f.size for f in files)
    return min(unit_bytes, max(_MIN_UNIT_BYTES, total // _UNITS_AT_LEAST))


# -- finding a prepared dataset -------------------------------------------------------------

def locate(config: RunConfig, store: Store, tokenizer_from: str | None = None) -> DatasetPlan:
    """The plan of the dataset `config` trains on, for training, evaluation and validation.

    From the listing where the sources are here; where they are not (deleted after
    `prepare`, or a host that never had them), from the pointer that `prepare` left from
    these data settings to the dataset id, locally or in the store.
    """
    try:
        return plan_dataset(config, tokenizer_from)
    except SourcesNotHere as unlisted:
        pointer = _pointer_by_settings(config, store, tokenizer_from)
        if pointer is None:
            raise DataError(f"{unlisted}; and no dataset was prepared from these data settings "
                            "(none in the store either)") from unlisted
        dataset_id = pointer["dataset_id"]
        if (config.data.source, dataset_id) not in _said_not_listable:
            _said_not_listable.add((config.data.source, dataset_id))
            log.warning("the sources (%s) are not here: using dataset %s, prepared from them "
                        "with these data settings before (%s)", config.data.source, dataset_id,
                        unlisted)
        return _plan(config, dataset_id, [], tokenizer_from)


_said_not_listable: set[tuple[str, str]] = set()  # once per process: locate runs often


def _pointer_by_settings(config: RunConfig, store: Store, tokenizer_from: str | None) -> dict | None:
    """The pointer `prepare` left from these data settings to their dataset: here, else in
    the store; a pointer an earlier version wrote under the key of data.source as typed
    where none is under today's (it names no listed_from: nothing to tell it by)."""
    keys = [settings_key(config, tokenizer_from)]
    legacy = settings_key(config, tokenizer_from, as_typed=True)
    keys += [legacy] if legacy != keys[0] else []
    for key in keys:
        local = Path(config.data.data_dir) / BY_SETTINGS / f"{key}.json"
        try:
            pointer = json.loads(local.read_bytes() if local.is_file()
                                 else store.get_bytes(_pointer_store_key(key)))
        except FileNotFoundError:
            continue
        if key == keys[0] or "listed_from" not in pointer:
            return pointer
    return None


def require_sources(plan: DatasetPlan) -> None:
    """Refuse to prepare from a plan `locate` found by its data settings alone (no listing):
    its dataset is gone from here and from the store, and there is nothing to tokenize."""
    if not plan.files:
        raise DataError(f"the sources of dataset {plan.dataset_id} ({plan.source}) are not "
                        "listable here, and the dataset, prepared from these data settings "
                        f"before, is neither in {plan.dir} nor in the store any more: make the "
                        "sources reachable from this machine, or point storage.uri at the "
                        "store that holds the dataset")


@contextmanager
def one_prepare_at_a_time(plan: DatasetPlan) -> Iterator[bool]:
    """Hold the dataset's lock (`<data_dir>/.<dataset_id>.lock`) while it is prepared and
    published; yields whether another prepare held it first (this one waited for it: look
    for the dataset again). Another prepare of the same dataset on this machine, or on a
    filesystem it shares, waits for this one. Eight pipelines triggered together each
    tokenized the whole corpus, the same files written eight times over. Taken only where
    the dataset was not found prepared: a prepare with nothing to do writes nothing."""
    waited = []

    def say_waiting(waited_s: float, holder: str) -> None:
        waited.append(True)
        by = f"by {holder}" if holder else "by another process"
        if waited_s < 1:
            log.info("dataset %s is being prepared %s (lock %s): waiting for it",
                     plan.dataset_id, by, lock)
        else:  # a prepare that hangs (a dead Ray cluster) is waited for without end: say so
            log.warning("dataset %s: still waiting after %.0f min for its prepare %s (lock %s); "
                        "if that one hangs, stop it, and this one goes on", plan.dataset_id,
                        waited_s / 60, by, lock)

    lock = plan.dir.with_name(f".{plan.dataset_id}.lock")
    def holder() -> str:  # when it was taken, not when this prepare began to wait for it
        return f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"

    with exclusive_lock(lock, on_wait=say_waiting, holder=holder):
        yield bool(waited)


def find_prepared(plan: DatasetPlan, store: Store, listing: bool = False) -> DatasetManifest | None:
    """The complete dataset of `plan`, found where it lies: verified on this machine, or its
    manifest in the store; else None. A dataset in the store stays there: nothing here
    downloads it whole (training streams its shards through the cache, dataset_for_training),
    so a prepare with nothing to do moves nothing. `listing` (prepare's look): the store must
    also hold every file its manifest lists, or the dataset is prepared again (training
    found one missing and said to)."""
    manifest = _verified_manifest(plan.dir)
    if manifest is not None:
        log.debug("dataset %s is prepared in %s", plan.dataset_id, plan.dir)  # the flow says where
        return manifest
    key = plan.store_key(DATASET_MANIFEST)
    if not store.exists(key):
        return None
    manifest = DatasetManifest.model_validate_json(store.get_bytes(key))
    lacking = store_lacks(plan, manifest, store) if listing else []
    if lacking:
        log.warning("dataset %s in %s lacks %d of the files its manifest lists (%s): it is "
                    "prepared again", plan.dataset_id, store.url(plan.store_prefix), len(lacking),
                    ", ".join(lacking[:3]))
        return None
    log.debug("dataset %s is prepared in %s", plan.dataset_id, store.url(plan.store_prefix))
    return manifest


def store_lacks(plan: DatasetPlan, manifest: DatasetManifest, store: Store) -> list[str]:
    """The shards `manifest` lists that the store's copy of the dataset does not hold at
    their size (and its tokenizer, if missing), from one listing of its prefix."""
    held = {key.removeprefix(f"{plan.store_prefix}/"): size
            for key, size in store.sizes(plan.store_prefix).items()}
    shards = [(s.path, s.size) for split in manifest.splits.values() for s in split]
    return ([] if manifest.tokenizer in held else [manifest.tokenizer]) + [
        path for path, size in shards if held.get(path) != size]


def prepared_location(plan: DatasetPlan, store: Store) -> str:
    """Where find_prepared found the dataset of `plan`: its directory here when complete
    here, else its prefix in the store."""
    return str(plan.dir) if (plan.dir / DATASET_MANIFEST).is_file() else store.url(plan.store_prefix)


def require_prepared(plan: DatasetPlan, store: Store) -> DatasetManifest:
    """For training and evaluation: the prepared dataset of `plan` (here, or in the store), or
    a ConfigError that says whether it was never prepared or is damaged."""
    had_manifest = (plan.dir / DATASET_MANIFEST).is_file()
    manifest = find_prepared(plan, store)
    if manifest is None:
        # Where it was looked for, resolved: a relative data.data_dir or storage.uri is read
        # from the directory the command runs in, and a run's config.yaml given from another
        # directory looks there.
        state = ("is damaged: its files no longer match its manifest (the log names them)"
                 if had_manifest else f"is not prepared (not in {plan.dir.resolve()}, nor in "
                                      f"the store at {store.url(plan.store_prefix)})")
        elsewhere = ("" if had_manifest or plan.dir.is_absolute() else
                     ", or run the command where the config's relative paths start")
        raise ConfigError(f"dataset {plan.dataset_id} of this config {state}; run `goodput "
                          f"prepare` (or the pipeline) first{elsewhere}")
    return manifest


def mix_plans(config: RunConfig, store: Store | None = None) -> list[tuple[SourceConfig, DatasetPlan]]:
    """Each source of the mix (data.sources, or data.source alone) with its dataset's plan.

    A mix shares one tokenizer: tokenizer.path, or else the one trained on its first source,
    which the later sources' datasets name by that dataset's id (so a source prepared for one
    mix is reused by every mix with the same first source). With `store`, sources not
    listable here are found by their data settings (`locate`)."""
    plans, tokenizer_from = [], None
    for source in config.data.mix():
        source_config = config.source_config(source)
        plan = (plan_dataset(source_config, tokenizer_from) if store is None
                else locate(source_config, store, tokenizer_from))
        plans.append((source, plan))
        tokenizer_from = mix_tokenizer_from(config, plans[0][1].dataset_id)
    return plans


def mix_tokenizer_from(config: RunConfig, first_dataset_id: str) -> str | None:
    """The dataset whose tokenizer a mix's later sources use: the first source's, unless
    tokenizer.path gives the tokenizer to all."""
    return first_dataset_id if config.tokenizer.path is None else None


def mixture_manifest(sources: list[tuple[SourceConfig, DatasetManifest]]) -> MixtureManifest:
    """The mix of these prepared datasets, refused unless they share one tokenizer (where
    training reads each, MixSource.dir, is filled in by dataset_for_training)."""
    first = sources[0][1]
    for source, manifest in sources[1:]:
        if (manifest.tokenizer_sha256, manifest.vocab_size, manifest.eos_id, manifest.doc_prefix_ids) != (
                first.tokenizer_sha256, first.vocab_size, first.eos_id, first.doc_prefix_ids):
            raise ConfigError(
                f"data.sources: {source.name} (dataset {manifest.dataset_id}) was tokenized with "
                f"another tokenizer than {sources[0][0].name} (dataset {first.dataset_id}), or "
                "starts or ends its documents with other tokens (one was prepared before documents "
                "started with the tokenizer's BOS): a mix "
                "needs one; set tokenizer.path, or leave it unset to use the one trained on the "
                "first source, and prepare again")
    listed = [[source.name, source.weight, manifest.dataset_id] for source, manifest in sources]
    return MixtureManifest(
        dataset_id=sha256_bytes(canonical_json(listed))[:16], tokenizer_sha256=first.tokenizer_sha256,
        vocab_size=first.vocab_size, eos_id=first.eos_id,
        sources=[MixSource(name=source.name, weight=source.weight, dataset_id=manifest.dataset_id)
                 for source, manifest in sources])


def dataset_store_prefix(dataset_id: str) -> str:
    """Where a prepared dataset lies in the store (its manifest, tokenizer and shards)."""
    return f"datasets/{dataset_id}"


def dataset_dir(config: RunConfig, dataset_id: str) -> Path:
    """Where a prepared dataset lies on this machine (its manifest, tokenizer and shards)."""
    return Path(config.data.data_dir) / dataset_id


def mixture_dir(config: RunConfig, mix_id: str) -> Path:
    """Where a mix of data.sources is read from (its mixture.json names each source's dir)."""
    return Path(config.data.data_dir) / MIXES_DIR / mix_id


def local_dataset_dir(config: RunConfig, dataset: DatasetManifest | MixtureManifest) -> Path | None:
    """The directory to give `torchrun -m training --dataset` (or `goodput export
    --tokenizer`) where `dataset` lies on this machine, else None. A mix's is written here
    when every source's dataset is complete on this machine; one that streams a source from
    the store has it once training made it (dataset_for_training)."""
    if not config.data.sources:  # a directory without its manifest is not (or no longer) complete
        directory = dataset_dir(config, dataset.dataset_id)
        return directory if (directory / DATASET_MANIFEST).is_file() else None
    dirs = {source.name: dataset_dir(config, source.dataset_id) for source in dataset.sources}
    if all((d / DATASET_MANIFEST).is_file() for d in dirs.values()):
        return _save_mixture(config, dataset, {name: str(d.resolve()) for name, d in dirs.items()})
    directory = mixture_dir(config, dataset.dataset_id)
    return directory if directory.is_dir() else None


def _save_mixture(config: RunConfig, mix: MixtureManifest, dirs: dict[str, str]) -> Path:
    """`mix` with where each source is read on this machine (`dirs`, by source name), saved
    in the mix's directory; that directory."""
    mix = mix.model_copy(update={"sources": [s.model_copy(update={"dir": dirs[s.name]}) for s in mix.sources]})
    directory = mixture_dir(config, mix.dataset_id)
    mix.save(directory)
    return directory


def dataset_for_training(config: RunConfig, store: Store) -> Path:
    """The directory that training, checkpoint validation and evaluation read: the dataset's
    (a mix of one) or, for data.sources, a mixture.json naming each source's.

    A complete copy on this machine is read in place. Otherwise nothing is downloaded whole:
    a cache directory (`<data_dir>/cache/<dataset_id>`) gets the manifest and tokenizer, and
    the readers fetch each shard from the store when they need it, keeping at most
    data.cache_limit on disk (training.shard_cache; a mix's sources share it evenly). Never
    prepared or damaged beyond what the store holds: a ConfigError that says which.
    """
    found = [(source, plan, require_prepared(plan, store))
             for source, plan in mix_plans(config, store)]
    mix = mixture_manifest([(source, manifest) for source, _, manifest in found])  # before any fetch
    limit = parse_bytes(config.data.cache_limit) if config.data.cache_limit is not None else None
    streamed = [plan for _, plan, _ in found if not (plan.dir / DATASET_MANIFEST).is_file()]
    share = limit // len(streamed) if limit is not None and streamed else limit
    dirs = {source.name: str(_reading_dir(config, plan, manifest, store, share, len(streamed)).resolve())
            for source, plan, manifest in found}
    if not config.data.sources:
        return Path(dirs[SINGLE_SOURCE])
    directory = _save_mixture(config, mix, dirs)
    log.info("mix %s: %s", mix.dataset_id, ", ".join(f"{s.name} {s.weight:g} ({s.dataset_id})"
                                                      for s in mix.sources))
    return directory


def _reading_dir(config: RunConfig, plan: DatasetPlan, manifest: DatasetManifest, store: Store,
                 limit: int | None, sharers: int) -> Path:
    """A prepared dataset's dir on this machine, or its shard cache of `limit` bytes (the
    share of data.cache_limit of each of `sharers` streamed sources)."""
    if (plan.dir / DATASET_MANIFEST).is_file():  # complete and verified on this machine
        return plan.dir
    check_cache_limit(limit, manifest, config.training.shuffle_window_tokens, sharers)
    cache = Path(config.data.data_dir) / CACHE_DIR / plan.dataset_id
    tokenizer = cache / manifest.tokenizer
    if not tokenizer.is_file() or sha256_file(tokenizer) != manifest.tokenizer_sha256:
        store.get_file(plan.store_key(manifest.tokenizer), tokenizer)
        if sha256_file(tokenizer) != manifest.tokenizer_sha256:
            raise ConfigError(f"the tokenizer of dataset {plan.dataset_id} in "
                              f"{store.url(plan.store_prefix)} differs from its manifest: the "
                              "dataset in the store is damaged; run `goodput prepare` again")
    manifest.save(cache)
    write_cache_settings(cache, usable_anywhere(config.storage), plan.store_prefix, limit)
    log.info("dataset %s streams from %s through %s (cache limit %s)", plan.dataset_id,
             store.url(plan.store_prefix), cache, limit if limit is not None else "none")
    return cache


def _stamp_path(directory: Path) -> Path:
    """What was last verified of a dataset dir: (size, mtime, inode) per file, kept beside it."""
    return directory.parent / ".verified" / f"{directory.name}.json"


def _file_stats(directory: Path, rels: list[str]) -> dict[str, list[int]]:
    stats = {}
    for rel in rels:
        try:
            st = (directory / rel).stat()
        except FileNotFoundError:
            continue
        stats[rel] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return stats


def _verified_manifest(directory: Path) -> DatasetManifest | None:
    """The manifest in `directory` if every file it lists checks out.

    Files unchanged since they were last hashed (same size, mtime and inode) are not hashed
    again, so finding a prepared dataset costs a stat per file, not a read of every shard. A
    damaged dataset loses its manifest and its damaged files, so the steps that make them run
    again while the intact files are kept.
    """
    if not (directory / DATASET_MANIFEST).is_file():
        return None
    try:
        manifest = DatasetManifest.load(directory)
    except ValueError as e:
        # One line, not pydantic's whole report; and it is prepared again only where the
        # store does not hold the dataset (training then streams the store's).
        reason = e.errors()[0]["msg"] if isinstance(e, ValidationError) and e.errors() else str(e)
        log.warning("%s is unreadable (%s): removed; the dataset is read from the store, or "
                    "prepared again where the store does not hold it", directory / DATASET_MANIFEST,
                    reason)
        (directory / DATASET_MANIFEST).unlink()
        return None
    expected = {manifest.tokenizer: manifest.tokenizer_sha256}
    expected |= {shard.path: shard.sha256 for shards in manifest.splits.values() for shard in shards}
    stats = _file_stats(directory, list(expected))
    try:
        stamp = json.loads(_stamp_path(directory).read_text())
    except (FileNotFoundError, ValueError):
        stamp = {}
    damaged = [rel for rel, sha256 in expected.items()
               if rel not in stats or (stamp.get(rel) != stats[rel]
                                       and sha256_file(directory / rel) != sha256)]
    if not damaged:
        if stamp != stats:
            _stamp_path(directory).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(_stamp_path(directory), json.dumps(stats).encode())
        return manifest
    log.warning("dataset in %s is damaged (%s); those files are removed (and prepared again "
                "where the store does not hold the dataset)", directory, ", ".join(damaged))
    _stamp_path(directory).unlink(missing_ok=True)
    (directory / DATASET_MANIFEST).unlink()
    for rel in damaged:
        (directory / rel).unlink(missing_ok=True)
    return None


# -- tokenizer ------------------------------------------------------------------------------

def build_tokenizer(plan: DatasetPlan, config: RunConfig, units: list[WorkUnit],
                    store: Store | None = None) -> str:
    """tokenizer.json in the dataset dir: the one given, or trained on a bounded sample.

    The sample is deterministic: the first train-split documents of up to 64 units spread
    evenly over the corpus, tokenizer.sample_bytes of text in all. An existing tokenizer.json
    is kept: shards already written by a crashed run used it. With `store` (units that
    write to the store), the tokenizer is the store's when it has one, else it goes there.
    A given tokenizer's Hugging Face side files (its special tokens, chat template and
    generation settings: training.tokenizer.HF_TOKENIZER_SIDE_FILES) come along, for export.
    """
    path = plan.tokenizer_path
    if store is not None:
        return _shared_tokenizer(plan, config, units, store)
    if path.is_file():
        return str(path)
    plan.dir.mkdir(parents=True, exist_ok=True)
    if config.tokenizer.path is not None:
        given = given_tokenizer_file(config.tokenizer.path)
        load_tokenizer(given, plan.eos_token)  # validate before adopting it
        _copy_side_files(given, plan.dir)  # first: tokenizer.json's presence means all is there
        write_atomic(path, given.read_bytes())
        return str(path)
    if plan.tokenizer_from is not None:  # the mix's first source's, here or in the store
        first = plan.dir.parent / plan.tokenizer_from / TOKENIZER_FILE
        if first.is_file():
            _copy_side_files(first, plan.dir)
            write_atomic(path, first.read_bytes())
        else:
            store_from_config(config.storage).get_file(
                f"{dataset_store_prefix(plan.tokenizer_from)}/{TOKENIZER_FILE}", path)
        return str(path)
    start = time.perf_counter()
    texts = _sample_texts(units, config, parse_bytes(config.tokenizer.sample_bytes))
    tokenizer = train_tokenizer(texts, config.tokenizer.vocab_size, config.tokenizer.min_frequency)
    log.info("trained a %d-token BPE in %.1fs", tokenizer.get_vocab_size(), time.perf_counter() - start)
    write_atomic(path, tokenizer.to_str().encode())
    return str(path)


def _copy_side_files(tokenizer_json: Path, directory: Path) -> None:
    """The Hugging Face side files beside `tokenizer_json`, copied into `directory`."""
    for side in tokenizer_side_files(tokenizer_json):
        write_atomic(directory / side.name, side.read_bytes())


def _shared_tokenizer(plan: DatasetPlan, config: RunConfig, units: list[WorkUnit], store: Store) -> str:
    key = plan.store_key(TOKENIZER_FILE)
    if store.exists(key):  # units recorded done in the store used this one (and its side files)
        plan.dir.mkdir(parents=True, exist_ok=True)
        for name in HF_TOKENIZER_SIDE_FILES:
            if store.exists(plan.store_key(name)):
                store.get_file(plan.store_key(name), plan.dir / name)
        store.get_file(key, plan.tokenizer_path)
        return str(plan.tokenizer_path)
    path = build_tokenizer(plan, config, units)
    for side in tokenizer_side_files(path):  # first: the tokenizer in the store means all is
        store.put_file(side, plan.store_key(side.name), sha256=sha256_file(side))
    store.put_file(path, key, sha256=sha256_file(path))
    return path


def _sample_texts(units: list[WorkUnit], config: RunConfig, sample_bytes: int) -> Iterator[str]:
    chosen = units[::max(1, -(-len(units) // _SAMPLE_UNITS))]
    budget = max(1, sample_bytes // len(chosen))
    for unit in chosen:
        taken = 0
        for text in _unit_texts(unit, config.data, config.storage):
            if not is_validation(text, config.data.validation_fraction):
                yield text
                taken += len(text)
                if taken >= budget:
                    break


@dataclass
class _Counts:
    """What a unit's readers counted: bad records skipped, records without text, input bytes read."""

    skipped: int = 0
    empty: int = 0
    bytes_read: int = 0


def _unit_texts(unit: WorkUnit, data: DataConfig, storage: StorageConfig) -> Iterator[str]:
    for batch in _unit_batches(unit, data, storage, _Counts()):
        yield from batch


def _unit_batches(unit: WorkUnit, data: DataConfig, storage: StorageConfig, counts: _Counts,
                  ) -> Iterator[list[str]]:
    """Batches of a unit's documents, its pieces in order, cut at unit.max_docs."""
    left = unit.max_docs
    for piece in unit.pieces:
        reader = read_documents(piece, data.text_column, on_bad_record=data.on_bad_record,
                                storage=storage, batch_bytes=_BATCH_BYTES,
                                field_prefix=data.field_prefix)
        try:
            for batch in reader:
                if left is not None:
                    batch = batch[:left]
                    left -= len(batch)
                yield batch
                if left == 0:
                    return
        finally:
            counts.skipped += reader.skipped
            counts.empty += reader.empty
            counts.bytes_read += reader.bytes_read


def is_validation(text: str, fraction: float) -> bool:
    """Whether a document is held out: a keyed hash of its text, so the split does not depend
    on where the document sits, and duplicates never straddle train and validation."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=_SPLIT_KEY).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


# -- work units -----------------------------------------------------------------------------

def tokenize_unit(plan: DatasetPlan, unit: WorkUnit, data: DataConfig, storage: StorageConfig,
                  to_store: bool = False) -> UnitResult:
    """Stream the unit's documents through the tokenizer into token shards; record it done.

    A unit recorded done with the same inputs, its shards all present, is not redone; a
    half-done one (a crash, a retry) starts over, its partial shards replaced. With
    `to_store`, the unit shares no disk with the others (a cluster's machines): it takes the
    tokenizer from the store, tokenizes into a scratch directory, uploads its shards and
    records itself done in the store.
    """
    if to_store:
        return _tokenize_unit_to_store(plan, unit, data, storage)
    tokenizer_sha256 = sha256_file(plan.tokenizer_path)
    record = plan.dir / plan.unit_record(unit.index)
    done = _finished_unit(record.read_bytes, unit.key(data, tokenizer_sha256),
                          lambda s: _has_size(plan.dir / s.path, s.size))
    if done is not None:
        return done
    result = _tokenize(plan.dir, plan.tokenizer_path, tokenizer_sha256, plan.eos_token, unit, data, storage)
    record.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(record, result.model_dump_json(indent=1).encode())
    return result


def _tokenize_unit_to_store(plan: DatasetPlan, unit: WorkUnit, data: DataConfig,
                            storage: StorageConfig) -> UnitResult:
    store = store_from_config(storage)
    record_key = plan.store_key(plan.unit_record(unit.index))
    with tempfile.TemporaryDirectory(prefix=f"goodput-unit-{unit.index:05d}-") as scratch:
        tokenizer_path = Path(scratch) / TOKENIZER_FILE
        store.get_file(plan.store_key(TOKENIZER_FILE), tokenizer_path)
        tokenizer_sha256 = sha256_file(tokenizer_path)
        # Shards are uploaded whole before the record: a listed one that is there is complete.
        done = _finished_unit(lambda: store.get_bytes(record_key), unit.key(data, tokenizer_sha256),
                              lambda s: store.exists(plan.store_key(s.path)))
        if done is not None:
            return done
        result = _tokenize(Path(scratch), tokenizer_path, tokenizer_sha256, plan.eos_token, unit,
                           data, storage)
        for shards in result.shards.values():
            for shard in shards:
                store.put_file(Path(scratch) / shard.path, plan.store_key(shard.path),
                               sha256=shard.sha256)
    store.put_bytes(record_key, result.model_dump_json(indent=1).encode())
    return result


def _tokenize(directory: Path, tokenizer_path: Path, tokenizer_sha256: str, eos_token: str | None,
              unit: WorkUnit, data: DataConfig, storage: StorageConfig) -> UnitResult:
    """The unit's shards, written into `directory` (partial ones of an earlier try replaced)."""
    for stale in directory.glob(f"*-{unit.index:05d}-*.arrow"):
        stale.unlink()
    started = time.perf_counter()
    tokenizer = _unit_tokenizer(tokenizer_path, tokenizer_sha256, eos_token)
    eos, dtype = eos_id(tokenizer, eos_token), token_dtype(tokenizer.get_vocab_size())
    prefix = document_prefix(tokenizer)  # a BOS, where the tokenizer's template puts one
    made_from = {"tokenizer_sha256": tokenizer_sha256}  # not where the text was: bytes follow content
    writers = {split: ShardWriter(directory, lambda k, s=split: f"{s}-{unit.index:05d}-{k:04d}.arrow",
                                  dtype, data.shard_tokens, made_from) for split in SPLITS}
    docs, counts = 0, _Counts()
    for batch in _unit_batches(unit, data, storage, counts):
        docs += len(batch)
        held_out = [is_validation(text, data.validation_fraction) for text in batch]
        for split, texts in (("train", [t for t, v in zip(batch, held_out) if not v]),
                             ("validation", [t for t, v in zip(batch, held_out) if v])):
            if texts:
                # add_special_tokens=False: not the template itself, which may also end a text
                # with an EOS; a document is the template's prefix (a BOS, or nothing), its
                # text and exactly one EOS.
                encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
                writers[split].add([np.array(prefix + e.ids + [eos], dtype=dtype) for e in encodings])
    shards = {split: [_shard_info(directory, name, n_tokens, n_docs)
                      for name, n_tokens, n_docs in writer.close()] for split, writer in writers.items()}
    return UnitResult(index=unit.index, key=unit.key(data, tokenizer_sha256), shards=shards,
                      docs=docs, skipped=counts.skipped, empty=counts.empty, bytes_read=counts.bytes_read,
                      seconds=time.perf_counter() - started,
                      worker=f"{socket.gethostname()}:{os.getpid()}")


_loaded_tokenizers: dict[str, Tokenizer] = {}


def _unit_tokenizer(path: Path, sha256: str, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer with this content, loaded once per process: a pool's process tokenizes
    unit after unit, and loading a 16k-vocabulary tokenizer.json takes ~70 ms each time."""
    if sha256 not in _loaded_tokenizers:
        _loaded_tokenizers.clear()  # one dataset's at a time
        _loaded_tokenizers[sha256] = load_tokenizer(path, eos_token)
    return _loaded_tokenizers[sha256]


def _shard_info(directory: Path, name: str, n_tokens: int, n_docs: int) -> ShardInfo:
    path = directory / name
    return ShardInfo(path=name, n_tokens=n_tokens, n_docs=n_docs, size=path.stat().st_size,
                     sha256=sha256_file(path))


def _finished_unit(read_record: Callable[[], bytes], key: str,
                   present: Callable[[ShardInfo], bool]) -> UnitResult | None:
    """The unit's recorded result if it was made with these inputs (`key`) and every shard
    it lists is `present`; else None (never recorded, another key, a shard gone)."""
    try:
        result = UnitResult.model_validate_json(read_record())
    except (FileNotFoundError, ValueError):
        return None
    shards = [s for split in result.shards.values() for s in split]
    if result.key != key or not all(present(s) for s in shards):
        return None
    return result.model_copy(update={"reused": True})


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


# -- manifest and publishing ----------------------------------------------------------------

def write_manifest(plan: DatasetPlan, results: list[UnitResult], tokenizer_path: str,
                   store: Store | None = None) -> DatasetManifest:
    """Seal the dataset: drop what it does not list (unit records, leftovers), then write the
    manifest, and the pointer from these data settings to it.

    With `store` (units that wrote to the store), the dataset is sealed there: the manifest
    goes up once every file it lists is there, and this machine keeps none of it.
    """
    tokenizer = load_tokenizer(tokenizer_path, plan.eos_token)
    results = sorted(results, key=lambda r: r.index)
    splits = {split: [s for r in results for s in r.shards[split]] for split in SPLITS}
    docs, skipped = sum(r.docs for r in results), sum(r.skipped for r in results)
    empty = sum(r.empty for r in results)
    field = plan.field_prefix
    if docs == 0:
        raise DataError(f"{field}.source={plan.source!r} holds no text: none of its documents has "
                        f"any ({empty} records without text, {skipped} bad records skipped); "
                        f"point {field}.source at files with text, or check {field}.text_column")
    for split, shards in splits.items():
        if not shards:
            raise DataError(f"{field}.source={plan.source!r}: its {docs} document(s) (after "
                            f"{skipped} bad records skipped) leave the {split} split empty; add "
                            "documents or change data.validation_fraction")
    manifest = DatasetManifest(
        dataset_id=plan.dataset_id,
        source=plan.source,
        tokenizer=Path(tokenizer_path).name,
        tokenizer_sha256=sha256_file(tokenizer_path),
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos_id(tokenizer, plan.eos_token),
        doc_prefix_ids=document_prefix(tokenizer),
        dtype=token_dtype(tokenizer.get_vocab_size()),
        splits=splits,
        skipped_records=skipped,
        empty_records=empty,
        source_bytes=sum(r.bytes_read for r in results),
        created_at=time.time(),
    )
    listed = {manifest.tokenizer} | {s.path for ss in splits.values() for s in ss}
    # The tokenizer's Hugging Face side files stay beside it (unlisted in the manifest: they
    # do not name the dataset, and one prepared without them is complete as it is).
    listed |= {side.name for side in tokenizer_side_files(tokenizer_path)}
    if store is None:
        _remove_unlisted(plan.dir, listed)
        manifest.save(plan.dir)
        _verified_manifest(plan.dir)  # stamps the files just hashed: the next look is a stat each
    else:
        _seal_in_store(plan, manifest, listed, store)
        shutil.rmtree(plan.dir, ignore_errors=True)
    pointer = Path(plan.dir).parent / BY_SETTINGS / f"{plan.settings_key}.json"
    pointer.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(pointer, _pointer(plan))
    return manifest


def _pointer(plan: DatasetPlan) -> bytes:
    return canonical_json({"dataset_id": plan.dataset_id, "source": plan.source,
                           "listed_from": plan.listed_from})


def _seal_in_store(plan: DatasetPlan, manifest: DatasetManifest, listed: set[str], store: Store) -> None:
    found = {key.removeprefix(f"{plan.store_prefix}/") for key in store.list(plan.store_prefix)}
    missing = sorted(listed - found)
    if missing:
        raise FileNotFoundError(f"dataset {plan.dataset_id}: {len(missing)} file(s) its work units "
                                f"recorded are not in {store.url(plan.store_prefix)} (e.g. "
                                f"{missing[0]}); run prepare again: it redoes those units")
    store.put_bytes(plan.store_key(DATASET_MANIFEST), manifest.to_json())
    for rel in sorted(found - listed - {DATASET_MANIFEST}):  # unit records, leftovers of crashes
        store.delete(plan.store_key(rel))


def _remove_unlisted(directory: Path, keep: set[str]) -> None:
    # The dataset dir ends up holding exactly what the manifest lists, so it can be uploaded
    # as it is: no unit records, no temporary files of crashed writes.
    for path in directory.iterdir():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def publish(plan: DatasetPlan, manifest: DatasetManifest, store: Store) -> str:
    """Upload the dataset dir to `datasets/<dataset_id>/`, manifest last, then the pointer;
    where the dataset lies in the store.

    Nothing is sent when the store already holds this very manifest: it is uploaded last,
    so everything it lists is there already.
    """
    missing = unpublished(plan, store)
    if "dataset" in missing:
        # The manifest's digests spare a hashing pass over every shard; the upload checks them.
        known = {shard.path: shard.sha256 for shards in manifest.splits.values() for shard in shards}
        if manifest.tokenizer_sha256:
            known[manifest.tokenizer] = manifest.tokenizer_sha256
        store.upload_dir(plan.dir, plan.store_prefix, last=(DATASET_MANIFEST,), known_sha256=known)
        log.info("published dataset %s to %s (%d train tokens)", manifest.dataset_id,
                 store.url(plan.store_prefix), manifest.n_tokens("train"))
    if "pointer" in missing:
        store.put_bytes(_pointer_key(plan), _pointer(plan))
    return store.url(plan.store_prefix)


def unpublished(plan: DatasetPlan, store: Store) -> list[str]:
    """What `publish` has to send of the dataset of `plan`: "dataset" when it is complete
    here and the store lacks this very manifest (uploaded last, so the store holding it holds
    everything it lists), "pointer" when the store lacks the pointer from these data
    settings to it. Empty: nothing."""
    missing = []
    local = plan.dir / DATASET_MANIFEST  # absent when the dataset was sealed in the store
    key = plan.store_key(DATASET_MANIFEST)
    if local.is_file() and not (store.exists(key) and store.get_bytes(key) == local.read_bytes()
                                and not store_lacks(plan, DatasetManifest.load(plan.dir), store)):
        missing.append("dataset")
    pointer_key = _pointer_key(plan)
    if plan.files and not (store.exists(pointer_key) and store.get_bytes(pointer_key) == _pointer(plan)):
        missing.append("pointer")
    return missing


def publish_for_training(config: RunConfig, store: Store) -> list[str]:
    """Publish each source's dataset that lies complete on this machine but not in `store`
    (prepared with another storage.uri, or while the store was down), where training is about
    to checkpoint to that store: a machine with only the store can then resume the run. The
    store locations a dataset was sent to; empty when the store had them all (a pointer
    alone, from these data settings to a dataset the store holds, is sent but not counted)."""
    sent = []
    for _, plan in mix_plans(config, store):
        manifest = DatasetManifest.load(plan.dir) if (plan.dir / DATASET_MANIFEST).is_file() else None
        missing = unpublished(plan, store) if manifest is not None else []
        if missing:
            url = publish(plan, manifest, store)
            if "dataset" in missing:
                sent.append(url)
    return sent


def _pointer_key(plan: DatasetPlan) -> str:
    return _pointer_store_key(plan.settings_key)


def _pointer_store_key(settings_key: str) -> str:
    return f"datasets/{BY_SETTINGS}/{settings_key}.json"


def nothing_to_prepare(config: RunConfig, store: Store
                       ) -> list[tuple[SourceConfig, DatasetManifest, str, bool]] | None:
    """The decision of a prepare with no work: every source's dataset of `config` found
    prepared (`find_prepared`, as the prepare flow finds it) with nothing left to publish,
    each with where it lies and whether its sources were listed here (else it was found by
    its data settings); None when any source has work to do. Lets a command say "already
    prepared" without starting the flow (and Prefect's server) at all."""
    found = []
    for source, plan in mix_plans(config, store):
        manifest = find_prepared(plan, store, listing=True)
        if manifest is None or unpublished(plan, store):
            return None
        found.append((source, manifest, prepared_location(plan, store), bool(plan.files)))
    return found


def record_prepare(config: RunConfig,
                   prepared: list[tuple[str, DatasetManifest, float | None, list[str] | None]],
                   started: float, mix: MixtureManifest | None = None) -> dict:
    """Write the prepare stage's part of the run's summary.json: per source (name, manifest,
    `tokenize_s`: the work units' wall time, None when the dataset was found prepared;
    `workers`: where they ran), and the mix's id for data.sources."""
    per_source = {}
    for name, manifest, tokenize_s, workers in prepared:
        per_source[name] = {
            "dataset_id": manifest.dataset_id, "source": manifest.source,
            "vocab_size": manifest.vocab_size,
            "tokens": {split: manifest.n_tokens(split) for split in manifest.splits},
            "skipped_records": manifest.skipped_records, "empty_records": manifest.empty_records,
            "tokenize_s": tokenize_s, "workers": workers}
    if mix is None:  # a mix of one: its dataset is the stage's
        values = next(iter(per_source.values()))
    else:
        values = {"dataset_id": mix.dataset_id, "vocab_size": mix.vocab_size, "sources": per_source}
    values["wall_time_s"] = time.time() - started
    update_summary(config.run_dir, "prepare", values)
    return values


# -- the whole stage ------------------------------------------------------------------------

def prepare_dataset(config: RunConfig) -> DatasetManifest | MixtureManifest:
    """Prepare (or find) the dataset `config` describes, without Prefect, one unit at a time:
    its manifest, or for data.sources the mixture of each source's dataset."""
    store = store_from_config(config.storage)
    prepared = []
    for source, plan in mix_plans(config, store):
        source_config = config.source_config(source)
        manifest = find_prepared(plan, store, listing=True)
        with one_prepare_at_a_time(plan) if manifest is None else nullcontext(False) as waited:
            if waited:  # another prepare had the dataset: prepared it, or failed
                manifest = find_prepared(plan, store, listing=True)
            if manifest is None:
                require_sources(plan)
                units = plan_units(plan, source_config)
                tokenizer_path = build_tokenizer(plan, source_config, units)
                results = [tokenize_unit(plan, unit, source_config.data, config.storage) for unit in units]
                manifest = write_manifest(plan, results, tokenizer_path)
            publish(plan, manifest, store)
        prepared.append((source, manifest))
    return prepared[0][1] if not config.data.sources else mixture_manifest(prepared)
