"""A training run's attempts: launch one, record how it ended, decide whether to retry.

The run directory's layout is core.protocol.RunDir; this module writes its config.yaml,
summary.json and each attempt's outcome.json.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from core.config import ConfigError, RunConfig, dump_config, load_config, trajectory_differences
from core.errors import DataError
from core.files import exclusive_lock, write_atomic
from core.protocol import FailureClass, RunDir, read_exit_records, read_starts, step_of
from goodput.accounting import data_wait_share, mix_drawn, mix_drawn_by_stage, summarize_goodput
from goodput.checkpoint_lifecycle import resume_point, resume_position, set_aside_damaged
from infra.launchers import SubmitRefused
from infra.torchrun import AttemptResult, TrainingFailed, run_attempt
from storage.ledger import DataSkip, Ledger, choose_resume

log = logging.getLogger("goodput.runs")


def write_run_config(config: RunConfig) -> Path:
    """Write config.yaml; refuse to continue a run whose trajectory-defining config changed."""
    path = check_run_config(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = config.run_dir.init_from_record
    here = config.model.init_from
    # With the run's first config.yaml (again if that write failed), or for a run from before
    # the record, what check_run_config compared it with.
    if here and Path(here).is_dir() and (not path.is_file() or not record.is_file()):
        from core import hf_llama

        write_atomic(record, json.dumps({"init_from": here, "weights": hf_llama.weights_digest(here),
                                         "files": hf_llama.weights_stat(here)}, indent=2).encode())
    write_atomic(path, dump_config(config).encode())
    return path


def check_run_config(config: RunConfig) -> Path:
    """The run's config.yaml, once `config` is known to continue the run saved there (the
    same data, tokenizer, model and training; a ConfigError that says what differs)."""
    path = config.run_dir.config_file
    if path.is_file():
        try:
            previous = load_config(path)
        except ConfigError as e:
            raise ConfigError(
                f"run '{config.run.run_id}' already exists at {config.run_dir}, and its saved "
                f"config no longer loads, so whether this config continues it cannot be told: "
                f"{e}\nFix that in {path} (or choose a new run.run_id, or delete the run "
                "directory to start over).") from None
        if previous.config_hash() != config.config_hash():
            raise ConfigError(
                f"run '{config.run.run_id}' already exists at {config.run_dir} with a different "
                f"data/tokenizer/model/training config "
                f"({trajectory_differences(previous, config)}); its checkpoints "
                f"would not continue this one.{_what_keeps_it(previous, config)} To continue or "
                f"evaluate that run, give its own config (--config {path}) without overrides "
                "that change these; to start another, choose a new run.run_id (or delete the "
                "run directory to start over).")
        _check_init_from_weights(config, previous)
    return path


def warn_of_checkpoints_elsewhere(config: RunConfig) -> None:
    """checkpoints_elsewhere's reason as a warning, where there is one."""
    elsewhere = checkpoints_elsewhere(config)
    if elsewhere:
        log.warning("%s", elsewhere)


def checkpoints_elsewhere(config: RunConfig) -> str | None:
    """Why the run's newest uploaded checkpoint is not where this config's store would find
    it (the ledger names it in another store), else None. Pointing a finished run at a new
    store (storage.uri) uploaded nothing there, silently: a new machine could not resume it
    from that store. (Older steps left in a store the run moved away from are not warned of:
    its newest checkpoint is what a resume reads.)"""
    from storage.ledger import checkpoint_key
    from storage.store import store_uri

    try:
        entries = Ledger(config.run_dir).read().entries
    except (OSError, ValueError):
        return None
    uploaded = [entry for _, entry in sorted(entries.items()) if entry.state == "uploaded" and entry.store_url]
    if not uploaded:
        return None
    newest, here = uploaded[-1], store_uri(config.storage.uri)
    key = checkpoint_key(config.run.run_id, newest.step)
    if newest.store_url == f"{here}/{key}":
        return None
    there = newest.store_url.removesuffix(f"/{key}")
    return (f"run '{config.run.run_id}' has its newest checkpoint (step {newest.step}) uploaded to "
            f"{there}, not to this config's store {here}: a machine resuming from {here} will not "
            f"find it. To continue the run where its checkpoints are, set storage.uri to that "
            f"store; for a run of its own in {here}, choose a new run.run_id")


