"""Metrics where users already look: TensorBoard (by default), MLflow and W&B (opt-in).

The one metrics writer (training.metrics) hands every record to these trackers; the evaluate
stage hands them its scores. Each run of Goodput is one run in each backend, continued by
every attempt:

- TensorBoard: event files in `<run dir>/tensorboard/`. A resumed attempt starts its writer
  with `purge_step`, so TensorBoard hides what an earlier attempt logged for the steps now
  redone (after a crash or a rollback): nothing shows twice.
- MLflow: the run tagged `goodput.run_id` in `tracking.mlflow_experiment`, found again by
  each attempt. MLflow keeps every value it was sent, so a resume logs `resumed_at_step`
  at the step it resumed from: the redone steps after it are marked.
- W&B: the run id follows from the Goodput run id, resumed with `resume="allow"`. Every
  value is logged against `trainer/step` (W&B's own step only counts the records: it drops
  a value logged at a step below one it has, and a resume redoes steps), so like MLflow it
  keeps every value, and the `resumed_at_step` marker says where an attempt resumed.
  Offline, W&B cannot resume a run (and `wandb sync` of two folders of one id keeps the
  later one's history only): each process logs a run of its own, all in the run's group.

MLflow and W&B send from a background thread with a bounded buffer: a tracking server that
is slow or down never stops or slows training; its records wait and are retried with backoff,
and a warning says so (at the end, how many were never sent).
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import re
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

# metrics.jsonl's fields as tracking tags; numbers only (other fields are not curves).
TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_seen": "train/tokens_seen",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
    "flops_per_s_per_device": "perf/flops_per_s_per_device",
    "data_wait_s": "perf/data_wait_s", "data_wait_share": "perf/data_wait_share",
    "checkpoint_s": "checkpoint/stall_s", "max_memory_allocated_gb": "memory/max_allocated_gb",
    "max_rss_gb": "memory/max_rss_gb",  # a CPU worker's peak resident set (training.train.device_memory)
    "val_loss": "val/loss", "val_bits_per_byte": "val/bits_per_byte",
    "resumed_at_step": "train/resumed_at_step",  # where an attempt resumed: later steps redone
    "world_size": "elastic/world_size",  # drops where an elastic job lost nodes, rises where they joined
}
# per-source and evaluation scores; a mixture of experts' loads (training.moe_balance);
# eval-<settings hash>/: a one-off evaluation's scores (training.evaluate.curves_prefix).
_PREFIXES = {"val_loss/": "val/loss/", "eval/": "eval/", "eval-": "eval-", "moe/": "moe/",
             "samples/": "data/samples/"}  # a mix's samples drawn from each source
TRAINER_STEP = "trainer/step"  # the x axis of a W&B evaluation run (WandbTracker)


def curves(record: dict) -> dict[str, float]:
    """The record's numbers under their tracking tags."""
    found = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        tag = TAGS.get(key) or next((t + key[len(p):] for p, t in _PREFIXES.items()
                                     if key.startswith(p)), None)
        if tag is not None:
            found[tag] = float(value)
    return found


