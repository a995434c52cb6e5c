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
