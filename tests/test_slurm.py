"""Training on a real Slurm cluster: slurmctld and two slurmd (n1, n2) on this machine
(tests/slurm_fixtures.py), driven by the production launcher (infra/launchers.py,
launch.kind=slurm) through run_attempt and the train flow.

What real Slurm does that fakes never did: `squeue -j ID` prints nothing once a job has
ended, plain `sacct` fails without slurmdbd, time limits and lost nodes end jobs as TIMEOUT
and NODE_FAIL, and the controller can go away while its jobs run on. The exact command
lines are checked against fakes in tests/test_launchers.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from core.config import ConfigError
from core.protocol import ResumeSpec, read_heartbeat
from flows.prepare import prepare
from flows.train import train
from goodput.runs import read_outcomes, write_run_config
from infra.launchers import free_port
from infra.torchrun import TrainingFailed, run_attempt, stop_live_attempts
from storage.ledger import Ledger
from tests.helpers import losses_by_step, small_config, synthetic_dataset, wait_for
from tests.test_multinode import WORKER_LINE, processes_mentioning

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_dataset(tmp_path_factory.mktemp("slurm-data") / "dataset")


def slurm_config(tmp_path, *overrides: str):
    """Two Slurm nodes, one torchrun each, the job's state asked every half second."""
    return small_config(tmp_path, "launch.kind=slurm", "launch.poll_s=0.5",
                        f"launch.rdzv_port={free_port()}", "parallelism.nnodes=2",
                        "parallelism.nproc_per_node=1", *overrides)


def attempt(config, dataset, lines: list[str], attempt_id: str = "a1"):
    return run_attempt(config, write_run_config(config), dataset, attempt_id, lines.append,
                       poll_s=0.2)


def in_background(function, *args):
    """Run `function(*args)` in a thread; returns the thread and the list its result lands in."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(function(*args)), daemon=True)
    thread.start()
    return thread, results


def trained_to(config) -> int:
    """The step rank 0's heartbeat is at (0 before the first)."""
    return (read_heartbeat(config.run_dir) or {}).get("step") or 0


def job_id(lines: list[str]) -> str:
    return next(line.split()[3].rstrip(":") for line in lines
                if line.startswith("submitted Slurm job"))


def test_two_slurm_nodes_train_as_two_local_nodes_do(tmp_path, dataset, slurm):
    """srun starts one torchrun on n1 and one on n2, 2 workers each; they meet at n1's
    rendezvous (the endpoint the script derives from the allocation), train, and the job's
    output streams into the log as it comes. The losses are the local launcher's."""
    steps = ("training.max_steps=4", "training.warmup_steps=1", "checkpoint.every_steps=4",
             "parallelism.nproc_per_node=2")
    config = slurm_config(tmp_path / "slurm", *steps)
    lines: list[str] = []
    result = attempt(config, dataset, lines)
    assert result.failure_class == "done" and result.step == 4, "\n".join(lines[-40:])
    assert sorted(r["rank"] for r in result.records) == [0, 1, 2, 3]
    assert {WORKER_LINE.match(line)["node"] for line in lines if WORKER_LINE.match(line)} == {"0", "1"}
    assert any("[train] done" in line for line in lines)
    job = job_id(lines)
    assert slurm.run("squeue", "-h", "-j", job).strip() == ""  # gone, as real squeue says it
    assert "JobState=COMPLETED" in slurm.run("scontrol", "show", "job", "-o", job)
    manifest = json.loads((config.run_dir.checkpoint(4) / "manifest.json").read_text())
    assert manifest["world_size"] == 4

    local = small_config(tmp_path / "local", *steps, "parallelism.nnodes=2")
    assert attempt(local, dataset, []).failure_class == "done"
    assert losses_by_step(config.run_dir) == pytest.approx(losses_by_step(local.run_dir), rel=1e-6)
    assert processes_mentioning(str(tmp_path)) == []


