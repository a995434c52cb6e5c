"""Pretraining sources read in place: listed cheaply, cut into pieces, streamed in batches.

`data.source` names local files (a path, a glob with `**`, a directory, or a comma-separated
list of those), an `s3://bucket/prefix` (or one object), or else a Hugging Face hub dataset,
streamed. Nothing is copied: `list_source` reads names, sizes and versions only (mtime, ETag,
revision: the dataset's fingerprint); `split_into_pieces` groups files into work units of
about a given size, cutting big files at byte ranges or parquet row groups; `read_documents`
streams one piece's documents in batches of bounded size, whatever the file's size.

Formats, from each file's extension unless data.format says: JSON Lines (.jsonl, .json; a
file holding one JSON array is read whole, up to 256 MiB), parquet, text (.txt, a document
per line); JSON and text also compressed (.gz, .zst). A folder laid out as a Hugging Face
dataset (files or folders named for splits, `-of-` shard names, a dataset card's configs)
gives one split of it, found by `datasets`' own rules. Every problem with the input raises
`DataError` worded for the user; storage trouble stays an OSError, which a retry may cure.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from core.errors import DataError
from core.files import canonical_json, sha256_bytes
from core.uris import parse_s3_uri
from storage.store import ObjectChangedError, open_store

try:  # several times faster than json on JSON Lines; optional
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson is in the venv
    _loads = json.loads

log = logging.getLogger(__name__)


class SourcesNotHere(DataError):
    """Nothing that a source names exists here (no such path, no file matches its glob, no
    object under its prefix, the hub out of reach). Only then is the dataset found by the
    data settings it was prepared from (prepare.locate): sources that exist but cannot be
    listed as given (a broken dataset card, a folder of unknown files), or exist in part, are
    an error, so a dataset is never taken for sources that changed."""


Format = Literal["json", "parquet", "text", "hub"]
Compression = Literal["", "gzip", "zstd"]
FORMAT_OF_EXTENSION = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
COMPRESSION_OF_EXTENSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
MiB = 2**20
_ONE_LINE, _COLUMN = re.compile(r"line 1 column (\d+)(?: \(char \d+\))?"), r"column \1"
MAX_WHOLE_JSON = 256 * MiB  # a JSON array is parsed in one piece; larger ones must be JSON Lines
MAX_LINE = 256 * MiB  # a longer "line" is no JSON Lines or text file: stop before memory runs out
MAX_HUB_UNITS = 4096
_CHUNK = MiB  # read size when splitting lines
_AWS_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_PROFILE",
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_STORES: dict[str, object] = {}  # see _s3_store
_STORES_LOCK = threading.Lock()
_BAD_RECORD_FIX = "fix or remove the file, or set data.on_bad_record=skip to skip such records"
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which Windows tools write first: no text


class SourceFile(BaseModel):
    """One file of a source, as listed (no content read): what it is and which version."""

    uri: str  # absolute local path, s3://bucket/key, or hub:<name>
    size: int  # bytes (0 for hub)
    version: str  # local: st_mtime_ns; S3: the ETag; hub: the revision or "latest"
    format: Format
    compression: Compression = ""
    hub_config: str | None = None
    hub_split: str = "train"
    n_shards: int = 1  # hub: the streamed dataset's shards (data files); files: 1


class Piece(BaseModel):
    """A part of one source file that one work unit reads."""

    file: SourceFile
    start: int = 0  # text formats: byte offset; parquet: first row group; hub: first shard
    stop: int | None = None  # exclusive; None = to the end

    def describe(self) -> str:
        """Where the piece lies, for logs and errors: "x.jsonl bytes 0-1048576"."""
        if self.start == 0 and self.stop is None:
            return self.file.uri
        unit = {"parquet": "row groups", "hub": "shards"}.get(self.file.format, "bytes")
        return f"{self.file.uri} {unit} {self.start}-{'end' if self.stop is None else self.stop}"


# -- listing ---------------------------------------------------------------------------------

def list_source(source: str, fmt: str = "auto", *, storage=None, hub_config: str | None = None,
                hub_split: str = "train", revision: str | None = None,
                field_prefix: str = "data") -> list[SourceFile]:
    """The files `source` names, sorted by URI; one `hub:` entry for a hub dataset.

    `storage` (a StorageConfig) gives the endpoint and region for s3:// sources. Reads no
    file content: the listing is the dataset's fingerprint and must stay cheap at 100 TB.
    `field_prefix` is how errors name the fields of the source (DataConfig.field_prefix):
    `data` (data.source, data.format) or, for a source of a mix, `data.sources[<name>]`.
    """
    if fmt not in ("auto", "json", "parquet", "text"):
        raise ValueError(f"unknown format {fmt!r}: use auto, json, parquet or text")
    parts = _parts(source)
    if not parts:
        raise DataError(f"{field_prefix}.source is empty; name files, an s3:// prefix or a hub dataset")
    if _names_hub_dataset(parts):
        return [list_hub(parts[0], hub_config, hub_split, revision, field_prefix=field_prefix)]
    files: dict[str, SourceFile] = {}
    absent: list[SourcesNotHere] = []
    for part in parts:
        try:
            found = (_list_s3(part, source, fmt, storage, field_prefix) if part.startswith("s3://")
                     else _list_local(part, source, fmt, field_prefix, hub_config, hub_split))
        except SourcesNotHere as e:
            absent.append(e)
            continue
        files.update((f.uri, f) for f in found)
    if absent and not files:
        raise SourcesNotHere("; ".join(str(e) for e in absent))
    if absent:  # what is here changed with what is not: no earlier dataset stands for it
        raise DataError(f"{absent[0]}. The rest of {field_prefix}.source is here, so its dataset "
                        "cannot be the one prepared from all of it before: make every part "
                        f"reachable, or drop the missing part from {field_prefix}.source")
    return [files[uri] for uri in sorted(files)]


# Extensions of data files not read here (refused with a word on converting them) and of
# archives: a name that ends in one names a file, never a hub dataset.
_FILE_EXTENSIONS = {".csv", ".tsv", ".arrow", ".feather", ".zip", ".tar", ".bz2", ".xz", ".lz4"}


def _looks_local(part: str) -> bool:
    """Whether `part` names local files: a hub name ("owner/name") has no extension of a
    file, no glob characters, no leading ".", "/" or "~", no trailing "/" and no local match."""
    path = Path(part).expanduser()
    return (glob.has_magic(part) or path.exists() or _kind(part) != (None, "")
            or os.path.splitext(part.lower())[1] in _FILE_EXTENSIONS
            or part.startswith((".", "/", "~")) or part.endswith(("/", os.sep)))


def _parts(source: str) -> list[str]:
    """The comma-separated parts of a source: paths, globs, s3:// URIs, or one hub name."""
    return [p.strip() for p in source.split(",") if p.strip()]


