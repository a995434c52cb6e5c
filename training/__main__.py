"""`python -m training`: the torchrun entrypoint. Works with or without the orchestrator.

    torchrun --nproc-per-node 2 -m training --config configs/tiny.yaml \
        --dataset .goodput/data/<dataset_id> [--resume auto|none|DIR|store:STEP|validated[:DIR]] [key=value ...]

Exits with the codes in training/exits.py and leaves an exit record for the launch task.

When torchrun restarts the workers within an attempt (`--max-restarts`, launch.max_restarts),
they run this same command line again: `--resume validated:DIR` makes them resume from the
newest checkpoint validated since (training.train.resolve_resume), and a failure that a
restart cannot fix (exits.NOT_RESTARTABLE) makes them exit at once with its code.
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
                        help="'auto' (newest committed checkpoint), 'none', a checkpoint directory, "
                             "'store:STEP' (the uploaded checkpoint of STEP, each rank fetching "
                             "the files it reads), or 'validated[:LOCATION]' (newest checkpoint "
                             "the run's ledger marks validated, else LOCATION, else from scratch)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", 0))
    attempt = os.environ.get("GOODPUT_ATTEMPT", "0")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_agent()
    from goodput.config import ConfigError, load_config  # after argparse: --help stays fast

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr, flush=True)
        if "GOODPUT_RUN_DIR" in os.environ:  # the launch task's: it reads why the attempt ended
            exits.write_exit_record(os.environ["GOODPUT_RUN_DIR"], attempt, rank, exits.CONFIG_ERROR,
                                    f"--config {args.config}: {e}", None)
        return exits.CONFIG_ERROR
    run_dir = config.run_dir
    if "GOODPUT_ATTEMPT" in os.environ:  # attempts of the launch task are unique; plain runs reuse "0"
        blocker = exits.restart_blocker(run_dir, attempt)
        if blocker is not None:
            if rank == 0:
                print(f"[train] not training on after an in-job restart: rank {blocker['rank']} "
                      f"ended with {blocker['class']} ({blocker['reason']}); the launch task "
                      "decides what comes next", file=sys.stderr, flush=True)
            return blocker["code"]
    if rank == 0:
        announce_start(run_dir, attempt)
    import torch

    from training.checkpoint import CheckpointCorrupt, CheckpointFailed
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
    except CheckpointCorrupt as e:  # the launch task sets that copy aside; the retry resumes elsewhere
        print(f"[train] not resuming: {e}", file=sys.stderr, flush=True)
        exits.write_exit_record(run_dir, attempt, rank, exits.RETRYABLE, str(e), None,
                                failure_class="corrupt_checkpoint", checkpoint_step=e.step,
                                from_store=e.from_store)
        return exits.RETRYABLE
    except CheckpointFailed as e:  # nothing was committed; a full disk stays full on retry
        print(f"[train] checkpoint failed: {e}", file=sys.stderr, flush=True)
        exits.write_exit_record(run_dir, attempt, rank, exits.RETRYABLE, f"checkpoint failed: {e}",
                                None, failure_class="disk_full" if e.disk_full else None)
        if e.writes_stuck:  # an interpreter exit would join the blocked write thread first
            sys.stdout.flush()
            os._exit(exits.RETRYABLE)
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


def die_with_agent() -> None:
    """Have the kernel kill this worker when its torchrun agent dies.

    torchrun starts each worker in a session of its own and stops it itself; when the agent
    is killed outright (SIGKILL, a node's supervisor gone) nobody would, and the orphan would
    go on training with the other nodes. Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    agent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent:  # the agent died before the request took effect
        os._exit(exits.RETRYABLE)


def announce_start(run_dir: Path, attempt: str) -> None:
    """Global rank 0, at every start of the worker group: note the start and tell the launch
    task through the heartbeat, which gives a (re)start its startup allowance before the
    first step rather than the allowance of a step."""
    from training.metrics import MetricsWriter

    # Attempts of the launch task are unique; plain runs share "0" and each starts anew.
    plain_run = "GOODPUT_ATTEMPT" not in os.environ and exits.restart_count() == 0
    start = exits.record_start(run_dir, attempt, fresh=plain_run)
    if start:
        print(f"[train] in-job restart {start} of attempt {attempt} (torchrun restart count "
              f"{exits.restart_count()} on this node)", flush=True)
    writer = MetricsWriter(run_dir, enabled=True)
    writer.heartbeat(attempt=attempt, phase="startup", step=None, start=start,
                     restart=exits.restart_count())
    writer.close()


if __name__ == "__main__":
    sys.exit(main())
