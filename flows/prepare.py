"""The prepare flow: text -> tokenizer -> token shards (in parallel) -> manifest -> store."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger, unmapped

from core.config import RunConfig
from storage.manifests import DatasetManifest
from tasks.control import resolve_config
from tasks.prepare import (
    build_tokenizer,
    find_prepared,
    plan_dataset,
    publish,
    record_prepare,
    shard_specs,
    stage_corpus,
    tokenize_shard,
    write_manifest,
)


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
    logger.info("dataset %s from %s", plan.dataset_id, plan.source)

    manifest = find_prepared(plan, config.storage)
    if manifest is None:
        corpus = stage_corpus(plan, config)
        tokenizer_path = build_tokenizer(plan, config)
        specs = shard_specs(plan, corpus)
        shards = tokenize_shard.map(plan=unmapped(plan), spec=specs)
        manifest = write_manifest(plan, shards.result(), tokenizer_path)
    # Also when found: a dataset prepared here while the store was down still gets uploaded.
    publish(plan, manifest, config.storage)

    logger.info("dataset %s: %d train tokens in %d shards, %d validation tokens (%s)",
                manifest.dataset_id, manifest.n_tokens("train"), len(manifest.splits["train"]),
                manifest.n_tokens("validation"), manifest.dtype)
    record_prepare(config, manifest, started)
    return manifest
