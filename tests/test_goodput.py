"""Goodput accounting on metrics as the trainer writes them (pure: no training)."""

import json
import os
import subprocess
import sys
import threading

import pytest

from goodput.accounting import goodput_breakdown
from goodput.runs import read_summary, update_summary


def write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_every_step_counts_when_only_every_nth_is_logged(tmp_path):
    """training.log_every=5: each record stands for the 5 steps since the previous one. A
    crash at step 13 and a resume from the checkpoint of step 5 redo steps 6-13: the first
    run of 6-10 (logged) is lost work; 11-13 were never logged, their time falls to restart.
    The accounting sees all 15 steps of the final model, not 3 of them."""
    first = [{"step": 5, "step_time_s": 1.2, "window_steps": 5, "window_time_s": 5.0, "checkpoint_s": 0.5},
             {"step": 10, "step_time_s": 1.0, "window_steps": 5, "window_time_s": 5.0, "checkpoint_s": 0.0}]
    resumed = [{"step": 10, "step_time_s": 1.0, "window_steps": 5, "window_time_s": 5.0, "checkpoint_s": 0.0},
               {"step": 15, "step_time_s": 1.0, "window_steps": 5, "window_time_s": 5.0, "checkpoint_s": 0.5}]
    write_metrics(tmp_path, first + resumed)
    result = goodput_breakdown(tmp_path, train_wall_s=30.0)
    assert result["productive_s"] == pytest.approx(15.0)  # steps 1..15 at 1 s each
    assert result["lost_work_s"] == pytest.approx(5.0)    # the first run of steps 6..10
    assert result["checkpoint_s"] == pytest.approx(1.0)
    assert result["restart_s"] == pytest.approx(30.0 - 15.0 - 5.0 - 1.0)
    assert result["goodput"] == pytest.approx(15.0 / 30.0)


def test_the_checkpoint_interval_advice_counts_a_background_saves_stall_once_per_save(tmp_path):
    """A background save stalls training twice: at its step (starting it) and in the next
    step's wait for its copy of the weights, logged in two records. The advice's cost is per
    save (records marked checkpointed), not per record with a stall."""
    from goodput.accounting import checkpoint_interval_advice

    records = [{"step": s, "step_time_s": 1.0, "checkpointed": s in (5, 10),
                "checkpoint_s": {5: 0.2, 6: 0.3, 10: 0.2, 11: 0.3}.get(s, 0.0)} for s in range(1, 13)]
    write_metrics(tmp_path, records)
    advice = checkpoint_interval_advice(tmp_path, failures=0, wall_s=12.0, mtbf_hours=1.0,
                                        every_steps=5)
    assert advice["checkpoint_cost_s"] == pytest.approx(0.5)
    assert advice["optimal_interval_s"] == pytest.approx((2 * 0.5 * 3600) ** 0.5)
    # Metrics from before the mark: the mean over the records that hold a stall.
    write_metrics(tmp_path, [{k: v for k, v in r.items() if k != "checkpointed"} for r in records])
    assert checkpoint_interval_advice(tmp_path, 0, 12.0, 1.0, 5)["checkpoint_cost_s"] == pytest.approx(0.25)


def test_records_without_windows_count_one_step_each(tmp_path):
    """Metrics written with log_every=1 (or before windows were recorded)."""
    write_metrics(tmp_path, [{"step": s, "step_time_s": 0.5} for s in (1, 2, 3, 2, 3)])
    result = goodput_breakdown(tmp_path, train_wall_s=4.0)
    assert result["productive_s"] == pytest.approx(1.5) and result["lost_work_s"] == pytest.approx(1.0)


def test_in_loop_validation_of_a_redone_step_is_lost_work(tmp_path):
    """eval.every_steps=2: the validation at step 2 ran twice (a crash after step 3, a resume
    from step 1). Its first run is lost work like the steps', the last counts as evaluation."""
    first = [{"step": 1, "step_time_s": 1.0}, {"step": 2, "step_time_s": 1.0, "val_time_s": 0.4},
             {"step": 3, "step_time_s": 1.0}]
    resumed = [{"step": 2, "step_time_s": 1.0, "val_time_s": 0.3}, {"step": 3, "step_time_s": 1.0},
               {"step": 4, "step_time_s": 1.0, "val_time_s": 0.5}]
    write_metrics(tmp_path, first + resumed)
    result = goodput_breakdown(tmp_path, train_wall_s=10.0)
    assert result["productive_s"] == pytest.approx(4.0)
    assert result["lost_work_s"] == pytest.approx(2.0 + 0.4)  # steps 2-3 and step 2's validation
    assert result["evaluation_s"] == pytest.approx(0.3 + 0.5)
    assert result["restart_s"] == pytest.approx(10.0 - 4.0 - 2.4 - 0.8)
    assert result["total_s"] == pytest.approx(10.0)


