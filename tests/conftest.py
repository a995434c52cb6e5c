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
# from the per-test times of a whole `make test` on 2 cores (1 Dec, 870 tests in 1,699 s);
# a file not listed runs after these, in collection order.
FILE_SECONDS = {
    "test_prefect_surface.py": 420, "test_pipeline.py": 407, "test_prefect_stack.py": 285,
    "test_slurm.py": 258, "test_parallel.py": 248, "test_faults.py": 240,
    "test_checkpoints.py": 192, "test_cli.py": 156, "test_tracking.py": 143, "test_plan.py": 115,
    "test_checkpoint_crashes.py": 110, "test_downstream.py": 94, "test_prepare.py": 81,
    "test_elastic.py": 80, "test_prepare_ray.py": 70, "test_init_from.py": 66,
    "test_moe_parallel.py": 54, "test_credentials.py": 54, "test_launchers.py": 50,
    "test_mfu_bench.py": 41, "test_export.py": 34, "test_storage.py": 33,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: order within a file kept
