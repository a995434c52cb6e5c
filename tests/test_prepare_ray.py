"""prepare.runner=ray: the prepare flow's work units on a real Ray cluster of two nodes on
this machine (Ray's own `cluster_utils.Cluster`), writing to the SeaweedFS store."""

from __future__ import annotations

import json
import shutil

import pytest

from goodput.data import prepare as prep
from storage.shards import read_documents
from storage.store import open_store
from tests.test_prepare import DOCS, make_config, write_source
from training.tokenizer import load_tokenizer

pytestmark = pytest.mark.s3


@pytest.fixture
def ray_cluster(s3_env, monkeypatch):
    """Two Ray nodes of one CPU each. They start without the store's credentials in their
    environment, so a unit that reaches the store got them from the flow."""
    from ray.cluster_utils import Cluster

    with monkeypatch.context() as bare:
        for name in s3_env:
            bare.delenv(name)
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_units_on_two_ray_nodes_write_the_process_pool_s_shards_straight_to_the_store(
        prefect_api, ray_cluster, s3_uri, tmp_path):
    from flows.prepare import prepare

    source = write_source(tmp_path / "in", "jsonl", DOCS * 20)
    overrides = (f"data.source={source}", "data.max_docs=null", "data.unit_bytes=16KiB",
                 "data.shard_tokens=2048", "tokenizer.vocab_size=300")
    pool_config = make_config(tmp_path / "pool", *overrides, "prepare.workers=2")
    pool = prepare(pool_config)

    config = make_config(tmp_path / "ray", *overrides, f"storage.uri={s3_uri}", "prepare.runner=ray",
                         f"prepare.ray_address={ray_cluster.address}")
    manifest = prepare(config)
    assert manifest.model_dump(exclude={"created_at"}) == pool.model_dump(exclude={"created_at"})

    # The dataset is in the store, exactly the files its manifest lists, byte for byte those
    # the process pool wrote; this machine kept nothing of it.
    store, prefix = open_store(s3_uri), f"datasets/{manifest.dataset_id}"
    listed = [manifest.tokenizer] + [s.path for shards in manifest.splits.values() for s in shards]
    assert store.list(prefix) == sorted(f"{prefix}/{rel}" for rel in listed + ["manifest.json"])
    pool_dir = prep.plan_dataset(pool_config).dir
    for rel in listed:
        assert store.get_bytes(f"{prefix}/{rel}") == (pool_dir / rel).read_bytes(), rel
    assert not prep.plan_dataset(config).dir.exists()

    # Units ran on both nodes.
    summary = json.loads(config.run_dir.summary_file.read_text())["prepare"]
    nodes = {worker.split("Ray node ")[1] for worker in summary["workers"]}
    assert len(nodes) == 2, summary["workers"]

    # A rerun finds it in the store and does nothing; training needs only the store.
    assert prepare(config) == manifest
    shutil.rmtree(source.parent)
    trainer_config = make_config(tmp_path / "trainer", *overrides, f"storage.uri={s3_uri}")
    plan = prep.locate(trainer_config, store)
    assert prep.require_prepared(plan, store) == manifest
    # Training reads it through the shard cache: its manifest and tokenizer come to this
    # machine, the shards when a reader needs them (their bytes are the pool's, checked above).
    directory = prep.dataset_for_training(trainer_config, store)
    tokenizer = load_tokenizer(directory / manifest.tokenizer)
    texts = [tokenizer.decode(doc[:-1].tolist()) for shards in manifest.splits.values()
             for shard in shards for doc in read_documents(pool_dir / shard.path)]
    assert sorted(texts) == sorted(DOCS * 20)


def test_ray_auto_with_no_ray_running_is_refused_naming_the_field(tmp_path, monkeypatch):
    """prepare.ray_address=auto with no Ray on the machine printed Ray's own "Could not find
    any running Ray instance" once the units' runner started. (In this file: `auto` finds a
    Ray by its processes, and this file's other tests start clusters, never beside it.)"""
    from ray._private.services import find_gcs_addresses

    from core.config import PrepareConfig
    from core.errors import ConfigError
    from tasks.prepare import unit_runner

    if find_gcs_addresses():
        pytest.skip("a Ray instance runs on this machine: auto would join it")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where `ray start` notes its address
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"prepare.ray_address=auto finds no running Ray cluster "
                                          r".*`ray start --head`.*leave prepare.ray_address unset"):
        unit_runner(PrepareConfig(runner="ray", ray_address="auto"), 4, None)
    # As the command meets it: the flows imported first, prefect_ray's lazy `ray` with them.
    # Ray's services module then failed on ray._private.utils (AttributeError), cluster or not.
    import subprocess
    import sys

    from tests.helpers import REPO

    proc = subprocess.run([sys.executable, "-c", (
        "import flows.prepare\n"
        "from core.config import PrepareConfig\n"
        "from tasks.prepare import unit_runner\n"
        "unit_runner(PrepareConfig(runner='ray', ray_address='auto'), 4, None)\n")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "AttributeError" not in proc.stderr, proc.stderr[-3000:]
    assert "ConfigError: prepare.ray_address=auto finds no running Ray cluster" in proc.stderr