def test_flows_updating_summary_at_once_lose_no_section(tmp_path):
    """A scheduled evaluation writes its section while the train flow writes its own (and adds
    up its wall time): every write lands."""
    def train():
        for _ in range(100):
            update_summary(tmp_path, "train", lambda previous: {
                "wall_time_total_s": previous.get("wall_time_total_s", 0.0) + 1.0})

    def evaluate():
        for step in range(100):
            update_summary(tmp_path, f"evaluate-{step}", {"step": step})

    threads = [threading.Thread(target=train), threading.Thread(target=train),
               threading.Thread(target=evaluate)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    summary = read_summary(tmp_path)
    assert summary["train"]["wall_time_total_s"] == 200.0
    assert all(summary[f"evaluate-{step}"] == {"step": step} for step in range(100))


def test_a_cancelled_train_flow_runs_time_counts_and_a_cancel_is_no_failure(tmp_path):
    """Every train flow run's wall time adds to the run's total, also one that ended without
    finishing (cancelled); and a cancelled attempt is not a failure to plan checkpoints for."""
    import time

    from goodput.runs import record_training, record_unfinished_training
    from tests.helpers import small_config

    config = small_config(tmp_path)
    write_metrics(config.run_dir.path, [{"step": s, "step_time_s": 1.0, "checkpoint_s": 0.5 * (s == 5)}
                                        for s in range(1, 11)])
    for attempt, outcome in (("a-1", "cancelled"), ("b-1", "done")):
        directory = config.run_dir.attempts / f"attempt-{attempt}"
        directory.mkdir(parents=True)
        (directory / "outcome.json").write_text(json.dumps(
            {"class": outcome, "time": time.time(), "wall_time_s": 8.0, "restarts": 0,
             "resumed_from": 0, "newest_checkpoint": 5}))
    record_unfinished_training(config, started=time.time() - 20.0)  # the cancelled flow run
    assert read_summary(config.run_dir)["train"]["wall_time_total_s"] == pytest.approx(20.0, abs=1.0)
    record_training(config, {"class": "done"}, started=time.time() - 15.0)
    summary = read_summary(config.run_dir)
    assert summary["train"]["wall_time_total_s"] == pytest.approx(35.0, abs=1.0)
    goodput = summary["goodput"]
    assert goodput["attempts"] == {"cancelled": 1, "done": 1}
    assert goodput["productive_s"] == pytest.approx(10.0)
    assert goodput["total_s"] == pytest.approx(35.0, abs=1.0)
    assert goodput["checkpoint_advice"]["mtbf_s"] is None  # no failure observed


def test_a_refused_train_flow_run_adds_no_time(tmp_path):
    """The flow's guard counts an unfinished run's time, but not a refusal of its input."""
    import time

    from core.errors import ConfigError
    from goodput.runs import unfinished_training_counted
    from tests.helpers import small_config

    config = small_config(tmp_path)
    with pytest.raises(ConfigError), unfinished_training_counted(config, time.time() - 5.0):
        raise ConfigError("another run's config")
    assert "train" not in read_summary(config.run_dir)
    with pytest.raises(RuntimeError), unfinished_training_counted(config, time.time() - 5.0):
        raise RuntimeError("the last attempt failed")
    assert read_summary(config.run_dir)["train"]["wall_time_total_s"] == pytest.approx(5.0, abs=1.0)


def test_a_vanished_supervisors_time_and_attempts_are_recorded_by_the_next_holder(tmp_path,
                                                                                  monkeypatch):
    """A supervisor killed outright (SIGKILL: no cleanup) leaves the run's lease unreleased and
    its attempts without outcomes. The next holder of the lease records them: the time that
    supervisor held the run, and each attempt as its workers' exit records tell."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from core.protocol import ENV_LEASE_HOLDER, FailureClass, record_start, write_exit_record
    from goodput.runs import read_outcomes, record_abandoned_training
    from infra.torchrun import RunLease
    from tests.helpers import small_config

    config = small_config(tmp_path, "launch.orphan_timeout_s=30")
    earlier = config.run_dir.attempts / "attempt-old-1"  # an attempt of an earlier holder
    earlier.mkdir(parents=True)
    (earlier / "starts.jsonl").write_text(json.dumps({"start": 0, "time": time.time() - 3600}) + "\n")
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from core.config import load_config
from infra.torchrun import RunLease
config = load_config(None, {[f'run.runs_dir={config.run.runs_dir}', 'run.run_id=test',
                             'launch.orphan_timeout_s=30']!r})
with RunLease(config, "flow run killed").held(print):
    print("held", flush=True)
    time.sleep(600)
"""], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert holder.stdout.readline().strip() == "held"
    # A plain `torchrun -m training` run meanwhile (attempt "0", no supervisor): not its.
    record_start(config.run_dir, "0")
    # Its attempt's workers: started, trained to step 7, then saved and stopped when nobody
    # renewed the lease (as training/__main__ records an orphaned end).
    monkeypatch.setenv(ENV_LEASE_HOLDER, "flow run killed")
    record_start(config.run_dir, "killed-1")
    write_metrics(config.run_dir.path, [{"step": s, "attempt": "killed-1", "step_time_s": 0.1}
                                        for s in range(5, 8)])
    time.sleep(2.0)  # it renews the lease meanwhile
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    time.sleep(1.0)  # its workers train on a while, unsupervised, then stop by themselves
    for rank in (0, 1):
        write_exit_record(config.run_dir, "killed-1", rank, FailureClass.ORPHANED,
                          "no supervisor renewed the lease for 30s: saved step 7 and stopped", 7)

    stopped = time.time()
    with RunLease(config, "flow run next").held(print) as lease:
        # Its process is gone from this host: no wait for its lease to run out.
        assert lease.waited_s < 1.0
        assert lease.abandoned["holder"] == "flow run killed" and not lease.abandoned["released"]
        found = record_abandoned_training(config, lease.abandoned)
    # Its time runs until its workers stopped, past its last renewal of the lease.
    assert found["wall_time_s"] >= stopped - lease.abandoned["since"] - 0.1
    assert found["wall_time_s"] > lease.abandoned["time"] - lease.abandoned["since"] + 0.5
    [outcome] = found["outcomes"]
    assert (outcome["attempt"], outcome["class"], outcome["step"]) == ("killed-1", "orphaned", 7)
    assert outcome["resumed_from"] == 4 and "saved step 7 and stopped" in outcome["reason"]
    assert [o["attempt"] for o in read_outcomes(config)] == ["killed-1"]  # not the earlier one
    summary = read_summary(config.run_dir)
    assert summary["train"]["wall_time_total_s"] == pytest.approx(found["wall_time_s"])
    assert summary["goodput"]["attempts"] == {"orphaned": 1}
    # A holder that let go leaves nothing to record.
    with RunLease(config, "flow run after").held(print) as lease:
        assert lease.abandoned is None