def _names_hub_dataset(parts: list[str]) -> bool:
    return len(parts) == 1 and not parts[0].startswith("s3://") and not _looks_local(parts[0])


def absolute_source(source: str) -> str:
    """`source` with its local parts made absolute (as the listing names their files), so
    that one string names the same files from any working directory; s3:// URIs and hub
    names as they are."""
    parts = _parts(source)
    if _names_hub_dataset(parts):
        return parts[0]
    return ",".join(p if p.startswith("s3://") else os.path.abspath(os.path.expanduser(p))
                    for p in parts)


def _kind(name: str) -> tuple[str | None, Compression]:
    """The format and compression a name's extensions say: "x.jsonl.zst" -> ("json", "zstd")."""
    stem, ext = os.path.splitext(name.lower())
    compression = COMPRESSION_OF_EXTENSION.get(ext, "")
    if compression:
        ext = os.path.splitext(stem)[1]
    return FORMAT_OF_EXTENSION.get(ext), compression


def _list_local(part: str, source: str, fmt: str, field_prefix: str, hub_config: str | None = None,
                hub_split: str = "train") -> list[SourceFile]:
    pattern = os.path.expanduser(part)
    if not glob.has_magic(pattern) and not os.path.exists(pattern):
        folder = part.endswith(("/", os.sep))
        fixes = ["create it and put the corpus files there" if folder else "fix the path"]
        fixes += [] if os.path.isabs(pattern) else ["run from the directory it is relative to"]
        raise SourcesNotHere(
            f"{part!r} ({field_prefix}.source={source!r}) does not exist: no "
            f"{'folder' if folder else 'file or folder'} {os.path.abspath(pattern)} (looked from "
            f"{os.getcwd()}); {', '.join(fixes)}, or use {field_prefix}.source=builtin")
    paths = _expand(part, hub_config, hub_split, field_prefix)
    if not paths and os.path.isdir(pattern) and not any(
            p.is_file() for p in Path(pattern).rglob("*")):
        raise SourcesNotHere(f"{part!r} ({field_prefix}.source={source!r}) is an empty folder, "
                             f"{os.path.abspath(pattern)}; put the corpus files there, or use "
                             f"{field_prefix}.source=builtin")
    if not paths and os.path.isdir(pattern):
        raise DataError(f"{part!r} ({field_prefix}.source={source!r}) holds no files of a known "
                        "format (.jsonl, .ndjson, .json, .parquet, .txt, also .gz or .zst; the "
                        "others are named above); convert them, or name them (a file or glob) "
                        f"with {field_prefix}.format")
    if not paths:
        raise SourcesNotHere(f"no files match {part!r} ({field_prefix}.source={source!r}, looked from "
                        f"{os.getcwd()}); fix the path or glob, or use {field_prefix}.source=builtin")
    files = []
    for path in paths:
        stat = path.stat()
        files.append(_source_file(str(path), stat.st_size, str(stat.st_mtime_ns), fmt, source,
                                  field_prefix))
    return files


def _expand(part: str, hub_config: str | None = None, hub_split: str = "train",
            field_prefix: str = "data") -> list[Path]:
    """The files a path, glob or directory names; a directory gives its files in known
    formats: those of split `hub_split` where it is laid out as a Hugging Face hub dataset
    (_hub_splits), else all of them."""
    pattern = os.path.expanduser(part)
    if glob.has_magic(pattern):
        matches = [Path(p) for p in glob.glob(pattern, recursive=True)]
    else:
        matches = [Path(pattern)] if os.path.exists(pattern) else []
    files = []
    for path in matches:
        if path.is_dir():  # hidden files and folders (.git, .cache) hold no corpus
            below = [p for p in path.rglob("*") if p.is_file()
                     and not any(s.startswith(".") for s in p.relative_to(path).parts)]
            names = [p.relative_to(path).as_posix() for p in below]
            _refuse_saved_dataset(str(path), names)
            splits = _hub_splits(path, names, hub_config, field_prefix)
            if splits is not None:
                below, names = _take_split(path, below, splits, hub_split or "train", field_prefix)
            else:
                _warn_split_named(str(path), [n for n in names if _kind(n)[0]])
            files += [p for p in below if _kind(p.name)[0]]
            _warn_left_out(str(path), [n for n in names if not _kind(n)[0]
                                       and not (n == DATASET_CARD and _is_dataset_card(path / n))])
        elif path.is_file():
            files.append(path)
    return [p.resolve() for p in files]


DATASET_CARD = "README.md"
# Words of a file or folder name that name a split other than train (datasets' own names).
_HELD_OUT_WORDS = {"test", "testing", "eval", "evaluation", "valid", "validation", "val", "dev"}


