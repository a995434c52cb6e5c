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

from goodput.checkpoints import resume_point
from goodput.config import ConfigError, RunConfig, dump_config
from infra.torchrun import AttemptResult, TrainingFailed, run_attempt
from storage.checksums import write_atomic
from training.checkpoint import step_of


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

    Raises TrainingFailed (with its failure class) when the attempt does not finish.
    """
    config_path = write_run_config(config)
    resume = resume_point(config, store)
    if resume is not None and step_of(resume) >= config.training.max_steps:
        log(f"checkpoint {resume.name} already reached max_steps={config.training.max_steps}")
        return AttemptResult(0, "done", "already complete", step_of(resume), 0.0)
    log(f"attempt {attempt}: resuming from {resume.name}" if resume else
        f"attempt {attempt}: starting from scratch")
    result = run_attempt(config, config_path, dataset_dir, resume, attempt, log,
                         on_progress=on_progress)
    if result.failure_class != "done":
        raise TrainingFailed(f"training attempt {attempt} ended: {result.failure_class} "
                             f"({result.reason}) at step {result.step}",
                             result.failure_class, result.step)
    return result


def update_summary(run_dir: Path, section: str, values: dict) -> dict:
    """Merge one stage's results into summary.json (stages run separately or chained)."""
    path = Path(run_dir) / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary[section] = values
    summary["updated_at"] = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(summary, indent=2, default=str).encode())
    return summary
