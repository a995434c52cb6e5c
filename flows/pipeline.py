"""The whole pipeline: prepare -> train -> evaluate.

Every stage is idempotent by content (dataset id, ledger, eval report per checkpoint), so
rerunning a pipeline that failed picks up at the failed stage without redoing the others.
"""

from __future__ import annotations

from prefect import flow

from flows.evaluate import evaluate
from flows.prepare import prepare
from flows.train import train
from goodput.config import RunConfig


@flow(name="pipeline")
def pipeline(config: RunConfig = RunConfig()) -> dict:
    dataset = prepare(config)
    trained = train(config)
    report = evaluate(config)
    return {"dataset_id": dataset.dataset_id, "final_step": trained["final_step"],
            "eval_loss": report.loss, "perplexity": report.perplexity,
            "run_dir": str(config.run_dir)}
