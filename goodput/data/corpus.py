"""Documents to pretrain on, as a Hugging Face `datasets.Dataset` with one `text` column.

`data.source` is one of:
- `builtin`: a corpus built at run time from the documentation every Python installation
  ships (the help() topics and the docstrings of the standard library), so the pipeline
  runs anywhere, offline, without bundling third-party text;
- local files: a path, a glob, a directory, or a comma-separated list of those; json/jsonl
  (one object per document), parquet (one row per document) or txt (one document per line);
- anything else: a Hugging Face hub dataset name (needs network).

Every problem with the input raises `DataError`, worded for the user: which file or field,
what is wrong, what to change. Retrying cannot fix these, so the tasks fail at once on them.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np

from core.config import DataConfig
from core.errors import DataError
from core.files import canonical_json, sha256_bytes, sha256_file, write_atomic

BUILTIN = "builtin"
FORMAT_OF_EXTENSION = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
BUILTIN_VERSION = 1  # bump when the builtin corpus builder would write different text
# Standard-library folders whose docstrings are not prose worth learning from.
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "__pycache__"}

datasets.disable_progress_bars()  # one bar per load and filter would flood the run logs


# -- finding the source ---------------------------------------------------------------------

def resolve_files(source: str) -> list[Path] | None:
    """The local files `source` names, sorted; None when `source` is a hub dataset name."""
    parts = [p.strip() for p in source.split(",") if p.strip()]
    if not any(_looks_local(p) for p in parts):
        return None
    files: set[Path] = set()
    for part in parts:
        matched = _expand(part)
        if not matched:
            raise DataError(f"no files match {part!r} (data.source={source!r}, looked from "
                            f"{os.getcwd()}); fix the path or glob, or use data.source=builtin")
        files.update(matched)
    return sorted(files)


def _looks_local(part: str) -> bool:
    # A hub name ("owner/name") has no extension, no glob characters and no local match.
    path = Path(part).expanduser()
    return (glob.has_magic(part) or path.exists() or path.suffix in FORMAT_OF_EXTENSION
            or part.startswith((".", "/", "~")))


def _expand(part: str) -> list[Path]:
    pattern = os.path.expanduser(part)
    if glob.has_magic(pattern):
        matches = [Path(p) for p in glob.glob(pattern, recursive=True)]
    else:
        matches = [Path(pattern)] if os.path.exists(pattern) else []
    files = []
    for path in matches:
        if path.is_dir():  # a directory contributes the files it holds in known formats
            files += [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                      and p.suffix in FORMAT_OF_EXTENSION]
        elif path.is_file():
            files.append(path)
    return [p.resolve() for p in files]


def file_format(files: list[Path], fmt: str) -> str:
    """The `datasets` builder for `files`: `fmt` itself, or ("auto") their common extension's."""
    if fmt != "auto":
        return fmt
    formats = {}
    for path in files:
        if path.suffix not in FORMAT_OF_EXTENSION:
            raise DataError(f"cannot tell the format of {path} from its extension; rename it "
                            f"({', '.join(FORMAT_OF_EXTENSION)}) or set data.format=json|parquet|text")
        formats.setdefault(FORMAT_OF_EXTENSION[path.suffix], path)
    if len(formats) > 1:
        examples = ", ".join(f"{name} ({path.name})" for name, path in formats.items())
        raise DataError(f"data.source mixes formats: {examples}; use files of one format")
    return next(iter(formats))


def source_files(cfg: DataConfig, workdir: str | os.PathLike) -> list[Path] | None:
    """The files the documents come from (the builtin corpus is built first); None for hub."""
    return [build_builtin_corpus(workdir)] if cfg.source == BUILTIN else resolve_files(cfg.source)


def source_fingerprint(cfg: DataConfig, workdir: str | os.PathLike) -> str:
    """A hash of the source's content: changes when (and only when) the documents can change.

    Local files: names and bytes, in sorted order. Hub datasets cannot be hashed from here,
    so their coordinates stand in (pin data.revision to make that meaningful).
    """
    files = source_files(cfg, workdir)
    if files is None:
        coordinates = ["hub", cfg.source, cfg.hub_config, cfg.hub_split, cfg.revision]
        return sha256_bytes(canonical_json(coordinates))
    return sha256_bytes(canonical_json([[f.name, sha256_file(f)] for f in files]))


def describe_source(cfg: DataConfig) -> str:
    """One line saying where the documents come from, for manifests and logs."""
    if cfg.source == BUILTIN:
        return f"builtin: Python {sys.version.split()[0]} help topics and stdlib docstrings"
    if resolve_files(cfg.source) is None:
        return (f"hub: {cfg.source} (config={cfg.hub_config}, split={cfg.hub_split}, "
                f"revision={cfg.revision or 'latest'})")
    return f"files: {cfg.source}"


# -- loading --------------------------------------------------------------------------------

def load_documents(cfg: DataConfig, workdir: str | os.PathLike) -> datasets.Dataset:
    """The non-empty documents of the source, in source order, as a `text` column.

    `workdir` holds what loading produces: the builtin corpus and the `datasets` cache.
    """
    cache_dir = str(Path(workdir) / "hf-cache")
    files = source_files(cfg, workdir)
    if files is None:
        table = _load_hub(cfg, cache_dir)
    else:
        table = _load_files(files, file_format(files, cfg.format), cache_dir)
    column = "text" if cfg.source == BUILTIN else cfg.text_column
    return _text_documents(table, column, cfg.source)


