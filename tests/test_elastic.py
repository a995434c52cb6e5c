"""Elastic training: a lost node is a failure class of its own, and with a node range
(parallelism.nnodes=MIN:MAX) torchrun's own elastic rendezvous trains on with the nodes that
remain, the layout following the world it gets (core.layout.follow_world). The real tests
start real torchrun agents through the local launcher (2 nodes x 2 workers) and kill one."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from core.config import ConfigError, load_config
from core.layout import LayoutError, ParallelDims, follow_world
from core.protocol import ResumeSpec
from goodput.runs import write_run_config
from training.metrics import read_metrics
from storage.manifests import CheckpointManifest
from infra.launchers import LocalLauncher, NodeLaunch, SlurmLauncher, pod_lost
from goodput.accounting import goodput_breakdown
from infra.torchrun import AGENT_MODULE, layout_change, run_attempt, torchrun_command, worker_env
from tasks.reporting import TrainingProgress
from tests.helpers import Watcher, committed, losses_by_step, small_config, synthetic_dataset
from tests.test_multinode import WORKER_LINE, processes_mentioning
from tests.test_launchers import (attempt, calls, fakes, launch_config,  # noqa: F401
                                  node_records, set_k8s)

ELASTIC = ("parallelism.nnodes=1:2", "parallelism.nproc_per_node=2", "launch.max_restarts=2",
           "elastic.wait_for_replacement_s=3")


# -- the layout follows the world -----------------------------------------------------------

def test_the_data_parallel_degree_absorbs_the_change_and_accumulation_keeps_the_batch():
    full = ParallelDims(dp_replicate=4)
    assert follow_world(full, 1, 2) == (ParallelDims(dp_replicate=2), 2)  # 4 x 1 -> 2 x 2
    assert follow_world(full, 3, 1) == (ParallelDims(dp_replicate=1), 12)
    # tp and pp stay; FSDP's dp_shard absorbs where data parallelism is sharding only...
    fsdp_tp = ParallelDims(dp_shard=4, tp=2)
    assert follow_world(fsdp_tp, 1, 4) == (ParallelDims(dp_shard=2, tp=2), 2)
    # ...and under HSDP dp_shard stays, dp_replicate changes.
    hsdp = ParallelDims(dp_replicate=4, dp_shard=2)
    assert follow_world(hsdp, 1, 4) == (ParallelDims(dp_replicate=2, dp_shard=2), 2)
    with pytest.raises(LayoutError, match="does not divide the 8 micro-batches"):
        follow_world(ParallelDims(dp_replicate=8), 1, 6)
    with pytest.raises(LayoutError, match="not a multiple of tp x pp = 4"):
        follow_world(ParallelDims(dp_replicate=2, tp=2, pp=2), 1, 6)
    with pytest.raises(LayoutError, match="HSDP's dp_shard=4"):
        follow_world(ParallelDims(dp_replicate=2, dp_shard=4), 3, 6)


def test_a_node_range_is_checked_for_every_count_in_it(tmp_path):
    config = small_config(tmp_path, *ELASTIC)
    assert config.node_range == (1, 2) and config.elastic_run
    assert config.parallelism.nnodes == 2 and config.elastic.min_nodes == 1
    assert config.layout_on(1) == (ParallelDims(dp_replicate=2), 2)
    assert config.layout_on(2) == (config.parallelism.dims(), 1)
    # A range in a YAML file is text, not YAML 1.1's base-60 number (2:4 would be 124).
    path = tmp_path / "run.yaml"
    path.write_text("parallelism:\n  nnodes: 2:4\n  nproc_per_node: 2\ntraining:\n"
                    "  grad_accum_steps: 3\n")
    assert load_config(path).node_range == (2, 4)
    with pytest.raises(ConfigError, match=r"on 3 node\(s\).*training.grad_accum_steps=3"):
        load_config(None, ["parallelism.nnodes=2:4", "parallelism.nproc_per_node=2"])
    with pytest.raises(ConfigError, match="elastic.min_nodes=3 says otherwise"):
        load_config(None, ["parallelism.nnodes=2:4", "elastic.min_nodes=3"])
    with pytest.raises(ConfigError, match="elastic.min_nodes=3 exceeds parallelism.nnodes=2"):
        load_config(None, ["parallelism.nnodes=2", "elastic.min_nodes=3"])
    with pytest.raises(ConfigError, match=r"parallelism.nnodes='two:4': give a node count"):
        load_config(None, ["parallelism.nnodes=two:4"])


def test_torchrun_gets_the_range_and_the_rendezvous_waits(tmp_path):
    config = small_config(tmp_path, *ELASTIC)
    command = torchrun_command(config, tmp_path / "c.yaml", tmp_path, "a1")
    assert "--nnodes=1:2" in command and "--rdzv-backend=c10d" in command
    env = worker_env(config, "a1")
    assert env["GOODPUT_RDZV_CONF"].startswith("last_call_timeout=3,join_timeout=18,")
    assert "GOODPUT_RDZV_CONF" not in worker_env(small_config(tmp_path), "a1")
    # Slurm asks for a node range, and the job outlives a failed node.
    slurm = load_config(None, [f"run.runs_dir={tmp_path}", *ELASTIC, "launch.kind=slurm"])
    script = SlurmLauncher(NodeLaunch.of(slurm, ["torchrun"], {}, tmp_path, "j")).script()
    assert "#SBATCH --nodes=1-2" in script and "#SBATCH --no-kill" in script
    assert "--kill-on-bad-exit" not in script


def test_a_layout_change_is_described_before_and_after(tmp_path):
    config = small_config(tmp_path, *ELASTIC)
    change = layout_change(config, 4, 2)
    assert change["before"] == {"nodes": 2, "world_size": 4, "grad_accum_steps": 1,
                                "layout": {"dp_replicate": 4, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1},
                                "name": "dp_replicate=4 x dp_shard=1 x cp=1 x tp=1 x pp=1 x accumulation 1"}
    assert change["after"]["world_size"] == 2 and change["after"]["grad_accum_steps"] == 2
    assert change["text"] == ("layout changed: 2 -> 1 node(s), world 4 -> 2, dp_replicate=4 x "
                              "dp_shard=1 x cp=1 x tp=1 x pp=1 x accumulation 1 -> dp_replicate=2 x "
                              "dp_shard=1 x cp=1 x tp=1 x pp=1 x accumulation 2 (global batch 16 kept)")
    # The progress artifact's line says the world it trains on from then on.
    progress = TrainingProgress(config, "a1")
    progress.layout_changed(change)
    beat = {"step": 3, "loss": 2.0, "time": 1.0, "phase": "step"}
    progress.first = beat
    assert "world 2 of 4: dp_replicate=2 x dp_shard=1 x cp=1 x tp=1 x pp=1 x accumulation 2" in \
        progress.describe(beat)


def test_the_goodput_breakdown_counts_time_in_a_degraded_layout(tmp_path):
    records = [{"step": 1, "step_time_s": 1.0, "world_size": 4},
               {"step": 2, "step_time_s": 1.0, "world_size": 4},
               {"step": 2, "step_time_s": 3.0, "world_size": 2},  # redone after the loss
               {"step": 3, "step_time_s": 2.0, "world_size": 2},
               {"step": 4, "step_time_s": 1.0, "world_size": 4}]  # grown back
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    parts = goodput_breakdown(tmp_path, train_wall_s=20.0, full_world=4)
    assert parts["productive_s"] == 7.0 and parts["lost_work_s"] == 1.0
    assert parts["degraded_s"] == 5.0  # steps 2 and 3 as they were kept


# -- a lost node, as each launcher sees it ----------------------------------------------------

K8S = ("launch.kind=kubernetes", "launch.kubernetes.image=goodput:test",
       "launch.kubernetes.namespace=ml", "launch.poll_s=0.05", "launch.kubernetes.volume_claim=runs")


def test_pod_statuses_that_mean_a_lost_node():
    assert pod_lost({"phase": "Failed", "reason": "Evicted"}) == "NODE_LOST"
    assert pod_lost({"conditions": [{"type": "DisruptionTarget", "status": "True",
                                     "reason": "DeletionByTaintManager"}]}) == "NODE_LOST"
    assert pod_lost({"conditions": [{"type": "DisruptionTarget", "status": "True",
                                     "reason": "PreemptionByScheduler"}]}) == "PREEMPTED"
    assert pod_lost({"phase": "Failed", "containerStatuses": []}) is None


def test_an_evicted_kubernetes_pod_fails_the_attempt_as_node_lost(tmp_path, fakes):  # noqa: F811
    config = launch_config(tmp_path, fakes, *K8S, f"launch.kubernetes.mount_path={tmp_path}")
    set_k8s(fakes, [{"conditions": [{"type": "Running", "status": "True"}]},
                    {"conditions": [{"type": "Failed", "status": "True"}]}], pods=[137, 75])
    pods = json.loads((fakes / "k8s-pods.json").read_text())
    pods["items"][0]["status"].update(phase="Failed", reason="Evicted",
                                      message="The node was low on resource: memory.")
    (fakes / "k8s-pods.json").write_text(json.dumps(pods))
    result = attempt(config)
    assert result.failure_class == "node_lost" and result.exit_code == 137
    assert "evicted its pod" in result.reason
    assert calls(fakes, "kubectl")[-1][:3] == ["delete", "jobset", "goodput-test-t1"]


def test_an_elastic_ssh_run_starts_on_the_hosts_that_answer(tmp_path, fakes, monkeypatch):  # noqa: F811
    """Three hosts, at least two: the one that does not answer is left out, the first that
    does hosts the rendezvous as node 0."""
    monkeypatch.setenv("FAKE_SSH_DOWN", "10.1.0.1")
    config = launch_config(tmp_path, fakes, "launch.kind=ssh", "parallelism.nnodes=2:3",
                           "launch.hosts=[10.1.0.1, 10.1.0.2, 10.1.0.3]", "launch.rdzv_port=29555",
                           "training.grad_accum_steps=6")
    lines: list[str] = []
    result = attempt(config, lines=lines)
    assert result.failure_class == "done", lines
    assert any("not answering over ssh, left out: 10.1.0.1; starting on 2 of 3 hosts" in line
               for line in lines)
    records = node_records(fakes)
    assert sorted(records) == ["10.1.0.2", "10.1.0.3"]
    assert {r["env"]["PET_RDZV_ENDPOINT"] for r in records.values()} == {"10.1.0.2:29555"}
    assert records["10.1.0.2"]["env"]["PET_RDZV_CONF"].startswith("is_host=1,last_call_timeout=")
    assert "--nnodes=2:3" in records["10.1.0.2"]["argv"]


def test_elastic_kubernetes_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="drop elastic.min_nodes"):
        load_config(None, [*ELASTIC, *K8S, f"launch.kubernetes.mount_path={tmp_path}",
                           f"run.runs_dir={tmp_path}/runs", f"data.data_dir={tmp_path}/data"])


def node_processes(tmp_path, *overrides: str) -> LocalLauncher:
    """Two local "nodes" whose agent is `sleep`: real processes, started as the launcher
    starts torchrun (node_wrapper, a session each)."""
    config = small_config(tmp_path, "parallelism.nnodes=2", "parallelism.nproc_per_node=1",
                          *overrides)
    launcher = LocalLauncher(NodeLaunch.of(config, ["sleep", "60"], {}, tmp_path, "t"))
    launcher.start(lambda line: None)
    return launcher


def wait_until(probe, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.05)
    raise TimeoutError


def test_a_local_node_whose_agent_vanishes_is_a_lost_node(tmp_path):
    launcher = node_processes(tmp_path)
    try:
        os.kill(launcher.procs[1].pid, signal.SIGKILL)
        assert wait_until(launcher.poll) == -signal.SIGKILL  # the attempt ends...
        assert launcher.final_state == "NODE_LOST" and launcher.lost_nodes == [1]  # ...node_lost
    finally:
        launcher.stop(grace_s=1)
    # A node whose workers failed (torchrun exits 1) is no lost node: the others are stopped.
    launcher = node_processes(tmp_path)
    launcher.commands[1] = (["bash", "-c", "exit 1"], launcher.commands[1][1])
    launcher.procs[1].kill()
    launcher.procs[1].wait()
    launcher._start_node(1)
    try:
        assert wait_until(launcher.poll) == 1 and launcher.final_state is None
    finally:
        launcher.stop(grace_s=1)


def test_an_elastic_attempt_goes_on_while_nodes_remain_and_starts_a_lost_one_again(tmp_path):
    launcher = node_processes(tmp_path, "parallelism.nnodes=1:2", "launch.max_restarts=1",
                              "elastic.wait_for_replacement_s=0.5")
    try:
        first = launcher.procs[1]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert launcher.poll() is None and launcher.lost_nodes == [1]  # node 0 trains on
        # elastic.grow: node 1's agent starts again after elastic.wait_for_replacement_s, and
        # only once node 0's workers started without it: sooner, it would join their
        # rendezvous and the world would not have shrunk.
        time.sleep(0.7)
        assert launcher.poll() is None and launcher.procs[1] is first
        launcher.world_started(2)
        wait_until(lambda: launcher.poll() or (True if launcher.procs[1] is not first else None))
        assert launcher.procs[1].poll() is None
        os.kill(launcher.procs[1].pid, signal.SIGKILL)  # lost again: its restarts are spent
        launcher.procs[1].wait()
        time.sleep(0.7)
        assert launcher.poll() is None and launcher.lost_nodes == [1, 1]
        assert launcher.procs[1].poll() is not None
        os.kill(launcher.procs[0].pid, signal.SIGKILL)  # the rendezvous host: the end
        assert wait_until(launcher.poll) == -signal.SIGKILL
    finally:
        launcher.stop(grace_s=1)


# -- real torchrun agents ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("elastic") / "dataset")


def agents_of(config, is_host: int) -> list[int]:
    """The torchrun agents of this run's nodes whose rendezvous role is `is_host` (node 0
    hosts it): read from /proc, as an operator would find them."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (AGENT_MODULE.encode() in cmdline and any(str(config.run_dir.path).encode() in a
                                                       for a in cmdline + environ)
                and any(e.startswith(f"PET_RDZV_CONF=is_host={is_host}".encode()) for e in environ)):
            found.append(int(entry.name))
    return found


