"""Prefect tasks of the prepare stage: each wraps one function of `goodput.data.prepare`.

Policy lives here, logic there. Results are never cached by Prefect (NO_CACHE): the library
is idempotent by content (dataset ids, unit records, the manifest), which survives changed
files and other machines where a Prefect cache key would not.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from core.config import DataConfig, PrepareConfig, RunConfig, SourceConfig, StorageConfig
from core.errors import ConfigError
from goodput.data import prepare as lib
from goodput.data import unit_processes
from storage.manifests import DatasetManifest, MixtureManifest
from storage.store import store_from_config
from tasks.retries import retry_if_transient

TAGS = ["prepare"]
# Reading sources, the store and shards touches disks and networks that fail transiently.
_io_retries = dict(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=retry_if_transient)


def unit_runner(prepare: PrepareConfig, n_units: int, api_url: str | None,
                storage_uri: str = "") -> TaskRunner:
    """Where the units' task runs run.

    prepare.runner=process: on threads of this process, one per unit in flight (at most
    prepare.workers, 0: one per core, never more than there are units), each handing its
    unit to a process of a pool that imports only the library (`UnitTaskRunner`: tokenizing
    holds the GIL); one unit at a time runs in this process.

    prepare.runner=ray: prefect-ray's RayTaskRunner on the cluster at prepare.ray_address
    (unset: a Ray of this machine, started for the run), its workers handed what they cannot
    find on their own node: the Prefect API this flow run reports to (`api_url`), the store's
    credentials from this environment (AWS_*) and one tokenizer thread per process.
    """
    if prepare.runner == "process":
        workers = _local_workers(prepare, n_units)
        return UnitTaskRunner(workers) if workers > 1 else ThreadPoolTaskRunner(max_workers=1)
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as e:
        raise ConfigError("prepare.runner=ray needs prefect-ray on this machine and every node "
                          "of the cluster: install the ray extra from the goodput checkout, "
                          "pip install -e '.[ray]' (goodput is not on PyPI)") from e
    if prepare.ray_address == "auto":
        _require_a_running_ray()
    if prepare.ray_address is not None:
        _warn_what_other_machines_cannot_reach(api_url, storage_uri)
    init_kwargs: dict = {"runtime_env": {"env_vars": worker_environment(api_url)},
                         "log_to_driver": False}  # unit logs reach Prefect; not also the console
    if prepare.ray_address is None:  # a Ray of this machine: no dashboard to serve
        init_kwargs |= {"include_dashboard": False, "num_cpus": prepare.workers or None}
    elif prepare.ray_address == "auto":  # RayTaskRunner would drop it and maybe start a Ray
        init_kwargs["address"] = "auto"
        return RayTaskRunner(init_kwargs=init_kwargs)
    return RayTaskRunner(address=prepare.ray_address, init_kwargs=init_kwargs)


def _local_workers(prepare: PrepareConfig, n_units: int) -> int:
    """prepare.workers (0: one per core), never more than there are units."""
    return max(1, min(prepare.workers or os.cpu_count() or 1, n_units))


def _require_a_running_ray() -> None:
    """prepare.ray_address=auto joins the Ray cluster this machine runs (RAY_ADDRESS, else the
    last `ray start` here): refused before the flow starts any unit where there is none, which
    Ray itself says only when the units' runner starts, in its own words."""
    import ray

    # prefect_ray leaves `ray` a lazy module until an attribute of it is read; Ray's services
    # module, imported before that, failed on `ray._private.utils` (AttributeError), so
    # `auto` crashed whether or not a cluster ran.
    getattr(ray, "__version__")
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:  # moved in another Ray version: Ray's own error, when it connects
        return
    try:
        get_ray_address_from_environment("auto", None)
    except ConnectionError:
        raise ConfigError(
            "prepare.ray_address=auto finds no running Ray cluster on this machine (no `ray "
            "start` here, RAY_ADDRESS unset): start one first (`ray start --head`, then `ray "
            "start --address=HEAD:6379` on the other nodes), or set prepare.ray_address to the "
            "cluster's address (HEAD:6379), or leave prepare.ray_address unset to run the units "
            "on a Ray of this machine started for the run") from None


