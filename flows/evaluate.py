"""The evaluate flow: held-out loss, perplexity and samples for one validated checkpoint."""

from __future__ import annotations

import time

from prefect import flow

from goodput.config import RunConfig
from storage.manifests import EvalReport
from tasks.evaluate import evaluate_checkpoint, locate_checkpoint, publish_eval_report, record_eval
from tasks.train import locate_dataset


@flow(name="evaluate")
def evaluate(config: RunConfig = RunConfig(), checkpoint: str | None = None) -> EvalReport:
    """Evaluate `checkpoint` (a step number or a directory; default: the newest validated)."""
    started = time.time()
    dataset_dir = locate_dataset(config)
    path = locate_checkpoint(config, checkpoint)
    report = evaluate_checkpoint(config, path, dataset_dir)
    publish_eval_report(report)
    record_eval(config, report, started)
    return report