def kill_node(config, is_host: int = 0) -> list[int]:
    """SIGKILL the torchrun agents of the nodes that do not host the rendezvous: a node
    gone at once (its workers die with their agent: training.__main__.die_with_agent)."""
    pids = agents_of(config, is_host)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def train(config, dataset, attempt_id="a1", kill_after_step=None, nodes_killed=1):
    lines: list[str] = []
    watcher = None
    if kill_after_step is not None:
        watcher = Watcher(lambda: committed(config, kill_after_step),
                          lambda: kill_node(config), timeout_s=300)
        watcher.start()
    result = run_attempt(config, write_run_config(config), dataset, attempt_id, lines.append,
                         poll_s=0.2, start=ResumeSpec.newest_committed())
    killed = watcher.check() if watcher is not None else []
    assert len(killed) == (nodes_killed if watcher else 0), "\n".join(lines[-60:])
    return result, lines


def final_manifest(config, step: int) -> CheckpointManifest:
    return CheckpointManifest.load(config.run_dir.checkpoint(step))


STEPS = 10
RUN = (f"training.max_steps={STEPS}", "training.warmup_steps=2", "checkpoint.every_steps=2",
       "run.hang_min_s=120")


class Uninterrupted(NamedTuple):
    losses: dict[int, float]
    manifest: CheckpointManifest  # of the last step
    config: object
    result: object  # run_attempt's AttemptResult
    lines: list[str]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, dataset) -> Uninterrupted:
    """The same run on 2 nodes x 2 workers, nothing lost: the losses to match."""
    config = small_config(tmp_path_factory.mktemp("whole"), *RUN, "parallelism.nnodes=2",
                          "parallelism.nproc_per_node=2", "run.run_id=whole")
    result, lines = train(config, dataset)
    assert result.failure_class == "done" and result.worlds == [4], "\n".join(lines[-40:])
    return Uninterrupted(losses_by_step(config.run_dir), final_manifest(config, STEPS), config,
                         result, lines)


