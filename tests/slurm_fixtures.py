"""A real Slurm cluster for the test session: slurmctld and two slurmd (nodes n1, n2) on
this machine, started by infra.local_slurm. Registered in tests/conftest.py.

It needs root (the daemons run as root) and Debian's slurm-wlm, which the setup script
installs where it can (scripts/setup.sh); elsewhere the tests that use it are skipped,
saying why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from infra.local_slurm import LocalSlurm, ensure_names_resolve, forget_names, missing_daemons


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[LocalSlurm]:
    missing = missing_daemons()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): "
                    "apt-get install slurm-wlm, or run scripts/setup.sh as root")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster runs its daemons as root")
    added = ensure_names_resolve(["n1", "n2"])
    try:
        with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    finally:
        if added:
            forget_names()


@pytest.fixture
def slurm(slurm_cluster, monkeypatch) -> Iterator[LocalSlurm]:
    """The cluster, with its SLURM_CONF in this process's environment (the launcher's sbatch,
    squeue, scancel find it there, and so do the jobs it submits). After the test: no job
    left, every node back in service."""
    for name, value in slurm_cluster.env.items():
        monkeypatch.setenv(name, value)
    yield slurm_cluster
    slurm_cluster.run("scancel", f"--partition={slurm_cluster.partition}", check=False)
    slurm_cluster.resume_nodes()
