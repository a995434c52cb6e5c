"""Test-suite wiring. Fixtures live in plugin modules grouped by the real service they start."""

import os

# Worker processes share 2 cores; keep each to one thread (STACK_NOTES).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

pytest_plugins = ["tests.s3_fixtures", "tests.prefect_fixtures", "tests.slurm_fixtures"]
