"""What a run shows in the Prefect UI: artifacts, events and the worker log.

- live: a progress artifact per training attempt (step / total, tokens, ETA), updated from
  the supervisor's heartbeat callback, and the workers' output in the flow run's log;
- after training: the metrics table, the loss curve (a PNG kept in the run directory and
  embedded in a markdown artifact), the checkpoint ledger and, when summary.json has one,
  the goodput breakdown;
- events for every checkpoint transition, failed attempt and finished run, named
  `goodput.*` with the run as a resource, so automations can react to them;
- a finished run switches off the schedule that started its flow run (continuations).

Artifact keys are per run id, so the Artifacts page keeps one history per run.
"""

from __future__ import annotations

import base64
import io
import math
import re
import time
from pathlib import Path
from typing import Callable, Literal

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.logging import get_run_logger

from core.config import RunConfig
from goodput.runs import read_summary
from storage.ledger import Ledger, LedgerEntry
from storage.manifests import CheckpointManifest
from tasks.control import switch_off_own_schedule
from training.metrics import read_metrics

WorkerLogs = Literal["rank0", "all"]


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


# -- live progress -------------------------------------------------------------------------

class TrainingProgress:
    """The heartbeat callback of one attempt: keeps a progress artifact up to date.

    Updates are throttled (the heartbeat changes every step; the API needs no more than a
    refresh every few seconds), and the final heartbeat is always shown: the supervisor
    polls the heartbeat, so a job can end between two polls, and `show_last` is then given
    the heartbeat it left.
    """

    def __init__(self, config: RunConfig, attempt: str, every_s: float = 2.0):
        self.max_steps = config.training.max_steps
        self.tokens_per_step = (config.training.tokens_per_rank_step
                                * config.parallelism.world_size)
        self.key = artifact_key("training-progress", config.run.run_id)
        self.attempt, self.every_s = attempt, every_s
        self.artifact_id = None
        self.layout: str | None = None  # an elastic job's world, once it changed
        self.first: dict | None = None
        self.shown: dict | None = None
        self.shown_at = -math.inf  # the first heartbeat is shown (monotonic time starts at boot)

    def __call__(self, beat: dict) -> None:
        self.first = self.first or beat
        last_step = beat["step"] >= self.max_steps
        if not last_step and time.monotonic() - self.shown_at < self.every_s:
            return
        self.show(beat)

    def show_last(self, beat: dict | None, ended: str) -> None:
        """The attempt's last heartbeat (read after its job ended) and how it `ended`."""
        if beat is not None and beat.get("attempt") == self.attempt and beat.get("step") is not None:
            self.first = self.first or beat
            self.show(beat, ended)

    def show(self, beat: dict, ended: str | None = None) -> None:
        self.shown, self.shown_at = beat, time.monotonic()
        try:
            progress = 100.0 * min(beat["step"], self.max_steps) / self.max_steps
            description = self.describe(beat, ended)
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(progress, key=self.key,
                                                            description=description)
            else:
                update_progress_artifact(self.artifact_id, progress, description=description)
        except Exception as e:  # a view of the run: it must never stop training
            get_run_logger().warning(f"progress artifact not updated: {e!r}")

    def layout_changed(self, change: dict) -> None:
        """An elastic job's new world (infra.torchrun.layout_change): shown from the next
        update on, e.g. "world 2 of 4: dp_replicate=2 x ... x accumulation 2"."""
        after = change["after"]
        self.layout = f"world {after['world_size']} of {change['full_world_size']}: {after['name']}"
        self.shown_at = -math.inf  # the next heartbeat shows it

    def describe(self, beat: dict, ended: str | None = None) -> str:
        """E.g. "step 120 / 300 · 61,440 tokens · loss 3.2101 · 2,900 tokens/s · ETA 1m02s";
        once the attempt `ended`, "step 140 / 300 · ... · loss 3.1002 · ended: time limit"."""
        step = beat["step"]
        parts = [f"step {step:,} / {self.max_steps:,}", f"{step * self.tokens_per_step:,} tokens"]
        if beat.get("loss") is not None:
            parts.append(f"loss {beat['loss']:.4f}")
        if self.layout is not None:
            parts.append(self.layout)
        if ended is not None:
            return " · ".join([*parts, f"ended: {ended}", f"attempt {self.attempt}"])
        if beat.get("phase") == "checkpoint":
            parts.append("saving a checkpoint")
        elif beat.get("tokens_per_s"):
            parts.append(f"{beat['tokens_per_s']:,.0f} tokens/s")
            if beat.get("data_wait_share") is not None:
                parts.append(f"data wait {beat['data_wait_share']:.0%}")
        steps_done = step - self.first["step"]
        elapsed = beat["time"] - self.first["time"]
        if steps_done > 0 and elapsed > 0 and step < self.max_steps:
            parts.append(f"ETA {format_duration((self.max_steps - step) * elapsed / steps_done)}")
        return " · ".join([*parts, f"attempt {self.attempt}"])