def test_two_local_nodes_of_two_workers_train(uninterrupted):
    config, result, lines = uninterrupted.config, uninterrupted.result, uninterrupted.lines
    assert result.failure_class == "done" and result.step == STEPS, "\n".join(lines[-40:])
    assert sorted(r["rank"] for r in result.records) == [0, 1, 2, 3]
    # Two torchrun nodes, each with its own rendezvous role, and worker lines prefixed.
    assert [line.split(":")[0] for line in lines if line.startswith("node ")] == ["node 0", "node 1"]
    assert any(WORKER_LINE.match(line) and "[train] done" in line for line in lines)
    assert uninterrupted.manifest.world_size == 4
    # Per-rank log files next to the attempt's exit records: 2 nodes x 2 local ranks.
    logs = config.run_dir.attempt("a1") / "torchrun"
    assert len(list(logs.glob("*/attempt_0/[01]/stdout.log"))) == 4
    assert processes_mentioning(str(config.run_dir)) == []


def test_a_lost_node_shrinks_the_world_in_the_job_and_the_run_matches(tmp_path, dataset,
                                                                      uninterrupted):
    """Node 1's agent killed mid-run: node 0's workers fail their collective, torchrun
    restarts them in the job on a world of 2 (accumulation 2), they resume from the newest
    checkpoint, and the run ends as the uninterrupted one: same losses, same samples."""
    config = small_config(tmp_path, *RUN, *ELASTIC, "elastic.grow=false")
    result, lines = train(config, dataset, kill_after_step=2)
    text = "\n".join(lines[-80:])
    assert result.failure_class == "done" and result.step == STEPS, text
    assert result.restarts >= 1 and result.worlds[0] == 4 and result.worlds[-1] == 2, text
    assert any("node 1 lost: its torchrun agent ended (killed by signal 9)" in line
               for line in lines), text
    assert any(line.startswith("layout changed: 2 -> 1 node(s), world 4 -> 2") and
               "dp_replicate=2 x dp_shard=1 x cp=1 x tp=1 x pp=1 x accumulation 2" in line
               for line in lines), text
    losses, whole = losses_by_step(config.run_dir), uninterrupted.losses
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in whole.items():
        assert loss == pytest.approx(losses[step], rel=1e-4), step
    end, whole_end = final_manifest(config, STEPS), uninterrupted.manifest
    assert end.world_size == 2 and whole_end.world_size == 4
    assert (end.data_position, end.tokens_seen) == (whole_end.data_position, whole_end.tokens_seen)
    assert end.data_position == STEPS * config.global_batch  # no sample skipped or repeated
    # The metrics say which steps ran on the shrunk world; goodput counts their time.
    kept = {r["step"]: r["world_size"] for r in read_metrics(config.run_dir)}
    assert kept[STEPS] == 2 and kept[1] in (2, 4)
    assert goodput_breakdown(config.run_dir, 100.0, full_world=4)["degraded_s"] > 0