def _check_init_from_weights(config: RunConfig, previous: RunConfig) -> None:
    """The config hash names model.init_from by its fingerprint (two samples per weights
    file: milliseconds, and every worker computes it), which two checkpoints of one model
    can share: a LoRA merged into a few projections left the run of the original model
    "already trained", its scores reported for the other. Here every tensor's sample
    (hf_llama.weights_digest) against the run's record of its start, unless the record
    names these very files, unchanged (sizes and modification times): then nothing is read."""
    here = config.model.init_from
    if not here or not Path(here).is_dir():
        return  # a run that no longer reads its init_from (moved): nothing to compare
    from core import hf_llama

    record = config.run_dir.init_from_record
    try:
        started_from = json.loads(record.read_text())
        recorded, where = started_from["weights"], started_from.get("init_from", "?")
        if (Path(where).resolve() == Path(here).resolve()
                and started_from.get("files") == hf_llama.weights_stat(here)):
            return
    except (OSError, ValueError, KeyError, TypeError):  # a run from before the record
        there = previous.model.init_from
        if not there or not Path(there).is_dir() or Path(there).resolve() == Path(here).resolve():
            return
        recorded, where = hf_llama.weights_digest(there), there
    found = hf_llama.weights_digest(here)
    if found != recorded:
        raise ConfigError(
            f"run '{config.run.run_id}' already exists at {config.run_dir} and was started from "
            f"other weights than model.init_from={here} holds (a sample of every tensor: "
            f"{recorded} when it started from {where}, {found} here); its checkpoints and "
            "scores are not this checkpoint's. Choose a new run.run_id for this checkpoint "
            "(or delete the run directory to start over).")


def _what_keeps_it(run: RunConfig, here: RunConfig) -> str:
    """Advice for the differences a user makes on purpose: another number of workers (the
    global batch follows it), a longer run (max_steps)."""
    advice = ""
    if run.global_batch != here.global_batch:
        micro, accum = here.training.micro_batch_size, here.training.grad_accum_steps
        dp = here.global_batch // (micro * accum)  # this layout's data-parallel degree
        keep = [f"training.{field}={run.global_batch // (other * dp)}"
                for field, other in (("micro_batch_size", accum), ("grad_accum_steps", micro))
                if run.global_batch % (other * dp) == 0]
        advice += (f" Another layout continues the run when the global batch stays "
                   f"{run.global_batch} (micro_batch_size x grad_accum_steps x data-parallel "
                   f"degree, {dp} here)" + (f": add {' or '.join(keep)}." if keep else "."))
    if run.training.max_steps != here.training.max_steps:
        advice += (" A run's length is part of its trajectory (the learning-rate schedule is "
                   "laid out over training.max_steps): to train on from its weights, export a "
                   "checkpoint (goodput export CHECKPOINT_DIR --format hf --out DIR) and start "
                   "a new run.run_id with model.init_from=DIR.")
    return advice


def train_attempt(config: RunConfig, dataset_dir: Path, store, attempt: str,
                  log: Callable[[str], None], **options) -> AttemptResult:
    """One attempt: resume from the newest validated checkpoint and train to max_steps, or
    to the checkpoint saved at the step after `stop_after` (Unix time; the result's reason is then
    core.protocol.TIME_LIMIT). `lease_holder`: who holds the run's lease (infra.torchrun's
    RunLease) for it; None: the attempt takes it. `on_layout_change`: each new world of an
    elastic job (infra.torchrun.layout_change). `on_progress`: each new heartbeat.

    Raises TrainingFailed with the failure class and the retry policy's verdict when the
    attempt does not finish (a cancelled attempt: class cancelled, never retried; a job the
    scheduler refused or could not be reached for, launch.scheduler_unreachable_s: class
    config, never retried). A rollback
    first records the data window to skip. The run directory's disk full under this process
    (its config, lease or records) is disk_full, never retried: the workers' own record of it
    could not be written there.
    """
    try:
        return _attempt(config, dataset_dir, store, attempt, log, **options)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise TrainingFailed(f"{e} (under {config.run_dir}): {FailureClass.DISK_FULL.hint}",
                             FailureClass.DISK_FULL, retry=False) from None


