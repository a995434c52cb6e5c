"""Verify a committed checkpoint in a process apart from training, in bounded memory.

    python -m training.checkpoint.verify STEP_DIR [--dataset DIR --eval-batches N] [--max-bytes B]

Checks, in order: the manifest (present, parses, names this step), every file's size and
sha256 against it, that the tensors it stores fit the model it records (names and shapes,
against the model built on the meta device), and that every floating tensor is finite.
Tensors are read a group at a time, each group at most `--max-bytes` (a tensor larger than
that alone), whatever layout saved them: the verifier holds about the largest group, never
the checkpoint, so a model larger than the host's memory validates. With a dataset and
`--eval-batches`, the held-out loss must not exceed the training loss recorded at the step by
more than `--loss-tolerance` (relative): weights that are finite but wrong fail here; this
check holds the model's weights (not the optimizer state).

Prints one JSON verdict, {"ok": bool, "reason": str, ...}; exits 0 when ok, 1 when not. A
verifier that ends any other way has given no verdict.

    python -m training.checkpoint.verify --serve [--background]

judges one checkpoint per line of its standard input instead, each line a request
{"cwd": DIR, "argv": [STEP_DIR, ...the options above]}, printing each verdict line as it
goes; it exits at the end of its input or after IDLE_EXIT_S without a request. Importing
torch and its checkpoint modules is most of a verifier's CPU on a small model: a flow
keeps one serving process for the checkpoints of a run (goodput.verifier_pool). Each
request builds its model anew from the checkpoint's files; nothing is kept between them.
A request that raises ends the process without a verdict, as the one-shot form does.
"""

from __future__ import annotations

import argparse
import json
import math
import select
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from core.cpu_priority import lower_thread_priority
from core.process_exit import exit_without_teardown
from core.protocol import CHECKPOINT_MANIFEST, is_committed, step_of, take_request
from storage.manifests import CheckpointManifest, verify_files
from training.checkpoint.reader import load_all_tensors, model_state_from

DEFAULT_MAX_BYTES = 256 * 2**20
IDLE_EXIT_S = 300.0  # a served verifier left idle this long exits (its memory back to training)


def verify_checkpoint(path: str | Path, dataset_dir: str | Path | None = None,
                      eval_batches: int = 0, loss_tolerance: float = 0.5,
                      max_bytes: int = DEFAULT_MAX_BYTES,
                      mix_weights: dict[str, float] | None = None) -> dict:
    """The verdict on the committed checkpoint at `path` (see the module docstring).
    `mix_weights`: the mix's weights at the checkpoint's step (a curriculum stage's), which
    the held-out loss of a mixture is weighted by to compare with the training loss."""
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
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        return {"ok": False, "reason": f"reload failed: {type(e).__name__}: {e}"}
    tensors = {fqn: meta for fqn, meta in stored.items() if isinstance(meta, TensorStorageMetadata)}
    try:
        with torch.device("meta"):
            expected = Transformer(ModelArgs(**manifest.model_args)).state_dict()
    except Exception as e:
        return {"ok": False, "reason": f"weights do not fit the model: {e}"}
    mismatch = _model_mismatch(expected, tensors)
    if mismatch:
        return {"ok": False, "reason": f"weights do not fit the model: {mismatch}"}
    try:
        non_finite = [fqn for group in _groups(tensors, max_bytes)
                      for fqn, value in _load(path, group).items()
                      if value.is_floating_point() and not torch.isfinite(value).all()]
        _load(path, [fqn for fqn in stored if fqn not in tensors])  # progress, data order, RNG
    except Exception as e:
        if _out_of_memory(e):
            raise  # this machine's limit, not the checkpoint's fault: no verdict
        return {"ok": False, "reason": f"reload failed: {type(e).__name__}: {e}"}
    if non_finite:
        return {"ok": False, "reason": f"non-finite values in {', '.join(non_finite[:5])}"}
    loss = manifest.loss if manifest.loss is not None and math.isfinite(manifest.loss) else None
    result = {"ok": True, "reason": "", "step": manifest.step, "tensors": len(tensors), "loss": loss}
    if eval_batches and dataset_dir is not None and loss is not None:
        model = Transformer.with_weights(ModelArgs(**manifest.model_args),
                                         model_state_from(load_all_tensors(path, prefix="model.")))
        # At the length training measured its loss at: positions past it were never trained.
        held_out = _held_out_loss(model, Path(dataset_dir), eval_batches,
                                  manifest.seq_len or model.args.max_seq_len, mix_weights)
        result["held_out_loss"] = held_out
        if not held_out <= loss * (1 + loss_tolerance):
            return {**result, "ok": False, "reason":
                    f"held-out loss {held_out:.4f} over {eval_batches} batches exceeds the training "
                    f"loss {loss:.4f} at step {manifest.step} by more than "
                    f"{loss_tolerance:.0%} (checkpoint.validate_loss_tolerance)"}
    return result


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or \
        "can't allocate memory" in str(error)


