"""Evaluate a checkpoint in its own process and keep the report with the run."""

from __future__ import annotations

import atexit
import io
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from core.config import RunConfig, dump_config, runs_own_eval_settings
from core.cpu_priority import lower_session_priority
from core.errors import ConfigError
from core.files import sha256_bytes, write_atomic
from core.process_exit import PARENT_PID
from core.uris import local_path_of
from core.protocol import copy_id, is_committed, request_line, step_of
from goodput.checkpoint_lifecycle import ledger_of, prune_fetched, restore_ledger
from goodput.accounting import summarize_goodput
from goodput.runs import check_run_config, update_summary
from storage.ledger import ResumePoint, choose_resume, readable_copy
from storage.manifests import EvalReport, dataset_id_of

log = logging.getLogger(__name__)

# Evaluations running beside training (eval.every_validated), in sessions of their own where
# no Ctrl-C to the terminal's process group reaches them: a stopped or cancelled training
# ends them (stop_background_evaluations) instead of waiting minutes for their scores.
_background_lock = threading.Lock()
_background: dict[subprocess.Popen, bool] = {}  # process -> stopped by stop_background_evaluations


def stop_background_evaluations() -> int:
    """Kill the evaluations this process runs beside training; returns how many. Each one's
    `evaluate` then raises EvaluationStopped."""
    with _background_lock:
        for proc in _background:
            _background[proc] = True
            proc.kill()
        return len(_background)


class EvaluationStopped(RuntimeError):
    """An evaluation beside training ended because the training was stopped."""


# -- the evaluation process, started before its checkpoint is known -------------------------
#
# A new evaluation process spends about 2.5 s of a core importing torch and the model's modules
# before it reads a checkpoint: most of a small model's evaluation. Where one is known to
# follow (the pipeline, once training has finished), the process is started then and imports
# while the train flow writes its report; `evaluate` hands it its arguments (`python -m
# training.evaluate --when-told`).

_evaluation_follows: ContextVar[bool] = ContextVar("evaluation_follows", default=False)
_started_lock = threading.Lock()
_started: tuple[subprocess.Popen, dict[str, str]] | None = None  # the process, its environment


@contextmanager
def evaluation_follows():
    """Within it, a train flow that finishes starts the evaluation's process
    (start_evaluation_process): the pipeline evaluates next."""
    token = _evaluation_follows.set(True)
    try:
        yield
    finally:
        _evaluation_follows.reset(token)


def is_evaluation_following() -> bool:
    return _evaluation_follows.get()