def _looks_like_hub_dataset(folder: Path, names: list[str]) -> bool:
    """A dataset card (README.md with a YAML header) or the hub's shard names
    (train-00000-of-00002.parquet) in the folder or one folder down (data/, a config's
    folder), where the hub puts them. Only such a folder is split by `datasets`'
    conventions: a corpus folder of our users' own (train_notes.jsonl, a dev/ folder,
    scripts, a downloaded hub dataset further down among other corpora) is read whole, as
    before, and its dataset id stays what it was."""
    card = folder / DATASET_CARD
    return (card.is_file() and _is_dataset_card(card)) or any(
        "-of-" in Path(name).name and name.count("/") <= 1 for name in names)


def _warn_split_named(folder: str, names: list[str]) -> None:
    """A folder read whole whose files or folders are named like a held-out split
    (test.jsonl, validation/): they are trained on, which a user may not expect."""
    held_out = [n for n in names
                if _HELD_OUT_WORDS & set(re.split(r"[^a-z]+", n.lower().rsplit(".", 1)[0]))]
    if held_out:
        log.warning("%s is read whole, %s included: named like a held-out split, these are "
                    "trained on; to leave them out, give data.source the files to read (a glob), "
                    "or lay the folder out as a Hugging Face dataset (a dataset card, or "
                    "<split>-00000-of-00001 file names)", folder, _some(sorted(held_out)))


def _hub_splits(folder: Path, names: list[str], hub_config: str | None,
                field_prefix: str) -> dict[str, set[Path]] | None:
    """A folder's splits where it is laid out as a Hugging Face hub dataset, each split's
    files (resolved paths), as `datasets.load_dataset(folder)` finds them, by `datasets`' own
    code: the `configs:` data_files of its dataset card (README.md; the config
    {field_prefix}.hub_config names, else the card's default), else `datasets`' default
    patterns (data/<split>-00000-of-00002.* shard names, then files or folders named for
    splits: train, validation, valid, dev, test, ...). None where it names no splits: a
    folder `datasets` reads whole, as the train split."""
    if not _looks_like_hub_dataset(folder, names):
        return None
    card_patterns = _card_data_files(folder, hub_config, field_prefix)
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    base, patterns = card_patterns if card_patterns is not None else (folder, None)
    if patterns is None:
        try:
            patterns = get_data_patterns(str(base))
        except EmptyDatasetError:
            return None
        if {str(split): p for split, p in patterns.items()} == {"train": ["**"]}:
            return None  # no split naming: everything is train
    try:
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(base))
    except FileNotFoundError as e:  # a pattern of the card that matches no file
        raise DataError(f"{folder}/{DATASET_CARD} (a dataset card) names data files that are not "
                        f"there ({e}); fix its `configs:` data_files, or name the files to read "
                        f"with {field_prefix}.source (a file or glob)") from None
    # Only files of formats read here: a split of scripts or images is no split of the corpus.
    splits = {str(split): {Path(f).resolve() for f in files if _kind(Path(f).name)[0]}
              for split, files in resolved.items()}
    return {split: files for split, files in splits.items() if files} or None


def _is_dataset_card(path: Path) -> bool:
    """Whether a README.md is a Hugging Face dataset card: it opens with a YAML header."""
    with open(path, "rb") as f:
        return f.read(4) in (b"---\n", b"---\r")


def _card_data_files(folder: Path, hub_config: str | None,
                     field_prefix: str) -> tuple[Path, dict[str, list[str]] | None] | None:
    """(where its patterns start, {split: patterns}) of the config a folder's dataset card
    chooses in its YAML header (`configs:` ... `data_files:`), patterns None for a config that
    gives only a data_dir; None where the card has no configs (or there is no card)."""
    card = folder / DATASET_CARD
    if not card.is_file() or not _is_dataset_card(card):  # no YAML header: no configs
        return None
    from datasets.data_files import sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
    except Exception as e:  # broken YAML, or configs datasets refuses
        raise DataError(f"{card} (a dataset card) has a YAML header that datasets cannot read "
                        f"({e}); fix it, or name the files to read with {field_prefix}.source "
                        "(a file or glob)") from None
    if not configs:
        return None
    try:
        name = hub_config or configs.get_default_config_name()
    except ValueError as e:  # several defaults
        raise DataError(f"{card}: {e}; choose one with {field_prefix}.hub_config") from None
    if name not in configs:
        asked = f"has no config {name!r}" if name else "names no default config"
        raise DataError(f"{card} (a dataset card) {asked}; its configs are {sorted(configs)}: "
                        f"set {field_prefix}.hub_config=<one of them>")
    chosen = configs[name]
    base = folder / chosen["data_dir"] if chosen.get("data_dir") else folder
    if chosen.get("data_files") is None:
        return base, None
    return base, sanitize_patterns(chosen["data_files"])


def _take_split(folder: Path, below: list[Path], splits: dict[str, set[Path]], split: str,
                field_prefix: str) -> tuple[list[Path], list[str]]:
    """The files of `split` among a folder's (`below`), and the relative names of those and
    of the folder's other files that are no dataset metadata (its card, dataset_info.json);
    the files of other splits, and those in no split, are logged as left out."""
    from datasets.data_files import FILES_TO_IGNORE

    if split not in splits:
        raise DataError(f"{folder} is laid out as a Hugging Face dataset (datasets' conventions) "
                        f"with the splits {', '.join(sorted(splits))}, none of them {split!r}: set "
                        f"{field_prefix}.hub_split=<one of them>, or name the files to read with "
                        f"{field_prefix}.source (a file or glob)")
    taken = [p for p in below if p.resolve() in splits[split]]
    others = {name: sorted(p.relative_to(folder).as_posix() for p in below if p.resolve() in files)
              for name, files in splits.items() if name != split}
    others = {name: files for name, files in others.items() if files}
    chosen = {p.resolve() for files in splits.values() for p in files}
    unsplit = sorted(p.relative_to(folder).as_posix() for p in below
                     if p.resolve() not in chosen and p.name not in FILES_TO_IGNORE
                     and _kind(p.name)[0])
    left_out = [f"split {name}: {_some(files)}" for name, files in others.items()]
    left_out += [f"in no split: {_some(unsplit)}"] if unsplit else []
    (log.warning if left_out else log.info)(
        "%s is laid out as a Hugging Face dataset: reading its %s split (%d files)%s",
        folder, split, len(taken), "; left out: " + "; ".join(left_out) if left_out else "")
    return taken, [p.relative_to(folder).as_posix() for p in taken]


