"""Checkpoints: a torch.distributed.checkpoint (DCP) directory plus a manifest written last.

Layout: `<run_dir>/checkpoints/step-00000050/` holds the DCP files (`*.distcp`,
`.metadata`) and `manifest.json`. Every rank writes its shards; after a barrier rank 0
hashes the files and writes the manifest atomically. A directory without a manifest is
what a crash mid-save leaves behind: it is never loaded and is cleared before reuse.

The same save loads at any world size (DCP reshards), and `verify_checkpoint` reloads a
checkpoint in one process with no model or layout given, to prove it is whole.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from storage.manifests import CHECKPOINT_MANIFEST, CheckpointManifest, list_files, verify_files

STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step-{step:08d}"


def step_of(path: str | Path) -> int:
    match = STEP_DIR.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory (expected step-XXXXXXXX)")
    return int(match.group(1))


def is_committed(path: Path) -> bool:
    return (path / CHECKPOINT_MANIFEST).is_file()


def committed_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories with a manifest, oldest first. Others are crash debris."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and is_committed(p)]
    return sorted(found, key=step_of)


# -- saving and loading inside the training job (collective: every rank calls) ---------------

# Flattened optimizer state is keyed by parameter name, so the states of several pipeline
# stages merge into one dict and load under any other layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _part_states(model_parts, optimizers) -> list[tuple[dict, dict]]:
    return [get_state_dict(part, opt, options=_OPTIONS) for part, opt in zip(model_parts, optimizers)]


def _train_state(parts: list[tuple[dict, dict]], extra: dict) -> dict:
    model_state, optim_state = {}, {}
    for m, o in parts:
        model_state.update(m)
        optim_state.update(o)
    return {"model": model_state, "optim": optim_state, **extra}


class Checkpointer:
    """Saves checkpoints synchronously or in the background, and commits each when whole.

    Training blocks only while the state is staged (copied off the live tensors); the write
    runs on its own gloo process group (on the default group it deadlocks against FSDP's
    collectives) and rank 0 hashes the files and writes the manifest in a background thread
    once every rank's shards are durable. At most one save is in flight; one that fails is
    reported and never committed. Never overwrites a committed checkpoint: one found at the
    target path (from an abandoned attempt that went further) is moved aside first.
    """

    def __init__(self, mode: str = "sync"):
        self.mode = mode
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = (dist.new_group(backend="gloo")
                      if mode != "sync" and dist.is_initialized() else None)
        self._pending: threading.Thread | None = None
        self.failures: list[str] = []

    def save(self, path: Path, model_parts, optimizers, extra: dict, manifest_fields: dict) -> float:
        """Start (or do) a save; returns the seconds training was blocked."""
        started = time.perf_counter()
        self.wait()
        if self.rank == 0:
            _clear_for_save(path)
        _barrier()
        state = _train_state(_part_states(model_parts, optimizers), extra)
        if self.mode == "sync":
            dcp.save(state, checkpoint_id=str(path))
            _barrier()  # every rank's shards are durable (FileSystemWriter fsyncs) before the commit
            self._commit(path, manifest_fields)
            _barrier()
            return time.perf_counter() - started
        kind = (AsyncCheckpointerType.PROCESS if self.mode == "process"
                else AsyncCheckpointerType.THREAD)
        future = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group,
                                async_checkpointer_type=kind)
        blocked = time.perf_counter() - started
        # The coordinator's future completes after it gathered every rank's write results
        # and wrote .metadata: then, and only then, the checkpoint may be committed.
        self._pending = threading.Thread(target=self._finish, args=(future, path, manifest_fields),
                                         name=f"commit-{path.name}", daemon=True)
        self._pending.start()
        return blocked

    def _finish(self, future, path: Path, manifest_fields: dict) -> None:
        try:
            future.result()
            self._commit(path, manifest_fields)
        except Exception as e:  # reported, never committed: the directory stays debris
            self.failures.append(f"{path.name}: {type(e).__name__}: {e}")
            print(f"[checkpoint] save of {path.name} failed, not committed: {e}", flush=True)

    def _commit(self, path: Path, manifest_fields: dict) -> None:
        if self.rank != 0:
            return
        manifest = CheckpointManifest(files=list_files(path, exclude=(CHECKPOINT_MANIFEST,)),
                                      created_at=time.time(), **manifest_fields)
        manifest.save(path)
        print(f"[checkpoint] committed {path.name} (loss {manifest.loss:.4f})", flush=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None


def load_checkpoint(path: Path, model_parts, optimizers, extra_template: dict) -> dict:
    """Load a committed checkpoint into this rank's model parts and optimizers, whatever
    layout saved it (DCP reshards); returns the extras."""
    if not is_committed(path):
        raise FileNotFoundError(f"{path} has no {CHECKPOINT_MANIFEST}: not a committed checkpoint")
    parts = _part_states(model_parts, optimizers)
    state = _train_state(parts, extra_template)
    dcp.load(state, checkpoint_id=str(path))
    for (m, o), part, opt in zip(parts, model_parts, optimizers):
        set_state_dict(part, opt, options=_OPTIONS,
                       model_state_dict={k: state["model"][k] for k in m},
                       optim_state_dict={k: state["optim"][k] for k in o})
    return {k: v for k, v in state.items() if k not in ("model", "optim")}


def _clear_for_save(path: Path) -> None:
    if is_committed(path):
        aside = path.parent / "superseded" / f"{path.name}-{int(time.time())}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        path.rename(aside)
        print(f"[checkpoint] moved committed {path.name} aside to {aside}", flush=True)
    elif path.exists():
        shutil.rmtree(path)  # debris of a save that never committed
    path.parent.mkdir(parents=True, exist_ok=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# -- verification in a fresh single process ---------------------------------------------------

def load_all_tensors(path: Path, prefix: str = "") -> dict:
    """Every entry (under `prefix`) of a DCP checkpoint, loaded in this process whatever
    layout saved it."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
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
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def model_state_from(flat: dict) -> dict:
    prefix = "model."
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def verify_checkpoint(path: str | Path) -> dict:
    """Checks a committed checkpoint; returns {"ok": bool, "reason": str, ...}.

    Checksums against the manifest, a full reload, every floating tensor finite, and the
    model weights loading strictly into a freshly built model of the recorded shape.
    """
    from training.model import ModelArgs, Transformer

    path = Path(path)
    if not is_committed(path):
        return {"ok": False, "reason": f"no {CHECKPOINT_MANIFEST}: incomplete save"}
    try:
        manifest = CheckpointManifest.load(path)
    except Exception as e:  # a manifest that does not parse is as bad as none
        return {"ok": False, "reason": f"unreadable manifest: {e}"}
    if manifest.step != step_of(path):
        return {"ok": False, "reason": f"manifest step {manifest.step} != directory {path.name}"}
    problems = verify_files(path, manifest.files)
    if problems:
        return {"ok": False, "reason": "checksum: " + "; ".join(problems[:5])}
    try:
        state = load_all_tensors(path)
    except Exception as e:
        return {"ok": False, "reason": f"reload failed: {type(e).__name__}: {e}"}
    non_finite = [k for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]
    if non_finite:
        return {"ok": False, "reason": f"non-finite values in {', '.join(non_finite[:5])}"}
    try:
        model = Transformer(ModelArgs(**manifest.model_args))
        model.load_state_dict(model_state_from(state), strict=True)
    except Exception as e:
        return {"ok": False, "reason": f"weights do not fit the model: {e}"}
    n_tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    return {"ok": True, "reason": "", "step": manifest.step, "tensors": n_tensors,
            "loss": manifest.loss if manifest.loss is None or math.isfinite(manifest.loss) else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.checkpoint",
                                     description="Verify a checkpoint in this process; prints JSON.")
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("path")
    args = parser.parse_args(argv)
    result = verify_checkpoint(args.path)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
