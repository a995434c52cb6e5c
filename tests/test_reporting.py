"""What the train flow's report draws from metrics.jsonl (pure: no Prefect run)."""

from tasks.reporting import latest_per_step, plot_loss_curve, resumed_at


def test_the_loss_curve_marks_every_resume_in_job_restarts_too(tmp_path):
    """Attempt a-1 logged steps 1-6 (log_every=2); its workers were restarted by torchrun
    from the checkpoint of step 4 (the same attempt logs step 6 again); attempt b-1 resumed
    from step 6 after a crash. Both resumes are marked, where they resumed from."""
    def records(attempt, steps):
        return [{"step": s, "loss": 10.0 / s, "window_steps": 2, "attempt": attempt} for s in steps]

    logged = records("a-1", (2, 4, 6)) + records("a-1", (6, 8)) + records("b-1", (8, 10))
    assert resumed_at(logged) == [4, 6]
    assert resumed_at(records("a-1", (2, 4, 6))) == []
    curve = plot_loss_curve(latest_per_step(logged), tmp_path / "loss_curve.png", "run",
                            resumed_at(logged))
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_prepare_progress_times_only_what_this_run_tokenized(monkeypatch):
    """Units an earlier run finished return at once: counted done (and said so), but the
    speed and the ETA are those of the units this run tokenized (they counted the reused
    units' tokens as made in no time)."""
    import time

    from tasks.reporting import PrepareProgress

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    progress = PrepareProgress("run", "d0", n_units=6, show_bar=False)
    progress.count(docs=10, tokens=5_000, skipped=0, reused=True)
    progress.count(docs=10, tokens=5_000, skipped=0, reused=True)
    assert progress.describe() == "2 / 6 units · 20 docs · 10,000 tokens · 2 done before"
    clock[0] += 10.0
    progress.count(docs=10, tokens=1_000, skipped=0)  # 10 s for the first new unit
    said = progress.describe()
    assert "100 tokens/s" in said and "2 done before" in said
    assert said.endswith("ETA 0m30s")  # 3 units left at 10 s each, not 3 x 10 s / 3 units done

    # No bar drawn (a log file, a pipe): the log says it, the first unit, then at most every
    # LOG_EVERY_S, and the last.
    assert progress.to_log() == f"prepare d0: {said}"
    clock[0] += 10.0
    progress.count(docs=10, tokens=1_000, skipped=0)
    assert progress.to_log() is None  # 10 s after the last line
    clock[0] += 25.0
    progress.count(docs=10, tokens=1_000, skipped=0)
    assert progress.to_log().startswith("prepare d0: 5 / 6 units")
    progress.count(docs=10, tokens=1_000, skipped=0)
    assert progress.to_log().startswith("prepare d0: 6 / 6 units")  # the last, however soon