def _some(names: list[str]) -> str:
    return f"{len(names)} file(s), " + ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _refuse_saved_dataset(folder: str, names: list[str]) -> None:
    """A folder that `datasets`' save_to_disk wrote (`names`: its files, relative) holds Arrow
    files and their JSON metadata, which would be read as JSON Lines and fail on line 1: say
    what it is and how to make a corpus of it."""
    found = set(names)
    marks = sorted(n for n in found if n.rsplit("/", 1)[-1] == "dataset_dict.json"
                   or (n.rsplit("/", 1)[-1] == "state.json"
                       and n.removesuffix("state.json") + "dataset_info.json" in found))
    if marks:
        # load_from_disk takes the folder that holds the marker, which may lie below `folder`.
        below, marker = marks[0].rpartition("/")[::2]
        saved = f"{folder.rstrip('/')}/{below}" if below else folder
        split = "['train']" if marker == "dataset_dict.json" else ""  # a DatasetDict: one split
        raise DataError(f"{folder} holds a dataset saved by datasets' save_to_disk ({marks[0]}): "
                        "Arrow files, which are not read here; write it as parquet and point "
                        f"data.source there, e.g. datasets.load_from_disk({saved!r}){split}"
                        ".to_parquet('corpus.parquet')")


def _warn_left_out(folder: str, names: list[str]) -> None:
    """A folder's files of no known format are not read: say so, lest a corpus of .csv or .md
    files train on nothing but the folder's README."""
    if names:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        log.warning("%s: left out %d file(s) of no known format (%s); only .jsonl, .ndjson, "
                    ".json, .parquet and .txt files (also .gz or .zst) of a folder are read: "
                    "rename the others, or name them (a file or glob) with data.format; files "
                    "compressed otherwise (.xz, .bz2, ...) are read by neither: recompress them "
                    "as .gz or .zst",
                    folder, len(names), shown)


def _source_file(uri: str, size: int, version: str, fmt: str, source: str,
                 field_prefix: str) -> SourceFile:
    detected, compression = _kind(uri)
    file_format = detected if fmt == "auto" else fmt
    if file_format is None:
        raise DataError(f"cannot tell the format of {uri} ({field_prefix}.source={source!r}) from "
                        "its extension; rename it (.jsonl, .json, .parquet, .txt, each optionally "
                        f"with .gz or .zst) or set {field_prefix}.format=json|parquet|text")
    if file_format == "parquet" and compression:
        raise DataError(f"{uri} ({field_prefix}.source={source!r}) is a {compression}-compressed parquet "
                        "file, which cannot be read by row groups; parquet compresses inside: "
                        "decompress it (or write it with compression='zstd')")
    return SourceFile(uri=uri, size=size, version=version, format=file_format, compression=compression)


def _list_s3(uri: str, source: str, fmt: str, storage, field_prefix: str) -> list[SourceFile]:
    """The objects of a known format under the folder `uri`, or the one object it names."""
    try:
        bucket, prefix = parse_s3_uri(uri)
    except ValueError as e:
        raise DataError(f"{field_prefix}.source={source!r}: {e}") from None
    store = _s3_store(bucket, storage)
    try:
        if glob.has_magic(prefix):
            objects = _glob_s3(store, prefix)
        else:
            below = [o for o in store.list_objects(f"{prefix}/" if prefix else "")
                     if not _hidden(o[0][len(prefix):])]
            _refuse_saved_dataset(uri, [o[0][len(prefix):].lstrip("/") for o in below])
            objects = [o for o in below if _kind(o[0])[0]]
            _warn_left_out(uri, [o[0][len(prefix):].lstrip("/") for o in below if not _kind(o[0])[0]])
            if not objects and prefix:  # no folder: maybe the key of one object
                objects = [o for o in store.list_objects(prefix) if o[0] == prefix]
    except FileNotFoundError as e:  # no such bucket
        raise SourcesNotHere(f"{field_prefix}.source={source!r}: {e}; fix the bucket name") from None
    if not objects:
        what = "match" if glob.has_magic(prefix) else "under"
        raise SourcesNotHere(f"no objects of a known format (.jsonl, .json, .parquet, .txt, also .gz "
                        f"or .zst) {what} {uri} ({field_prefix}.source={source!r}); fix the "
                        f"{'glob' if what == 'match' else 'prefix'}")
    return [_source_file(f"s3://{bucket}/{key}", size, etag, fmt, source, field_prefix)
            for key, size, etag in objects]


def _hidden(relative_key: str) -> bool:
    # As for local folders: hidden files and folders (.staging, .cache) hold no corpus.
    return any(part.startswith(".") for part in relative_key.split("/"))


