"""The run directory: its resolved config, its summary, and one training attempt in it.

    <runs_dir>/<run_id>/
        config.yaml      the resolved RunConfig the workers read
        checkpoints/     step-XXXXXXXX/ (DCP + manifest), rejected/, superseded/
        ledger.json      checkpoint states (mirrored to the store)
        metrics.jsonl    rank 0, one line per step;  heartbeat.json  latest step
        attempts/        per attempt, each rank's exit record
        eval/            step-XXXXXXXX.json reports
        summary.json     what the stages produced, wall time per stage
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import yaml

from goodput.checkpoints import ResumePoint, resume_point, set_aside_damaged
from goodput.config import ConfigError, RunConfig, dump_config
from infra.torchrun import AttemptResult, TrainingFailed, run_attempt
from storage.checksums import exclusive_lock, write_atomic
from storage.ledger import DataSkip, Ledger
from training.checkpoint import committed_checkpoints, step_of
from training.exits import attempt_dir


def write_run_config(config: RunConfig) -> Path:
    """Write config.yaml; refuse to continue a run whose trajectory-defining config changed."""
    path = config.run_dir / "config.yaml"
    if path.is_file():
        previous = RunConfig.model_validate(yaml.safe_load(path.read_text()))
        if previous.config_hash() != config.config_hash():
            raise ConfigError(
                f"run '{config.run.run_id}' already exists at {config.run_dir} with a different "
                "data/tokenizer/model/training config; its checkpoints would not continue this "
                "one. Choose a new run.run_id (or delete the run directory to start over).")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dump_config(config).encode())
    return path


def train_attempt(config: RunConfig, dataset_dir: Path, store, attempt: str,
                  log: Callable[[str], None],
                  on_progress: Callable[[dict], None] | None = None) -> AttemptResult:
    """One attempt: resume from the newest validated checkpoint and train to max_steps.

    Raises TrainingFailed with the failure class and the retry policy's verdict when the
    attempt does not finish. A rollback first records the data window to skip.
    """
    if not config.checkpoint.save_at_end:
        raise ConfigError(
            "checkpoint.save_at_end=false is for throughput measurements (benchmarks/mfu_bench.py), "
            "which launch the trainer themselves: a run whose last step is not saved never counts as "
            "finished, so every rerun would train its tail again. Leave it true.")
    config_path = write_run_config(config)
    resume = resume_point(config, store)
    if resume is not None and resume.step >= config.training.max_steps:
        log(f"checkpoint {resume} already reached max_steps={config.training.max_steps}")
        return AttemptResult(0, "done", "already complete", resume.step, 0.0)
    log(f"attempt {attempt}: resuming from {resume}" if resume else
        f"attempt {attempt}: starting from scratch")
    result = run_attempt(config, config_path, dataset_dir, resume.location if resume else None,
                         attempt, log, on_progress=on_progress)
    outcome = record_outcome(config, attempt, result, resume)
    if result.restarts:
        log(f"attempt {attempt}: torchrun restarted the workers {result.restarts} time(s) in-job")
    if result.failure_class == "done":
        return result
    if result.failure_class == "rollback":
        skip = skip_data_before(config, store, result)
        log(f"rollback: samples [{skip.start}, {skip.end}) will be skipped ({skip.reason})")
    if result.failure_class == "corrupt_checkpoint":
        damaged = next(r for r in result.records if r["class"] == "corrupt_checkpoint")
        entry = set_aside_damaged(config, damaged["checkpoint_step"], damaged["from_store"],
                                  damaged["reason"])
        log(f"checkpoint step {entry.step} failed its checksums at load: now {entry.state} "
            f"({entry.history[-1].note})")
    retry, why = retry_decision(config, read_outcomes(config, attempt_prefix(attempt)))
    log(f"attempt {attempt} ended: {outcome['class']} at step {outcome['step']} ({outcome['reason']}); "
        + ("retrying" if retry else f"not retrying: {why}"))
    raise TrainingFailed(f"training attempt {attempt} ended: {result.failure_class} "
                         f"({result.reason}) at step {result.step}" + ("" if retry else f"; {why}"),
                         result.failure_class, result.step, retry=retry)


def attempt_prefix(attempt: str) -> str:
    """Attempts of one flow run share a prefix (`<flow run>-<try>`): budgets count per run."""
    return attempt.rsplit("-", 1)[0]


def record_outcome(config: RunConfig, attempt: str, result: AttemptResult,
                   resumed_from: ResumePoint | None) -> dict:
    """Why the attempt ended, where it started and what it left: the retry policy's input."""
    committed = committed_checkpoints(config.run_dir)
    outcome = {"attempt": attempt, "class": result.failure_class, "reason": result.reason,
               "step": result.step, "exit_code": result.exit_code,
               "resumed_from": resumed_from.step if resumed_from else 0,
               "newest_checkpoint": step_of(committed[-1]) if committed else 0,
               "restarts": result.restarts,  # in-job (torchrun) restarts within the attempt
               "wall_time_s": result.wall_time_s, "time": time.time()}
    directory = attempt_dir(config.run_dir, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "outcome.json", json.dumps(outcome).encode())
    return outcome


