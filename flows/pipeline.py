"""The whole pipeline: prepare -> train -> evaluate.

Every stage is idempotent by content (dataset id, ledger, eval report per checkpoint), so
rerunning a pipeline that failed picks up at the failed stage without redoing the others.
"""

from __future__ import annotations

from prefect import flow
from prefect.exceptions import Abort, CancelledRun
from prefect.states import Cancelled

from core.config import RunConfig
from flows.evaluate import evaluate
from flows.prepare import prepare
from flows.train import train
from goodput.evaluation import evaluation_follows
from goodput.runs import check_run_config
from tasks.control import cancelled_on_ctrl_c, resolve_config
from tasks.credentials import load_credentials, uses_blocks
from tasks.evaluate import check_eval_tasks
from tasks.layout import check_layout
from tasks.reporting import WorkerLogs


@flow(name="pipeline", on_crashed=[cancelled_on_ctrl_c])
def pipeline(config: RunConfig = RunConfig(), config_file: str | None = None,
             overrides: tuple[str, ...] = (), worker_logs: WorkerLogs = "rank0") -> dict:
    """Prepare the dataset, train on it, evaluate the newest checkpoint.

    The layout and the names of eval.tasks are checked first, so that a layout that cannot
    run or a misspelt task fails in seconds, before the dataset is prepared (the train and
    evaluate stages check again, as they do on their own; the task names are kept, so
    that costs little).

    Args:
        config: The run's configuration (the form); used unless `config_file` is set.
        config_file: A RunConfig YAML file (e.g. configs/tiny.yaml), relative to the
            working directory of the flow run; leave the form at its defaults when set.
        overrides: Field overrides applied last, e.g. ["training.max_steps=600"].
        worker_logs: Training output in the log from global rank 0 ("rank0") or every
            rank ("all").
    """
    config = resolve_config(config, config_file, overrides)
    # A config the run's checkpoints do not continue (the UI's form with another max_steps)
    # fails here, not after the dataset is prepared.
    check_run_config(config)
    if uses_blocks(config):  # the store's and W&B's keys, from Prefect blocks
        load_credentials(config)
    eval_tasks = check_eval_tasks.submit(config) if config.eval.tasks else None
    check_layout(config)
    if eval_tasks is not None:
        eval_tasks.result()
    try:
        dataset = prepare(config)
        with evaluation_follows():  # the evaluation's process starts as training finishes
            trained = train(config, worker_logs=worker_logs)
        report = evaluate(config)
    except (CancelledRun, Abort) as e:
        # This run or a stage cancelled (a task the server refused in a run being cancelled:
        # Abort); from Cancelling, the server accepts Cancelled alone.
        return Cancelled(message=f"cancelled: {e}")
    return {"dataset_id": dataset.dataset_id, "final_step": trained["final_step"],
            "eval_loss": report.loss, "perplexity": report.perplexity,
            "run_dir": str(config.run_dir)}