def _attempt(config: RunConfig, dataset_dir: Path, store, attempt: str,
             log: Callable[[str], None], on_progress: Callable[[dict], None] | None = None,
             stop_after: float | None = None, lease_holder: str | None = None,
             on_layout_change: Callable[[dict], None] | None = None) -> AttemptResult:
    if not config.checkpoint.save_at_end:
        raise ConfigError(
            "checkpoint.save_at_end=false is for throughput measurements (benchmarks/mfu_bench.py), "
            "which launch the trainer themselves: a run whose last step is not saved never counts as "
            "finished, so every rerun would train its tail again. Leave it true.")
    config_path = write_run_config(config)
    resume = resume_point(config, store)
    if resume is None and config.model.init_from and not Path(config.model.init_from).is_dir():
        # Once the run has a checkpoint, init_from is not read again and may have moved.
        raise ConfigError(f"model.init_from={config.model.init_from}: no such directory, and run "
                          f"'{config.run.run_id}' has no checkpoint to resume from yet, so training "
                          "starts from its weights; point model.init_from at the checkpoint's "
                          "directory")
    if resume is not None and resume.step >= config.training.max_steps:
        log(f"checkpoint {resume} already reached max_steps={config.training.max_steps}")
        return AttemptResult(0, FailureClass.DONE, "already complete", resume.step, 0.0)
    log(f"attempt {attempt}: resuming from {resume}" if resume else
        f"attempt {attempt}: starting from scratch")
    started = time.time()
    try:
        result = run_attempt(config, config_path, dataset_dir, attempt, log, on_progress=on_progress,
                             mtbf_s=observed_mtbf_s(config), stop_after=stop_after,
                             lease_holder=lease_holder, on_layout_change=on_layout_change)
    except SubmitRefused as e:  # the scheduler refused the job, or none could be reached
        failed = AttemptResult(None, FailureClass.CONFIG, str(e), None, time.time() - started)
        record_outcome(config, attempt, failed, resume.step if resume else 0)
        log(f"attempt {attempt} ended: config (its job was not submitted); not retrying")
        raise TrainingFailed(f"training attempt {attempt}: {e}",
                             FailureClass.CONFIG, retry=False) from None
    outcome = record_outcome(config, attempt, result, resume.step if resume else 0)
    if result.restarts:
        log(f"attempt {attempt}: torchrun restarted the workers {result.restarts} time(s) in-job")
    if result.failure_class == FailureClass.DONE:
        return result
    if result.failure_class == FailureClass.CANCELLED:
        # The flow run, interrupted, may have summed up its time before this outcome was in.
        with contextlib.suppress(Exception):  # never in place of the cancellation
            summarize_goodput(config)
        log(f"attempt {attempt} cancelled {at_step(result.step)}: not retrying")
        raise TrainingFailed(f"training attempt {attempt} was cancelled {at_step(result.step)}: "
                             f"{result.reason}",
                             FailureClass.CANCELLED, result.step, retry=False)
    if result.failure_class == FailureClass.ROLLBACK:
        skip = skip_data_before(config, store, result)
        log(f"rollback: samples [{skip.start}, {skip.end}) will be skipped ({skip.reason})")
    if result.failure_class == FailureClass.CORRUPT_CHECKPOINT:
        damaged = next(r for r in result.records if r["class"] == FailureClass.CORRUPT_CHECKPOINT)
        entry = set_aside_damaged(config, damaged["checkpoint_step"], damaged["from_store"],
                                  damaged["reason"])
        log(f"checkpoint step {entry.step} failed its checksums at load: now {entry.state} "
            f"({entry.history[-1].note})")
    retry, why = retry_decision(config, read_outcomes(config, attempt_prefix(attempt)))
    log(f"attempt {attempt} ended: {outcome['class']} {at_step(outcome['step'])} ({outcome['reason']}); "
        + ("retrying" if retry else f"not retrying: {why}"))
    raise TrainingFailed(f"training attempt {attempt} ended: {result.failure_class} "
                         f"({result.reason}) {at_step(result.step)}" + ("" if retry else f"; {why}"),
                         result.failure_class, result.step, retry=retry)


