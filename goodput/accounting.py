"""Goodput accounting: where every second of a run's wall time went.

    productive   steps whose result the final model contains (the last run of each step)
    lost work    steps computed and then thrown away (redone after a crash or rollback), and
                 the in-loop validations that ran at them
    checkpoint   time training was blocked saving checkpoints
    hung         attempts that hung: from their last step to the supervisor's kill
    restart      recovering from failures: from a failed attempt's end to the next attempt's
                 first step (retry delay, relaunch, rendezvous, loading the checkpoint), and
                 the gaps an in-job (torchrun) restart left between steps; 0 for a run that
                 never restarted
    securing     after the workers of the last attempt finished: validating and uploading the
                 checkpoints they left (the ledger's last transitions), before the stage ends
    startup      the rest of the train stage: the flow's own start (config, layout check,
                 dataset), launching the workers, rendezvous and loading before the first
                 step, teardown
    evaluation   the evaluate stage, and in-loop validation at steps the model keeps

goodput = productive / total. The parts add up to the total exactly. Where the records carry
no times to tell a restart's share (metrics written before records had `time` and `attempt`,
no attempt outcomes) and a step was trained twice, the time between steps is restart time,
as it was before start-up and securing had buckets of their own (summary.json files written
then have no `startup_s` or `securing_s`: their `restart_s` holds both). `degraded_s`, a part of
productive, is the time of the steps an elastic job trained on fewer workers than configured
(the world shrunk by lost nodes: each step as long as on the full world, or longer).
"""

from __future__ import annotations

from core.protocol import FailureClass
from storage.ledger import Ledger, LedgerData
from training.metrics import read_metrics, young_daly_interval_s


def step_times(record: dict) -> dict[int, float]:
    """The time of each step a metrics record stands for. With training.log_every = N a
    record covers the N steps since the previous one (window_steps, window_time_s); their
    times are not recorded one by one, so each gets the window's mean."""
    steps = record.get("window_steps", 1)
    per_step = record.get("window_time_s", record["step_time_s"]) / steps
    return {record["step"] - i: per_step for i in range(steps)}


def goodput_breakdown(run_dir, train_wall_s: float, eval_wall_s: float = 0.0,
                      full_world: int | None = None, outcomes: list[dict] = (),
                      ledger: LedgerData | None = None) -> dict:
    """`outcomes`: the attempts' (goodput.runs.read_outcomes), for the time hung ones spent
    and the restarts' times; `ledger`: the run's checkpoint ledger, for the time securing the
    last checkpoints took."""
    records = read_metrics(run_dir)
    last_run: dict[int, float] = {}
    degraded: dict[int, bool] = {}  # the last run of each step was on fewer workers than full_world
    last_validation: dict[int, float] = {}  # in-loop validation, between steps
    lost = 0.0
    for record in records:  # metrics.jsonl is in time order
        for step, seconds in step_times(record).items():
            lost += last_run.get(step, 0.0)  # that step ran before: its earlier run was lost
            last_run[step] = seconds
            degraded[step] = bool(full_world and record.get("world_size", full_world) < full_world)
        if "val_time_s" in record:  # a validation redone with its step was lost work too
            lost += last_validation.get(record["step"], 0.0)
            last_validation[record["step"]] = record["val_time_s"]
    productive = sum(last_run.values())
    checkpoint = sum(r.get("checkpoint_s", 0.0) for r in records)
    validation = sum(last_validation.values())
    between = max(0.0, train_wall_s - productive - lost - checkpoint - validation)
    # Of the time between steps, what hung attempts spent from their last step to the kill.
    hung = min(between, hung_s(records, outcomes))
    securing = min(between - hung, securing_s(outcomes, ledger))
    left = between - hung - securing
    timed = restart_s(records, outcomes)
    if timed is None:  # no times to tell: a run that trained a step twice restarted
        restarted = lost > 0 or any(b["step"] <= a["step"] for a, b in zip(records, records[1:]))
        timed = left if restarted else 0.0
    restart = min(left, timed)
    startup = left - restart
    evaluation = eval_wall_s + validation
    total = productive + lost + checkpoint + hung + restart + startup + securing + evaluation
    return {"productive_s": productive, "lost_work_s": lost, "checkpoint_s": checkpoint,
            "hung_s": hung, "restart_s": restart, "startup_s": startup, "securing_s": securing,
            "evaluation_s": evaluation, "total_s": total,
            "degraded_s": sum(t for step, t in last_run.items() if degraded[step]),
            "goodput": productive / total if total > 0 else None}