def test_a_shrink_below_min_nodes_waits_then_fails_as_node_lost(tmp_path, dataset):
    """3 nodes of 1 worker, at least 2: two lost leave node 0 alone, which waits
    elastic.wait_for_replacement_s for them and then fails, naming the setting."""
    config = small_config(tmp_path, *RUN, "parallelism.nnodes=2:3",
                          "parallelism.nproc_per_node=1", "training.grad_accum_steps=2",
                          "launch.max_restarts=2", "elastic.wait_for_replacement_s=3",
                          "elastic.grow=false", "training.max_steps=40")
    started = time.monotonic()
    result, lines = train(config, dataset, kill_after_step=2, nodes_killed=2)
    assert result.failure_class == "node_lost", "\n".join(lines[-60:])
    assert "fewer than elastic.min_nodes=2 remained" in result.reason
    assert "elastic.wait_for_replacement_s=3s" in result.reason
    assert result.step is not None and result.step < 40
    # The second loss is not told to train on below the minimum.
    lost = [line for line in lines if " lost: its torchrun agent ended" in line]
    assert "training goes on" not in lost[-1] and "fewer than elastic.min_nodes=2" in lost[-1], lost
    assert time.monotonic() - started < 240


@pytest.mark.slow  # about 50 s; tests/test_elastic's launcher test covers it in CI
def test_a_lost_node_of_a_fixed_world_fails_the_attempt_as_node_lost(tmp_path, dataset):
    config = small_config(tmp_path, *RUN, "parallelism.nnodes=2", "parallelism.nproc_per_node=1",
                          "training.max_steps=40")
    result, lines = train(config, dataset, kill_after_step=2)
    assert result.failure_class == "node_lost", "\n".join(lines[-60:])
    assert "torchrun agent vanished" in result.reason
    assert any("node 1 lost: its torchrun agent ended (killed by signal 9)" in line
               for line in lines)