def _model_mismatch(expected: dict, stored: dict) -> str:
    """What keeps the stored weights from loading strictly into the recorded model."""
    saved = {fqn.removeprefix("model."): meta for fqn, meta in stored.items() if fqn.startswith("model.")}
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    shapes = [f"{name}: {tuple(saved[name].size)} != {tuple(expected[name].shape)}"
              for name in sorted(expected.keys() & saved.keys())
              if tuple(saved[name].size) != tuple(expected[name].shape)]
    return "; ".join(filter(None, [f"missing {', '.join(missing[:5])}" if missing else "",
                                   f"unexpected {', '.join(unexpected[:5])}" if unexpected else "",
                                   ", ".join(shapes[:5])]))


def _groups(tensors: dict[str, TensorStorageMetadata], max_bytes: int) -> list[list[str]]:
    """The tensors in groups of at most `max_bytes` each (a larger tensor alone)."""
    groups, current, size = [], [], 0
    for fqn, meta in tensors.items():
        nbytes = math.prod(meta.size) * meta.properties.dtype.itemsize
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(fqn)
        size += nbytes
    return groups + ([current] if current else [])


def _load(path: Path, names: list[str]) -> dict:
    """Just these entries of the checkpoint (tensors whole, whatever layout saved them)."""
    if not names:
        return {}
    reader = dcp.FileSystemReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    state = {fqn: (torch.empty(stored[fqn].size, dtype=stored[fqn].properties.dtype)
                   if isinstance(stored[fqn], TensorStorageMetadata) else None)  # None: DCP unpickles
             for fqn in names}
    with warnings.catch_warnings():  # single-process load is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _held_out_loss(model, dataset_dir: Path, batches: int, seq_len: int,
                   mix_weights: dict[str, float] | None) -> float:
    from training.data import open_training_data
    from training.held_out import mix_held_out_loss

    model.eval()
    loss, _tokens, _per_source = mix_held_out_loss(model, open_training_data(dataset_dir), seq_len,
                                                   4, batches, torch.device("cpu"), mix_weights)
    return loss


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.checkpoint.verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="a checkpoint directory, step-XXXXXXXX")
    parser.add_argument("--dataset", help="prepared dataset: also check the held-out loss")
    parser.add_argument("--eval-batches", type=int, default=0,
                        help="validation batches for the held-out loss check (0: off)")
    parser.add_argument("--loss-tolerance", type=float, default=0.5,
                        help="held-out loss may exceed the training loss by this fraction")
    parser.add_argument("--mix-weights", type=json.loads, metavar="JSON",
                        help='a mixture\'s weights at the checkpoint\'s step, e.g. {"web": 0.1, '
                        '"code": 0.9} (default: data.sources\' weights)')
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="tensor bytes read at once (a larger tensor is read alone)")
    parser.add_argument("--background", action="store_true",
                        help="run at the lowest CPU priority (beside training)")
    parser.add_argument("--serve", action="store_true",
                        help="judge one checkpoint per request line on standard input (see above)")
    return parser


def _verdict(args: argparse.Namespace) -> dict:
    return verify_checkpoint(args.path, args.dataset, args.eval_batches, args.loss_tolerance,
                             args.max_bytes, args.mix_weights)


def serve(parser: argparse.ArgumentParser) -> int:
    """Judge the checkpoint of each request line until the input ends (or stays idle for
    IDLE_EXIT_S); see the module docstring."""
    import gc

    from training.allocator import return_freed_memory

    # What the imports made (torch's modules: most of the heap's objects) lives as long as
    # the process: out of the collections below, each of which walked it all (0.07 s quiet,
    # 0.25 s at background priority beside training, per checkpoint).
    gc.collect()  # what the imports left for collection goes first, not into the frozen set
    gc.freeze()
    while select.select([sys.stdin], [], [], IDLE_EXIT_S)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        args = parser.parse_args(take_request(line))  # relative paths as the one asking meant them
        if args.path is None:
            parser.error("a request names a checkpoint directory")
        print(json.dumps(_verdict(args)), flush=True)
        gc.collect()
        return_freed_memory()  # idle between checkpoints, it holds no checkpoint's memory
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.background:  # before torch starts its intra-op threads, which inherit it
        lower_thread_priority()
    if args.serve:
        return serve(parser)
    if args.path is None:
        parser.error("name the checkpoint directory to verify (or --serve)")
    result = _verdict(args)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    # A served verifier ends with the flow that kept it (goodput.verifier_pool.stop_all waits
    # for it): the interpreter's teardown of torch would add to every such flow's end.
    exit_without_teardown(main())
