"""A real S3 endpoint for the test session: one SeaweedFS on free loopback ports.

The server requires fixed test credentials, so tests can also show that wrong keys are
refused. Registered in tests/conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import boto3
import pytest
from botocore.config import Config

from infra.seaweedfs import REGION, SeaweedFS

TEST_BUCKET = "goodput-test"
TEST_ACCESS_KEY = "goodput-test-access"
TEST_SECRET_KEY = "goodput-test-secret"
# Set by s3_env; stale values of these would change which credentials or endpoint boto3 uses.
_CLEARED_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")


@dataclass(frozen=True)
class S3TestServer:
    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)

    @property
    def env(self) -> dict[str, str]:
        """Environment that points boto3, in this process or a subprocess, at the server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            # The S3-specific variable wins over AWS_ENDPOINT_URL, so a developer's own
            # setting must not be left to point elsewhere.
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def client(self):
        """A plain boto3 client, for reaching objects behind a store's back (e.g. to corrupt them)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}),
        )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3TestServer]:
    data_dir = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedFS(data_dir, access_key=TEST_ACCESS_KEY, secret_key=TEST_SECRET_KEY, bucket=TEST_BUCKET)
    with server:
        yield S3TestServer(server.endpoint_url, TEST_BUCKET, TEST_ACCESS_KEY, TEST_SECRET_KEY)


@pytest.fixture
def s3_outage_server(tmp_path, monkeypatch) -> Iterator[SeaweedFS]:
    """A SeaweedFS of this test's own, which the test may stop and start again on the same
    ports (`stop()`, `start(same_ports=True)`): an object store outage. Its endpoint and
    credentials are applied to this process, so flows called in the test reach it."""
    server = SeaweedFS(tmp_path / "seaweedfs", access_key=TEST_ACCESS_KEY,
                       secret_key=TEST_SECRET_KEY, bucket=TEST_BUCKET)
    with server:
        for name in _CLEARED_ENV:
            monkeypatch.delenv(name, raising=False)
        env = S3TestServer(server.endpoint_url, TEST_BUCKET, TEST_ACCESS_KEY, TEST_SECRET_KEY).env
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """The server's environment applied to this process for one test."""
    for name in _CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server.env


@pytest.fixture
def s3_uri(s3_server, s3_env) -> str:
    """A fresh `s3://goodput-test/<random>` prefix, with s3_env applied so open_store finds it."""
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:12]}"