def test_stopping_an_attempt_signals_the_workers_and_waits_for_the_job_to_end(tmp_path, dataset,
                                                                              slurm):
    """What a cancelled flow run does: SIGTERM reaches every node's workers through
    `scancel --signal=TERM`, they commit an emergency checkpoint, and the attempt returns
    only once the job has left the queue."""
    config = slurm_config(tmp_path, "training.max_steps=100000", "checkpoint.every_steps=1000")
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(lambda: trained_to(config) >= 3, timeout_s=420,
             what="training on Slurm", every_s=0.2)
    for stopping in stop_live_attempts(grace_s=60):
        stopping.join(timeout=120)
    thread.join(timeout=60)
    [result] = results
    assert result.failure_class == "cancelled", "\n".join(lines[-40:])
    assert slurm.queue() == []  # the job is gone before the attempt returned
    [emergency] = config.run_dir.committed_checkpoints()  # step 1000 was never reached
    assert 3 <= int(emergency.name.removeprefix("step-")) < 1000
    assert any("sent SIGTERM to Slurm job" in line for line in lines)
    assert processes_mentioning(str(config.run_dir)) == []


def test_a_job_whose_workers_ignore_sigterm_is_cancelled_after_the_grace(tmp_path, dataset, slurm):
    """A frozen worker (SIGSTOP) never answers SIGTERM: once the grace has passed the job is
    cancelled outright, and gone before the attempt returns."""
    config = slurm_config(tmp_path, "training.max_steps=100000", "checkpoint.every_steps=1000",
                          "faults.hang_at_step=3", "run.hang_timeout_s=900")
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(lambda: trained_to(config) >= 3, timeout_s=420, what="the frozen step", every_s=0.2)
    started = time.monotonic()
    for stopping in stop_live_attempts(grace_s=5):
        stopping.join(timeout=120)
    thread.join(timeout=60)
    assert results[0].failure_class == "cancelled"
    assert any(line.startswith("cancelled Slurm job") for line in lines), "\n".join(lines[-30:])
    assert 5 <= time.monotonic() - started < 90
    assert slurm.queue() == []
    assert processes_mentioning(str(config.run_dir)) == []


def test_a_pending_job_is_cancelled_at_once(tmp_path, dataset, slurm):
    """Both nodes busy with another job: the attempt's job waits in the queue, and stopping
    it cancels it there and then (no SIGTERM to send, no grace to wait)."""
    blocker = slurm.run("sbatch", "--parsable", "--nodes=2", "--exclusive", "--output=/dev/null",
                        "--wrap", "sleep 600").strip()
    config = slurm_config(tmp_path)
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(lambda: any(line.startswith("submitted Slurm job") for line in lines), timeout_s=60,
             what="the attempt's job submitted", every_s=0.2)
    job = job_id(lines)
    wait_for(lambda: slurm.run("squeue", "-h", "-j", job, "-o", "%T").strip() == "PENDING",
             timeout_s=30, what="the job pending")
    started = time.monotonic()
    for stopping in stop_live_attempts(grace_s=60):
        stopping.join(timeout=60)
    thread.join(timeout=30)
    assert time.monotonic() - started < 20
    assert results[0].failure_class == "cancelled"
    assert slurm.queue() == [blocker]
    assert "cancelled Slurm job" in "\n".join(lines)