def test_a_lease_runs_out_by_its_holders_orphan_timeout_and_a_dead_local_holder_holds_none(tmp_path):
    """A waiting supervisor judges a lease by the timeout its holder's workers go by (the
    holder's launch.orphan_timeout_s, 20 s, not its own default of 120 s: it waited a minute
    for nothing), and a holder on this host whose process is gone holds nothing."""
    import socket
    import time

    from core.protocol import RunDir, _pid_space
    from infra.torchrun import RunLease
    from tests.helpers import small_config

    config = small_config(tmp_path, "launch.orphan_timeout_s=120")
    lease_file = RunDir.of(config.run_dir).lease_file
    lease_file.parent.mkdir(parents=True, exist_ok=True)

    here = _pid_space()

    def held_by(host: str, pid: int, renewed_s_ago: float, orphan_after_s: float | None,
                pid_space: str | None = here) -> str:
        now = time.time()
        lease_file.write_text(json.dumps({
            "holder": "flow run other", "pid": pid, "host": host, "time": now - renewed_s_ago,
            "since": now - 100, "released": False, "orphan_after_s": orphan_after_s,
            "pid_space": pid_space}))
        return RunLease(config, "flow run here").blocker()

    assert "is being trained by flow run other" in held_by("elsewhere", 1, 30, None)
    assert held_by("elsewhere", 1, 30, 20.0) == ""  # ran out by the holder's 20 s
    assert "is being trained" in held_by("elsewhere", 1, 10, 20.0)
    assert "is being trained" in held_by(socket.gethostname(), os.getpid(), 10, 20.0)  # alive
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert held_by(socket.gethostname(), int(gone.stdout), 10, 20.0) == ""  # its process is gone
    # The same host name in another pid namespace (a container): its pids are not ours to judge.
    assert "is being trained" in held_by(socket.gethostname(), int(gone.stdout), 10, 20.0,
                                         pid_space="another-boot/4026531836")