def at_step(step: int | None) -> str:
    """Where an attempt ended, for a message."""
    return "before its first step" if step is None else f"at step {step}"


def attempt_prefix(attempt: str) -> str:
    """Attempts of one flow run share a prefix (`<flow run>-<try>`): budgets count per run."""
    return attempt.rsplit("-", 1)[0]


def record_outcome(config: RunConfig, attempt: str, result: AttemptResult, resumed_from: int,
                   ended: float | None = None, **details) -> dict:
    """Why the attempt ended, where it started (the step it resumed from) and what it left:
    the retry policy's input. `ended`: when (default now)."""
    committed = config.run_dir.committed_checkpoints()
    outcome = {"attempt": attempt, "class": result.failure_class.value, "reason": result.reason,
               "step": result.step, "exit_code": result.exit_code, "resumed_from": resumed_from,
               "newest_checkpoint": step_of(committed[-1]) if committed else 0,
               "restarts": result.restarts,  # in-job (torchrun) restarts within the attempt
               # Of those, an elastic world growing back (elastic.grow): planned, no failure.
               "grows": sum(b > a for a, b in zip(result.worlds, result.worlds[1:])),
               "wall_time_s": result.wall_time_s,
               "time": time.time() if ended is None else ended, **details}
    directory = config.run_dir.attempt(attempt)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "outcome.json", json.dumps(outcome).encode())
    return outcome


def read_outcomes(config: RunConfig, prefix: str = "") -> list[dict]:
    root = config.run_dir.attempts
    paths = root.glob(f"attempt-{prefix}*/outcome.json") if root.is_dir() else []
    return sorted((json.loads(p.read_text()) for p in paths), key=lambda o: o.get("time", 0.0))


def failures_of(outcomes: list[dict]) -> int:
    """Failures the outcomes record, those that cost training: failed attempts that had
    trained a step and the in-job restarts each recovered. A cancelled attempt failed
    nothing, and one that never reached a step (a host that never answered, a crash at
    start) lost no work to checkpoint against: counted, a few such in a row made the
    mean time between failures seconds, and checkpoint.interval=auto a save every step."""
    return sum((o["class"] not in (FailureClass.DONE, FailureClass.CANCELLED)
                and o.get("step") is not None) + failed_restarts(o) for o in outcomes)


def failed_restarts(outcome: dict) -> int:
    """The in-job restarts of an attempt that recovered a failure: not the restarts that
    let a lost node back into an elastic world (elastic.grow), which the workers' own
    membership change makes."""
    return (outcome.get("restarts") or 0) - (outcome.get("grows") or 0)


def observed_mtbf_s(config: RunConfig) -> float:
    """The run's mean time between failures: faults.mtbf_hours, else the wall time of its
    attempts so far over their failures; 0 when there is nothing to go on."""
    if config.faults.mtbf_hours:
        return config.faults.mtbf_hours * 3600
    outcomes = read_outcomes(config)
    failures = failures_of(outcomes)
    return sum(o.get("wall_time_s") or 0.0 for o in outcomes) / failures if failures else 0.0


