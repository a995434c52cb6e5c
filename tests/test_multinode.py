"""Multi-node training for real: several torchrun nodes on this machine, and two nodes as
separate hosts in network namespaces, each started by infra.torchrun.run_attempt through
its launcher."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from goodput.runs import write_run_config
from infra.torchrun import run_attempt
from tests.helpers import losses_by_step, small_config, synthetic_dataset
from tests.test_launchers import calls, fakes  # noqa: F401 (fixture)

STEPS = 4
SHORT = (f"training.max_steps={STEPS}", "training.warmup_steps=1", f"checkpoint.every_steps={STEPS}")
WORKER_LINE = re.compile(r"^\[node(?P<node>\d) rank(?P<rank>\d)\] ")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("multinode") / "dataset")


def train(config, dataset, attempt: str = "a1", resume: str | None = None, on_progress=None):
    from core.protocol import ResumeSpec

    lines: list[str] = []
    start = ResumeSpec.directory(resume) if resume else ResumeSpec.validated()
    result = run_attempt(config, write_run_config(config), dataset, attempt, lines.append,
                         poll_s=0.2, on_progress=on_progress, start=start)
    return result, lines


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (read from /proc, nothing killed)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def test_a_failing_node_stops_the_others_and_every_node_restarts(tmp_path, dataset):
    config = small_config(tmp_path, *SHORT, "checkpoint.every_steps=2", "parallelism.nnodes=2",
                          "parallelism.nproc_per_node=1", "faults.crash_at_step=2",
                          "faults.crash_rank=1", "run.hang_timeout_s=120")
    started = time.monotonic()
    result, lines = train(config, dataset)
    assert result.failure_class == "retryable", "\n".join(lines[-40:])
    assert result.exit_code != 0 and result.step == 2
    assert any("[faults] killing rank 1" in line for line in lines)
    # The injected kill leaves the record a SIGKILLed worker cannot: the reason names the
    # fault, not the OOM killer (a real SIGKILL's torchrun report: test_faults).
    assert result.reason == "rank 1: killed by SIGKILL, injected by faults.crash_at_step=2", result.reason
    assert time.monotonic() - started < 60  # the other node was stopped, not waited for
    assert processes_mentioning(str(config.run_dir)) == []
    # The retry starts every node again, on a fresh rendezvous, from the checkpoint.
    resumed, lines = train(config, dataset, "a2", resume=str(config.run_dir.checkpoint(2)))
    assert resumed.failure_class == "done" and resumed.step == STEPS, "\n".join(lines[-40:])
    assert any(WORKER_LINE.match(line) and "resumed from" in line for line in lines)
    assert sorted(losses_by_step(config.run_dir)) == list(range(1, STEPS + 1))


def require_network_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns); run the suite as root, as CI does")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: hosts 10.213.0.1 and 10.213.0.2, each
    with interface gp0. Deleted afterwards (which deletes the veth pair too)."""
    require_network_namespaces()
    tag = f"gp{os.getpid() % 100000}"
    names = [f"{tag}a", f"{tag}b"]
    hosts = {"10.213.0.1": names[0], "10.213.0.2": names[1]}
    setup = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
             ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"]]
    for ns, end, (addr, _) in zip(names, ("va", "vb"), hosts.items()):
        setup += [["ip", "link", "set", f"{tag}{end}", "netns", ns],
                  ["ip", "-n", ns, "link", "set", f"{tag}{end}", "name", "gp0"],
                  ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "gp0"],
                  ["ip", "-n", ns, "link", "set", "gp0", "up"],
                  ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for cmd in setup:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"cannot build network namespaces here: {' '.join(cmd)}: {proc.stderr.strip()}")
        yield hosts
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_hosts_in_network_namespaces_train_over_ssh(tmp_path, dataset, fakes, two_hosts,  # noqa: F811
                                                        monkeypatch):
    """The ssh launcher's command lines, run by an `ssh` that enters the namespace owning
    the host's address: the nodes reach each other only over the veth pair."""
    monkeypatch.setenv("FAKE_SSH_NETNS", json.dumps(two_hosts))
    config = small_config(tmp_path, *SHORT, "parallelism.nnodes=2", "parallelism.nproc_per_node=1",
                          "launch.kind=ssh", f"launch.hosts=[{', '.join(two_hosts)}]",
                          "launch.network_interface=gp0", f"launch.workdir={os.getcwd()}")
    rank0_netns: list[str] = []

    def on_progress(beat: dict) -> None:  # rank 0 runs in one of the namespaces
        if not rank0_netns:
            rank0_netns.append(os.readlink(f"/proc/{beat['pid']}/ns/net"))

    result, lines = train(config, dataset, on_progress=on_progress)
    assert result.failure_class == "done" and result.step == STEPS, "\n".join(lines[-40:])
    assert sorted(c[-2] for c in calls(fakes, "ssh")) == sorted(two_hosts)
    namespaces = {f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]" for ns in two_hosts.values()}
    assert rank0_netns and rank0_netns[0] in namespaces
    losses = losses_by_step(config.run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    assert processes_mentioning(str(config.run_dir)) == []
