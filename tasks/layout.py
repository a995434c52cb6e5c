"""Check the run's parallelism layout on its hardware before anything launches.

The planner (goodput/planner.py) validates the layout against the model, the batch and the
memory of the devices it will run on, and explains its estimate. This task logs that
explanation, publishes it as a markdown artifact, and fails the flow with a ConfigError
(never retried: the same config fails the same way) naming the fix when the layout cannot
work -- before torchrun starts, not minutes later with an out-of-memory crash.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from core.config import ConfigError, RunConfig
from goodput import planner
from tasks.reporting import artifact_key


@task(name="check-layout", cache_policy=NO_CACHE, retries=0, tags=["config", "training"])
def check_layout(config: RunConfig) -> dict:
    """Plan the config's layout on the cluster it launches on; raise ConfigError with the
    reason and the fix when it cannot run. Returns the estimate's headline numbers."""
    logger = get_run_logger()
    plan, cluster, source = planner.check_run(config)
    logger.info(f"{planner.explain(plan, cluster)}\n  device memory: {source}")
    if cluster.gpu_memory is None:
        logger.warning(f"memory per device not checked ({source})")
    for warning in plan.warnings:  # runs, at a cost; parallelism.strict_layout refuses instead
        logger.warning(f"layout {plan.name}: {warning}")
    try:
        create_markdown_artifact(planner.explain_markdown(plan, cluster, source),
                                 key=artifact_key("layout-plan", config.run.run_id),
                                 description=f"layout {plan.name}: "
                                             f"{'fits' if plan.ok else 'cannot run'}")
    except Exception as e:  # a view of the check: never the reason a run fails or passes
        logger.warning(f"layout artifact not published: {e!r}")
    if not plan.ok:
        raise ConfigError(planner.failure_message(plan, cluster, source))
    return {"layout": plan.degrees, "device": cluster.device,
            "peak_bytes": plan.memory.peak, "need_bytes": plan.memory.need,
            "device_memory_bytes": cluster.gpu_memory,
            "memory_source": source, "bubble": plan.bubble, "comm_bytes": plan.comm,
            "warnings": [str(w) for w in plan.warnings]}