def retry_decision(config: RunConfig, outcomes: list[dict]) -> tuple[bool, str]:
    """Retry the last failed attempt? Each failure class has its own budget, configuration
    errors and cancellations never retry, and attempts that keep failing without progress
    stop the run."""
    cls = outcomes[-1]["class"]
    if cls in (FailureClass.CONFIG, FailureClass.CANCELLED):
        return False, FailureClass(cls).hint or "cancelled"
    budgets = config.run.retry_budgets
    budget = budgets.get(cls, budgets.get("unknown", 0))
    failures = sum(1 for o in outcomes if o["class"] == cls)
    if failures > budget:
        known = FailureClass.named(cls)
        hint = known.hint if known else ""
        return False, (f"{cls} failures ({failures}) exceed their budget of {budget} retries"
                       + (f" — {hint}" if hint else ""))
    stalled = 0
    for o in reversed(outcomes):
        if o["class"] == FailureClass.DONE or o["newest_checkpoint"] > o["resumed_from"]:
            break
        stalled += 1
    if stalled >= config.run.no_progress_attempts:
        return False, (f"{stalled} attempts in a row committed no checkpoint newer than the one "
                       "they resumed from")
    if len(outcomes) >= config.run.max_attempts:  # Prefect would not retry: say so, not "retrying"
        return False, (f"run.max_attempts={config.run.max_attempts} attempts made in this flow "
                       "run; the next `goodput train` resumes from the newest validated checkpoint")
    return True, ""


def skip_data_before(config: RunConfig, store, result: AttemptResult) -> DataSkip:
    """Record the data window from the checkpoint the next attempt resumes at to the bad step."""
    bad = next(r for r in result.records if r["class"] == FailureClass.ROLLBACK)
    start = resume_position(config, resume_point(config, store), store)
    return Ledger(config.run_dir).add_data_skip(
        start, bad["sample_end"], f"rollback at step {bad['step']}: {bad['reason']}")


def read_summary(run_dir: RunDir | Path) -> dict:
    path = RunDir.of(run_dir).summary_file
    return json.loads(path.read_text()) if path.is_file() else {}


def update_summary(run_dir: RunDir | Path, section: str, values: dict | Callable[[dict], dict]) -> dict:
    """Merge one stage's results into summary.json (stages run separately or chained, and
    flows of one run at the same time: a scheduled evaluation while training runs). Under a
    lock, so no flow's section is lost; `values` may be a function of the section's previous
    values (e.g. to add up wall time across flow runs)."""
    path = RunDir.of(run_dir).summary_file
    with exclusive_lock(path.with_suffix(".lock")):
        summary = read_summary(run_dir)
        summary[section] = values(summary.get(section, {})) if callable(values) else values
        summary["updated_at"] = time.time()
        write_atomic(path, json.dumps(summary, indent=2, default=str).encode())
    return summary


def record_training(config: RunConfig, outcome: dict, started: float) -> dict:
    """Write the train stage's part of summary.json: final step, ledger, wall time (this
    flow run's and the total over every train flow run of the run); returns that part."""
    ledger = Ledger(config.run_dir).read()
    newest = choose_resume(config.run_dir, ledger)  # the newest checkpoint this machine can use
    newest = ledger.entries[newest.step] if newest else None
    wall = time.time() - started
    values = {"final_step": newest.step if newest else None,
              "final_train_loss": newest.loss if newest else None,
              "last_attempt": outcome, "wall_time_s": wall,
              "data_wait_share": data_wait_share(config.run_dir),
              "mix_drawn": mix_drawn(config.run_dir, newest.step if newest else None),
              "mix_drawn_by_stage": mix_drawn_by_stage(config.run_dir, newest.step if newest else None,
                                                       config.mix_stages(), config.global_batch),
              "ledger": {str(s): e.state for s, e in sorted(ledger.entries.items())}}

    def with_total(previous: dict) -> dict:
        return {**values, "wall_time_total_s": previous.get("wall_time_total_s", 0.0) + wall}

    values = update_summary(config.run_dir, "train", with_total)["train"]
    summarize_goodput(config)
    return values