def _load_hub(cfg: DataConfig, cache_dir: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(cfg.source, cfg.hub_config, split=cfg.hub_split,
                                     revision=cfg.revision, cache_dir=cache_dir)
    except ConnectionError as e:
        raise DataError(
            f"data.source={cfg.source!r} is no local file, so it was read as a Hugging Face hub "
            f"dataset, but the hub is unreachable from here ({e}); use local files instead "
            "(data.source=path/to/*.jsonl, json/jsonl/parquet/txt) or data.source=builtin") from e
    except Exception as e:  # unknown name, config or split: the hub said no
        raise DataError(f"cannot load hub dataset {cfg.source!r} (data.hub_config="
                        f"{cfg.hub_config}, data.hub_split={cfg.hub_split}, data.revision="
                        f"{cfg.revision}): {e}") from e


def _load_files(files: list[Path], fmt: str, cache_dir: str) -> datasets.Dataset:
    try:
        return _load_builder(files, fmt, cache_dir)
    except Exception as e:
        if isinstance(_root_cause(e), OSError):
            raise  # I/O trouble (a network filesystem, a full disk): worth a retry as it is
        raise _unreadable(files, fmt, cache_dir, e) from e


def _load_builder(files: list[Path], fmt: str, cache_dir: str) -> datasets.Dataset:
    return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train",
                                 cache_dir=cache_dir)


def _unreadable(files: list[Path], fmt: str, cache_dir: str, error: Exception) -> DataError:
    """Name the file that cannot be read; `datasets` reports parse errors without it."""
    if len(files) == 1:
        return DataError(f"cannot read {files[0]} as {fmt}: {_root_cause(error)}; fix or remove "
                         "the file, or set data.format if its extension is misleading")
    for path in files:
        try:
            _load_builder([path], fmt, cache_dir)
        except Exception as e:
            return _unreadable([path], fmt, cache_dir, e)
    return DataError(f"the {len(files)} files of data.source load one by one but not together "
                     f"(different columns or types?): {_root_cause(error)}")


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _text_documents(ds: datasets.Dataset, column: str, source: str) -> datasets.Dataset:
    """Keep only `column`, named `text`, without empty or whitespace-only documents."""
    if column not in ds.column_names:
        raise DataError(f"data.source={source!r} has no column {column!r}; its columns are "
                        f"{ds.column_names}: set data.text_column=<one of them>")
    dtype = getattr(ds.features[column], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(f"column {column!r} of data.source={source!r} holds {ds.features[column]}, "
                        "not text; set data.text_column to a text column")
    ds = ds.select_columns([column])
    if column != "text":
        ds = ds.rename_column(column, "text")
    n_rows = len(ds)
    ds = ds.filter(lambda batch: [bool(t and not t.isspace()) for t in batch["text"]], batched=True)
    if len(ds) == 0:
        raise DataError(f"data.source={source!r} holds no text: all {n_rows} documents in column "
                        f"{column!r} are empty or whitespace; point data.source at files with text")
    return ds


# -- splitting ------------------------------------------------------------------------------

def split_documents(ds: datasets.Dataset, validation_fraction: float, seed: int = 0,
                    ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation), chosen by a seeded permutation; each keeps the source order.

    Validation gets round(n * fraction) documents, at least one; train must keep at least one.
    """
    n_docs = len(ds)
    n_validation = max(1, round(n_docs * validation_fraction))
    if n_validation >= n_docs:
        raise DataError(f"{n_docs} document(s) cannot be split into non-empty train and "
                        f"validation sets (data.validation_fraction={validation_fraction}); "
                        "add documents or change data.validation_fraction")
    order = np.random.default_rng(seed).permutation(n_docs)
    return ds.select(np.sort(order[n_validation:])), ds.select(np.sort(order[:n_validation]))


# -- the builtin corpus ---------------------------------------------------------------------

def build_builtin_corpus(workdir: str | os.PathLike) -> Path:
    """A jsonl corpus (one {"text": ...} per line) of the documentation Python ships.

    Built once per Python installation and kept in `workdir`: the stdlib does not change
    under a given interpreter, and parsing it takes a few seconds.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = sha256_bytes(f"{BUILTIN_VERSION}\0{sys.version}\0{stdlib}".encode())[:12]
    path = Path(workdir) / f"builtin-{key}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in builtin_texts(stdlib)]
        write_atomic(path, "".join(lines).encode())
    return path


def builtin_texts(stdlib: Path) -> Iterator[str]:
    """The help() topics, then one document per stdlib module, class and function docstring.

    Read from source with `ast`, never imported, in sorted path order so every run yields
    the same text.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package pydoc_data separately
        topics = {}
    for name in sorted(topics):
        yield topics[name]
    for path in _stdlib_sources(stdlib):
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        yield from _docstrings(path, module)


def _stdlib_sources(stdlib: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # Only importable package names: skips site-packages, lib-dynload, config-3.x-...
        dirnames[:] = sorted(d for d in dirnames if d.isidentifier() and d not in _SKIPPED_STDLIB_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def _docstrings(path: Path, module: str) -> Iterator[str]:
    """"<qualified name>\\n\\n<docstring>" for the module and each class and function in it."""
    try:
        with warnings.catch_warnings():  # invalid escape sequences in old modules
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):  # e.g. a file for another Python version
        return
    yield from _named_docstrings(tree, module)


def _named_docstrings(node: ast.AST, name: str) -> Iterator[str]:
    doc = ast.get_docstring(node)
    if doc:
        yield f"{name}\n\n{doc}"
    for child in node.body:
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _named_docstrings(child, f"{name}.{child.name}")
