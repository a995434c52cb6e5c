"""The prepare flow: list sources -> tokenizer -> work units (in parallel) -> manifest -> store,
once per source of a mix (the first source's tokenizer serves them all).

Work units run in a pool of processes on this machine that import only the library (their
task runs stay in the flow's process; one unit at a time: in the flow's own process) and
write the dataset here (then it is uploaded), or with prepare.runner=ray on a Ray cluster,
writing it straight to the store.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from prefect import flow, get_run_logger
from prefect.futures import as_completed

from core.config import RunConfig
from goodput.data.prepare import (
    DatasetPlan,
    UnitResult,
    WorkUnit,
    one_prepare_at_a_time,
    require_sources,
)
from goodput.data.unit_processes import stop_units
from storage.manifests import DatasetManifest, MixtureManifest
from storage.store import usable_anywhere
from tasks.control import cancelled_on_ctrl_c, resolve_config
from tasks.credentials import load_credentials, uses_blocks
from tasks.prepare import (
    api_shared_with_unit_processes,
    build_tokenizer,
    find_prepared,
    mix_datasets,
    plan_datasets,
    plan_units,
    publish,
    record_prepare,
    tokenize_unit,
    unit_runner,
    units_in_flight,
    warm_unit_processes,
    write_manifest,
)
from tasks.reporting import PrepareProgress


@flow(name="prepare", on_crashed=[cancelled_on_ctrl_c])
def prepare(config: RunConfig = RunConfig(), config_file: str | None = None,
            overrides: tuple[str, ...] = ()) -> DatasetManifest | MixtureManifest:
    """Prepare the dataset `config.data` and `config.tokenizer` describe, or find it prepared;
    for a mix (data.sources), each source's dataset in turn.

    Args:
        config: The run's configuration (the form); used unless `config_file` is set.
        config_file: A RunConfig YAML file, relative to the working directory of the flow
            run; leave the form at its defaults when set.
        overrides: Field overrides applied last, e.g. ["data.max_docs=1000"].
    """
    started = time.time()
    config = resolve_config(config, config_file, overrides)
    if uses_blocks(config):  # the store's and W&B's keys, from Prefect blocks
        load_credentials(config)
    prepared = []
    for source, plan in plan_datasets(config):
        manifest, tokenize_s, workers = prepare_source.with_options(flow_run_name=f"prepare-{source.name}")(
            config.source_config(source), plan)
        prepared.append((source, manifest, tokenize_s, workers))
    mix = mix_datasets([(source, manifest) for source, manifest, _, _ in prepared]) if config.data.sources else None
    record_prepare(config, [(s.name, m, t, w) for s, m, t, w in prepared], started, mix)
    return mix or prepared[0][1]


@flow(name="prepare-source", on_crashed=[cancelled_on_ctrl_c])
def prepare_source(config: RunConfig, plan: DatasetPlan,
                   ) -> tuple[DatasetManifest, float | None, list[str] | None]:
    """One source's dataset (`config.data.source`, planned as `plan`), found prepared or
    tokenized and published. Returns its manifest, the work units' wall time and where they
    ran (None, None when found prepared)."""
    logger = get_run_logger()
    if plan.files:  # else the sources are not here, and plan-datasets' log says which dataset stands for them
        logger.info("dataset %s from %s (%d files)", plan.dataset_id, plan.source, len(plan.files))
    to_store = config.prepare.runner == "ray"  # a cluster's machines share the store, not a disk
    found, tokenize_s, workers = find_prepared(plan, config.storage), None, None
    # Two prepares of one dataset at once (a pipeline triggered twice): the second waits.
    with one_prepare_at_a_time(plan) if found is None else nullcontext(False) as waited:
        if waited:  # the other prepare had it: it is prepared now, unless that one failed
            found = find_prepared(plan, config.storage)
        if found is not None:
            manifest, where = found
            # Checked where it lies: a dataset in the store is not downloaded (training streams it).
            logger.info("dataset %s is already prepared in %s (%s): nothing to tokenize",
                        plan.dataset_id, where, "from the same listing and settings" if plan.files
                        else "found by the data settings it was prepared with")
        else:
            require_sources(plan)
            # Passed on as a future: Prefect records it as a reference where a list of units
            # would be recorded whole among tokenize-units' parameters (refused above 512 KiB).
            planned_units = plan_units.submit(plan, config)
            units = planned_units.result()
            if not to_store:  # their library imported while the tokenizer is built
                warm_unit_processes(config.prepare, len(units))
            tokenizer_path = build_tokenizer(plan, config, units, to_store)
            tokenizing_since = time.time()
            with api_shared_with_unit_processes() as api_url:
                # Outside the try: a runner that cannot start (no Ray there) tokenized nothing.
                runner = unit_runner(config.prepare, len(units), api_url, config.storage.uri)
                try:
                    results = tokenize_units.with_options(task_runner=runner)(plan, planned_units, config, to_store)
                except BaseException:
                    logger.warning("the finished units of dataset %s stay in %s: a rerun with the "
                                   "same sources and settings redoes only the others. If you change "
                                   "them (a fixed file, other settings), that is another dataset: "
                                   "delete this one",
                                   plan.dataset_id, f"{usable_anywhere(config.storage).uri.rstrip('/')}/"
                                   f"{plan.store_key('')}" if to_store else plan.dir)
                    raise
            tokenize_s = time.time() - tokenizing_since
            workers = sorted({result.worker for result in results})
            manifest = write_manifest(plan, results, tokenizer_path, config.storage if to_store else None)
        # Also when found: a dataset prepared here while the store was down still gets uploaded.
        published = publish(plan, manifest, config.storage)
    logger.info("dataset %s: %d train tokens in %d shards, %d validation tokens (%s); "
                "%d records without text dropped, %d bad records skipped; in the store at %s",
                manifest.dataset_id, manifest.n_tokens("train"), len(manifest.splits["train"]),
                manifest.n_tokens("validation"), manifest.dtype, manifest.empty_records,
                manifest.skipped_records, published)
    return manifest, tokenize_s, workers


@flow(name="tokenize-units", on_crashed=[cancelled_on_ctrl_c])
def tokenize_units(plan: DatasetPlan, units: list[WorkUnit], config: RunConfig,
                   to_store: bool = False) -> list[UnitResult]:
    """Every work unit through the tokenizer on the configured task runner, a bounded number
    in flight, reporting progress as each finishes. Units recorded done by an earlier run
    return at once."""
    progress = PrepareProgress(config.run.run_id, plan.dataset_id, len(units), config.prepare.progress)
    plan, storage = plan.without_listing(), usable_anywhere(config.storage)
    waiting, in_flight, results = iter(units), set(), []
    window = units_in_flight(config.prepare)
    try:
        while True:
            for unit in waiting:
                in_flight.add(tokenize_unit.submit(plan, unit, config.data, storage, to_store))
                if len(in_flight) >= window:
                    break
            if not in_flight:
                return sorted(results, key=lambda r: r.index)
            finished = next(as_completed(in_flight))
            in_flight.remove(finished)
            result = finished.result()
            progress(result.docs, result.tokens, result.skipped, result.reused)
            results.append(result)
    except Exception:
        raise  # a unit that failed: the others in flight finish, and a rerun keeps their work
    except BaseException:
        # Ctrl-C or a cancel: the units in flight stop now, not when the runner's exit has
        # waited for them.
        stop_units()
        raise
    finally:
        progress.close()