class TensorBoardTracker:
    def __init__(self, directory: Path, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events an earlier attempt wrote at or after it are hidden. Written out
        # every few seconds: a crash loses at most that much of the curves.
        self.writer = SummaryWriter(str(directory), flush_secs=5,
                                    purge_step=None if resumed_step is None else resumed_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event holding every value of the step (add_scalar writes an event per tag:
        # ten times the cost, a millisecond a step), through the writer's public FileWriter
        # (SummaryWriter opens it, with the purge_step events, when it is made).
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self.writer.file_writer.add_summary(summary, global_step=step)

    def close(self, status: str = "FINISHED") -> None:
        self.writer.close()  # TensorBoard has no status


class _Background:
    """Sends records from a thread: `send(batch)` may fail or hang; the trainer never waits.

    Records beyond `capacity` waiting are dropped, oldest first (and counted)."""

    def __init__(self, name: str, send, capacity: int = 10_000, close_timeout_s: float = 10.0):
        self.name, self.send, self.capacity, self.close_timeout_s = name, send, capacity, close_timeout_s
        self.pending: queue.Queue = queue.Queue()
        self.dropped, self.unsent = 0, 0
        self._stopping = threading.Event()  # set when close gives up waiting
        self.thread = threading.Thread(target=self._run, name=f"tracking-{name}", daemon=True)
        self.thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.pending.qsize() >= self.capacity:
            try:
                self.pending.get_nowait()
                self.dropped += 1
            except queue.Empty:
                pass
        self.pending.put((step, values))

    def _run(self) -> None:
        delay, warned = 1.0, False
        while True:
            item = self.pending.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < 500:  # what queued meanwhile goes in the same request
                try:
                    more = self.pending.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.pending.put(None)
                    break
                batch.append(more)
            while True:
                try:
                    self.send(batch)
                    if warned:
                        log.warning("%s is reachable again; the buffered metrics were sent", self.name)
                    delay, warned = 1.0, False
                    break
                except Exception as e:  # the server is down or refuses: keep the records, retry
                    if not warned:
                        log.warning("%s: could not log metrics (%s); training goes on, the records "
                                    "are kept and retried", self.name, e)
                        warned = True
                    if self._stopping.is_set():
                        self.unsent = len(batch) + self.pending.qsize()
                        return
                    self._stopping.wait(delay)
                    delay = min(delay * 2, 60.0)

    def close(self, status: str = "FINISHED") -> None:
        """Send what is left (waiting up to close_timeout_s); `status` is for subclasses."""
        self.pending.put(None)
        self.thread.join(self.close_timeout_s)
        if self.thread.is_alive() or self.unsent:
            self._stopping.set()
            self.thread.join(2.0)
            left = self.unsent or self.pending.qsize()
            log.warning("%s: %d metric records were never sent (the server did not answer within "
                        "%.0f s of the end)", self.name, left, self.close_timeout_s)
        if self.dropped:
            log.warning("%s: %d metric records were dropped while the server was down (the "
                        "buffer holds %d)", self.name, self.dropped, self.capacity)


class MLflowTracker(_Background):
    """One MLflow run per Goodput run id, found by its tag, continued by every attempt.

    `earlier`: metrics.jsonl's records of the steps before this attempt; those the MLflow run
    lacks (an attempt that crashed before its thread sent them) are sent first.

    The MLflow run's status follows training's: RUNNING while an attempt trains (set again
    by each attempt that continues it), then FINISHED when the attempt ends normally (at
    training.max_steps or at a time limit), KILLED when it was stopped (a cancellation, a
    preemption) and FAILED when it failed. An evaluation (`job="eval"`) logs its scores
    without touching the status, except that of a run it made itself (no training logged
    there yet): FINISHED once its scores are in."""

    def __init__(self, uri: str, experiment: str, run_id: str, config: dict | None,
                 earlier: list[dict] = (), job: str = "train"):
        self.uri, self.experiment, self.goodput_run = uri, experiment, run_id
        self.config, self.run, self.earlier, self.job = config, None, list(earlier), job
        self.made_here = False
        super().__init__(f"MLflow at {uri}", self._send)

    def _mlflow_run(self):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        runs = client.search_runs([experiment_id], f"tags.`goodput.run_id` = '{self.goodput_run}'",
                                  max_results=1)
        if runs:
            run_id = runs[0].info.run_id
            have = {m.step for m in client.get_metric_history(run_id, TAGS["loss"])}
            if self.job == "train" and runs[0].info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")  # trained on again
        else:
            run_id = client.create_run(experiment_id, run_name=self.goodput_run,
                                       tags={"goodput.run_id": self.goodput_run}).info.run_id
            have, self.made_here = set(), True
            if self.config:
                from mlflow.entities import Param

                client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in self.config.items()])
        self._log(client, run_id, [(r["step"], curves(r)) for r in self.earlier if r["step"] not in have])
        self.earlier = []
        return client, run_id

    def _send(self, batch: list[tuple[int, dict[str, float]]]) -> None:
        if self.run is None:
            self.run = self._mlflow_run()
        self._log(*self.run, batch)

    def close(self, status: str = "FINISHED") -> None:
        """Send what is left, then end the MLflow run with `status` (see the class)."""
        super().close(status)
        if self.run is None or self.unsent or self.thread.is_alive():
            return  # the server never answered: the run's status cannot be set either
        if self.job == "train" or self.made_here:
            client, run_id = self.run
            # From a thread, waited for as long as the records were: a server gone now (its
            # client retries for minutes) never holds a worker that is ending.
            ending = threading.Thread(target=client.set_terminated, daemon=True,
                                      args=(run_id, status if self.job == "train" else "FINISHED"))
            ending.start()
            ending.join(self.close_timeout_s)
            if ending.is_alive():
                log.warning("%s: the run's status (%s) was not set: the server did not answer "
                            "within %.0f s", self.name, status, self.close_timeout_s)

    @staticmethod
    def _log(client, run_id: str, batch: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(tag), value, now, step)
                   for step, values in batch for tag, value in values.items()]
        for first in range(0, len(metrics), 1000):  # MLflow takes at most 1000 per batch
            client.log_batch(run_id, metrics=metrics[first:first + 1000])


