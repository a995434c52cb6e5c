"""Credentials the Prefect way: the store's keys and endpoint in a prefect-aws AwsCredentials
block, the W&B key in a Secret block. A pipeline against the session's SeaweedFS (which
refuses any other keys) runs with no AWS variable in its environment, and none of the
secret values turns up in anything it writes: the run and data directories, the store, the
flow runs' logs, artifacts and events, show-config."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import pytest

from core.config import ConfigError
from flows.pipeline import pipeline
from storage.ledger import Ledger
from storage.store import store_from_config
from tasks.credentials import AWS_VARIABLES
from tests.helpers import REPO, logs_of, small_config, subflow_runs

pytestmark = pytest.mark.s3


@pytest.fixture
def no_credentials_here(monkeypatch):
    """No AWS or W&B variable in this process; whatever a flow sets here is undone after."""
    saved = dict(os.environ)
    for name in (*AWS_VARIABLES, "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_pipeline_takes_its_keys_from_blocks_and_writes_them_nowhere(
        prefect_api, s3_server, tmp_path, no_credentials_here):
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    store_block, wandb_block = f"store-{uuid.uuid4().hex[:8]}", f"wandb-{uuid.uuid4().hex[:8]}"
    AwsCredentials(aws_access_key_id=s3_server.access_key,
                   aws_secret_access_key=s3_server.secret_key, region_name="us-east-1",
                   aws_client_parameters=AwsClientParameters(endpoint_url=s3_server.endpoint_url),
                   ).save(store_block)
    wandb_key = uuid.uuid4().hex + uuid.uuid4().hex[:8]  # 40 characters, as W&B's keys
    Secret(value=wandb_key).save(wandb_block)
    prefix = uuid.uuid4().hex[:12]
    overrides = (f"storage.uri=s3://{s3_server.bucket}/{prefix}",
                 f"storage.credentials_block={store_block}",
                 "tracking.wandb_project=goodput-test", "tracking.wandb_mode=offline",
                 f"tracking.wandb_api_key_block={wandb_block}",
                 "training.max_steps=4", "training.warmup_steps=1", "checkpoint.every_steps=2")
    config = small_config(tmp_path, *overrides)
    with pytest.raises(Exception):  # without the block, this process has no way in
        store_from_config(config.storage).list("")

    state = pipeline(config, return_state=True)
    assert state.is_completed(), state
    assert os.environ["WANDB_API_KEY"] == wandb_key  # what the workers inherited
    store = store_from_config(config.storage)  # the block's keys, now in this environment
    assert any(key.endswith("manifest.json") for key in store.list("runs/test/checkpoints"))

    secrets = [s3_server.secret_key.encode(), wandb_key.encode()]

    def leaks(data: bytes) -> list[bytes]:
        return [secret for secret in secrets if secret in data]

    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 20 and not {str(p): leaks(p.read_bytes()) for p in written
                                      if leaks(p.read_bytes())}
    client = s3_server.client()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=s3_server.bucket, Prefix=prefix) for o in page.get("Contents", [])]
    assert keys and not [k for k in keys if leaks(
        client.get_object(Bucket=s3_server.bucket, Key=k)["Body"].read())]
    # The whole pipeline on S3 (test_pipeline_with_an_s3_store, slow, does it with keys from
    # the environment): the dataset published there, every checkpoint uploaded, the ledger.
    assert f"{prefix}/datasets/{state.result()['dataset_id']}/manifest.json" in keys
    assert f"{prefix}/runs/test/ledger.json" in keys
    assert Ledger(config.run_dir, "test").read().steps("uploaded") == [2, 4]

    flow_runs = [state.state_details.flow_run_id,
                 *(run.id for run in subflow_runs(state.state_details.flow_run_id).values())]
    lines = logs_of(*flow_runs)
    assert any("load-credentials" in line or "Finished in state" in line for line in lines)
    assert not leaks("\n".join(lines).encode())
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts()
    events = httpx.post(f"{prefect_api.api_url}/events/filter", timeout=60, json={"filter": {
        "event": {"prefix": ["goodput."]},
        "any_resource": {"labels": {"goodput.run-id": ["test"]}}}, "limit": 50}).json()
    assert not leaks(b"".join(a.model_dump_json().encode() for a in artifacts))
    assert events["events"] and not leaks(repr(events).encode())

    shown = subprocess.run([sys.executable, "-m", "flows.cli", "show-config", *overrides],
                           capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert f"credentials_block: {store_block}" in shown and not leaks(shown.encode())


def test_a_block_that_does_not_exist_is_named_in_the_error(prefect_api, tmp_path,
                                                           no_credentials_here):
    from flows.train import train

    config = small_config(tmp_path, "storage.credentials_block=no-such-block")
    with pytest.raises(ConfigError, match="storage.credentials_block='no-such-block': no "
                                          "AwsCredentials block of that name"):
        train(config)
