"""The contracts between stages that describe data on disk (see shared/DESIGN.md, section 2).

Each manifest is a pydantic model serialised as JSON next to the data it describes and is
written last: its presence means everything it lists is complete.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, Field

from core.files import sha256_file, write_atomic
from core.protocol import CHECKPOINT_MANIFEST

DATASET_MANIFEST = "manifest.json"
MIXTURE_MANIFEST = "mixture.json"  # in a directory of its own: the mix training reads


class FileEntry(BaseModel):
    """One file of a checkpoint or dataset: path relative to the manifest, size, sha256."""

    path: str
    size: int
    sha256: str


class ShardInfo(BaseModel):
    """One Arrow IPC file of token ids: a table with one row per document."""

    path: str  # relative to the dataset directory
    n_tokens: int
    n_docs: int
    size: int
    sha256: str


class DatasetManifest(BaseModel):
    dataset_id: str = Field(description="Hash of source fingerprint + tokenizer + prep params.")
    source: str = Field(description="Human-readable description of the text source.")
    tokenizer: str = Field(description="Path of tokenizer.json relative to the dataset directory.")
    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    doc_prefix_ids: list[int] = Field(default_factory=list, description="The ids every document "
                                      "starts with: the tokenizer template's (a BOS), or none.")
    dtype: Literal["uint8", "uint16", "uint32"]
    splits: dict[str, list[ShardInfo]]
    skipped_records: int = Field(0, description="Bad records skipped (data.on_bad_record=skip).")
    empty_records: int = Field(0, description="Records whose text is empty, whitespace or null: "
                               "not documents, dropped.")
    source_bytes: int = Field(0, description="Input bytes read to make the shards.")
    created_at: float

    def n_tokens(self, split: str) -> int:
        return sum(s.n_tokens for s in self.splits[split])

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=2).encode()

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / DATASET_MANIFEST
        write_atomic(path, self.to_json())
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "DatasetManifest":
        return cls.model_validate_json((Path(directory) / DATASET_MANIFEST).read_text())


class MixSource(BaseModel):
    name: str
    weight: float = Field(description="Its share of training tokens from the start (data.sources).")
    dataset_id: str
    dir: str | None = Field(None, description="Where training reads it on this machine: the "
                            "dataset dir or its shard cache (set when training locates it).")


class MixtureManifest(BaseModel):
    """A mixture of prepared datasets that share one tokenizer (data.sources)."""

    dataset_id: str = Field(description="The mix's id: a hash of its sources' names, weights "
                            "and dataset ids.")
    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    sources: list[MixSource]

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / MIXTURE_MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.model_dump_json(indent=2).encode())
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "MixtureManifest":
        return cls.model_validate_json((Path(directory) / MIXTURE_MANIFEST).read_text())


def dataset_id_of(directory: str | os.PathLike) -> str:
    """The id of the dataset or mixture in `directory` (what a report was evaluated on)."""
    if (Path(directory) / MIXTURE_MANIFEST).is_file():
        return MixtureManifest.load(directory).dataset_id
    return DatasetManifest.load(directory).dataset_id


class CheckpointManifest(BaseModel):
    """Written by rank 0 after every shard of a DCP save is durable."""

    step: int
    tokens_seen: int
    data_position: int = Field(0, description="Global sample index the data loader resumes at.")
    files: list[FileEntry]
    world_size: int
    layout: dict[str, int]
    config_hash: str
    dataset_id: str
    model_args: dict = Field(description="Arguments that rebuild the model (training.model.ModelArgs).")
    loss: float | None = None
    seq_len: int | None = Field(None, description="Tokens per sample the loss was measured at "
                                "(training.seq_len); the held-out check uses the same.")
    eos_id: int | None = Field(None, description="The end-of-document id of the data the model "
                               "trained on (its dataset manifest's); export writes it.")
    tokenizer_sha256: str | None = Field(None, description="The tokenizer of the data the model "
                                         "trained on: a resume on data of another is refused.")
    trajectory: dict | None = Field(None, description="RunConfig.trajectory() of the run that "
                                    "saved it: a resume or an adoption under another is refused.")
    created_at: float

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / CHECKPOINT_MANIFEST
        write_atomic(path, self.model_dump_json(indent=2).encode())
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "CheckpointManifest":
        return cls.model_validate_json((Path(directory) / CHECKPOINT_MANIFEST).read_text())


def list_files(directory: str | os.PathLike, exclude: tuple[str, ...] = (),
               known: Mapping[str, FileEntry] | None = None) -> list[FileEntry]:
    """Every regular file under `directory` (recursively) with size and sha256, sorted.

    `known`: entries (by relative path) of files hashed as they were written; those are not
    read again, the others are hashed here. ValueError naming the file when a known file is
    missing, or its size on disk differs from what its writer wrote (it changed since)."""
    root, known = Path(directory), known or {}
    entries = []
    for p in sorted(root.rglob("*")):
        # DCP's own `.metadata` counts; our in-flight temporary files do not.
        if p.is_file() and p.name not in exclude and ".tmp-" not in p.name:
            rel, size = p.relative_to(root).as_posix(), p.stat().st_size
            if rel in known and known[rel].size != size:
                raise ValueError(f"{p}: {size} bytes on disk, but its writer wrote {known[rel].size}")
            entries.append(known[rel] if rel in known else FileEntry(path=rel, size=size, sha256=sha256_file(p)))
    missing = sorted(set(known) - {e.path for e in entries})
    if missing:  # written, yet not here (another node's disk, a stale listing, deleted)
        raise ValueError(f"{root}: {', '.join(missing)} written but not found")
    return entries


def verify_files(directory: str | os.PathLike, files: list[FileEntry]) -> list[str]:
    """Problems found comparing `directory` against `files`; empty when everything matches."""
    root = Path(directory)
    problems = []
    for entry in files:
        p = root / entry.path
        if not p.is_file():
            problems.append(f"missing file {entry.path}")
            continue
        size = p.stat().st_size
        if size != entry.size:
            problems.append(f"{entry.path}: size {size} != manifest {entry.size}")
            continue
        digest = sha256_file(p)
        if digest != entry.sha256:
            problems.append(f"{entry.path}: sha256 {digest[:12]}… != manifest {entry.sha256[:12]}…")
    return problems


class EvalSample(BaseModel):
    prompt: str
    completion: str


class EvalReport(BaseModel):
    """Held-out quality of one checkpoint."""

    run_id: str
    step: int
    checkpoint: str
    dataset_id: str
    loss: float
    perplexity: float
    tokens_evaluated: int
    samples: list[EvalSample]
    wall_time_s: float
    created_at: float
    # What the report depends on besides the step: the copy of the checkpoint evaluated (a
    # step saved again is another copy) and the evaluation settings (RunConfig.eval_hash).
    # A report is reused only for the same of both; older reports without them never are.
    copy_id: str | None = None
    eval_hash: str | None = None
    # A mixture: the held-out loss of each source (`loss` is theirs, weighted as the mix).
    source_losses: dict[str, float] = Field(default_factory=dict)
    # Bits per UTF-8 byte of the held-out text: comparable across tokenizers, unlike the
    # loss (nats per token). A mix's is its sources', weighted as its loss is.
    bits_per_byte: float | None = None
    # lm-evaluation-harness scores of eval.tasks: task -> metric -> value (e.g.
    # {"hellaswag": {"acc": 0.29, "acc_stderr": 0.01, "acc_norm": 0.31, ...}}).
    downstream: dict[str, dict[str, float]] = Field(default_factory=dict)
    # The downstream scores ('<task>/<metric>') that lm-eval says are better lower.
    downstream_lower_is_better: list[str] = Field(default_factory=list)
    # How the report was made, as a reader compares it with another (eval_hash only tells
    # equal from different): device, held-out batches, and for eval.tasks the limit, the
    # few-shot count, the scoring precision that ran (eval.precision resolved) and lm-eval's
    # version.
    settings: dict[str, Any] = Field(default_factory=dict)

    def scores(self) -> dict[str, float]:
        """Every score of the report by name: loss, perplexity, bits_per_byte, loss/<source>
        and <task>/<metric> (the names eval.best_metric takes)."""
        found = {"loss": self.loss, "perplexity": self.perplexity}
        if self.bits_per_byte is not None:
            found["bits_per_byte"] = self.bits_per_byte
        found.update({f"loss/{name}": loss for name, loss in self.source_losses.items()})
        found.update({f"{task}/{metric}": value for task, metrics in self.downstream.items()
                      for metric, value in metrics.items()})
        return found


def lower_is_better(metric: str, reports: list[EvalReport] = ()) -> bool:
    """Losses, perplexities and bits per byte are better lower, and so is a downstream score
    that lm-eval marks so in `reports` (e.g. brier_score); accuracies and the like higher."""
    if any(metric in r.downstream_lower_is_better for r in reports):
        return True
    name = metric.rsplit("/", 1)[-1]
    return metric.split("/")[0] == "loss" or any(k in name for k in ("loss", "perplexity", "bits_per_byte"))