def _warn_what_other_machines_cannot_reach(api_url: str | None, storage_uri: str) -> None:
    # A cluster of this machine alone is fine; nodes on other machines fail on these.
    log = logging.getLogger(__name__)
    if api_url and urlparse(api_url).hostname in ("127.0.0.1", "localhost", "::1"):
        log.warning("prepare.ray_address: the Prefect API (%s) is this machine's loopback; Ray "
                    "nodes on other machines cannot report to it: set PREFECT_API_URL to a "
                    "server they can reach", api_url)
    if storage_uri and not storage_uri.startswith("s3://"):
        log.warning("prepare.ray_address: storage.uri=%s is a local path; Ray nodes on other "
                    "machines write their shards to their own disks unless it is a shared "
                    "filesystem: use an s3:// store", storage_uri)


def worker_environment(api_url: str | None) -> dict[str, str]:
    """What a unit on another machine needs of this one's environment: the Prefect API (and
    key), the AWS_* settings that reach the store (credentials, endpoint, region, profile)."""
    from prefect.settings import PREFECT_API_KEY

    env = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    env["TOKENIZERS_PARALLELISM"] = "false"  # see _one_thread_per_process
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if PREFECT_API_KEY.value():
        env["PREFECT_API_KEY"] = PREFECT_API_KEY.value().get_secret_value()
    return env


def units_in_flight(prepare: PrepareConfig) -> int:
    """Units submitted at once: enough to keep every worker busy, few enough that a corpus
    of a million units never sits in the runner's queue (or Ray's object store) at once."""
    if prepare.workers:  # Ray runs whatever is submitted, as far as the cluster's CPUs go
        return prepare.workers if prepare.runner == "ray" else 2 * prepare.workers
    if prepare.runner == "ray":
        import ray

        return 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    return 2 * (os.cpu_count() or 1)


@contextmanager
def api_shared_with_unit_processes() -> Iterator[str | None]:
    """Point the work units' processes at this process's Prefect API; yields its URL.

    A flow called in Python with no PREFECT_API_URL talks to a temporary server that Prefect
    started in this process; the unit processes, handed that setting (none), would each start
    another one: seconds and hundreds of MB apiece, and their task runs out of the flow run's
    sight. (`goodput` commands set PREFECT_API_URL to the temporary server they start.)
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value() or "prefect.server.api.server" not in sys.modules:
        yield PREFECT_API_URL.value()  # none started here: importing its module takes seconds
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the temporary server, if this process started one
    if not server.running:
        yield None
        return
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield server.api_url


class UnitTaskRunner(ThreadPoolTaskRunner):
    """The units' task runs on `max_workers` threads of the flow's process, each handing its
    unit to a process of a pool that imports only the library (`goodput.data.unit_processes`).
    Prefect's own process pool imported Prefect in each of its processes before their first
    unit: 3.6 s on 16 cores, where a unit takes about 5 s."""

    def __init__(self, max_workers: int):
        super().__init__(max_workers=max_workers)
        self._processes: unit_processes.UnitProcesses | None = None

    def duplicate(self) -> UnitTaskRunner:
        return type(self)(max_workers=self._max_workers)

    def __enter__(self) -> UnitTaskRunner:
        super().__enter__()
        self._processes = unit_processes.UnitProcesses(self._max_workers).__enter__()
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            unit_processes.stop_units()  # Ctrl-C, a cancel: the units in flight end now
        try:
            super().__exit__(exc_type, exc_value, traceback)  # else the units running finish first
        except BaseException as e:  # Ctrl-C while they finish (after a unit failed)
            if not isinstance(e, Exception):
                unit_processes.stop_units()
            raise
        finally:
            processes, self._processes = self._processes, None
            if processes is not None:
                processes.__exit__(None, None, None)

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        with unit_processes.in_use(self._processes):  # where tokenize_unit finds them
            return super().submit(task, parameters, wait_for, dependencies)

    def __getstate__(self) -> dict:
        return super().__getstate__() | {"_processes": None}  # a pool stays with its process


def warm_unit_processes(prepare: PrepareConfig, n_units: int) -> None:
    """Have the unit processes' library imported in the background now, while the tokenizer
    is built, so that their pool starts at once (where `unit_runner` gives them a pool)."""
    if prepare.runner == "process" and _local_workers(prepare, n_units) > 1:
        unit_processes.warm_up()


@task(name="plan-datasets", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def plan_datasets(config: RunConfig) -> list[tuple[SourceConfig, lib.DatasetPlan]]:
    """Each source's plan, all listed before any is tokenized (a mix's missing third source
    is said before hours on the first two). From the source listing; where a source is not
    listable here (deleted after prepare, a worker that never had it), that of the dataset
    prepared from its data settings, as training finds it (lib.locate)."""
    return lib.mix_plans(config, store_from_config(config.storage))


@task(name="mix-datasets", cache_policy=NO_CACHE, tags=TAGS)
def mix_datasets(sources: list[tuple[SourceConfig, DatasetManifest]]) -> MixtureManifest:
    """The mixture of the sources' datasets, refused unless they share one tokenizer."""
    return lib.mixture_manifest(sources)