def read_outcomes(config: RunConfig, prefix: str = "") -> list[dict]:
    root = config.run_dir / "attempts"
    paths = root.glob(f"attempt-{prefix}*/outcome.json") if root.is_dir() else []
    return sorted((json.loads(p.read_text()) for p in paths), key=lambda o: o["time"])


# What a user can do about a failure class once its retries are spent.
_WHAT_TO_DO = {
    "oom": " — lower training.micro_batch_size, or shard more (parallelism.dp_shard, "
           "activation_checkpointing); `goodput plan` estimates memory",
    "disk_full": " — the checkpoint disk is full: free space on it, lower checkpoint.keep_local or "
                 "checkpoint.keep_aside, "
                 "or move run.runs_dir to a larger disk; committed checkpoints are intact",
}


def retry_decision(config: RunConfig, outcomes: list[dict]) -> tuple[bool, str]:
    """Retry the last failed attempt? Each failure class has its own budget, configuration
    errors never retry, and attempts that keep failing without progress stop the run."""
    last = outcomes[-1]
    cls = last["class"]
    if cls == "config":
        return False, "configuration or data error: fix the input and rerun"
    budgets = config.run.retry_budgets
    budget = budgets.get(cls, budgets.get("unknown", 0))
    failures = sum(1 for o in outcomes if o["class"] == cls)
    if failures > budget:
        return False, (f"{cls} failures ({failures}) exceed their budget of {budget} retries"
                       + _WHAT_TO_DO.get(cls, ""))
    stalled = 0
    for o in reversed(outcomes):
        if o["class"] == "done" or o["newest_checkpoint"] > o["resumed_from"]:
            break
        stalled += 1
    if stalled >= config.run.no_progress_attempts:
        return False, (f"{stalled} attempts in a row committed no checkpoint newer than the one "
                       "they resumed from")
    return True, ""


def skip_data_before(config: RunConfig, store, result: AttemptResult) -> DataSkip:
    """Record the data window from the checkpoint the next attempt resumes at to the bad step."""
    bad = next(r for r in result.records if r["class"] == "rollback")
    resume = resume_point(config, store)
    start = resume.data_position if resume is not None else 0
    return Ledger(config.run_dir, config.run.run_id).add_data_skip(
        start, bad["sample_end"], f"rollback at step {bad['step']}: {bad['reason']}")


def read_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def update_summary(run_dir: Path, section: str, values: dict | Callable[[dict], dict]) -> dict:
    """Merge one stage's results into summary.json (stages run separately or chained, and
    flows of one run at the same time: a scheduled evaluation while training runs). Under a
    lock, so no flow's section is lost; `values` may be a function of the section's previous
    values (e.g. to add up wall time across flow runs)."""
    path = Path(run_dir) / "summary.json"
    with exclusive_lock(path.with_suffix(".lock")):
        summary = read_summary(run_dir)
        summary[section] = values(summary.get(section, {})) if callable(values) else values
        summary["updated_at"] = time.time()
        write_atomic(path, json.dumps(summary, indent=2, default=str).encode())
    return summary