class PrepareProgress:
    """Work units done, documents, tokens, tokens/s and ETA: on a console bar (tqdm) for
    local runs and as a live progress artifact. Fed each unit's result as it finishes."""

    def __init__(self, run_id: str, dataset_id: str, n_units: int, show_bar: bool):
        from tqdm import tqdm

        self.n_units, self.done, self.docs, self.tokens, self.skipped = n_units, 0, 0, 0, 0
        # What this run tokenized, apart from units an earlier run had done (they return at
        # once): the speed and the ETA count only these.
        self.new_units, self.new_tokens = 0, 0
        self.started = time.monotonic()
        self.key = artifact_key("prepare-progress", run_id)
        self.dataset_id = dataset_id
        self.artifact_id = None
        # On a terminal only (tqdm's disable=None): in a log file or a pipe its redraws ran
        # into the log lines; the artifact and the log say the same there.
        self.bar = tqdm(total=n_units, unit="unit", desc=f"prepare {dataset_id}",
                        disable=None if show_bar else True, dynamic_ncols=True)
        self.logged_at: float | None = None

    LOG_EVERY_S = 30.0  # where no bar is drawn, the log's progress line at most this often

    def __call__(self, docs: int, tokens: int, skipped: int, reused: bool = False) -> None:
        self.count(docs, tokens, skipped, reused)
        line = self.to_log()
        if line:
            get_run_logger().info(line)
        self.bar.set_postfix_str(self.describe(with_units=False), refresh=False)
        self.bar.update(1)
        try:
            progress = 100.0 * self.done / self.n_units
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(progress, key=self.key,
                                                            description=self.describe())
            else:
                update_progress_artifact(self.artifact_id, progress, description=self.describe())
        except Exception as e:  # a view of the run: it must never stop preparation
            get_run_logger().warning(f"progress artifact not updated: {e!r}")

    def to_log(self) -> str | None:
        """The log's line for the unit just counted where no bar is drawn (a log file, a pipe,
        a worker's flow run): the first unit, then at most every LOG_EVERY_S, and the last.
        A run there showed only "Task run 'tokenize-unit-N' Finished" lines, with no tokens/s
        or ETA (and with prepare.runner=ray nothing at all for minutes)."""
        if not self.bar.disable:
            return None
        now = time.monotonic()
        if (self.logged_at is not None and self.done < self.n_units
                and now - self.logged_at < self.LOG_EVERY_S):
            return None
        self.logged_at = now
        return f"prepare {self.dataset_id}: {self.describe()}"

    def count(self, docs: int, tokens: int, skipped: int, reused: bool = False) -> None:
        """One unit finished (`reused`: an earlier run had done it)."""
        self.done += 1
        self.docs, self.tokens, self.skipped = self.docs + docs, self.tokens + tokens, self.skipped + skipped
        if not reused:
            self.new_units, self.new_tokens = self.new_units + 1, self.new_tokens + tokens

    def describe(self, with_units: bool = True) -> str:
        """E.g. "12 / 40 units · 120,000 docs · 31,000,000 tokens · 2,500,000 tokens/s · ETA 0m31s"."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        parts = [f"{self.done} / {self.n_units} units"] if with_units else []
        parts += [f"{self.docs:,} docs", f"{self.tokens:,} tokens"]
        if self.new_units:
            parts.append(f"{self.new_tokens / elapsed:,.0f} tokens/s")
        if self.new_units < self.done:
            parts.append(f"{self.done - self.new_units} done before")
        if self.skipped:
            parts.append(f"{self.skipped:,} bad records skipped")
        if 0 < self.new_units and self.done < self.n_units:
            parts.append(f"ETA {format_duration(elapsed * (self.n_units - self.done) / self.new_units)}")
        return " · ".join(parts)

    def close(self) -> None:
        self.bar.close()


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


# -- worker output in the flow run's log ----------------------------------------------------

# torchrun's prefix of a worker's line: the node, then the global rank. The launchers set it
# (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[node<n> rank${rank}] ", with torchrun --tee=3).
_WORKER_PREFIX = re.compile(r"^\[(?P<node>[^\]\s]+) rank(?P<rank>\d+)\] ")


def worker_log(log: Callable[[str], None], ranks: WorkerLogs = "rank0") -> Callable[[str], None]:
    """A line sink for the supervisor: keeps global rank 0's lines, or every rank's.

    Lines without a worker prefix (the launcher's and torchrun's own) always pass. The
    profiler's trace markers (kineto's "USDT: ... profiler_start" at each window) do not:
    they say nothing rank 0's "profile of steps ..." line does not.
    """
    def sink(line: str) -> None:
        match = _WORKER_PREFIX.match(line)
        if (ranks == "all" or match is None or match["rank"] == "0") and not _PROFILER_MARKER.search(line):
            log(line)
    return sink


_PROFILER_MARKER = re.compile(r"USDT:.*ActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)$")


# -- the report after training ---------------------------------------------------------------

@task(name="publish-training-report", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      tags=["report"])
def publish_training_report(config: RunConfig) -> Path | None:
    """Metrics table, loss curve, checkpoint ledger and goodput breakdown of the run.

    Returns the loss-curve PNG (None before the first logged step).
    """
    run_id, run_dir = config.run.run_id, config.run_dir
    logged = read_metrics(run_dir)
    metrics = latest_per_step(logged)
    curve = None
    if metrics:
        create_table_artifact(metrics_rows(metrics), key=artifact_key("training-metrics", run_id),
                              description=f"Training metrics of {run_id} (sampled steps)")
        curve = plot_loss_curve(metrics, run_dir.loss_curve, run_id, resumed_at(logged))
        encoded = base64.b64encode(curve.read_bytes()).decode()
        create_markdown_artifact(
            f"### Training loss of `{run_id}`\n\n"
            f"![training loss of {run_id}](data:image/png;base64,{encoded})\n\n"
            f"Stored with the run: `{curve.resolve()}`",
            key=artifact_key("loss-curve", run_id), description=f"Training loss of {run_id}")
    ledger = Ledger(run_dir).read()
    if ledger.entries:
        create_table_artifact(ledger_rows(ledger.entries.values()),
                              key=artifact_key("checkpoint-ledger", run_id),
                              description=f"Checkpoints of {run_id}: "
                                          "committed → validated → uploaded")
    publish_goodput(config)
    return curve


def publish_goodput(config: RunConfig) -> None:
    """The goodput artifact, from summary.json's breakdown: after training, and again after
    an evaluation (its time counts too; the pipeline's artifact said 0.585 after training
    where summary.json said 0.336 once it had evaluated)."""
    goodput = read_summary(config.run_dir).get("goodput")
    if goodput:
        create_table_artifact(flatten(goodput), key=artifact_key("goodput", config.run.run_id),
                              description=f"Goodput breakdown of {config.run.run_id}")


def resumed_at(logged: list[dict]) -> list[int]:
    """The steps training resumed from (metrics.jsonl's records in the order written): a retried
    attempt, and a restart of the workers within one (torchrun's), which logs a step again."""
    steps = set()
    for previous, record in zip(logged, logged[1:]):
        if record["step"] <= previous["step"] or record.get("attempt") != previous.get("attempt"):
            steps.add(record["step"] - record.get("window_steps", 1))  # where its window began
    return sorted(steps)


def latest_per_step(metrics: list[dict]) -> list[dict]:
    """Steps in order; a step trained twice (resumed from before it) counts as its last run."""
    return sorted({m["step"]: m for m in metrics}.values(), key=lambda m: m["step"])


def metrics_rows(metrics: list[dict], max_rows: int = 25) -> list[dict]:
    """About `max_rows` evenly spaced steps, always including the last one."""
    stride = max(1, -(-len(metrics) // max_rows))
    sampled = metrics[::stride]
    if sampled[-1] is not metrics[-1]:
        sampled.append(metrics[-1])
    return [{"step": m["step"], "loss": f"{m['loss']:.4f}", "lr": f"{m['lr']:.2e}",
             "grad norm": f"{m['grad_norm']:.3f}", "tokens seen": f"{m['tokens_seen']:,}",
             "tokens/s": f"{m['tokens_per_s']:,.0f}", "step time (s)": f"{m['step_time_s']:.3f}",
             "data wait": f"{m['data_wait_share']:.1%}" if "data_wait_share" in m else "",
             "attempt": m.get("attempt", "")} for m in sampled]


def ledger_rows(entries) -> list[dict]:
    return [{"step": e.step, "state": e.state,
             "loss": "" if e.loss is None else f"{e.loss:.4f}",
             "tokens seen": "" if e.tokens_seen is None else f"{e.tokens_seen:,}",
             "store": e.store_url or "", "reason": e.reason}
            for e in sorted(entries, key=lambda e: e.step)]


def plot_loss_curve(metrics: list[dict], path: Path, title: str, resumed: list[int] = ()) -> Path:
    """Training loss per step as a PNG (matplotlib's Agg canvas: no display, thread-safe),
    a dotted line at each step training `resumed` from."""
    from matplotlib.figure import Figure  # a Figure made directly renders with Agg

    steps = [m["step"] for m in metrics]
    fig = Figure(figsize=(7, 3.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, [m["loss"] for m in metrics], linewidth=1.2)
    for step in resumed:
        ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def flatten(tree: dict, prefix: str = "") -> list[dict]:
    """{"a": {"b": 1}} -> [{"metric": "a.b", "value": "1"}]: any breakdown as a table."""
    rows = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += flatten(value, f"{name}.")
        else:
            rows.append({"metric": name,
                         "value": f"{value:.4g}" if isinstance(value, float) else str(value)})
    return rows


# -- events ---------------------------------------------------------------------------------

def run_resource(run_id: str) -> dict[str, str]:
    return {"prefect.resource.id": f"goodput.run.{run_id}", "prefect.resource.name": run_id,
            "goodput.run-id": run_id}


def checkpoint_event(config: RunConfig, entry: LedgerEntry, state: str | None = None) -> None:
    """`goodput.checkpoint.<state>` for one checkpoint (state defaults to the entry's)."""
    run_id = config.run.run_id
    state = state or entry.state
    emit_event(
        f"goodput.checkpoint.{state}",
        resource={"prefect.resource.id": f"goodput.checkpoint.{run_id}.{entry.step}",
                  "prefect.resource.name": f"{run_id} step {entry.step}",
                  "goodput.run-id": run_id, "goodput.step": str(entry.step)},
        related=[{**run_resource(run_id), "prefect.resource.role": "run"}],
        payload={"step": entry.step, "loss": entry.loss, "tokens_seen": entry.tokens_seen,
                 "store_url": entry.store_url, "reason": entry.reason})


def announce_committed(config: RunConfig, step: int) -> None:
    """`goodput.checkpoint.committed` as the train flow sees the commit (whatever becomes of
    its validation), with what the checkpoint's manifest records."""
    manifest = CheckpointManifest.load(config.run_dir.checkpoint(step))
    checkpoint_event(config, LedgerEntry(step=step, state="committed", loss=manifest.loss,
                                         tokens_seen=manifest.tokens_seen))


def attempt_failed_event(config: RunConfig, attempt: str, failure_class: str, reason: str,
                         step: int | None) -> None:
    """`goodput.attempt.failed`; the class is also a resource label, which automation
    triggers can match (they match resources, not payloads): e.g. only `hang`."""
    emit_event("goodput.attempt.failed",
               resource={**run_resource(config.run.run_id), "goodput.failure-class": failure_class},
               payload={"attempt": attempt, "failure_class": failure_class, "reason": reason,
                        "step": step})


def layout_changed_event(config: RunConfig, attempt: str, change: dict) -> None:
    """`goodput.layout.changed`: an elastic job's world shrank (lost nodes) or grew (nodes
    joined), with the layout before and after (nodes, workers, degrees, accumulation)."""
    emit_event("goodput.layout.changed", resource=run_resource(config.run.run_id),
               payload={"attempt": attempt, "before": change["before"], "after": change["after"],
                        "full_world_size": change["full_world_size"],
                        "global_batch": change["global_batch"]})


@task(name="announce-run-finished", cache_policy=NO_CACHE, tags=["report"])
def announce_run_finished(config: RunConfig, trained: dict) -> bool:
    """Once the run has reached training.max_steps: emit `goodput.run.finished`, and if a
    schedule created this flow run (a continuation), switch that schedule off."""
    logger = get_run_logger()
    run_id = config.run.run_id
    finished = (trained.get("final_step") or 0) >= config.training.max_steps
    if not finished:
        logger.info(f"run {run_id} at step {trained.get('final_step')} of "
                    f"{config.training.max_steps}: not finished yet")
        return False
    emit_event("goodput.run.finished", resource=run_resource(run_id),
               payload={"final_step": trained["final_step"],
                        "final_train_loss": trained.get("final_train_loss"),
                        "max_steps": config.training.max_steps,
                        "run_dir": str(config.run_dir.path.resolve())})
    deployment_name = switch_off_own_schedule()
    if deployment_name:
        logger.info(f"run {run_id} reached max_steps={config.training.max_steps}: switched off "
                    f"the schedule of deployment {deployment_name!r} that started this flow run")
    return True
