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
# from the per-test times of a whole `make test` on 2 cores (1 Dec, 886 tests in 3,038 s),
# less the tests since moved to the slow set or merged; a file not listed runs after these,
# in collection order.
FILE_SECONDS = {
    "test_prefect_surface.py": 519, "test_prefect_stack.py": 500, "test_pipeline.py": 478,
    "test_checkpoints.py": 467, "test_parallel.py": 433, "test_faults.py": 365,
    "test_slurm.py": 300, "test_cli.py": 266, "test_downstream.py": 170, "test_plan.py": 158,
    "test_tracking.py": 155, "test_checkpoint_crashes.py": 147, "test_prepare.py": 121,
    "test_elastic.py": 120, "test_init_from.py": 105, "test_export.py": 89,
    "test_moe_parallel.py": 88, "test_prepare_ray.py": 82, "test_mfu_bench.py": 77,
    "test_credentials.py": 73, "test_launchers.py": 70, "test_multinode.py": 45,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: order within a file kept