@pytest.mark.slow
def test_a_lost_node_started_again_grows_the_world_back_at_the_next_restart(tmp_path, dataset):
    """elastic.grow: the launcher starts node 1's agent again once
    elastic.wait_for_replacement_s has passed and node 0 trains on alone (started sooner, it
    joined node 0's rendezvous and the world never shrank); torchrun's agent on node 0 sees it waiting,
    restarts its workers (a membership change, not a failure: no restart budget spent), and
    the world is 4 again, accumulation back to 1."""
    steps = 200
    config = small_config(tmp_path, f"training.max_steps={steps}", "training.warmup_steps=2",
                          "checkpoint.every_steps=10", "run.hang_min_s=120", *ELASTIC,
                          "elastic.grow=true")
    result, lines = train(config, dataset, kill_after_step=10)
    text = "\n".join(lines[-80:])
    assert result.failure_class == "done" and result.step == steps, text
    assert result.worlds[:2] == [4, 2] and result.worlds[-1] == 4, (result.worlds, text)
    assert any("node 1: starting its agent again (elastic.grow" in line for line in lines), text
    assert any("layout changed: 1 -> 2 node(s), world 2 -> 4" in line for line in lines), text
    end = final_manifest(config, steps)
    assert end.world_size == 4 and end.data_position == steps * config.global_batch
    assert sorted(losses_by_step(config.run_dir)) == list(range(1, steps + 1))


