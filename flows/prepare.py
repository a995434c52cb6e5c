"""The prepare flow: list sources -> tokenizer -> work units (in parallel) -> manifest -> store."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger, unmapped
from prefect.futures import as_completed

from core.config import RunConfig
from goodput.data.prepare import DatasetPlan, UnitResult, WorkUnit
from storage.manifests import DatasetManifest
from tasks.control import resolve_config
from tasks.prepare import (
    api_shared_with_unit_processes,
    build_tokenizer,
    find_prepared,
    plan_dataset,
    plan_units,
    publish,
    record_prepare,
    tokenize_unit,
    unit_runner,
    write_manifest,
)
from tasks.reporting import PrepareProgress


@flow(name="prepare")
def prepare(config: RunConfig = RunConfig(), config_file: str | None = None,
            overrides: tuple[str, ...] = ()) -> DatasetManifest:
    """Prepare the dataset `config.data` and `config.tokenizer` describe, or find it prepared.

    Args:
        config: The run's configuration (the form); used unless `config_file` is set.
        config_file: A RunConfig YAML file, relative to the working directory of the flow
            run; leave the form at its defaults when set.
        overrides: Field overrides applied last, e.g. ["data.max_docs=1000"].
    """
    started = time.time()
    logger = get_run_logger()
    config = resolve_config(config, config_file, overrides)
    plan = plan_dataset(config)
    logger.info("dataset %s from %s (%d files)", plan.dataset_id, plan.source, len(plan.files))

    manifest, tokenize_s = find_prepared(plan, config.storage), None
    if manifest is None:
        units = plan_units(plan, config)
        tokenizer_path = build_tokenizer(plan, config, units)
        run_units = tokenize_units.with_options(task_runner=unit_runner(config.prepare, len(units)))
        tokenizing_since = time.time()
        with api_shared_with_unit_processes():
            results = run_units(plan, units, config)
        tokenize_s = time.time() - tokenizing_since
        manifest = write_manifest(plan, results, tokenizer_path)
    # Also when found: a dataset prepared here while the store was down still gets uploaded.
    publish(plan, manifest, config.storage)

    logger.info("dataset %s: %d train tokens in %d shards, %d validation tokens (%s)",
                manifest.dataset_id, manifest.n_tokens("train"), len(manifest.splits["train"]),
                manifest.n_tokens("validation"), manifest.dtype)
    record_prepare(config, manifest, started, tokenize_s)
    return manifest


@flow(name="tokenize-units")
def tokenize_units(plan: DatasetPlan, units: list[WorkUnit], config: RunConfig) -> list[UnitResult]:
    """Every work unit through the tokenizer on the configured task runner, reporting
    progress as each finishes. Units recorded done by an earlier run return at once."""
    progress = PrepareProgress(config.run.run_id, plan.dataset_id, len(units), config.prepare.progress)
    futures = tokenize_unit.map(plan=unmapped(plan.without_listing()), unit=units,
                                data=unmapped(config.data), storage=unmapped(config.storage))
    results = []
    try:
        for future in as_completed(futures):
            result = future.result()
            progress(result.docs, result.tokens, result.skipped)
            results.append(result)
    finally:
        progress.close()
    return results
