"""Deployments of every stage, for runs from the Prefect UI and on schedules.

`goodput serve` (this module) serves them from one long-lived process; `prefect.yaml`
declares the same deployments for `prefect deploy` + a process work pool.
"""

from __future__ import annotations

from prefect import serve

from flows.evaluate import evaluate
from flows.pipeline import pipeline
from flows.prepare import prepare
from flows.train import train
from goodput.config import RunConfig


def build_deployments(config: RunConfig, eval_cron: str | None = None) -> list:
    """One deployment per flow; `config` fills the UI form's defaults."""
    defaults = {"config": config.model_dump(mode="json")}
    tags = ["goodput", config.run.run_id]
    return [
        prepare.to_deployment(name="goodput-prepare", parameters=defaults, tags=tags),
        train.to_deployment(name="goodput-train", parameters=defaults, tags=tags),
        evaluate.to_deployment(name="goodput-evaluate", parameters=defaults, tags=tags,
                               cron=eval_cron),
        pipeline.to_deployment(name="goodput-pipeline", parameters=defaults, tags=tags),
    ]


def serve_all(config: RunConfig, eval_cron: str | None = None) -> None:
    serve(*build_deployments(config, eval_cron))