def start_evaluation_process() -> None:
    """Start the process that this process's next evaluation (not one beside training) runs
    in, so that it imports now. Unused, it is stopped when this process exits, or exits by
    itself once its input closes."""
    global _started
    with _started_lock:
        if _started is not None and _started[0].poll() is None:
            return
        process = subprocess.Popen([sys.executable, "-m", "training.evaluate", "--when-told"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        _started = (process, dict(os.environ))


def _started_evaluation(argv: list[str]) -> subprocess.Popen | None:
    """The started process, told to run `argv` (past its interpreter, `-m` and module), if it
    is still waiting and was started in this environment (torch read it at its import); else
    None, and one started in another environment is stopped."""
    global _started
    with _started_lock:
        started, _started = _started, None
    if started is None:
        return None
    process, environment = started
    request = request_line(argv[3:])
    if process.poll() is None and environment == dict(os.environ):
        try:
            process.stdin.write(request)
            process.stdin.flush()
            return process
        except (BrokenPipeError, ValueError):  # it ended meanwhile: a new one is started
            pass
    _stop_started(process)
    return None


def _stop_started(process: subprocess.Popen) -> None:
    process.kill()
    process.communicate()


@atexit.register
def _stop_unused_evaluation() -> None:
    with _started_lock:
        if _started is not None:
            _stop_started(_started[0])


def check_tasks(config: RunConfig) -> dict[str, str]:
    """The names of eval.tasks resolved before anything launches: each one's source
    ('eval.task_dir' or 'lm-eval'), or a ConfigError naming the unknown ones and their closest
    names. Names only: whether a task's data is there shows when the evaluation loads it."""
    if not config.eval.tasks:
        return {}
    from training.downstream import check_task_names  # imports lm-eval only when asked

    found = check_task_names(list(config.eval.tasks), config.eval.task_dir)
    metric = config.eval.best_metric
    task, _, score = metric.partition("/")
    if score and not metric.startswith("loss/") and task not in found:
        # Not a task of eval.tasks: a subtask of one of its groups, or a name no report has.
        try:
            check_task_names([task], config.eval.task_dir)
        except ConfigError:
            raise ConfigError(
                f"eval.best_metric={metric!r}: {task!r} is neither a task of eval.tasks "
                f"({', '.join(found)}) nor a task lm-eval knows (a subtask of a group), so no "
                f"report would have it; name '<task>/<metric>' of eval.tasks, e.g. "
                f"{next(iter(found))}/acc") from None
    return found


INITIAL = "init"  # --checkpoint init: the run's model.init_from weights, before any step


def is_initial(config: RunConfig, checkpoint: Path) -> bool:
    """Whether `checkpoint` is the run's model.init_from directory (pick_checkpoint's INITIAL)."""
    return bool(config.model.init_from) and Path(checkpoint) == Path(config.model.init_from)


def locate_checkpoint(config: RunConfig, store, checkpoint: str | int | None = None) -> Path:
    """The checkpoint to evaluate (pick_checkpoint's) as the directory `evaluate` takes
    (checkpoint_dir): nothing is fetched here."""
    picked = pick_checkpoint(config, store, checkpoint)
    return picked if isinstance(picked, Path) else checkpoint_dir(config, picked)


def pick_checkpoint(config: RunConfig, store, checkpoint: str | int | None = None) -> Path | ResumePoint:
    """The checkpoint to evaluate: the run's newest validated one (the one training would
    resume from, storage.ledger.choose_resume), or the given step, or a directory. A
    ConfigError says why there is none when the input names none (a step not validated, a
    path that is no checkpoint, a run with nothing validated); a FileNotFoundError when the
    step is validated but not readable from here yet. INITIAL ("init"): the weights a run
    with model.init_from starts from (its directory), evaluated as step 0: the baseline."""
    if checkpoint == INITIAL:
        if not config.model.init_from:
            raise ConfigError(f"--checkpoint {INITIAL} evaluates the weights a run starts from "
                              f"(model.init_from); run '{config.run.run_id}' has none: it starts "
                              "from random weights")
        if not Path(config.model.init_from).is_dir():
            raise ConfigError(f"--checkpoint {INITIAL}: model.init_from={config.model.init_from} "
                              "is not a directory here")
        return Path(config.model.init_from)
    if checkpoint is not None and not str(checkpoint).isdigit():
        location = local_path_of(str(checkpoint))
        path = Path(location)
        if "://" in location and not path.exists():
            # the store's URL of a step (s3://...): say what to give instead
            raise ConfigError(f"{checkpoint}: --checkpoint takes a checkpoint directory on this "
                              f"machine (or its file:// URL), or a step number of run "
                              f"'{config.run.run_id}', which is read from its store where this "
                              "machine has no copy; give the step number")
        if not path.exists():
            raise ConfigError(f"{path} does not exist: --checkpoint (the evaluate flow's "
                              f"checkpoint) takes a step number of run '{config.run.run_id}' "
                              "(its ledger's validated steps) or a checkpoint directory; leave "
                              "it out to evaluate the newest validated checkpoint")
        if not is_committed(path):
            raise ConfigError(f"{path} is not a committed checkpoint (no manifest.json)")
        return path
    restore_ledger(config, store)
    ledger = ledger_of(config).read()
    if checkpoint is None:
        point = choose_resume(config.run_dir, ledger)
        if point is None:
            raise ConfigError(f"run '{config.run.run_id}' has no validated checkpoint on this "
                              "machine or in the store yet; train it first (goodput train), or "
                              "name a run that has one (run.run_id)")
    else:
        entry = ledger.entries.get(int(checkpoint))
        if entry is None or entry.state not in ("validated", "uploaded"):
            state = entry.state if entry else "not in the ledger"
            raise ConfigError(f"checkpoint step {checkpoint} of run '{config.run.run_id}' "
                              f"is {state}; pick one of {ledger.steps('validated', 'uploaded')}")
        point = readable_copy(config.run_dir, entry)
        if point is None:
            raise FileNotFoundError(
                f"checkpoint step {checkpoint} of run '{config.run.run_id}' is validated but not "
                f"uploaded yet, and this machine has no copy; evaluate it where it was trained, "
                f"or one of the uploaded steps {ledger.steps('uploaded')}")
    return point


def checkpoint_dir(config: RunConfig, point: ResumePoint) -> Path:
    """The directory `evaluate` takes for a readable copy (storage.ledger.readable_copy):
    its local copy, or, where only the store's copy is readable from here, the run's
    directory for its step, absent on this machine: `evaluate` then reads the weights from
    the store (not the optimizer's state, two thirds of the checkpoint with AdamW)."""
    return point.local if point.local is not None else config.run_dir.checkpoint(point.step)


def evaluated_copy(config: RunConfig, checkpoint: Path) -> str | None:
    """The copy (core.protocol.copy_id) `evaluate` reads at `checkpoint`: the local one, or,
    for a step of the run that this machine has no copy of, the store's copy the ledger
    names uploaded. None: none that can be read. The init_from weights: their fingerprint."""
    if is_initial(config, checkpoint):
        return config.model.init_from_fingerprint
    local = copy_id(checkpoint)
    if local is not None or not config.run_dir.holds_checkpoint(checkpoint):
        return local
    entry = ledger_of(config).read().entries.get(step_of(checkpoint))
    return entry.copy_id if entry is not None and entry.state == "uploaded" else None


def evaluation_due(config: RunConfig, step: int) -> bool:
    """Whether checkpoint `step` is one eval.every_validated asks to evaluate: the N-th, 2N-th,
    ... checkpoint of the run (rejected copies not counted), so that the choice holds across
    retries and flow runs. Counted from the ledger and the committed checkpoints on disk:
    the train flow asks as it finds a checkpoint, before the validation tasks of the ones
    just before it have entered them in the ledger (every_validated=3 evaluated nothing)."""
    every = config.eval.every_validated
    if not every:
        return False
    entries = ledger_of(config).read().entries
    rejected = {s for s, entry in entries.items() if entry.state == "rejected"}
    steps = ({s for s in entries} | {step_of(p) for p in config.run_dir.committed_checkpoints()}) - rejected
    return (len([s for s in steps if s < step]) + 1) % every == 0


def report_path(config: RunConfig, checkpoint: Path) -> Path:
    """Where the report of `checkpoint` goes: eval/step-N.json for a checkpoint of this run
    evaluated with the run's own eval settings (its config.yaml's); with others (a one-off
    `goodput evaluate eval.limit=4`), eval/settings-<hash>/step-N.json, which leaves the
    run's report, its ledger scores and the best checkpoint by eval as they were. A
    directory of another run gets a report of its own (eval/other/), never this run's; the
    init_from weights one of theirs, eval/initial/ (a baseline, not a step of the run)."""
    if is_initial(config, checkpoint):
        return config.run_dir.eval_dir / "initial" / f"settings-{config.eval_hash()[:12]}.json"
    step = step_of(checkpoint)
    if config.run_dir.holds_checkpoint(checkpoint):
        if runs_own_eval_settings(config.run_dir, config.eval_hash()):
            return config.run_dir.eval_report(step)
        return config.run_dir.eval_dir / f"settings-{config.eval_hash()[:12]}" / f"step-{step:08d}.json"
    key = sha256_bytes(str(Path(checkpoint).resolve()).encode())[:12]
    return config.run_dir.eval_dir / "other" / f"{key}-step-{step:08d}.json"


def reusable_report(config: RunConfig, checkpoint: Path, dataset_id: str) -> EvalReport | None:
    """The report of `checkpoint` already kept with the run, if it was made of this copy of
    the checkpoint, on dataset `dataset_id`, with these eval settings."""
    out = report_path(config, checkpoint)
    if not out.is_file():
        return None
    try:
        report = EvalReport.model_validate_json(out.read_text())
    except ValueError:  # damaged: evaluated again (evaluate keeps the file aside)
        return None
    copy = evaluated_copy(config, checkpoint)
    if (report.checkpoint == str(checkpoint) and copy is not None and report.copy_id == copy
            and report.eval_hash == config.eval_hash() and report.dataset_id == dataset_id):
        return report
    return None


def report_to_reuse(config: RunConfig, store, dataset_id: str,
                    checkpoint: str | int | None = None) -> EvalReport | None:
    """What the evaluate stage would do with nothing to evaluate: the reusable report
    (reusable_report) of the checkpoint it picks (pick_checkpoint: the newest validated,
    a step, or a directory), on this machine or in the store. None when it would evaluate or
    fail (the stage then runs and says why); nothing is fetched."""
    try:
        picked = pick_checkpoint(config, store, checkpoint)
    except (FileNotFoundError, ConfigError):
        return None
    path = picked if isinstance(picked, Path) else checkpoint_dir(config, picked)
    return reusable_report(config, path, dataset_id)


def record_eval(config: RunConfig, report: EvalReport, started: float) -> dict:
    """Write the evaluate stage's part of summary.json and the report's scores into the
    ledger; returns that part. A checkpoint of another run (`goodput evaluate --checkpoint
    DIR`), or with other eval settings than the run's, leaves this run's summary and ledger
    as they are: its report is apart (report_path)."""
    values = {"step": report.step, "loss": report.loss, "perplexity": report.perplexity,
              "bits_per_byte": report.bits_per_byte,
              "tokens_evaluated": report.tokens_evaluated, "source_losses": report.source_losses,
              "downstream": report.downstream,
              "report": str(report_path(config, Path(report.checkpoint))),
              "wall_time_s": time.time() - started}
    if not is_this_runs(config, report):
        return values
    update_summary(config.run_dir, "evaluate", values)
    summarize_goodput(config)
    keep_in_ledger(config, report)
    return values


def is_this_runs(config: RunConfig, report: EvalReport) -> bool:
    """Whether `report` is the run's own: of one of its checkpoints, with its eval settings."""
    return report_path(config, Path(report.checkpoint)) == config.run_dir.eval_report(report.step)


def evaluate(config: RunConfig, checkpoint: Path, dataset_dir: Path, background: bool = False) -> EvalReport:
    """Run `python -m training.evaluate` (`background`: beside training, at the lowest CPU
    priority, on eval.background_device). A report that exists is reused only if it was made
    of this copy of the checkpoint, on this dataset, with these eval settings; otherwise the
    checkpoint is evaluated again and the new report replaces it. A step of the run that
    this machine has no copy of (checkpoint_dir) is read from the store: its weights only."""
    report = reusable_report(config, checkpoint, dataset_id_of(dataset_dir))
    if report is not None:
        return report
    initial = is_initial(config, checkpoint)
    from_store = not initial and not is_committed(checkpoint)
    store_copy = evaluated_copy(config, checkpoint) if from_store else None
    if from_store and store_copy is None:
        raise FileNotFoundError(f"{checkpoint} is not on this machine, and the ledger of run "
                                f"'{config.run.run_id}' names no uploaded copy of its step")
    out = report_path(config, checkpoint)
    new = out.with_name(f".{out.name}.new")  # the report it replaces stays until it exists
    # The evaluation's settings go to the process in a file of its own: the run's
    # config.yaml keeps the run's (a one-off eval.tasks=[...] there became the run's default,
    # and stayed after a failed evaluation).
    check_run_config(config)
    config_path = out.with_name(f".{out.stem}.config.yaml")
    config_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(config_path, dump_config(config).encode())
    argv = [sys.executable, "-m", "training.evaluate", "--checkpoint", str(checkpoint),
            "--dataset", str(dataset_dir), "--config", str(config_path), "--out", str(new),
            *(["--background", "--device", config.eval.background_device] if background else []),
            *(["--from-store", store_copy] if from_store else []),
            *(["--initial"] if initial else [])]
    try:
        # Beside training, in a session of its own with its scheduling group lowered
        # (core.cpu_priority); it dies with this process, as no Ctrl-C to the terminal's
        # process group reaches it there.
        env = {**os.environ, PARENT_PID: str(os.getpid())} if background else None
        started = None if background else _started_evaluation(argv)
        if started is not None:
            log.debug(f"step {step_of(checkpoint)}: evaluated in the process started before")
        with started or subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, start_new_session=background, env=env) as proc:
            if background:
                lower_session_priority(proc.pid)
                with _background_lock:
                    _background[proc] = False
            try:
                stdout, stderr = proc.communicate()
            except BaseException:  # as subprocess.run: the evaluation ends with the caller
                proc.kill()
                raise
            finally:
                with _background_lock:
                    stopped = _background.pop(proc, False)
    finally:
        config_path.unlink(missing_ok=True)
        if from_store:
            prune_fetched(config)
    if stopped:
        raise EvaluationStopped(f"evaluation of {checkpoint} stopped with the training")
    if proc.returncode == 2:  # the exit code of a configuration error (core.protocol)
        raise ConfigError(stderr.strip().splitlines()[-1].removeprefix("[eval] ")
                          if stderr.strip() else f"evaluation of {checkpoint}: configuration error")
    if proc.returncode != 0:
        raise RuntimeError(f"evaluation of {checkpoint} failed (exit {proc.returncode}):\n"
                           f"{stderr.strip()[-2000:]}")
    for line in stdout.splitlines():  # what the evaluation fetched, and where its scores went
        _, found, fetched = line.partition("read the weights from")
        if found:
            log.info(f"step {step_of(checkpoint)}: {found}{fetched}")
        _, apart, where = line.partition("these eval settings are not the run's")
        if apart:
            log.info(f"step {step_of(checkpoint)}: {apart}{where}")
    # Its own warnings (worker logging puts them on stderr): scores a tracking server never
    # got went unsaid when the evaluation succeeded.
    for line in stderr.splitlines():
        if line.startswith(("[training.tracking] ", "[eval] ")):
            log.warning(f"evaluation of {checkpoint}: {line.split('] ', 1)[1]}")
    keep_aside(out)
    os.replace(new, out)
    return EvalReport.model_validate_json(out.read_text())


def keep_aside(report_file: Path) -> Path | None:
    """A report about to be replaced (other eval settings, another dataset or copy of the
    checkpoint) moves to earlier/ beside it, named by its settings: a downstream score a user
    asked for once is not lost to a later evaluation with the defaults. Returns where."""
    if not report_file.is_file():
        return None
    try:
        report = EvalReport.model_validate_json(report_file.read_text())
        name = f"{report_file.stem}.{(report.eval_hash or 'unknown')[:12]}.{report.created_at:.0f}"
    except ValueError:  # not a report (damaged): kept aside all the same
        name = f"{report_file.stem}.unreadable.{time.time():.0f}"
    aside = report_file.parent / "earlier" / f"{name}.json"
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(report_file, aside)
    return aside


def keep_in_ledger(config: RunConfig, report: EvalReport) -> None:
    """A report of one of this run's checkpoints: its scores go into the ledger entry."""
    if is_this_runs(config, report):
        ledger_of(config).record_eval(report.step, report.scores())


def plot_eval_history(reports: list[EvalReport], names: list[str], path: Path, title: str) -> Path:
    """One small plot per score against step (matplotlib's Agg canvas: no display)."""
    from matplotlib.figure import Figure

    columns = min(3, len(names))
    rows = -(-len(names) // columns)
    fig = Figure(figsize=(4 * columns, 2.6 * rows), dpi=100, layout="constrained")
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, columns, i + 1)
        points = [(r.step, r.scores()[name]) for r in reports if name in r.scores()]
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", linewidth=1.2)
        ax.set(xlabel="step", title=name)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path