@task(name="find-prepared-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def find_prepared(plan: lib.DatasetPlan, storage: StorageConfig) -> tuple[DatasetManifest, str] | None:
    """The prepared dataset and where it lies (a directory here, or the store's prefix);
    None when it is neither here nor in the store."""
    store = store_from_config(storage)
    manifest = lib.find_prepared(plan, store, listing=True)
    return None if manifest is None else (manifest, lib.prepared_location(plan, store))


@task(name="plan-work-units", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def plan_units(plan: lib.DatasetPlan, config: RunConfig) -> list[lib.WorkUnit]:
    return lib.plan_units(plan, config)


@task(name="build-tokenizer", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def build_tokenizer(plan: lib.DatasetPlan, config: RunConfig, units: list[lib.WorkUnit],
                    to_store: bool = False) -> str:
    return lib.build_tokenizer(plan, config, units,
                               store_from_config(config.storage) if to_store else None)


# No tags: a tagged task asks the server for its tags' concurrency slots before it starts,
# which cost a work unit up to 2 s (a fifth of its work) on a busy machine. What caps the
# units in flight is prepare.workers.
@task(name="tokenize-unit", task_run_name="tokenize-unit-{unit.index}",
      cache_policy=NO_CACHE, **_io_retries)
def tokenize_unit(plan: lib.DatasetPlan, unit: lib.WorkUnit, data: DataConfig,
                  storage: StorageConfig, to_store: bool = False) -> lib.UnitResult:
    processes = unit_processes.current()
    if processes is not None:  # the unit's records come back to this task run's log
        return processes.run(lib.tokenize_unit, plan, unit, data, storage, to_store)
    result = lib.tokenize_unit(plan, unit, data, storage, to_store)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # one machine can hold several Ray nodes
        result.worker += f" (Ray node {ray.get_runtime_context().get_node_id()[:12]})"
    return result


@task(name="write-manifest", cache_policy=NO_CACHE, tags=TAGS)
def write_manifest(plan: lib.DatasetPlan, results: list[lib.UnitResult], tokenizer_path: str,
                   storage: StorageConfig | None = None) -> DatasetManifest:
    return lib.write_manifest(plan, results, tokenizer_path,
                              store_from_config(storage) if storage is not None else None)


@task(name="publish-dataset", cache_policy=NO_CACHE, tags=TAGS, **_io_retries)
def publish(plan: lib.DatasetPlan, manifest: DatasetManifest, storage: StorageConfig) -> str:
    return lib.publish(plan, manifest, store_from_config(storage))


@task(name="record-prepare", cache_policy=NO_CACHE, tags=TAGS)
def record_prepare(config: RunConfig, prepared: list[tuple[str, DatasetManifest, float | None, list[str] | None]],
                   started: float, mix: MixtureManifest | None = None) -> dict:
    return lib.record_prepare(config, prepared, started, mix)
