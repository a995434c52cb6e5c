"""Prefect policy around evaluation: locate the checkpoint, evaluate it, show the report."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from core.config import RunConfig
from core.errors import ConfigError
from goodput import evaluation
from goodput.accounting import summarize_goodput
from goodput.runs import update_summary
from storage.manifests import EvalReport
from storage.store import store_from_config
from tasks.reporting import artifact_key


@task(name="locate-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      tags=["evaluate"])
def locate_checkpoint(config: RunConfig, checkpoint: str | None) -> Path:
    return evaluation.locate_checkpoint(config, store_from_config(config.storage), checkpoint)


def _retry_unless_config_error(task, task_run, state) -> bool:
    """A wrong eval.tasks / eval.task_dir or missing task data fails the same way again."""
    try:
        state.result()
    except ConfigError:
        return False
    except Exception:
        return True
    return True


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      retry_condition_fn=_retry_unless_config_error, tags=["evaluate"])
def evaluate_checkpoint(config: RunConfig, checkpoint: Path, dataset_dir: Path) -> EvalReport:
    report = evaluation.evaluate(config, checkpoint, dataset_dir)
    per_source = "".join(f", {name} {loss:.4f}" for name, loss in report.source_losses.items())
    bpb = "" if report.bits_per_byte is None else f", {report.bits_per_byte:.4f} bits/byte"
    get_run_logger().info(f"step {report.step}: held-out loss {report.loss:.4f}{per_source}, "
                          f"perplexity {report.perplexity:.2f}{bpb} ({report.tokens_evaluated:,} tokens)")
    for name, metrics in report.downstream.items():
        get_run_logger().info(f"{name}: " + ", ".join(f"{m} {v:.4f}" for m, v in metrics.items()))
    return report


@task(name="publish-eval-report", cache_policy=NO_CACHE, tags=["evaluate"])
def publish_eval_report(report: EvalReport) -> None:
    rows = [{"metric": "held-out loss", "value": f"{report.loss:.4f}"},
            {"metric": "perplexity", "value": f"{report.perplexity:.2f}"},
            {"metric": "bits per byte", "value": "n/a" if report.bits_per_byte is None
             else f"{report.bits_per_byte:.4f}"},
            {"metric": "tokens evaluated", "value": f"{report.tokens_evaluated:,}"},
            {"metric": "checkpoint step", "value": str(report.step)}]
    rows += [{"metric": f"held-out loss of {name}", "value": f"{loss:.4f}"}
             for name, loss in report.source_losses.items()]
    # Downstream scores: one row per task and metric, its stderr beside it.
    rows += [{"metric": f"{name} {metric}",
              "value": f"{value:.4f}" + (f" ± {metrics[metric + '_stderr']:.4f}"
                                         if metric + "_stderr" in metrics else "")}
             for name, metrics in report.downstream.items()
             for metric, value in metrics.items() if not metric.endswith("_stderr")]
    rows += [{"metric": f"sample {i + 1}", "value": f"{s.prompt!r} → {s.completion!r}"}
             for i, s in enumerate(report.samples)]
    create_table_artifact(table=rows, key=artifact_key("eval", report.run_id),
                          description=f"Evaluation of {report.run_id} at step {report.step}")


@task(name="record-eval", cache_policy=NO_CACHE, tags=["evaluate"])
def record_eval(config: RunConfig, report: EvalReport, started: float) -> dict:
    values = {"step": report.step, "loss": report.loss, "perplexity": report.perplexity,
              "bits_per_byte": report.bits_per_byte,
              "tokens_evaluated": report.tokens_evaluated, "source_losses": report.source_losses,
              "downstream": report.downstream,
              "report": str(config.run_dir.eval_report(report.step)),
              "wall_time_s": time.time() - started}
    update_summary(config.run_dir, "evaluate", values)
    summarize_goodput(config)
    return values
