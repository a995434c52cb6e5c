"""`python -m training`: the torchrun entrypoint. Works with or without the orchestrator.

    torchrun --nproc-per-node 2 -m training --config configs/tiny.yaml \
        --dataset .goodput/data/<dataset_id> [--resume auto|none|validated|store:STEP|DIR] [key=value ...]

Each rank exits with its failure class's code and leaves an exit record for the launch task
(core/protocol.py). When torchrun restarts the workers within an attempt they run this same
command line again: `--resume validated` makes them resume from the newest checkpoint
validated since, and a failure that a restart cannot fix makes them exit at once with its code.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from core.protocol import (
    ENV_RUN_DIR,
    FailureClass,
    ResumeSpec,
    attempt_of_worker,
    restart_blocker,
    restart_count,
    supervised,
    write_exit_record,
)
from core.process_exit import exit_without_teardown
from training.allocator import keep_freed_memory
from training.logs import get_logger, setup_worker_logging

log = get_logger("train")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="RunConfig YAML")
    parser.add_argument("--dataset", required=True, help="prepared dataset directory (has manifest.json)")
    parser.add_argument("--resume", default="auto",
                        help="'auto' (newest committed checkpoint), 'none', a checkpoint directory, "
                             "'store:STEP' (the uploaded checkpoint of STEP, each rank fetching "
                             "the files it reads), or 'validated' (the newest checkpoint the run's "
                             "ledger marks validated that this machine can read)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    keep_freed_memory()  # before the first tensor

    rank = int(os.environ.get("RANK", 0))
    attempt = attempt_of_worker()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_agent()
    from core.config import ConfigError, load_config  # after argparse: --help stays fast
    from core.errors import DataError

    setup_worker_logging(rank)
    try:
        config = load_config(args.config, args.overrides)
        resume = ResumeSpec.parse(args.resume)
    except (ConfigError, ValueError) as e:
        log.error("%s", e)
        if ENV_RUN_DIR in os.environ:  # the launch task's: it reads why the attempt ended
            write_exit_record(os.environ[ENV_RUN_DIR], attempt, rank, FailureClass.CONFIG,
                              f"--config {args.config}: {e}", None)
        return FailureClass.CONFIG.exit_code
    run_dir = config.run_dir
    if supervised():
        blocker = restart_blocker(run_dir, attempt)
        if blocker is not None:
            log.warning("not training on after an in-job restart: rank %s ended with %s (%s); "
                        "the launch task decides what comes next",
                        blocker["rank"], blocker["class"], blocker["reason"])
            return blocker["code"]
    if rank == 0:
        announce_start(run_dir, attempt)
    import torch

    from training.checkpoint.errors import CheckpointCorrupt, CheckpointFailed
    from training.resilience import Orphaned, Preempted, RollbackRequested
    from training.train import train

    def ended(failure: FailureClass, reason: str, step: int | None, **details) -> int:
        write_exit_record(run_dir, attempt, rank, failure, reason, step, **details)
        return failure.exit_code

    try:
        summary = train(config, Path(args.dataset), resume)
    except RollbackRequested as e:
        log.warning("rollback: %s (the step is not applied: the attempt ends at step %d)", e, e.step - 1)
        return ended(FailureClass.ROLLBACK, e.reason, e.step, sample_end=e.sample_end)
    except Orphaned as e:  # not restarted in-job: nobody would watch the restarted workers
        return ended(FailureClass.ORPHANED, str(e), e.step)
    except Preempted as e:
        log.info("%s", e)
        return ended(FailureClass.RETRYABLE, str(e), e.step)
    except CheckpointCorrupt as e:  # the launch task sets that copy aside; the retry resumes elsewhere
        log.error("not resuming: %s", e)
        return ended(FailureClass.CORRUPT_CHECKPOINT, str(e), None, checkpoint_step=e.step,
                     from_store=e.from_store)
    except CheckpointFailed as e:  # nothing was committed; a full disk stays full on retry
        log.error("checkpoint failed: %s", e)
        code = ended(FailureClass.DISK_FULL if e.disk_full else FailureClass.RETRYABLE,
                     f"checkpoint failed: {e}", None)
        if e.writes_stuck:  # an interpreter exit would join the blocked write thread first
            logging.shutdown()
            os._exit(code)
        return code
    except torch.OutOfMemoryError as e:  # retrying the same layout would run out again
        log.exception("out of memory")
        return ended(FailureClass.OOM, f"out of memory: {e}", None)
    except (ConfigError, DataError) as e:  # the same inputs fail the same way: never retried
        log.exception("configuration or data error")
        return ended(FailureClass.CONFIG, f"{type(e).__name__}: {e}", None)
    except Exception as e:  # a crash, a communication error, a file a shared filesystem lost
        log.exception("training failed")
        return ended(FailureClass.RETRYABLE, f"{type(e).__name__}: {e}", None)
    reason = summary["stopped"] or "done"  # "time limit": stopped at a checkpoint before the end
    trained = summary["final_loss"] == summary["final_loss"]  # NaN: no step ran in this attempt
    log.info("%s: step %d%s", reason, summary["final_step"],
             f", loss {summary['final_loss']:.4f}" if trained else " (no step to train)")
    return ended(FailureClass.DONE, reason, summary["final_step"])


def die_with_agent() -> None:
    """Have the kernel kill this worker when its torchrun agent dies.

    torchrun starts each worker in a session of its own and stops it itself; when the agent
    is killed outright (SIGKILL, a node's supervisor gone) nobody would, and the orphan would
    go on training with the other nodes. Linux only; elsewhere a no-op.
    """
    import signal

    from core.process_exit import die_with_parent

    agent = os.getppid()
    if not die_with_parent(signal.SIGKILL):
        return
    if os.getppid() != agent:  # the agent died before the request took effect
        os._exit(FailureClass.RETRYABLE.exit_code)


def announce_start(run_dir, attempt: str) -> None:
    """Global rank 0, at every start of the worker group: note the start and tell the launch
    task through the heartbeat, which gives a (re)start its startup allowance before the
    first step rather than the allowance of a step."""
    from core.protocol import record_start, write_heartbeat

    # Attempts of the launch task are unique; plain runs share "0" and each starts anew.
    start = record_start(run_dir, attempt, fresh=not supervised() and restart_count() == 0)
    if start:
        log.info("in-job restart %d of attempt %s (torchrun restart count %d on this node)",
                 start, attempt, restart_count())
    run_dir.path.mkdir(parents=True, exist_ok=True)
    # (The world torchrun gave this start is in its starts.jsonl line, which the supervisor reads.)
    write_heartbeat(run_dir, attempt=attempt, phase="startup", step=None, start=start,
                    restart=restart_count())


if __name__ == "__main__":
    # Without Python's own teardown: its last garbage collection over torch's modules took
    # 2 s of every worker's exit on 2 cores (core.process_exit).
    exit_without_teardown(main())
