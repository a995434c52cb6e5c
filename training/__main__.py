"""`python -m training`: the torchrun entrypoint. Works with or without the orchestrator.

    torchrun --nproc-per-node 2 -m training --config configs/tiny.yaml \
        --dataset .goodput/data/<dataset_id> [--resume auto|none|DIR] [key=value ...]

Exits with the codes in training/exits.py and leaves an exit record for the launch task.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from training import exits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="RunConfig YAML")
    parser.add_argument("--dataset", required=True, help="prepared dataset directory (has manifest.json)")
    parser.add_argument("--resume", default="auto",
                        help="'auto' (newest committed checkpoint), 'none', or a checkpoint directory")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", 0))
    attempt = os.environ.get("GOODPUT_ATTEMPT", "0")
    from goodput.config import ConfigError, load_config  # after argparse: --help stays fast

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr, flush=True)
        return exits.CONFIG_ERROR
    run_dir = config.run_dir
    import torch

    from training.train import Preempted, RollbackRequested, train

    try:
        summary = train(config, Path(args.dataset), args.resume)
    except RollbackRequested as e:
        print(f"[train] rollback: {e}", file=sys.stderr, flush=True)
        exits.write_exit_record(run_dir, attempt, rank, exits.ROLLBACK, e.reason, e.step,
                                sample_end=e.sample_end)
        return exits.ROLLBACK
    except Preempted as e:
        print(f"[train] {e}", flush=True)
        exits.write_exit_record(run_dir, attempt, rank, exits.RETRYABLE, str(e), e.step)
        return exits.RETRYABLE
    except torch.OutOfMemoryError as e:  # retrying the same layout would run out again
        traceback.print_exc()
        exits.write_exit_record(run_dir, attempt, rank, exits.RETRYABLE, f"out of memory: {e}",
                                None, failure_class="oom")
        return exits.RETRYABLE
    except (ValueError, FileNotFoundError) as e:
        # Bad data, shapes that do not fit, a resume path that does not exist: retrying the
        # same inputs cannot help.
        traceback.print_exc()
        exits.write_exit_record(run_dir, attempt, rank, exits.CONFIG_ERROR, f"{type(e).__name__}: {e}", None)
        return exits.CONFIG_ERROR
    except Exception as e:  # crash, communication error: the next attempt resumes
        traceback.print_exc()
        exits.write_exit_record(run_dir, attempt, rank, exits.RETRYABLE, f"{type(e).__name__}: {e}", None)
        return exits.RETRYABLE
    exits.write_exit_record(run_dir, attempt, rank, exits.DONE, "done", summary["final_step"])
    if rank == 0:
        print(f"[train] done: step {summary['final_step']}, loss {summary['final_loss']:.4f}", flush=True)
    return exits.DONE


if __name__ == "__main__":
    sys.exit(main())