def _step_start(record: dict) -> float:
    """When the steps a record stands for began (its time is written after the last)."""
    return record["time"] - record.get("window_time_s", record["step_time_s"])


def restart_s(records: list[dict], outcomes: list[dict]) -> float | None:
    """Time spent recovering from failures: from each failed attempt's end to the first step
    of the next attempt of the same train flow run (a later flow run's attempt: from its
    launch; after a finished or cancelled attempt, none: that is start-up), and in an attempt
    whose workers torchrun restarted n times (an elastic world's shrinks and grows too), its
    n longest gaps between steps (less the checkpoint and validation time the records
    count). None when the records and outcomes carry no times to tell it by."""
    timed = [r for r in records if "time" in r and "attempt" in r]
    if not outcomes or not timed:
        return None
    by_attempt: dict[str, list[dict]] = {}
    for record in timed:
        by_attempt.setdefault(record["attempt"], []).append(record)
    total, previous = 0.0, None
    for outcome in outcomes:  # in time order
        mine = by_attempt.get(outcome.get("attempt"), [])
        if previous is not None and mine and previous["class"] not in (FailureClass.DONE,
                                                                       FailureClass.CANCELLED):
            same_flow_run = (str(previous.get("attempt")).rsplit("-", 1)[0]
                             == str(outcome.get("attempt")).rsplit("-", 1)[0])
            launched = outcome["time"] - (outcome.get("wall_time_s") or 0.0)
            since = previous["time"] if same_flow_run else launched
            total += max(0.0, _step_start(mine[0]) - since)
        restarts = outcome.get("restarts") or 0
        if restarts > 0:
            gaps = sorted((max(0.0, _step_start(b) - a["time"] - a.get("checkpoint_s", 0.0)
                               - b.get("checkpoint_s", 0.0) - b.get("val_time_s", 0.0))
                           for a, b in zip(mine, mine[1:])), reverse=True)
            total += sum(gaps[:restarts])
        previous = outcome
    return total


def securing_s(outcomes: list[dict], ledger: LedgerData | None) -> float:
    """Time the train stage spent after the last attempt's workers finished, validating and
    uploading the checkpoints they left: to the ledger's last transition after their end."""
    if not outcomes or ledger is None or outcomes[-1]["class"] != FailureClass.DONE:
        return 0.0
    ended = outcomes[-1]["time"]
    after = [t.at for entry in ledger.entries.values() for t in entry.history if t.at >= ended]
    return max(after) - ended if after else 0.0


def hung_s(records: list[dict], outcomes: list[dict]) -> float:
    """Time the attempts that ended hung (class hang) spent after their last logged step,
    until the supervisor killed them (run.hang_timeout_s and the like)."""
    last_step_at: dict[str, float] = {}
    for record in records:
        if "attempt" in record and "time" in record:
            last_step_at[record["attempt"]] = record["time"]
    return sum(max(0.0, o["time"] - last_step_at[o["attempt"]]) for o in outcomes
               if o["class"] == FailureClass.HANG and o["attempt"] in last_step_at)


def data_wait_share(run_dir) -> float | None:
    """The share of the run's step time spent waiting for batches (every recorded step)."""
    records = [r for r in read_metrics(run_dir) if "data_wait_s" in r]
    step_time = sum(r.get("window_time_s", r["step_time_s"]) for r in records)
    return sum(r["data_wait_s"] for r in records) / step_time if step_time > 0 else None


def mix_drawn(run_dir, step: int | None) -> dict | None:
    """A mix's samples drawn from each source up to `step`, and their shares (the realized
    mix: the newest metrics record at or before that step, training.log_every apart at most;
    the latest where a resume redid it); None for a single source or no record."""
    if step is None:
        return None
    found = None
    for record in read_metrics(run_dir):  # in time order: a redone step's later record wins
        if record["step"] <= step and any(k.startswith("samples/") for k in record) and (
                found is None or record["step"] >= found["step"]):
            found = record
    if found is None:
        return None
    samples = {k.removeprefix("samples/"): v for k, v in found.items() if k.startswith("samples/")}
    total = sum(samples.values()) or 1
    return {name: {"samples": n, "share": round(n / total, 4)} for name, n in samples.items()}