def test_workers_killed_outright_on_this_machine_are_not_waited_for(tmp_path):
    """kill -9 of a whole training (the command, torchrun and its workers): the next waited
    launch.orphan_timeout_s (2 minutes, then 3 with the emergency save's allowance) for
    workers that were gone. A heartbeat says where its workers ran: rank 0 and its torchrun
    agent dead on this machine, every worker on it, is none left."""
    import socket
    import time

    from core.protocol import RunDir, _pid_space, workers_gone
    from infra.torchrun import RunLease
    from tests.helpers import small_config

    config = small_config(tmp_path, "launch.orphan_timeout_s=120")
    beat_file = RunDir.of(config.run_dir).heartbeat_file
    beat_file.parent.mkdir(parents=True, exist_ok=True)
    dead = [int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True).stdout) for _ in range(2)]

    def beat(pid: int, agent_pid: int, one_machine: bool = True, host: str = socket.gethostname()) -> str:
        record = {"attempt": "killed-1", "phase": "step", "step": 7, "time": time.time() - 5,
                  "pid": pid, "agent_pid": agent_pid, "host": host, "pid_space": _pid_space(),
                  "one_machine": one_machine}
        beat_file.write_text(json.dumps(record))
        assert workers_gone(record) == (RunLease(config, "flow run here").blocker() == "")
        return RunLease(config, "flow run here").blocker()

    assert beat(*dead) == ""  # both gone: nothing to wait for
    assert "still train with no supervisor" in beat(dead[0], os.getpid())  # the agent lives
    assert "still train with no supervisor" in beat(os.getpid(), dead[1])  # rank 0 lives
    assert "still train with no supervisor" in beat(*dead, one_machine=False)  # other nodes' may
    assert "still train with no supervisor" in beat(*dead, host="elsewhere")
    # What rank 0 writes: where it runs, its agent (here: the test's parent), one machine.
    from core.protocol import read_heartbeat, write_heartbeat

    write_heartbeat(config.run_dir, attempt="a", phase="step", step=1)
    written = read_heartbeat(config.run_dir)
    assert (written["pid"], written["agent_pid"], written["host"]) == (os.getpid(), os.getppid(), socket.gethostname())
    assert written["one_machine"] is True and not workers_gone(written)


def test_an_elastic_world_growing_back_is_no_failure_in_the_accounting(tmp_path):
    """One node lost (the workers restart on 2 of 4), then let back in (they restart on 4):
    two in-job restarts, one failure. Counted as two, the observed MTBF was halved and the
    checkpoint-interval advice with it."""
    from core.protocol import FailureClass
    from goodput.runs import failures_of, read_outcomes, record_outcome
    from infra.torchrun import AttemptResult
    from tests.helpers import small_config

    config = small_config(tmp_path)
    result = AttemptResult(exit_code=0, failure_class=FailureClass.DONE, reason="done", step=30,
                           wall_time_s=100.0, restarts=2, worlds=[4, 2, 4])
    outcome = record_outcome(config, "a-1", result, resumed_from=0)
    assert (outcome["restarts"], outcome["grows"]) == (2, 1)
    assert failures_of(read_outcomes(config)) == 1


def test_a_start_still_being_appended_is_not_read_yet(tmp_path):
    """The supervisor reads starts.jsonl every poll: a last line without its newline (an
    append under way, seen on a shared filesystem) is left for the next poll, not a
    JSONDecodeError that ends the supervision."""
    from core.protocol import RunDir, read_starts

    attempt = RunDir.of(tmp_path / "run").attempt("a-1")
    attempt.mkdir(parents=True)
    (attempt / "starts.jsonl").write_text('{"start": 0, "world_size": 4}\n{"start": 1, "wor')
    assert read_starts(tmp_path / "run", "a-1") == [{"start": 0, "world_size": 4}]


def test_a_hung_attempts_time_after_its_last_step_is_its_own_item():
    """From the last step of an attempt that hung to the supervisor's kill: counted as
    restart time before, which hid the hang."""
    from goodput.accounting import hung_s

    records = [{"step": 29, "attempt": "a-1", "time": 100.0}, {"step": 30, "attempt": "a-1", "time": 101.0},
               {"step": 31, "attempt": "a-2", "time": 160.0}]
    outcomes = [{"attempt": "a-1", "class": "hang", "time": 125.0},
                {"attempt": "a-2", "class": "done", "time": 170.0}]
    assert hung_s(records, outcomes) == 24.0


# -- start-up and securing the last checkpoints are not restarts --------------------------------

