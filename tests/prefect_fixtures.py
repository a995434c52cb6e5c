"""One real Prefect API for the whole test session (starting one costs about 8 s)."""

import pytest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real, temporary Prefect server and database; flows called in tests run against it."""
    import os

    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
