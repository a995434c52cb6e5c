"""Prefect policy around evaluation: locate the checkpoint, evaluate it, show the report."""

from __future__ import annotations

import base64
import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from core.config import RunConfig
from core.errors import ConfigError
from core.protocol import is_committed, step_of
from goodput import evaluation
from goodput.checkpoint_lifecycle import eval_history, ledger_of
from storage.ledger import readable_copy
from storage.manifests import EvalReport
from storage.store import store_from_config
from tasks.retries import retry_if_transient
from tasks.reporting import artifact_key, publish_goodput


@task(name="locate-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_if_transient, tags=["evaluate"])
def locate_checkpoint(config: RunConfig, checkpoint: str | None) -> Path:
    """The checkpoint to evaluate (evaluation.locate_checkpoint), logged with where it is
    read from. A step or path that names none, or a run with none validated, is a
    ConfigError and fails at once; the store unreachable is tried again."""
    path = evaluation.locate_checkpoint(config, store_from_config(config.storage), checkpoint)
    if evaluation.is_initial(config, path):
        get_run_logger().info(f"evaluating the weights the run starts from (model.init_from={path}), as step 0")
        return path
    get_run_logger().info(f"evaluating {path}" if is_committed(path) else
                          f"evaluating step {step_of(path)} from the store's copy (this machine "
                          "has none): its weights are fetched, not the optimizer's state")
    return path


def _retry_unless_config_error(task, task_run, state) -> bool:
    """A wrong eval.tasks / eval.task_dir or missing task data fails the same way again."""
    try:
        state.result()
    except ConfigError:
        return False
    except Exception:
        return True
    return True


@task(name="check-eval-tasks", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2,
      retry_condition_fn=_retry_unless_config_error, tags=["config", "evaluate"])
def check_eval_tasks(config: RunConfig) -> dict[str, str]:
    """Resolve the names of eval.tasks (lm-eval's task index and eval.task_dir) so that a
    misspelt one fails the flow before anything launches, not at the first evaluation after
    training. Flows submit it first, beside their other start-up work. A ConfigError (the
    unknown name, its closest names, how to list tasks) is not retried."""
    started = time.perf_counter()
    found = evaluation.check_tasks(config)
    get_run_logger().info(f"eval.tasks resolved in {time.perf_counter() - started:.2f} s: "
                          + ", ".join(f"{name} ({source})" for name, source in found.items()))
    return found


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      retry_condition_fn=_retry_unless_config_error, tags=["evaluate"])
def evaluate_checkpoint(config: RunConfig, checkpoint: Path, dataset_dir: Path) -> EvalReport:
    report = evaluation.evaluate(config, checkpoint, dataset_dir)
    per_source = "".join(f", {name} {loss:.4f}" for name, loss in report.source_losses.items())
    bpb = "" if report.bits_per_byte is None else f", {report.bits_per_byte:.4f} bits/byte"
    get_run_logger().info(f"step {report.step}: held-out loss {report.loss:.4f}{per_source}, "
                          f"perplexity {report.perplexity:.2f}{bpb} ({report.tokens_evaluated:,} tokens)")
    if report.downstream:
        how = report.settings
        get_run_logger().info(
            f"eval.tasks scored on {how.get('device', '?')} in {how.get('precision', '?')} "
            f"(eval.precision={config.eval.precision}), "
            f"{how.get('limit') or 'all'} items per task, "
            f"{'the task default' if how.get('num_fewshot') is None else how['num_fewshot']} "
            f"few-shot, lm-eval {how.get('lm_eval', '?')}:")
    for name, metrics in report.downstream.items():
        get_run_logger().info(f"{name}: " + ", ".join(f"{m} {v:.4f}" for m, v in metrics.items()))
    return report