@contextmanager
def unfinished_training_counted(config: RunConfig, started: float) -> Iterator[None]:
    """Around a train flow run's training, once it holds the run's lease: if it ends without
    finishing (cancelled, failed, interrupted), its wall time still counts
    (record_unfinished_training). Not for a refusal of its input (ConfigError, DataError):
    that run never trained."""
    try:
        yield
    except (ConfigError, DataError):
        raise
    except BaseException:
        with contextlib.suppress(Exception):  # never in place of the failure itself
            record_unfinished_training(config, started)
        raise


def record_abandoned_training(config: RunConfig, lease: dict) -> dict:
    """A supervisor that held the run's lease and vanished without letting go (its flow
    process killed, its host lost) recorded nothing of how its training ended. From what it
    left: its time (from taking the lease to its last renewal, or to the end of the workers
    it left, which train on until they notice) counts in the run's total,
    and each attempt it launched gets the outcome its workers' records tell (orphaned: they
    saved and stopped by themselves, or were killed with it; done: they had finished).
    Returns {"holder", "wall_time_s", "outcomes"}."""
    from training.metrics import read_metrics

    since, until = lease["since"], lease["time"]  # the holder's clock
    run_dir = config.run_dir
    metrics = None
    outcomes = []
    for directory in sorted(run_dir.attempts.glob("attempt-*")) if run_dir.attempts.is_dir() else []:
        attempt = directory.name.removeprefix("attempt-")
        starts, records = read_starts(run_dir, attempt), read_exit_records(run_dir, attempt)
        # Its own attempts only: their workers name their supervisor (not a plain torchrun
        # run's, nor another holder's).
        if (directory / "outcome.json").exists() or not starts or any(
                s.get("holder") != lease["holder"] for s in starts):
            continue
        if metrics is None:
            metrics = read_metrics(run_dir)
        mine = [m for m in metrics if m.get("attempt") == attempt]
        steps = [m["step"] for m in mine]
        # Its workers went on until they stopped by themselves (launch.orphan_timeout_s).
        ended = max([r["time"] for r in records] + [s["time"] for s in starts]
                    + [m["time"] for m in mine if "time" in m])
        done = bool(records) and all(r["class"] == FailureClass.DONE for r in records)
        told = next((r["reason"] for r in records if r["class"] != FailureClass.DONE), None)
        reason = (f"its supervisor ({lease['holder']}) ended without recording it (its process "
                  "was killed or its host lost); "
                  + (f"the workers: {told}" if told else "the workers had finished" if done
                     else "no worker left an exit record (killed with it)"))
        result = AttemptResult(
            None, FailureClass.DONE if done else FailureClass.ORPHANED, reason,
            max([r["step"] for r in records if r.get("step") is not None] + steps, default=None),
            max(0.0, ended - starts[0]["time"]), records, restarts=max(0, len(starts) - 1))
        # (resumed from: the first logged step's, training.log_every may skip a few)
        outcomes.append(record_outcome(config, attempt, result, max(0, steps[0] - 1) if steps else 0,
                                       ended, recorded_by="the next holder of the run's lease"))
    # Until its last renewal, or until the workers it left stopped, whichever is later.
    wall = max(0.0, max([until] + [o["time"] for o in outcomes]) - since)
    count_training_time(config, wall)
    return {"holder": lease["holder"], "wall_time_s": wall, "outcomes": outcomes}


def record_unfinished_training(config: RunConfig, started: float) -> None:
    """A train flow run that ended without finishing (cancelled, failed, interrupted): its wall
    time still counts in the run's total (the goodput breakdown's restart time), as that of
    every train flow run does."""
    count_training_time(config, time.time() - started)


def count_training_time(config: RunConfig, wall_s: float) -> None:
    """Add `wall_s` of training to the run's total (summary.json) and sum up its goodput."""
    update_summary(config.run_dir, "train", lambda previous: {
        **previous, "wall_time_total_s": previous.get("wall_time_total_s", 0.0) + wall_s})
    summarize_goodput(config)
