"""The builtin corpus: documents built at run time from the documentation every Python
installation ships (the help() topics and the docstrings of the standard library), so the
pipeline runs anywhere, offline, without bundling third-party text. `data.source=builtin`.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from core.files import sha256_bytes, user_cache_dir, write_atomic

BUILTIN = "builtin"
BUILTIN_VERSION = 1  # bump when the builtin corpus builder would write different text
# Standard-library folders whose docstrings are not prose worth learning from.
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "__pycache__"}


def builtin_description() -> str:
    """One line saying where the builtin documents come from, for manifests and logs."""
    return f"builtin: Python {sys.version.split()[0]} help topics and stdlib docstrings"


# -- the builtin corpus ---------------------------------------------------------------------

def build_builtin_corpus(workdir: str | os.PathLike) -> Path:
    """A jsonl corpus (one {"text": ...} per line) of the documentation Python ships.

    Kept in `workdir` (data.data_dir's sources/, which every machine of a run may read) and
    built once per Python installation: the stdlib does not change under a given interpreter,
    and parsing it takes 4-10 s on 2 cores, so a build goes to the user's cache
    (core.files.user_cache_dir) and each new data directory copies it.
    Where that cache cannot be written, the build goes to `workdir` alone.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = sha256_bytes(f"{BUILTIN_VERSION}\0{sys.version}\0{stdlib}".encode())[:12]
    path = Path(workdir) / f"builtin-{key}.jsonl"
    if path.exists():
        return path
    cached = user_cache_dir() / path.name
    try:
        if not cached.exists():
            _write_corpus(cached, stdlib)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, cached.read_bytes())  # 2.7 MB: a copy, never a link into the cache
    except OSError:  # a read-only or full home: build where the run keeps its data
        if not path.exists():
            _write_corpus(path, stdlib)
    return path


def _write_corpus(path: Path, stdlib: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in builtin_texts(stdlib)]
    write_atomic(path, "".join(lines).encode())


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