def test_the_controller_restarting_mid_job_does_not_end_the_attempt(tmp_path, dataset, slurm,
                                                                    monkeypatch):
    """slurmctld stopped while the job trains: squeue fails for a while (the job runs on
    without its controller), the launcher keeps asking, and the attempt finishes."""
    # The launcher's queries give up on the absent controller in 2 s (MessageTimeout), not
    # in 18 (10 s and a retry): the controller is back while the job still trains. A job
    # that ended in the outage stays in the queue a minute after the restart.
    conf = tmp_path / "slurm.conf"
    conf.write_text(Path(slurm.conf).read_text() + "MessageTimeout=2\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    config = slurm_config(tmp_path, "training.max_steps=40", "checkpoint.every_steps=20")
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(lambda: trained_to(config) >= 2, timeout_s=180,
             what="training on Slurm", every_s=0.2)
    slurm.stop_controller()
    wait_for(lambda: any("scheduler query failed" in line for line in lines), timeout_s=30,
             what="a failed query", every_s=0.2)
    time.sleep(3)
    slurm.start_controller()
    thread.join(timeout=300)
    [result] = results
    assert result.failure_class == "done" and result.step == 40, "\n".join(lines[-40:])
    assert any("scheduler answers again" in line for line in lines)
    assert processes_mentioning(str(config.run_dir)) == []


def test_failures_on_slurm_are_classed_from_what_slurm_reports_and_each_retry_resumes(
        tmp_path, dataset, slurm, prefect_api):
    """The train flow on Slurm, through three failures in one flow run:
    1. a worker crashes (the job FAILED) -> retryable;
    2. a worker freezes and the job reaches its time limit (TIMEOUT) -> retryable;
    3. node n2 is set DOWN mid-job (NODE_FAIL) -> node_lost;
    and the fourth attempt finishes. Each retry resumes from the newest validated checkpoint.
    The third attempt has 11 steps left when n2 goes down: with 3, it once trained to the end
    before Slurm's signal came (its emergency checkpoint was the last step, leaving the
    fourth attempt nothing to do)."""
    prepare(small_config(tmp_path))  # the train flow finds the dataset its data settings name
    config = slurm_config(
        tmp_path, "training.max_steps=20", "checkpoint.every_steps=2", "faults.crash_at_step=3",
        "faults.hang_at_step=6", "launch.slurm.time=0:30",  # Slurm rounds it up to a minute
        "run.hang_timeout_s=900")
    run_dir = config.run_dir

    def set_n2_down_in_the_third_attempt():
        beat = read_heartbeat(run_dir) or {}
        if str(beat.get("attempt", "")).endswith("-3") and (beat.get("step") or 0) >= 9:
            slurm.set_node_state("n2", "down", "goodput test: node lost")
            return True
        return False

    def end_the_frozen_job_at_its_time_limit():
        # Slurm's smallest limit is a minute, checked every 30 s: instead of waiting out the
        # rest of it, the limit drops to 0 once the worker froze, as an administrator may
        # (`scontrol update JobId=... TimeLimit=...`); Slurm ends the job as TIMEOUT all the same.
        if not (run_dir.fault_markers / "hang_at_step-6.fired").exists():
            return False
        for job in slurm.queue():
            slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=0", check=False)
        return True

    watcher, _ = in_background(wait_for, set_n2_down_in_the_third_attempt, 600,
                               "the third attempt at step 9", 0.2)
    limiter, _ = in_background(wait_for, end_the_frozen_job_at_its_time_limit, 600,
                               "the worker frozen at step 6", 0.2)
    trained = train(config)
    watcher.join(timeout=10)
    limiter.join(timeout=10)
    assert trained["final_step"] == 20
    outcomes = read_outcomes(config)
    assert [o["class"] for o in outcomes] == ["retryable", "retryable", "node_lost", "done"], outcomes
    assert "time limit" in outcomes[1]["reason"] and "NODE_FAIL" in outcomes[2]["reason"]
    for before, retry in zip(outcomes, outcomes[1:]):
        assert retry["resumed_from"] > 0 and retry["resumed_from"] >= before["resumed_from"]
    assert Ledger(run_dir).read().steps("uploaded")[-1] == 20
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.slow  # about 100 s
def test_an_elastic_job_trains_on_when_a_node_is_set_down(tmp_path, dataset, slurm):
    """parallelism.nnodes=1:2 on Slurm: the job asks for 1-2 nodes and outlives a failed one
    (--no-kill), one step per node; n2 set DOWN mid-job ends its step (Slurm kills its task),
    and torchrun's rendezvous restarts the workers on n1 alone (world 1, accumulation 2)
    within the same job, which completes."""
    config = slurm_config(tmp_path, "parallelism.nnodes=1:2", "training.max_steps=40",
                          "checkpoint.every_steps=2", "launch.max_restarts=2",
                          "elastic.wait_for_replacement_s=3", "elastic.grow=false",
                          "run.hang_min_s=120")
    lines: list[str] = []

    def set_n2_down_at_step_3():
        if trained_to(config) >= 3:
            slurm.set_node_state("n2", "down", "goodput test: node lost")
            return True
        return False

    watcher, _ = in_background(wait_for, set_n2_down_at_step_3, 300, "step 3", 0.2)
    # In-job restarts resume from the newest committed checkpoint (nothing validates here).
    result = run_attempt(config, write_run_config(config), dataset, "a1", lines.append,
                         poll_s=0.2, start=ResumeSpec.newest_committed())
    watcher.join(timeout=10)
    text = "\n".join(lines[-60:])
    assert result.failure_class == "done" and result.step == 40, text
    assert result.worlds[0] == 2 and result.worlds[-1] == 1, (result.worlds, text)
    assert "#SBATCH --nodes=1-2" in (config.run_dir.attempt("a1") / "sbatch.sh").read_text()
    assert sorted(losses_by_step(config.run_dir)) == list(range(1, 41))
    assert any("resumed from" in line for line in lines), text  # not from scratch
    assert processes_mentioning(str(config.run_dir)) == []


def counting_sbatch(tmp_path, monkeypatch) -> Path:
    """Put a `sbatch` first on PATH that notes each call in a file, then runs the real one;
    returns the file."""
    calls = tmp_path / "sbatch-calls"
    shim = tmp_path / "bin" / "sbatch"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/bash\necho "$SLURM_CONF" >> {calls}\n'
                    f'exec {shutil.which("sbatch")} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
    return calls


def sbatch_calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.is_file() else 0


def answer_lost_sbatch(tmp_path, monkeypatch) -> None:
    """Put a `sbatch` first on PATH that submits with the real one, then never answers (a
    controller that took the job while the answer was lost: sbatch times out)."""
    shim = tmp_path / "bin" / "sbatch"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/bash\n{shutil.which("sbatch")} "$@" > /dev/null\nexec sleep 600\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")


def unreachable_controller(tmp_path, slurm, monkeypatch) -> Path:
    """SLURM_CONF names a slurm.conf whose controller port has nobody listening; returns it."""
    conf = tmp_path / "slurm.conf"
    text = Path(slurm.conf).read_text()
    conf.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port()}", text)
                    + "MessageTimeout=1\n")  # sbatch's own connect retries: 1 s, not 10
    monkeypatch.setenv("SLURM_CONF", str(conf))
    return conf


