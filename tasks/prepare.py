"""Prefect tasks of the prepare stage: each wraps one function of `goodput.data.prepare`.

Policy lives here, logic there. Results are never cached by Prefect (NO_CACHE): the library
is idempotent by content (dataset ids, unit records, the manifest), which survives changed
files and other machines where a Prefect cache key would not.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ProcessPoolTaskRunner

from core.config import DataConfig, PrepareConfig, RunConfig, StorageConfig
from core.errors import ConfigError, DataError
from goodput.data import prepare as lib
from goodput.runs import update_summary
from storage.manifests import DatasetManifest
from storage.store import store_from_config

TAGS = ["prepare"]
_NOT_TRANSIENT = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS}


def retry_if_transient(task, task_run, state) -> bool:
    """Bad input (DataError, ConfigError) and a full or read-only disk fail at once; other
    errors (a network filesystem, the store, a vanished object) are worth a retry."""
    try:
        state.result()
    except (DataError, ConfigError):
        return False
    except OSError as e:
        return e.errno not in _NOT_TRANSIENT
    except Exception:
        return True
    return True


# Reading sources, the store and shards touches disks and networks that fail transiently.
_io_retries = dict(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=retry_if_transient)


def unit_runner(prepare: PrepareConfig, n_units: int) -> ProcessPoolTaskRunner:
    """Where work units run: a process per unit in flight (tokenizing holds the GIL), at
    most prepare.workers (0: one per core), never more than there are units."""
    workers = prepare.workers or os.cpu_count() or 1
    return ProcessPoolTaskRunner(max_workers=max(1, min(workers, n_units)),
                                 initializer=_one_thread_per_process)


@contextmanager
def api_shared_with_unit_processes() -> Iterator[None]:
    """Point the work units' processes at this process's Prefect API.

    A plain local run (no PREFECT_API_URL) talks to a temporary server of its own; the unit
    processes, handed that setting (none), would each start another one: seconds and
    hundreds of MB apiece, and their task runs out of the flow run's sight.
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = SubprocessASGIServer()  # the temporary server, if this process started one
    if PREFECT_API_URL.value() or not server.running:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield


def _one_thread_per_process() -> None:
    # Each unit's process tokenizes on one core: the processes are the parallelism, and
    # tokenizers' own thread pool on top of them would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


@task(name="plan-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def plan_dataset(config: RunConfig) -> lib.DatasetPlan:
    return lib.plan_dataset(config)


@task(name="find-prepared-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def find_prepared(plan: lib.DatasetPlan, storage: StorageConfig) -> DatasetManifest | None:
    return lib.find_prepared(plan, store_from_config(storage))


@task(name="plan-work-units", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def plan_units(plan: lib.DatasetPlan, config: RunConfig) -> list[lib.WorkUnit]:
    return lib.plan_units(plan, config)


@task(name="build-tokenizer", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def build_tokenizer(plan: lib.DatasetPlan, config: RunConfig, units: list[lib.WorkUnit]) -> str:
    return lib.build_tokenizer(plan, config, units)


# No tags: a tagged task asks the server for its tags' concurrency slots before it starts,
# which cost a work unit up to 2 s (a fifth of its work) on a busy machine. What caps the
# units in flight is prepare.workers.
@task(name="tokenize-unit", task_run_name="tokenize-unit-{unit.index}",
      cache_policy=NO_CACHE, **_io_retries)
def tokenize_unit(plan: lib.DatasetPlan, unit: lib.WorkUnit, data: DataConfig,
                  storage: StorageConfig) -> lib.UnitResult:
    return lib.tokenize_unit(plan, unit, data, storage)


@task(name="write-manifest", cache_policy=NO_CACHE, tags=TAGS)
def write_manifest(plan: lib.DatasetPlan, results: list[lib.UnitResult], tokenizer_path: str,
                   ) -> DatasetManifest:
    return lib.write_manifest(plan, results, tokenizer_path)


@task(name="publish-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def publish(plan: lib.DatasetPlan, manifest: DatasetManifest, storage: StorageConfig) -> None:
    lib.publish(plan, manifest, store_from_config(storage))


@task(name="record-prepare", cache_policy=NO_CACHE, tags=TAGS)
def record_prepare(config: RunConfig, manifest: DatasetManifest, started: float,
                   tokenize_s: float | None = None) -> dict:
    """Write the prepare stage's part of the run's summary.json (`tokenize_s`: the work
    units' wall time, None when the dataset was found prepared)."""
    values = {"dataset_id": manifest.dataset_id, "source": manifest.source,
              "vocab_size": manifest.vocab_size,
              "tokens": {split: manifest.n_tokens(split) for split in manifest.splits},
              "skipped_records": manifest.skipped_records,
              "tokenize_s": tokenize_s, "wall_time_s": time.time() - started}
    update_summary(config.run_dir, "prepare", values)
    return values