def _glob_s3(store, pattern: str) -> list[tuple[str, int, str]]:
    """The objects (key, size, ETag) a glob over keys names, as glob.glob(recursive=True)
    names local files: `*`, `?` and `[...]` stay within one folder level, a `**` level spans
    any number of them, wildcards match no hidden names, and a matched folder gives the
    objects of known formats below it. Lists only below the part before the first wildcard.
    (Written here: glob.translate is Python 3.13's, and fsspec's glob_translate lets a
    wildcard match hidden names, which local globs here do not.)"""
    fixed = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    list_prefix = fixed[:fixed.rfind("/") + 1]
    matches = re.compile(_glob_regex(pattern.rstrip("/")) + r"(/.*)?").fullmatch
    objects = []
    for key, size, etag in store.list_objects(list_prefix):
        m = matches(key)
        if m is None:
            continue
        below = m.group(1) or ""
        if below and (not _kind(key)[0] or _hidden(below[1:])):
            continue  # under a matched folder: only files of known formats, none hidden
        objects.append((key, size, etag))
    return objects


def _glob_regex(pattern: str) -> str:
    parts, out, sep = pattern.split("/"), [], ""
    for i, part in enumerate(parts):
        if part == "**" and i < len(parts) - 1:  # zero or more folder levels, none hidden
            out.append(sep + "(?:[^/.][^/]*/)*")
            sep = ""
            continue
        if part == "**":  # last: everything below, none hidden
            out.append("(?:/[^/.][^/]*)*" if sep else "(?:[^/.][^/]*(?:/[^/.][^/]*)*)?")
            continue
        # like glob, a wildcard matches no leading dot
        out.append(sep + ("" if part.startswith(".") else r"(?!\.)") + _segment_regex(part))
        sep = "/"
    return "".join(out)