def test_no_slurm_configuration_here_fails_the_run_at_once_as_config(
        tmp_path, dataset, slurm, prefect_api, monkeypatch):
    """The shell of a new user: SLURM_CONF not exported, no slurm.conf at its default place,
    so sbatch finds no configuration and its DNS SRV lookup for a controller fails. Nothing
    will change by waiting: the train flow fails at once, as a configuration error (no
    further attempts), saying what to check. It submitted again with a backoff for
    launch.scheduler_unreachable_s (600 s), as for a controller that restarts."""
    if Path("/etc/slurm/slurm.conf").exists() or Path("/etc/slurm-llnl/slurm.conf").exists():
        pytest.skip("this host has a default slurm.conf: sbatch finds a controller without it")
    prepare(small_config(tmp_path))
    calls = counting_sbatch(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_CONF")
    config = slurm_config(tmp_path)  # the default launch.scheduler_unreachable_s, 600 s
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as failed:
        train(config)
    took = time.monotonic() - started
    message = str(failed.value)
    assert failed.value.failure_class == "config" and not failed.value.retry, message
    assert "sbatch found no Slurm configuration here (no SLURM_CONF, no slurm.conf at" in message
    assert "SLURM_CONF is exported" in message and "slurmctld" in message, message
    assert "resolve_ctls_from_dns_srv" in message, message  # sbatch's own words
    assert sbatch_calls(calls) == 1, calls.read_text()
    assert took < 120
    [outcome] = read_outcomes(config)
    assert outcome["class"] == "config" and outcome["step"] is None


def test_a_controller_that_refuses_connections_is_waited_for(tmp_path, dataset, slurm,
                                                             monkeypatch):
    """SLURM_CONF names a slurm.conf whose controller port has nobody listening: sbatch's
    "Unable to contact slurm controller" is retried with a backoff and logged, then the
    attempt fails as config with the sbatch error and what to check."""
    conf = unreachable_controller(tmp_path, slurm, monkeypatch)
    calls = counting_sbatch(tmp_path, monkeypatch)
    config = slurm_config(tmp_path, "launch.scheduler_unreachable_s=4")
    lines: list[str] = []
    with pytest.raises(ConfigError) as failed:
        attempt(config, dataset, lines)
    message = str(failed.value)
    assert "Unable to contact slurm controller" in message and str(conf) in message, message
    waits = [line for line in lines if "Slurm controller" in line and "submitting again" in line]
    assert len(waits) == sbatch_calls(calls) - 1 >= 1, lines
    assert not any(line.startswith("submitted Slurm job") for line in lines)


def test_a_submit_waiting_for_the_controller_ends_when_the_attempt_is_stopped(
        tmp_path, dataset, slurm, monkeypatch):
    """A cancellation during a controller outage: the submit's backoff (here up to 600 s)
    ends within seconds, no job is submitted, and the attempt ends cancelled."""
    unreachable_controller(tmp_path, slurm, monkeypatch)
    config = slurm_config(tmp_path, "launch.scheduler_unreachable_s=600")
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(lambda: any("submitting again" in line for line in lines), timeout_s=60,
             what="a wait for the controller", every_s=0.2)
    started = time.monotonic()
    for stopping in stop_live_attempts(grace_s=60):
        stopping.join(timeout=30)
    thread.join(timeout=10)
    assert time.monotonic() - started < 60, lines  # far inside the backoff's 600 s
    assert results and results[0].failure_class == "cancelled", lines
    assert not any(line.startswith("submitted Slurm job") for line in lines)


def test_a_stop_during_a_submit_whose_answer_is_lost_leaves_no_job_queued(
        tmp_path, dataset, slurm, monkeypatch):
    """Stopped while sbatch, its job taken, gives no answer: the job is cancelled by its
    name, so none is left to start later and hold nodes."""
    answer_lost_sbatch(tmp_path, monkeypatch)
    config = slurm_config(tmp_path, "launch.scheduler_unreachable_s=600",
                          "launch.slurm.extra_sbatch=[--hold]")  # pending: nothing runs
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(slurm.queue, timeout_s=60, what="the job queued", every_s=0.2)
    started = time.monotonic()
    for stopping in stop_live_attempts(grace_s=60):
        stopping.join(timeout=30)
    thread.join(timeout=10)
    assert time.monotonic() - started < 60, lines
    assert results and results[0].failure_class == "cancelled", lines
    assert slurm.queue() == [], lines


def test_a_job_taken_whose_answer_was_lost_is_used_even_on_the_last_try(
        tmp_path, dataset, slurm, monkeypatch):
    """sbatch took the job but its answer was lost (it timed out) on the last try within
    launch.scheduler_unreachable_s: the job found by its name is the attempt's, not left in
    the queue behind a configuration error."""
    answer_lost_sbatch(tmp_path, monkeypatch)
    config = slurm_config(tmp_path, "launch.scheduler_unreachable_s=4",
                          "launch.slurm.extra_sbatch=[--hold]")  # pending: nothing runs
    lines: list[str] = []
    thread, results = in_background(attempt, config, dataset, lines)
    wait_for(lambda: not thread.is_alive() or any(line.startswith("submitted Slurm job")
                                                  for line in lines),
             timeout_s=90, what="the submit's end", every_s=0.2)
    try:
        assert any(line.startswith("submitted Slurm job") for line in lines), lines
        assert slurm.queue() == [job_id(lines)]
        assert any("its answer lost" in line for line in lines), lines
    finally:
        for stopping in stop_live_attempts(grace_s=60):
            stopping.join(timeout=60)
        thread.join(timeout=30)
    assert results and results[0].failure_class == "cancelled", lines
    assert slurm.queue() == []


@pytest.mark.parametrize("setting, said, field", [
    ("launch.slurm.partition=nope", "Invalid partition name", "launch.slurm.partition"),
    ("parallelism.nnodes=5", "More processors requested than permitted", "parallelism.nnodes"),
])
def test_a_job_sbatch_refuses_fails_at_once_naming_the_setting(tmp_path, dataset, slurm,
                                                               monkeypatch, setting, said, field):
    """sbatch refusing the job itself is the configuration's fault: one submission, no
    wait, no retry, sbatch's message and the launch.slurm.* field to fix."""
    calls = counting_sbatch(tmp_path, monkeypatch)
    config = slurm_config(tmp_path, setting)
    lines: list[str] = []
    with pytest.raises(ConfigError) as failed:
        attempt(config, dataset, lines)
    message = str(failed.value)
    assert said in message and field in message, message
    assert sbatch_calls(calls) == 1
    assert slurm.queue() == []
