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
# as CI measured them (27 Nov); a file not listed runs after these, in collection order.
FILE_SECONDS = {
    "test_parallel.py": 835, "test_checkpoints.py": 808, "test_prefect_surface.py": 754,
    "test_faults.py": 737, "test_pipeline.py": 592, "test_slurm.py": 434,
    "test_prefect_stack.py": 400, "test_downstream.py": 304, "test_tracking.py": 255,
    "test_checkpoint_crashes.py": 199, "test_multinode.py": 117, "test_plan.py": 109,
    "test_mfu_bench.py": 95, "test_prepare.py": 84, "test_moe_parallel.py": 81,
    "test_credentials.py": 81, "test_chaos.py": 77, "test_init_from.py": 69,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: order within a file kept
