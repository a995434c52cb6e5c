"""The evaluate flow: held-out loss, perplexity and samples for one validated checkpoint."""

from __future__ import annotations

import time

from prefect import flow

from core.config import RunConfig
from storage.manifests import EvalReport
from tasks.control import cancelled_on_ctrl_c, resolve_config
from tasks.credentials import load_credentials, uses_blocks
from tasks.evaluate import (
    check_eval_tasks,
    evaluate_checkpoint,
    locate_checkpoint,
    publish_eval_report,
    record_eval,
)
from tasks.train import locate_dataset


@flow(name="evaluate", on_crashed=[cancelled_on_ctrl_c])
def evaluate(config: RunConfig = RunConfig(), checkpoint: str | None = None,
             config_file: str | None = None, overrides: tuple[str, ...] = ()) -> EvalReport:
    """Evaluate a checkpoint of the run: held-out loss, perplexity and samples.

    Args:
        config: The run's configuration (the form); used unless `config_file` is set.
        checkpoint: A step number or a checkpoint directory. Empty: the newest validated
            checkpoint, so a schedule evaluates whatever training has reached; a report that
            exists for that checkpoint is reused. "init": the model.init_from weights the
            run starts from (the baseline), as step 0.
        config_file: A RunConfig YAML file, relative to the working directory of the flow
            run; leave the form at its defaults when set.
        overrides: Field overrides applied last, e.g. ["eval.num_samples=5"].
    """
    started = time.time()
    config = resolve_config(config, config_file, overrides)
    if uses_blocks(config):  # the store's and W&B's keys, from Prefect blocks
        load_credentials(config)
    # A misspelt eval.tasks name fails here, before a checkpoint is fetched or evaluated.
    eval_tasks = check_eval_tasks.submit(config) if config.eval.tasks else None
    dataset = locate_dataset.submit(config)
    if eval_tasks is not None:
        eval_tasks.result()
    dataset_dir = dataset.result()
    path = locate_checkpoint(config, checkpoint)
    report = evaluate_checkpoint(config, path, dataset_dir)
    publish_eval_report(config, report)
    record_eval(config, report, started)
    return report
