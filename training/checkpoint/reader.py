"""Loading a committed checkpoint: every file a rank reads is first checked against the
manifest's sha256; from a local directory, or straight from the store (each rank fetching
only the files its part of the state is in). Any layout loads what any layout saved: DCP
reshards."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_state_dict

from core.files import reading_folder, sha256_file
from core.protocol import CHECKPOINT_MANIFEST, ResumeSpec, RunDir, copy_id_of_manifest, is_committed
from storage.ledger import checkpoint_key
from storage.manifests import CheckpointManifest
from training.checkpoint.errors import CheckpointCorrupt, causes, describe
from training.checkpoint.state import OPTIONS, part_states, train_state
from training.model import ModelArgs, Transformer


class VerifiedReader(dcp.FileSystemReader):
    """Reads a committed checkpoint directory, first checking each file this rank's DCP read
    plan touches against the manifest's sha256.

    Validation proved the checkpoint whole once; the hash at load proves it still is, for
    the files this rank reads (the read warms the page cache DCP then reads from).
    """

    from_store = False

    def __init__(self, path: str | Path, manifest: CheckpointManifest | None = None):
        super().__init__(str(path))
        self.source = str(path)
        if manifest is None:
            if not is_committed(Path(path)):
                raise FileNotFoundError(f"{path} has no {CHECKPOINT_MANIFEST}: not a committed checkpoint")
            manifest = CheckpointManifest.load(Path(path))
        self.manifest = manifest
        self.sha256 = {f.path: f.sha256 for f in manifest.files}
        self.local_dir = Path(path)

    def __str__(self) -> str:
        return self.source

    def corrupt(self, reason: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(self.manifest.step, self.source, reason, self.from_store)

    def _whole(self, relative: str) -> bool:
        """`relative` is under local_dir and matches the manifest."""
        if relative not in self.sha256:
            raise self.corrupt(f"{relative} is not in its manifest")
        path = self.local_dir / relative
        return path.is_file() and sha256_file(path) == self.sha256[relative]

    def _obtain(self, relative: str) -> None:
        """Make `relative` available under local_dir, matching the manifest."""
        if not self._whole(relative):
            raise self.corrupt(f"{relative} is missing" if not (self.local_dir / relative).is_file()
                               else f"{relative}: sha256 differs from the manifest")

    def read_metadata(self, *args, **kwargs):
        self._obtain(".metadata")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        for relative in sorted({self.storage_data[item.storage_index].relative_path
                                for item in plan.items}):
            self._obtain(relative)
        return super().read_data(plan, planner)


class StoreReader(VerifiedReader):
    """Loads an uploaded checkpoint straight from the object store, each rank fetching only
    the files its own part of the state lives in.

    DCP tells each rank which stored items it needs (its read plan) once the metadata is
    known; this reader fetches `.metadata`, then exactly the `.distcp` files that plan
    touches, each checked against the manifest's sha256, into `cache_dir` (shared by the
    ranks of a node: a file another rank fetched is reused). Used where the nodes do not share
    the disk the checkpoint was downloaded to, and where most of a large checkpoint belongs to
    other ranks (FSDP, PP). `fetched` lists what this rank downloaded.
    """

    from_store = True

    def __init__(self, store, prefix: str, cache_dir: str | Path):
        prefix = prefix.rstrip("/")
        manifest_key = f"{prefix}/{CHECKPOINT_MANIFEST}"
        if not store.exists(manifest_key):
            raise FileNotFoundError(f"{store.url(manifest_key)} not found: the checkpoint was "
                                    "never uploaded completely")
        raw = store.get_bytes(manifest_key)
        super().__init__(cache_dir, CheckpointManifest.model_validate_json(raw))
        self.store, self.prefix, self.source = store, prefix, store.url(prefix)
        self.copy_id = copy_id_of_manifest(raw)  # the stored copy's identity (core.protocol.copy_id)
        self.fetched: list[str] = []
        self.fetched_bytes = 0

    # The cache folder is held (shared) while DCP reads from it: retention deletes a step's
    # fetched files only where nothing reads them (goodput.checkpoint_lifecycle.prune_fetched).
    def read_metadata(self, *args, **kwargs):
        with reading_folder(self.local_dir):
            return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        with reading_folder(self.local_dir):
            return super().read_data(plan, planner)

    def _obtain(self, relative: str) -> None:
        if self._whole(relative):
            return  # another rank of this node fetched it
        dest = self.local_dir / relative
        for _ in range(2):  # a second fetch tells a bad transfer from a bad stored copy
            self.store.get_file(f"{self.prefix}/{relative}", dest)
            if self._whole(relative):
                self.fetched.append(relative)
                self.fetched_bytes += dest.stat().st_size
                return
            dest.unlink(missing_ok=True)
        raise self.corrupt(f"{relative}: sha256 differs from the manifest (fetched twice)")


def load_into(reader: VerifiedReader, model_parts, optimizers, extra_template: dict) -> dict:
    """Load a committed checkpoint (a local directory, or the store: see `VerifiedReader` and
    `StoreReader`) into this rank's model parts and optimizers, whatever layout saved it
    (DCP reshards); returns the extras. Raises CheckpointCorrupt on every rank when any
    rank found a file that no longer matches the manifest."""
    parts = part_states(model_parts, optimizers)
    state = train_state(parts, extra_template)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:  # every rank's errors, gathered by DCP (a BaseException)
        corrupt = [c for c in causes(e) if isinstance(c, CheckpointCorrupt)]
        if corrupt:
            raise corrupt[0] from None
        raise RuntimeError(f"loading {reader} failed: {describe(e)}") from None
    for (m, o), part, opt in zip(parts, model_parts, optimizers):
        set_state_dict(part, opt, options=OPTIONS,
                       model_state_dict={k: state["model"][k] for k in m},
                       optim_state_dict={k: state["optim"][k] for k in o})
    return {k: v for k, v in state.items() if k not in ("model", "optim")}


def load_all_tensors(path: Path | None = None, prefix: str = "", reader=None) -> dict:
    """Every entry (under `prefix`) of a DCP checkpoint, loaded in this process whatever
    layout saved it: the directory `path`, or through a DCP storage `reader` (StoreReader: a
    checkpoint in the store), whose own error (CheckpointCorrupt, a store's) is raised as
    itself, not wrapped by DCP."""
    metadata = (reader or dcp.FileSystemReader(str(path))).read_metadata()
    state = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        if isinstance(meta, TensorStorageMetadata):
            state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            state[fqn] = None  # a pickled object; DCP puts the loaded value here
    with warnings.catch_warnings():  # single-process load is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if reader is None:
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
        else:
            try:
                dcp.load(state, storage_reader=reader, no_dist=True)
            except CheckpointException as e:  # the reader's error, wrapped by DCP
                raise causes(e)[0] from None
    return state


def model_state_from(flat: dict) -> dict:
    prefix = "model."
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}



def load_model(checkpoint: Path | None, device: torch.device,
               reader: VerifiedReader | None = None) -> tuple[Transformer, CheckpointManifest]:
    """The model of a committed checkpoint, whatever layout trained it, for inference: the
    directory `checkpoint`, or through `reader` (a StoreReader: only the files the weights are
    in are fetched, training.checkpoint.writer.shard_file_name). A file that does not match
    the manifest raises CheckpointCorrupt."""
    # Its files checked against the manifest, here as from the store: a byte changed since
    # validation was scored as the checkpoint, silently, and its report kept.
    reader = reader if reader is not None else VerifiedReader(checkpoint)
    manifest = reader.manifest
    weights = load_all_tensors(prefix="model.", reader=reader)
    model = Transformer.with_weights(ModelArgs(**manifest.model_args), model_state_from(weights))
    return model.to(device).eval(), manifest


def open_reader(run_dir: RunDir, storage_config, start: ResumeSpec) -> VerifiedReader:
    """A reader of the checkpoint `start` names (a directory, or a step in the store). From
    the store it caches what this node fetches, for the node's other ranks and for in-job
    restarts."""
    if start.kind == "directory":
        return VerifiedReader(start.path)
    from storage.store import store_from_config  # boto3 only where the store is read

    return StoreReader(store_from_config(storage_config), checkpoint_key(run_dir.run_id, start.step),
                       run_dir.fetched_from_store(start.step))