def _ledger(*transitions: tuple[int, str, float]):
    """A ledger whose checkpoints went through (step, state, at) transitions."""
    from storage.ledger import LedgerData, LedgerEntry, Transition

    entries = {}
    for step, state, at in transitions:
        entry = entries.setdefault(step, LedgerEntry(step=step, state=state))
        entry.state = state
        entry.history.append(Transition(state=state, at=at))
    return LedgerData(run_id="run", entries=entries)


def _steps(attempt: str, first: int, last: int, started: float, **extra) -> list[dict]:
    """Records of steps first..last of one attempt, 1 s each, the first starting at `started`."""
    return [{"step": s, "step_time_s": 1.0, "attempt": attempt, "time": started + s - first + 1.0,
             **extra} for s in range(first, last + 1)]


def test_a_clean_run_s_start_up_and_securing_of_its_last_checkpoints_are_not_restart_time(tmp_path):
    """One attempt, no restart (the report: restart_s 91.7 of 303.4 s for such a run). The
    flow starts at 0 and launches the workers at 20; their first step starts at 50 and the
    tenth ends at 60; they exit at 61; the flow validates and uploads the last checkpoints
    until 121 and ends at 122. Securing after the workers finished (61 -> 121) and start-up
    (everything else between steps: the flow's and the workers') are buckets of their own,
    restart_s is 0, and the buckets still add up to the wall time."""
    write_metrics(tmp_path, _steps("f-1", 1, 10, started=50.0))
    outcomes = [{"attempt": "f-1", "class": "done", "time": 61.0, "wall_time_s": 41.0, "restarts": 0}]
    ledger = _ledger((5, "validated", 58.0), (10, "validated", 100.0), (10, "uploaded", 121.0))
    result = goodput_breakdown(tmp_path, train_wall_s=122.0, outcomes=outcomes, ledger=ledger)
    assert result["productive_s"] == pytest.approx(10.0)
    assert result["restart_s"] == 0.0
    assert result["securing_s"] == pytest.approx(60.0)
    assert result["startup_s"] == pytest.approx(122.0 - 10.0 - 60.0)
    parts = ("productive_s", "lost_work_s", "checkpoint_s", "hung_s", "restart_s", "startup_s",
             "securing_s", "evaluation_s")
    assert sum(result[p] for p in parts) == pytest.approx(result["total_s"]) == pytest.approx(122.0)
    assert result["goodput"] == pytest.approx(10.0 / 122.0)


def test_a_retry_s_time_from_the_failure_to_the_next_first_step_is_restart_time(tmp_path):
    """Attempt 1 launches at 10, steps 1-5 from 30, crashes at 36 (its checkpoint at step 5
    committed); attempt 2 launches at 40 (the retry delay) and steps 6-10 from 55, exits at 61;
    the last checkpoint is uploaded at 71, the flow ends at 71. Restart: 36 -> 55; securing:
    61 -> 71; start-up the rest (the flow before launching, the first launch, teardown)."""
    write_metrics(tmp_path, _steps("f-1", 1, 5, started=30.0) + _steps("f-2", 6, 10, started=55.0))
    outcomes = [{"attempt": "f-1", "class": "retryable", "time": 36.0, "wall_time_s": 26.0, "restarts": 0},
                {"attempt": "f-2", "class": "done", "time": 61.0, "wall_time_s": 21.0, "restarts": 0}]
    ledger = _ledger((5, "uploaded", 45.0), (10, "validated", 66.0), (10, "uploaded", 71.0))
    result = goodput_breakdown(tmp_path, train_wall_s=71.0, outcomes=outcomes, ledger=ledger)
    assert result["restart_s"] == pytest.approx(55.0 - 36.0)
    assert result["securing_s"] == pytest.approx(10.0)
    assert result["startup_s"] == pytest.approx(71.0 - 10.0 - 19.0 - 10.0)
    assert result["total_s"] == pytest.approx(71.0)


def test_an_in_job_restart_s_gap_between_steps_is_restart_time(tmp_path):
    """torchrun restarted the workers once within the attempt: the gap before the redone step
    (a resume from step 3's checkpoint) is restart time, the first launch start-up."""
    records = _steps("f-1", 1, 4, started=10.0) + _steps("f-1", 4, 6, started=30.0)
    write_metrics(tmp_path, records)
    outcomes = [{"attempt": "f-1", "class": "done", "time": 34.0, "wall_time_s": 34.0, "restarts": 1}]
    result = goodput_breakdown(tmp_path, train_wall_s=34.0, outcomes=outcomes)
    assert result["lost_work_s"] == pytest.approx(1.0)
    assert result["restart_s"] == pytest.approx(30.0 - 14.0)
    assert result["startup_s"] == pytest.approx(34.0 - 6.0 - 1.0 - 16.0)
    assert result["securing_s"] == 0.0