@task(name="publish-eval-report", cache_policy=NO_CACHE, tags=["evaluate"])
def publish_eval_report(config: RunConfig, report: EvalReport) -> None:
    rows = [{"metric": "held-out loss", "value": f"{report.loss:.4f}"},
            {"metric": "perplexity", "value": f"{report.perplexity:.2f}"},
            {"metric": "bits per byte", "value": "n/a" if report.bits_per_byte is None
             else f"{report.bits_per_byte:.4f}"},
            {"metric": "tokens evaluated", "value": f"{report.tokens_evaluated:,}"},
            {"metric": "checkpoint step", "value": str(report.step)}]
    # How it was made (eval.limit, num_fewshot, precision, ...): a score over a few items
    # reads like one over the whole task otherwise.
    rows += [{"metric": f"setting: {name}", "value": str(value)}
             for name, value in report.settings.items()]
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
    checkpoint = Path(report.checkpoint)
    if config.run_dir.holds_checkpoint(checkpoint):
        what = f"Evaluation of {report.run_id} at step {report.step}"
    elif evaluation.is_initial(config, checkpoint):
        what = f"Evaluation of the weights {report.run_id} starts from ({checkpoint}), before any step"
    else:  # the UI's latest eval-<run> read as the run's own
        what = f"Evaluation of {checkpoint} (step {report.step}): not a checkpoint of {report.run_id}"
    create_table_artifact(table=rows, key=artifact_key("eval", report.run_id), description=what)


@task(name="record-eval", cache_policy=NO_CACHE, tags=["evaluate"])
def record_eval(config: RunConfig, report: EvalReport, started: float) -> dict:
    values = evaluation.record_eval(config, report, started)
    publish_goodput(config)  # the evaluation's time is the run's too
    return values


@task(name="evaluate-validated", cache_policy=NO_CACHE, tags=["evaluate"],
      task_run_name="evaluate-step-{step}")
def evaluate_validated(config: RunConfig, step: int, dataset_dir: Path) -> EvalReport | None:
    """Evaluate checkpoint `step` while training goes on (eval.every_validated), at the lowest
    CPU priority, if validation passed it; its scores go into the ledger entry, the trackers
    and the eval-history artifact. A failed evaluation is a warning: training goes on, and
    the evaluate stage, which evaluates the final checkpoint, reports the error."""
    logger = get_run_logger()
    entry = ledger_of(config).read().entries.get(step)
    point = readable_copy(config.run_dir, entry) if entry is not None else None
    if point is None:
        logger.info(f"checkpoint step {step} is {entry.state if entry else 'unknown'}: not evaluated")
        return None
    try:  # retention may have pruned the local copy while earlier evaluations ran: the store's
        checkpoint = evaluation.checkpoint_dir(config, point)
        report = evaluation.evaluate(config, checkpoint, dataset_dir, background=True)
    except evaluation.EvaluationStopped as e:  # the training was stopped or cancelled
        logger.info(str(e))
        return None
    except Exception as e:  # noqa: BLE001 - reported, never a failure of training
        logger.warning(f"evaluation of checkpoint step {step} failed: {e}")
        return None
    evaluation.keep_in_ledger(config, report)
    logger.info(f"step {step}: " + ", ".join(f"{name} {value:.4g}" for name, value in report.scores().items()))
    publish_eval_history(config)
    return report


def publish_eval_history(config: RunConfig) -> Path | None:
    """Every score of the run's evaluated checkpoints against step: a table artifact and a
    plot (stored with the run as eval/history.png). None before any evaluation."""
    reports = eval_history(config)
    if not reports:
        return None
    run_id = config.run.run_id
    names = sorted({name for r in reports for name in r.scores()}, key=lambda n: (n.count("/"), n))
    rows = [{"step": r.step, **{n: f"{r.scores()[n]:.4f}" if n in r.scores() else "" for n in names}}
            for r in reports]
    create_table_artifact(table=rows, key=artifact_key("eval-history", run_id),
                          description=f"Evaluation of every evaluated checkpoint of {run_id}")
    plot = evaluation.plot_eval_history(reports, [n for n in names if not n.endswith("_stderr")],
                             config.run_dir.eval_dir / "history.png", run_id)
    encoded = base64.b64encode(plot.read_bytes()).decode()
    create_markdown_artifact(f"### Evaluation of `{run_id}` by step\n\n"
                             f"![evaluation of {run_id}](data:image/png;base64,{encoded})\n\n"
                             f"Stored with the run: `{plot.resolve()}`",
                             key=artifact_key("eval-curves", run_id),
                             description=f"Evaluation scores of {run_id} against step")
    return plot