def _segment_regex(part: str) -> str:
    regex, j = [], 0
    while j < len(part):
        c = part[j]
        end = part.find("]", j + 2) if c == "[" else -1
        if c == "*":
            regex.append("[^/]*")
        elif c == "?":
            regex.append("[^/]")
        elif end != -1:  # a character class; [!...] negates, as in glob
            body = part[j + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            regex.append("[" + body.replace("\\", "\\\\") + "]")
            j = end
        else:
            regex.append(re.escape(c))
        j += 1
    return "".join(regex)


def _s3_store(bucket: str, storage):
    """The store of `bucket`, kept per process and settings: opening one (a boto3 client) takes
    about 0.1 s, too much per piece when a unit holds a thousand small objects."""
    endpoint_url, region = getattr(storage, "endpoint_url", None), getattr(storage, "region", None)
    # The environment decides boto3's endpoint and credentials too; hashed, to keep no secret.
    key = sha256_bytes(canonical_json([os.getpid(), bucket, endpoint_url, region,
                                       *(os.environ.get(name) for name in _AWS_ENV)]))
    with _STORES_LOCK:
        if key not in _STORES:
            if len(_STORES) >= 16:  # settings that keep changing (rotated keys): start afresh
                _STORES.clear()
            _STORES[key] = open_store(f"s3://{bucket}", endpoint_url=endpoint_url, region=region)
        return _STORES[key]


def list_hub(name: str, hub_config: str | None = None, hub_split: str = "train",
             revision: str | None = None, *, field_prefix: str = "data") -> SourceFile:
    """A hub dataset (or a local dataset folder, which `datasets` streams the same way) as one
    entry; its shards (data files) are what work units split."""
    ds = _load_hub(name, hub_config, hub_split, revision, field_prefix)
    return SourceFile(uri=f"hub:{name}", size=0, version=revision or "latest", format="hub",
                      hub_config=hub_config, hub_split=hub_split, n_shards=ds.n_shards)


def _load_hub(name: str, hub_config: str | None, hub_split: str, revision: str | None,
              field_prefix: str):
    import datasets  # slow to import; only hub sources need it

    f = field_prefix
    try:
        return datasets.load_dataset(name, hub_config, split=hub_split, revision=revision, streaming=True)
    except ConnectionError as e:
        raise SourcesNotHere(
            f"{f}.source={name!r} is no local file or s3:// URI, so it was read as a Hugging Face "
            f"hub dataset, but the hub is unreachable from here ({e}); use local files "
            f"({f}.source=path/to/*.jsonl) or s3://bucket/prefix, or {f}.source=builtin") from e
    except Exception as e:  # unknown name, config or split; offline, the cache lacks it
        raise SourcesNotHere(f"cannot open hub dataset {name!r} ({f}.hub_config={hub_config}, "
                        f"{f}.hub_split={hub_split}, {f}.revision={revision}): {e}") from e


def fingerprint(files: list[SourceFile]) -> list[list]:
    """The listing as JSON-able rows [uri, size, version, format, compression]."""
    return [[f.uri, f.size, f.version, f.format, f.compression] for f in files]


def content_fingerprint(files: list[SourceFile], storage=None) -> str:
    """A sha256 over every file's bytes (streamed) and name, in listing order.

    File names, not full paths, so a moved copy keeps its id; a hub dataset cannot be read
    whole from here, so its listing row stands in.
    """
    rows = []
    for file in files:
        if file.format == "hub":
            rows.append(fingerprint([file])[0])
            continue
        digest = hashlib.sha256()
        with _open_binary(file, 0, storage) as f:
            while chunk := f.read(8 * MiB):
                digest.update(chunk)
        rows.append([file.uri.rsplit("/", 1)[-1], file.size, digest.hexdigest()])
    return sha256_bytes(canonical_json(rows))


# -- work units ------------------------------------------------------------------------------

def split_into_pieces(files: list[SourceFile], target_bytes: int, *, storage=None,
                      max_files: int = 1024) -> list[list[Piece]]:
    """Work units of about `target_bytes` of input each, in listing order.

    Small files are grouped (at most `max_files` per unit, so a unit stays a small task
    parameter); a larger file is cut into units of its own: byte ranges (uncompressed JSON
    Lines and text), row-group ranges (parquet, from its footer), shard ranges (hub).
    Compressed files cannot be cut and stay whole.
    """
    if target_bytes < 1:
        raise ValueError(f"target_bytes must be positive, not {target_bytes}")
    units: list[list[Piece]] = []
    group: list[Piece] = []
    group_bytes = 0
    for file in files:
        if file.format == "hub" or file.size > target_bytes:
            if group:
                units.append(group)
                group, group_bytes = [], 0
            units += [[piece] for piece in _cut(file, target_bytes, storage)]
            continue
        group.append(Piece(file=file))
        group_bytes += file.size
        if group_bytes >= target_bytes or len(group) >= max_files:
            units.append(group)
            group, group_bytes = [], 0
    if group:
        units.append(group)
    return units


def _cut(file: SourceFile, target_bytes: int, storage) -> list[Piece]:
    if file.format == "hub":  # a shard per unit, unless that would make too many units
        step = -(-file.n_shards // MAX_HUB_UNITS)
        return [Piece(file=file, start=i, stop=min(i + step, file.n_shards))
                for i in range(0, file.n_shards, step)]
    if file.compression:
        return [Piece(file=file)]
    if file.format == "parquet":
        return _row_group_pieces(file, target_bytes, storage)
    # The nearest whole number of pieces, not the next: a file just over a multiple of the
    # target (64 MiB + a line, at 16 MiB) would otherwise end in a sliver, one more task
    # run and one more unit at the tail.
    n = max(1, round(file.size / target_bytes))
    if n == 1:
        return [Piece(file=file)]
    bounds = [file.size * k // n for k in range(n + 1)]
    return [Piece(file=file, start=a, stop=b) for a, b in zip(bounds, bounds[1:])]


def _row_group_pieces(file: SourceFile, target_bytes: int, storage) -> list[Piece]:
    """Consecutive row groups of about `target_bytes` (compressed) per piece; reads the footer."""
    with _open_binary(file, 0, storage) as f:
        meta = _parquet_file(_Counted(f), file).metadata
    pieces, first, size = [], 0, 0
    for i in range(meta.num_row_groups):
        size += _row_group_bytes(meta.row_group(i))
        if size >= target_bytes or i == meta.num_row_groups - 1:
            pieces.append(Piece(file=file, start=first, stop=i + 1))
            first, size = i + 1, 0
    return pieces if len(pieces) > 1 else [Piece(file=file)]


def _row_group_bytes(row_group) -> int:
    return sum(row_group.column(j).total_compressed_size for j in range(row_group.num_columns))


# -- reading ---------------------------------------------------------------------------------

class _Skipped:
    """What a reader yields for a bad record it skipped (data.on_bad_record=skip)."""


_SKIPPED = _Skipped()


def read_documents(piece: Piece, text_column: str = "text", *, on_bad_record: str = "error",
                   storage=None, batch_bytes: int = 8 * MiB,
                   field_prefix: str = "data") -> DocumentBatches:
    """The non-empty documents of `piece`, as batches (lists) of about `batch_bytes` of text
    (`field_prefix`: as list_source's)."""
    if piece.file.compression and (piece.start or piece.stop is not None):
        raise ValueError(f"{piece.describe()}: a compressed file can only be read whole")
    return DocumentBatches(piece, text_column, on_bad_record, storage, batch_bytes, field_prefix)


class DocumentBatches:
    """The documents of one piece in batches of about `batch_bytes` characters of text.

    Each iteration reads the piece anew and keeps counts as it goes: `docs` (documents
    yielded), `skipped` (bad records skipped, with on_bad_record="skip"), `empty` (records
    whose text is empty, whitespace or null: dropped, as they hold nothing to learn) and `bytes_read`:
    the input consumed, as stored (compressed bytes for .gz/.zst; for uncompressed byte
    ranges the bytes of the lines the piece owns, so pieces add up to the file; parquet: the
    compressed size of the row groups done; hub: characters of text).
    """

    def __init__(self, piece: Piece, text_column: str, on_bad_record: str, storage, batch_bytes: int,
                 field_prefix: str = "data"):
        if on_bad_record not in ("error", "skip"):
            raise ValueError(f"on_bad_record must be 'error' or 'skip', not {on_bad_record!r}")
        self.piece, self.text_column, self.on_bad_record = piece, text_column, on_bad_record
        self.storage, self.batch_bytes, self.field_prefix = storage, batch_bytes, field_prefix
        self.docs = self.skipped = self.empty = self.bytes_read = 0

    def __iter__(self) -> Iterator[list[str]]:
        self.docs = self.skipped = self.empty = self.bytes_read = 0
        uri = self.piece.file.uri
        texts = {"json": self._json_texts, "text": self._text_texts, "parquet": self._parquet_texts,
                 "hub": self._hub_texts}[self.piece.file.format]()
        batch: list[str] = []
        size = 0
        try:
            for text in texts:
                if text is _SKIPPED:  # counted in self.skipped
                    continue
                if not text or text.isspace():
                    self.empty += 1
                    continue
                batch.append(text)
                size += len(text)
                if size >= self.batch_bytes:
                    self.docs += len(batch)
                    yield batch
                    batch, size = [], 0
        except FileNotFoundError as e:  # a retry helps if it was being replaced
            raise FileNotFoundError(f"{uri} vanished after it was listed ({e})") from e
        except ObjectChangedError as e:
            raise DataError(f"{uri} changed after it was listed ({e}); prepare again, so that "
                            "the new version is listed and named") from e
        if batch:
            self.docs += len(batch)
            yield batch

    # -- formats ----------------------------------------------------------------------------

    def _json_texts(self) -> Iterator[str | None]:
        start = self.piece.start
        with self._stream(max(start - 1, 0)) as (raw, read):
            if start == 0:
                first, read = _peek(read)
                if first == b"[":
                    yield from self._json_array(raw, read)
                    return
            else:
                with self._stream(0, buffer_size=64 * 1024) as (_, head):
                    if _peek(head)[0] == b"[":
                        return  # a JSON array: the piece at offset 0 reads it whole
            for where, line in self._owned_lines(raw, read):
                if not line.strip():
                    continue
                try:
                    obj = _loads(line)
                except ValueError as e:  # also bytes that are no UTF-8
                    # The parser's "line 1 column N" counts within this one line.
                    self._bad(where(), f"is not valid JSON ({_ONE_LINE.sub(_COLUMN, str(e))})")
                    continue
                yield self._field(obj, where)

    def _json_array(self, raw: _Counted, read: Callable[[int], bytes]) -> Iterator[str | None]:
        uri = self.piece.file.uri
        data = bytearray()
        while chunk := read(_CHUNK):
            data += chunk
            if len(data) > MAX_WHOLE_JSON:
                raise DataError(f"{uri} is a JSON array over {MAX_WHOLE_JSON // MiB} MiB, too large "
                                "to parse whole; convert it to JSON Lines (one object per line, .jsonl)")
        try:
            items = _loads(data.removeprefix(_BOM))
        except ValueError as e:  # one broken array: no record can be skipped on its own
            raise DataError(f"{uri} is not valid JSON ({e}); fix or replace the file") from None
        self.bytes_read = raw.count
        for i, item in enumerate(items):
            yield self._field(item, lambda i=i: f"{uri} element {i}")

    def _text_texts(self) -> Iterator[str]:
        with self._stream(max(self.piece.start - 1, 0)) as (raw, read):
            for where, line in self._owned_lines(raw, read):
                try:
                    yield line.removesuffix(b"\r").decode()
                except UnicodeDecodeError as e:
                    self._bad(where(), f"is not UTF-8 text ({e})")

    def _parquet_texts(self) -> Iterator[str | None]:
        file, column = self.piece.file, self.text_column
        with _open_binary(file, 0, self.storage) as f:
            raw = _Counted(f)
            pf = _parquet_file(raw, file, self.field_prefix)
            _check_text_column(pf.schema_arrow, column, file.uri, self.field_prefix)
            meta = pf.metadata
            stop = meta.num_row_groups if self.piece.stop is None else min(self.piece.stop, meta.num_row_groups)
            for i in range(self.piece.start, stop):
                rows = _rows_per_batch(meta.row_group(i), column, self.batch_bytes)
                try:
                    for batch in pf.iter_batches(batch_size=rows, row_groups=[i], columns=[column],
                                                 use_threads=False):
                        yield from batch.column(0).to_pylist()
                except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
                    if raw.error is not None:
                        raise
                    raise DataError(f"{file.uri} row group {i} cannot be read ({e}); fix or "
                                    "replace the file") from e
                self.bytes_read += _row_group_bytes(meta.row_group(i))

    def _hub_texts(self) -> Iterator[str | None]:
        file, column = self.piece.file, self.text_column
        name = file.uri.removeprefix("hub:")
        ds = _load_hub(name, file.hub_config, file.hub_split,
                       None if file.version == "latest" else file.version, self.field_prefix)
        if ds.n_shards != file.n_shards:
            raise DataError(f"hub dataset {name!r} has {ds.n_shards} shards now, {file.n_shards} "
                            f"when listed; pin {self.field_prefix}.revision so the data cannot "
                            "change under a run")
        if ds.column_names is not None:
            if column not in ds.column_names:
                raise DataError(f"hub dataset {name!r} has no column {column!r}; its columns are "
                                f"{ds.column_names}: set {self.field_prefix}.text_column=<one of them>")
            ds = ds.select_columns([column])
        stop = file.n_shards if self.piece.stop is None else self.piece.stop
        for shard in range(self.piece.start, stop):
            for i, row in enumerate(ds.shard(num_shards=file.n_shards, index=shard)):
                text = self._field(row, lambda s=shard, i=i: f"{file.uri} shard {s} row {i}")
                self.bytes_read += len(text or "")
                yield text

    # -- records ----------------------------------------------------------------------------

    def _owned_lines(self, raw: _Counted, read: Callable[[int], bytes]
                     ) -> Iterator[tuple[Callable[[], str], bytes]]:
        """(where, line) for each line this piece owns: those that start in [start, stop).

        The stream begins at start - 1 (when start > 0), and everything through the first
        newline belongs to the piece before: a line starting exactly at `start` is kept.
        `where` names the line for errors: its number from the file's start, else its offset.
        """
        file, start, stop = self.piece.file, self.piece.start, self.piece.stop
        lines = _lines(read, max(start - 1, 0), file.uri, self.field_prefix)
        if start > 0:
            next(lines, None)
        first = None
        for n, (offset, line) in enumerate(lines, 1):
            if stop is not None and offset >= stop:
                break
            first = offset if first is None else first
            if offset == 0:
                line = line.removeprefix(_BOM)
            self.bytes_read = raw.count if file.compression else min(offset + len(line) + 1, file.size) - first
            if start == 0:
                yield (lambda n=n: f"{file.uri} line {n}"), line
            else:
                yield (lambda o=offset: f"{file.uri} line at byte {o}"), line

    def _field(self, obj, where: Callable[[], str]) -> str | None | _Skipped:
        """The text of one record (None if null), _SKIPPED if it is bad and skipped."""
        if not isinstance(obj, dict):
            return self._bad(where(), f"is a JSON {type(obj).__name__}, not an object")
        if self.text_column not in obj:
            fields = ", ".join(list(obj)[:10])
            return self._bad(where(), f"has no field {self.text_column!r} (it has: {fields}); set "
                             f"{self.field_prefix}.text_column if the text is in another field")
        value = obj[self.text_column]
        if value is not None and not isinstance(value, str):
            return self._bad(where(), f"holds {type(value).__name__} in {self.text_column!r}, not text")
        return value

    def _bad(self, where: str, what: str) -> _Skipped:
        if self.on_bad_record == "error":
            raise DataError(f"{where} {what}; {_BAD_RECORD_FIX}")
        if not self.skipped:  # the first says what is skipped; the count says how many
            log.warning("skipping bad records in %s (data.on_bad_record=skip), the first: %s %s",
                        self.piece.describe(), where, what)
        self.skipped += 1
        return _SKIPPED

    @contextmanager
    def _stream(self, start: int, buffer_size: int = 8 * MiB
                ) -> Iterator[tuple[_Counted, Callable[[int], bytes]]]:
        """The piece's file from byte `start`: its raw bytes (counted) and a decompressed `read`."""
        with _open_binary(self.piece.file, start, self.storage, buffer_size) as f:
            raw = _Counted(f)
            yield raw, _decompressed(raw, self.piece.file)


# -- bytes -----------------------------------------------------------------------------------

@contextmanager
def _open_binary(file: SourceFile, start: int, storage, buffer_size: int = 8 * MiB) -> Iterator[BinaryIO]:
    """A seekable binary file over a local path or S3 object, positioned at `start`."""
    if file.uri.startswith("s3://"):
        bucket, key = parse_s3_uri(file.uri)
        f = _s3_store(bucket, storage).open_read(key, start, etag=file.version, buffer_size=buffer_size)
    else:
        f = open(file.uri, "rb")
        f.seek(start)
    with f:
        yield f


class _Counted(io.RawIOBase):
    """A file's bytes as read from storage, counted. It records the storage's own errors, so
    that a decompressor or parquet reader failing on top of it can be told to be a data
    problem (a corrupt file) rather than an I/O one (worth a retry)."""

    def __init__(self, f: BinaryIO):
        self._f, self.count, self.error = f, 0, None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer) -> int:
        try:
            n = self._f.readinto(buffer)
        except BaseException as e:
            self.error = e
            raise
        self.count += n
        return n


def _decompressed(raw: _Counted, file: SourceFile) -> Callable[[int], bytes]:
    """`read(n)` of the file's content; a corrupt compressed stream raises DataError."""
    if not file.compression:
        return raw.read
    if file.compression == "gzip":
        stream = gzip.GzipFile(fileobj=raw, mode="rb")
    else:
        stream = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")

    def read(n: int) -> bytes:
        try:
            return stream.read(n)
        except Exception as e:
            if raw.error is not None:  # storage failed, not the data: keep its error
                raise
            raise DataError(f"{file.uri} is not a valid {file.compression} file ({e}); a corrupt "
                            "compressed stream cannot be skipped record by record: fix or "
                            "replace the file") from e

    return read


def _peek(read: Callable[[int], bytes]) -> tuple[bytes, Callable[[int], bytes]]:
    """The first non-whitespace byte of a stream, after any BOM (b"" if none early on), and a
    `read` that still returns the stream from its start."""
    head = b""
    while len(head) < _CHUNK and not head.strip() and (chunk := read(64 * 1024)):
        head += chunk
    pending = [head] if head else []
    return head.removeprefix(_BOM).lstrip()[:1], lambda n: pending.pop() if pending else read(n)


def _lines(read: Callable[[int], bytes], offset: int, uri: str,
           field_prefix: str = "data") -> Iterator[tuple[int, bytes]]:
    """(offset, line without b"\\n") for each line of a stream that begins at `offset`."""
    parts: list[bytes] = []  # the line read so far, joined once its end arrives
    pending = 0
    while chunk := read(_CHUNK):
        cut = chunk.rfind(b"\n")
        if cut < 0:
            parts.append(chunk)
            pending += len(chunk)
            if pending > MAX_LINE:
                raise DataError(f"{uri} has a line over {MAX_LINE // MiB} MiB at byte {offset}: "
                                "not JSON Lines or text with one document per line; fix "
                                f"{field_prefix}.format")
            continue
        lines = b"".join([*parts, chunk[:cut]]).split(b"\n")
        parts = [chunk[cut + 1 :]]
        pending = len(parts[0])
        for line in lines:
            yield offset, line
            offset += len(line) + 1
    if tail := b"".join(parts):
        yield offset, tail


def _parquet_file(raw: _Counted, file: SourceFile, field_prefix: str = "data") -> pq.ParquetFile:
    try:  # buffer_size: read column chunks page by page, so memory stays bounded
        return pq.ParquetFile(raw, buffer_size=8 * MiB)
    except (pa.ArrowException, OSError) as e:
        if raw.error is not None:
            raise
        raise DataError(f"{file.uri} is not a readable parquet file ({e}); fix or replace it, or "
                        f"set {field_prefix}.format if its extension is misleading") from e


def _check_text_column(schema: pa.Schema, column: str, uri: str, field_prefix: str = "data") -> None:
    if column not in schema.names:
        raise DataError(f"{uri} has no column {column!r}; its columns are {schema.names}: set "
                        f"{field_prefix}.text_column=<one of them>")
    kind = schema.field(column).type
    if pa.types.is_dictionary(kind):  # a categorical column (pandas): read as its values
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"column {column!r} of {uri} holds {kind}, not text; set "
                        f"{field_prefix}.text_column to a text column")


def _rows_per_batch(row_group, column: str, batch_bytes: int) -> int:
    """Rows of about `batch_bytes` of text, from the column's size in the footer."""
    for j in range(row_group.num_columns):
        chunk = row_group.column(j)
        if chunk.path_in_schema == column:
            per_row = chunk.total_uncompressed_size / max(1, row_group.num_rows)
            return int(min(65536, max(1, batch_bytes // max(1.0, per_row))))
    return 1024