def test_waiting_or_shrinking_is_arithmetic():
    """goodput.elastic_plan by hand: waiting idles the job for the replacement and a restart;
    shrinking idles it for two restarts and runs without the lost node's share while it is
    out; they tie at flip_replacement_s."""
    import math

    from goodput.elastic_plan import (NodeLosses, flip_replacement_s, goodput_shrinking,
                                      goodput_waiting)
    losses = NodeLosses(nodes=4, mtbf_s=1000, replacement_s=100, restart_s=10)
    assert goodput_waiting(losses) == pytest.approx(1000 / 1110)
    assert goodput_shrinking(losses) == pytest.approx(1000 / 1020 * (1 - 0.1 / 4))
    flip = flip_replacement_s(losses)
    at_flip = NodeLosses(nodes=4, mtbf_s=1000, replacement_s=flip, restart_s=10)
    assert goodput_waiting(at_flip) == pytest.approx(goodput_shrinking(at_flip), rel=1e-6)
    # A replacement slower than the time between losses leaves the one node out, never more.
    slow = NodeLosses(nodes=2, mtbf_s=40, replacement_s=1e6, restart_s=14)
    assert goodput_shrinking(slow) == pytest.approx(40 / 68 * 0.5)
    assert flip_replacement_s(slow) < math.inf
