"""Test-suite wiring. Fixtures live in plugin modules grouped by the real service they start."""

import os

# Worker processes share 2 cores; keep each to one thread (STACK_NOTES).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

pytest_plugins = ["tests.s3_fixtures", "tests.prefect_fixtures", "tests.slurm_fixtures"]


# CI runs the files on 2 xdist workers, a whole file per worker (`--dist loadfile`, for the
# services a file's fixtures start once). Started in this order, longest first, the two
# workers finish together instead of one running the last long file alone. Seconds per file
# measured on a quiet 2-core machine (28 Nov, the whole `make test` in 1,274 s); a file not
# listed runs after these, in collection order.
FILE_SECONDS = {
    "test_checkpoints.py": 349, "test_faults.py": 285, "test_slurm.py": 275, "test_parallel.py": 223,
    "test_pipeline.py": 222, "test_prefect_surface.py": 208, "test_prefect_stack.py": 141,
    "test_tracking.py": 89, "test_launchers.py": 69, "test_elastic.py": 65, "test_plan.py": 65,
    "test_downstream.py": 63, "test_credentials.py": 56, "test_chaos.py": 48,
    "test_checkpoint_crashes.py": 46, "test_multinode.py": 45, "test_prepare.py": 42,
    "test_init_from.py": 41, "test_prepare_ray.py": 38, "test_moe_parallel.py": 34,
    "test_mfu_bench.py": 34,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: order within a file kept
