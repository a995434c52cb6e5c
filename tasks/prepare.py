"""Prefect tasks of the prepare stage: each wraps one function of `goodput.data.prepare`.

Policy lives here, logic there. Results are never cached by Prefect (NO_CACHE): the library
is idempotent by content (dataset ids, shard metadata, the manifest), which survives
changed files and other machines where a Prefect cache key would not.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from core.config import RunConfig, StorageConfig
from core.errors import DataError
from goodput.data import prepare as lib
from goodput.runs import update_summary
from storage.manifests import DatasetManifest, ShardInfo
from storage.store import store_from_config

TAGS = ["prepare"]


def retry_unless_data_error(task, task_run, state) -> bool:
    """Bad input (DataError) fails at once; other errors (I/O, network) are worth a retry."""
    try:
        state.result()
    except DataError:
        return False
    except Exception:
        return True
    return True


# Reading sources, the store and shards touches disks and networks that fail transiently.
_io_retries = dict(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=retry_unless_data_error)


@task(name="plan-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def plan_dataset(config: RunConfig) -> lib.DatasetPlan:
    return lib.plan_dataset(config)


@task(name="find-prepared-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def find_prepared(plan: lib.DatasetPlan, storage: StorageConfig) -> DatasetManifest | None:
    return lib.find_prepared(plan, store_from_config(storage))


@task(name="stage-corpus", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def stage_corpus(plan: lib.DatasetPlan, config: RunConfig) -> lib.CorpusInfo:
    return lib.stage_corpus(plan, config)


@task(name="build-tokenizer", cache_policy=NO_CACHE, tags=TAGS)
def build_tokenizer(plan: lib.DatasetPlan, config: RunConfig) -> str:
    return lib.build_tokenizer(plan, config)


@task(name="plan-shards", cache_policy=NO_CACHE, tags=TAGS)
def shard_specs(plan: lib.DatasetPlan, corpus: lib.CorpusInfo) -> list[lib.ShardSpec]:
    return lib.shard_specs(plan, corpus)


@task(name="tokenize-shard", task_run_name="tokenize-{spec.split}-{spec.index}",
      cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def tokenize_shard(plan: lib.DatasetPlan, spec: lib.ShardSpec) -> ShardInfo:
    return lib.tokenize_shard(plan, spec)


@task(name="write-manifest", cache_policy=NO_CACHE, tags=TAGS)
def write_manifest(plan: lib.DatasetPlan, shard_infos: list[ShardInfo], tokenizer_path: str,
                   ) -> DatasetManifest:
    return lib.write_manifest(plan, shard_infos, tokenizer_path)


@task(name="publish-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def publish(plan: lib.DatasetPlan, manifest: DatasetManifest, storage: StorageConfig) -> None:
    lib.publish(plan, manifest, store_from_config(storage))


@task(name="record-prepare", cache_policy=NO_CACHE, tags=TAGS)
def record_prepare(config: RunConfig, manifest: DatasetManifest, started: float) -> dict:
    """Write the prepare stage's part of the run's summary.json."""
    values = {"dataset_id": manifest.dataset_id, "source": manifest.source,
              "vocab_size": manifest.vocab_size,
              "tokens": {split: manifest.n_tokens(split) for split in manifest.splits},
              "wall_time_s": time.time() - started}
    update_summary(config.run_dir, "prepare", values)
    return values
