"""Chaos cases on the real pipeline: an object store outage during an upload, a whole node
killed (a checkpoint corrupted between commit and validation: tests/test_faults.py).

Each case checks what matters after a fault: the pipeline completes (or stops with the right
class), no committed and validated checkpoint is lost, no corrupt one is resumed from, the
losses equal an uninterrupted run's where the trajectory is deterministic, and the goodput
is reported. Faults come from outside the job, as they would in production: a watcher thread
in the test stops the S3 server, kills a torchrun agent or flips bytes of a shard.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from core.protocol import read_heartbeat
from flows.prepare import prepare
from infra.torchrun import AGENT_MODULE
from flows.train import train
from goodput.data.prepare import plan_dataset
from goodput.runs import read_outcomes, read_summary
from storage.ledger import Ledger
from storage.manifests import CheckpointManifest
from storage.store import open_store
from tests.helpers import (
    Watcher,
    committed,
    losses_by_step,
    small_config,
    torchrun_training,
)
from training.metrics import read_metrics

STEPS = 30


@pytest.fixture(scope="module")
def workdir(prefect_api, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chaos")
    prepare(small_config(workdir))
    return workdir


@pytest.fixture(scope="module")
def clean(workdir):
    """Losses of an uninterrupted run (plain torchrun: no orchestrator needed for this)."""
    config = small_config(workdir, "run.run_id=clean")
    proc = torchrun_training(config, Path(plan_dataset(config).local_dir), resume="none")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return losses_by_step(config.run_dir)


def ledger_state(config, step: int) -> str | None:
    entry = Ledger(config.run_dir, config.run.run_id).read().entries.get(step)
    return entry.state if entry else None


def heartbeat_step(config) -> int:
    beat = read_heartbeat(config.run_dir)
    return (beat or {}).get("step") or 0


def processes_of(run_dir: Path, *also: str) -> list[psutil.Process]:
    """Live processes (torchrun agents, workers) whose command line names this run (and
    contains each of `also`)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(run_dir) in cmdline and all(text in cmdline for text in also):
            found.append(process)
    return found


@pytest.mark.slow  # about 3 min; the soak's kind s3 (benchmarks/chaos_soak.py) runs it
@pytest.mark.chaos
@pytest.mark.s3
def test_store_outage_during_an_upload_delays_it_without_blocking_training(
        workdir, clean, s3_outage_server):
    """SeaweedFS stops when checkpoint 10 is committed and stays down until its upload has
    been tried against the dead endpoint and training reached step 20; it then starts again
    on the same ports. The upload retries and completes; training never waited for it."""
    server = s3_outage_server
    config = small_config(workdir, "run.run_id=outage", "storage.uri=s3://goodput-test/outage",
                          f"storage.endpoint_url={server.endpoint_url}")
    outage: dict[str, float] = {}

    def stop() -> None:
        outage["down"] = time.time()
        server.stop(grace=0)  # SIGTERM, then SIGKILL at once: a crash rather than a drain
        # Back once the upload of step 10 was under way against the dead endpoint for 2 s
        # and training went on to step 20.
        deadline = time.monotonic() + 300
        while not (ledger_state(config, 10) == "validated" and heartbeat_step(config) >= 20):
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint 10 is {ledger_state(config, 10)}, training at "
                                   f"step {heartbeat_step(config)}: the outage cannot end as planned")
            time.sleep(0.05)
        time.sleep(2.0)
        outage["up"] = time.time()
        server.start(same_ports=True)

    watcher = Watcher(lambda: committed(config, 10), stop)
    watcher.start()
    try:
        result = train(config)
    finally:
        watcher.check()
    assert result["final_step"] == STEPS
    assert [o["class"] for o in read_outcomes(config)] == ["done"]  # nothing failed
    # Training went on while the store was down (the server came back only after step 20).
    times = {m["step"]: m["time"] for m in read_metrics(config.run_dir)}
    assert all(outage["down"] < times[s] < outage["up"] for s in range(15, 21))
    # The upload of step 10 began during the outage (it follows validation) and finished after.
    history = {t.state: t.at for t in
               Ledger(config.run_dir, "outage").read().entries[10].history}
    assert outage["down"] < history["validated"] < outage["up"] < history["uploaded"]
    # Every checkpoint is in the store, each file as it is on disk, the manifest last.
    store = open_store(config.storage.uri, endpoint_url=server.endpoint_url)
    assert Ledger(config.run_dir, "outage").read().steps("uploaded") == [10, 20, 30]
    for step in (10, 20, 30):
        local = config.run_dir.checkpoint(step)
        prefix = f"runs/outage/checkpoints/step-{step:08d}"
        for rel in [f.path for f in CheckpointManifest.load(local).files] + ["manifest.json"]:
            store.verify(local / rel, f"{prefix}/{rel}")
    assert losses_by_step(config.run_dir) == clean
    goodput = read_summary(config.run_dir)["goodput"]
    assert goodput["lost_work_s"] == 0 and 0 < goodput["goodput"] <= 1


@pytest.mark.slow  # about 2 min; tests/test_multinode and tests/test_elastic lose nodes in CI
@pytest.mark.chaos
def test_a_killed_node_fails_the_attempt_and_the_retry_resumes(workdir, clean):
    """Two local torchrun nodes of one worker each; node 1's agent is killed (SIGKILL) after
    step 11. Its worker dies with it, node 0 is ended by the launch task, the attempt fails
    as retryable and the retry, on both nodes, resumes from the newest validated checkpoint."""
    config = small_config(workdir, "run.run_id=nodekill", "parallelism.nnodes=2",
                          "parallelism.nproc_per_node=1", "launch.max_restarts=1")
    agents: list[psutil.Process] = []

    def node_1_agent_found_and_step_11_done() -> bool:
        # Found once the workers run, ahead of time, so that the kill itself is immediate.
        if not agents and read_heartbeat(config.run_dir) is not None:
            # The launcher tells each node's torchrun its role: node 0 hosts the rendezvous.
            agents.extend(p for p in processes_of(config.run_dir, AGENT_MODULE)
                          if p.environ().get("PET_RDZV_CONF") == "is_host=0")
        return bool(agents) and heartbeat_step(config) >= 11

    def kill_node_1() -> int:
        [agent] = agents
        agent.send_signal(signal.SIGKILL)
        return heartbeat_step(config)

    watcher = Watcher(node_1_agent_found_and_step_11_done, kill_node_1)
    watcher.start()
    try:
        assert train(config)["final_step"] == STEPS
    finally:
        killed_at = watcher.check()
    assert 11 <= killed_at < STEPS
    failed, done = read_outcomes(config)
    assert failed["class"] == "retryable" and done["class"] == "done"
    assert done["resumed_from"] in (10, 20) and done["resumed_from"] <= killed_at
    assert processes_of(config.run_dir) == []  # neither node left anything behind
    ledger = Ledger(config.run_dir, "nodekill").read()
    assert ledger.steps("uploaded") == [10, 20, 30] and not ledger.steps("rejected")
    assert losses_by_step(config.run_dir) == clean
    goodput = read_summary(config.run_dir)["goodput"]
    assert goodput["attempts"] == {"retryable": 1, "done": 1} and 0 < goodput["goodput"] < 1