def mlflow_name(tag: str) -> str:
    """`tag` as MLflow takes a metric's name (letters, digits, _ - . / : and spaces): an
    lm-eval filter named in parentheses ("gsm8k/exact_match (strict-match)") becomes a part of
    its path ("gsm8k/exact_match/strict-match"), anything else MLflow refuses an "_". One name
    it refused made MLflow refuse the whole batch, the step's loss included."""
    return re.sub(r"[^\w\-./: ]", "_", re.sub(r"\s*\(([^()]*)\)", r"/\1", tag))


class WandbTracker(_Background):
    """The W&B run whose id follows from the Goodput run id, resumed by every attempt.

    `job="eval"` (evaluation processes): a run of its own in the training run's group.
    Values are plotted against a `trainer/step` axis of their own: W&B ignores a value logged
    at a step below its run's current one, and a resumed attempt redoes steps, as an
    evaluation logs checkpoints training has passed. Offline (no resume there), each process
    is a run of its own in the group."""

    def __init__(self, project: str, entity: str | None, mode: str, run_id: str, directory: Path,
                 config: dict | None, job: str = "train"):
        import wandb

        key = f"goodput:{project}:{run_id}" + (f":{job}" if job != "train" else "")
        if mode == "offline":  # not resumable: syncing two folders of one id loses one
            key += f":{uuid.uuid4()}"
        directory.mkdir(parents=True, exist_ok=True)
        # wandb.init starts W&B's own service process and returns at once in offline mode;
        # online, it may wait for the server, so the background thread does it.
        self._init = dict(project=project, entity=entity, mode=mode,
                          id=hashlib.sha256(key.encode()).hexdigest()[:16],
                          name=run_id if job == "train" else f"{run_id}-{job}", group=run_id,
                          job_type=job, resume="allow", dir=str(directory), config=config,
                          reinit="create_new",
                          settings=wandb.Settings(silent=True, console="off", init_timeout=30))
        self.job, self.run = job, None
        super().__init__(f"W&B project {project}", self._send)

    def _send(self, batch: list[tuple[int, dict[str, float]]]) -> None:
        import wandb

        if self.run is None:
            self.run = wandb.init(**self._init)
            self.run.define_metric(TRAINER_STEP)
            self.run.define_metric("*", step_metric=TRAINER_STEP)
        for step, values in batch:
            self.run.log({**values, TRAINER_STEP: step})

    def close(self, status: str = "FINISHED") -> None:
        super().close(status)
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class Trackers:
    """Every configured tracker; `log` is what the metrics writer and evaluation call."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, step: int, record: dict) -> None:
        values = curves(record)
        for tracker in list(self.trackers) if values else []:
            try:
                tracker.log(step, values)
            except Exception as e:  # metrics never stop training: that backend is let go
                log.warning("%s stopped logging: %s", type(tracker).__name__, e)
                self.trackers.remove(tracker)

    def close(self, status: str = "FINISHED") -> None:
        """`status`: how the process's work ended, as MLflow names it: FINISHED, KILLED (stopped
        by a signal: cancelled, preempted) or FAILED."""
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except Exception as e:
                log.warning("%s did not close cleanly: %s", type(tracker).__name__, e)


def open_trackers(tracking, run_dir: Path, run_id: str, resumed_step: int | None = None,
                  config: dict | None = None, earlier: list[dict] = (), job: str = "train") -> Trackers:
    """The trackers `tracking` (RunConfig.tracking) asks for, continuing run `run_id`.

    `resumed_step`: on a retried run, the step this attempt resumed from (0: from scratch;
    the later steps are redone); None for a first attempt;
    `config`: flat parameters recorded once with a new MLflow or W&B run; `earlier`: the
    metrics records of the steps before (for MLflow to fill in what it missed); `job`:
    "eval" for an evaluation process (W&B: a run of its own, see WandbTracker)."""
    trackers = []
    if tracking.tensorboard:
        trackers.append(TensorBoardTracker(Path(run_dir) / "tensorboard", resumed_step))
    if tracking.mlflow_uri:
        trackers.append(MLflowTracker(tracking.mlflow_uri, tracking.mlflow_experiment, run_id, config,
                                      earlier, job))
    if tracking.wandb_project:
        trackers.append(WandbTracker(tracking.wandb_project, tracking.wandb_entity, tracking.wandb_mode,
                                     run_id, Path(run_dir), config, job))
    opened = Trackers(trackers)
    if resumed_step is not None:
        opened.log(resumed_step, {"resumed_at_step": resumed_step})
    return opened