def mix_drawn_by_stage(run_dir, step: int | None, stages: list[tuple[int, dict[str, float]]],
                       global_batch: int) -> list[dict] | None:
    """A curriculum's samples drawn from each source within each of its stages up to `step`,
    beside the stage's weights (mix_drawn's shares run over every stage, so they match none
    of them). `stages`: RunConfig.mix_stages(). The trainer writes a metrics record at each
    stage's last step, so the counts are exact (for a run trained before it did, the record
    before a stage's start stands for it). None without stages or records."""
    if step is None or len(stages) < 2:
        return None
    bounds = [first_sample // global_batch for first_sample, _ in stages]  # the step before each
    by_stage = []
    for i, (before, (_, weights)) in enumerate(zip(bounds, stages)):
        if before >= step:
            break
        end = min(step, bounds[i + 1]) if i + 1 < len(bounds) else step
        upto, since = mix_drawn(run_dir, end), mix_drawn(run_dir, before) if before else {}
        if upto is None:
            return None
        samples = {name: got["samples"] - (since or {}).get(name, {}).get("samples", 0)
                   for name, got in upto.items()}
        total = sum(samples.values()) or 1
        by_stage.append({"stage": i, "steps": [before + 1, end], "weights": weights,
                         "drawn": {name: {"samples": n, "share": round(n / total, 4)}
                                   for name, n in samples.items()}})
    return by_stage


def checkpoint_interval_advice(run_dir, failures: int, wall_s: float,
                               mtbf_hours: float | None, every_steps: int) -> dict | None:
    """Young/Daly: the interval that minimises expected lost time is sqrt(2 * C * MTBF),
    with C the measured checkpoint cost and MTBF configured or observed in this run."""
    records = read_metrics(run_dir)
    stalls = [r["checkpoint_s"] for r in records if r.get("checkpoint_s")]
    if not stalls or not records:
        return None
    # Per save: a background save stalls training in two records, its step's (the start) and
    # the next one's (the wait for its copy of the weights). Older metrics (without
    # "checkpointed") give the mean per record that holds a stall.
    saves = sum(1 for r in records if r.get("checkpointed")) or len(stalls)
    cost = sum(stalls) / saves
    times = [t for r in records for t in step_times(r).values()]
    step_time = sum(times) / len(times)
    if mtbf_hours:
        mtbf, source = mtbf_hours * 3600, "configured (faults.mtbf_hours)"
    elif failures:
        mtbf, source = wall_s / failures, f"observed ({failures} failures in {wall_s:.0f}s)"
    else:
        return {"checkpoint_cost_s": cost, "mtbf_s": None, "note":
                "no failure observed and faults.mtbf_hours unset: no MTBF to plan for"}
    interval = young_daly_interval_s(cost, mtbf)
    steps = max(1, round(interval / step_time))
    return {"checkpoint_cost_s": cost, "mtbf_s": mtbf, "mtbf_source": source,
            "optimal_interval_s": interval, "optimal_every_steps": steps,
            "current_every_steps": every_steps}


def summarize_goodput(config) -> dict:
    """The run's goodput section of summary.json, from its metrics, attempts and stage times."""
    from goodput.runs import failed_restarts, failures_of, read_outcomes, read_summary, update_summary

    summary = read_summary(config.run_dir)
    train_wall = summary.get("train", {}).get("wall_time_total_s", 0.0)
    eval_wall = summary.get("evaluate", {}).get("wall_time_s", 0.0)
    outcomes = read_outcomes(config)
    attempts: dict[str, int] = {}
    for o in outcomes:
        attempts[o["class"]] = attempts.get(o["class"], 0) + 1
    in_job = sum(map(failed_restarts, outcomes))  # each one recovered a failure
    failures = failures_of(outcomes)  # a cancelled attempt failed nothing
    try:
        ledger = Ledger(config.run_dir).read()
    except Exception:  # a damaged ledger is the lifecycle's to report: no securing time then
        ledger = None
    values = goodput_breakdown(config.run_dir, train_wall, eval_wall, config.parallelism.world_size,
                               outcomes, ledger)
    values["attempts"] = attempts
    values["in_job_restarts"] = in_job
    grows = sum(o.get("grows") or 0 for o in outcomes)
    if grows:
        values["elastic_grows"] = grows  # restarts that let a lost node back in: no failure
    values["checkpoint_advice"] = checkpoint_interval_advice(
        config.run_dir, failures, train_wall, config.faults.mtbf_hours, config.checkpoint.every_steps)
    update_summary(config.run_dir, "goodput", values)
    return values
