"""Deployments of every stage, for runs from the Prefect UI and on schedules.

`goodput serve` (this module) serves them from one long-lived process; `prefect.yaml`
declares the same deployments for `prefect deploy` + a work pool, whose flow runs start in
the repository by this module's pull step (`enter_repository`).

Two example schedules:
- nightly evaluation (`eval_cron`): the evaluate deployment with no checkpoint given
  evaluates the newest validated checkpoint of the run (a report that exists is reused);
- continuing a run until its token budget is spent (`train_cron`, deployment
  `goodput-train-continue`): every run trains the *same* config for
  `train_time_limit_s`, then saves a checkpoint at its next step and stops, and the next
  run resumes from the ledger. The budget is `training.max_steps` (tokens = max_steps x tokens per step);
  it never changes between runs, so neither the config hash nor the LR schedule does.
  The scheduled run that reaches max_steps switches its schedule off
  (`tasks.control.switch_off_own_schedule`), so the schedule stops creating runs; serving
  a finished run again registers its schedule switched off.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.runner import Runner
from prefect.schedules import Cron

from core.config import RunConfig
from core.errors import ConfigError
from flows.evaluate import evaluate
from flows.pipeline import pipeline
from flows.prepare import prepare
from flows.train import train
from goodput.checkpoint_lifecycle import run_finished
from storage.store import store_from_config

REPO_VARIABLE = "GOODPUT_REPO"


def enter_repository() -> dict[str, str]:
    """prefect.yaml's pull step: start the flow run in this repository (its config files and
    relative paths), as Prefect's `set_working_directory` step would, and return what that
    returns: {"directory": the new working directory}.

    The repository is $GOODPUT_REPO where the worker sets it (the Kubernetes job variables
    do), else the one the installed `flows` package lives in (this file's). Prefect's own
    step, given "{{ $GOODPUT_REPO }}" from a worker without it, entered "" without a word
    and the flow run failed later on a file it could not find. Neither found: the flow run
    fails with the reason, in its log and its state (`_fail_the_flow_run`).
    """
    try:
        repo = _repository_to_enter()
    except ConfigError as e:
        _fail_the_flow_run(str(e))
        raise
    os.chdir(repo)
    return {"directory": os.getcwd()}


def _repository_to_enter() -> Path:
    named = os.environ.get(REPO_VARIABLE, "").strip()
    installed = Path(__file__).resolve().parents[1]
    if not named:
        if not _is_goodput_repository(installed):
            raise ConfigError(
                f"{REPO_VARIABLE} is not set on this worker and the installed flows package "
                f"({Path(__file__).parent}) is not in a Goodput repository (no prefect.yaml in "
                f"{installed}): set {REPO_VARIABLE} in the worker's environment (or the work "
                "pool's job variables, env) to the repository's directory")
        return installed
    repo = Path(named).expanduser().absolute()
    if not _is_goodput_repository(repo):
        raise ConfigError(
            f"{REPO_VARIABLE}={named} is not a Goodput repository (it needs prefect.yaml "
            f"and flows/): set {REPO_VARIABLE} on the worker (or in the work pool's job "
            "variables, env) to the directory of this repository, or unset it to use the "
            f"one the installed flows package lives in ({Path(__file__).parents[1]})")
    if _is_goodput_repository(installed) and installed != repo.resolve():
        # The flow's file would load from one checkout, everything it imports (already
        # imported by this step) from the other.
        raise ConfigError(
            f"{REPO_VARIABLE}={named} is another checkout than the one this worker's Python "
            f"runs ({installed}): its flows would run with that checkout's code. Start the "
            f"worker with {repo}'s .venv, or unset {REPO_VARIABLE}")
    return repo


def _fail_the_flow_run(reason: str) -> None:
    """Say `reason` in the log of the flow run this pull step runs for, and end it Failed
    with it. Raised alone, it reached neither: the flow run's process printed it where no
    one reads (stream_output: false) and exited, and the worker reported the run Crashed,
    "Process exited with status code: 1", naming no cause."""
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id:  # the step run outside a flow run (a test, by hand)
        return
    from datetime import datetime, timezone
    from logging import ERROR

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Failed

    try:
        with get_client(sync_client=True) as client:
            client.create_logs([LogCreate(name="goodput.deployments", level=ERROR, message=reason,
                                          timestamp=datetime.now(timezone.utc),
                                          flow_run_id=flow_run_id)])
            # Final: the worker's Crashed, proposed when the process exits, is then refused.
            client.set_flow_run_state(flow_run_id, Failed(message=reason), force=True)
    except Exception:  # noqa: BLE001 - the API away: the error raised after this still says it
        pass


def _is_goodput_repository(directory: Path) -> bool:
    return (directory / "prefect.yaml").is_file() and (directory / "flows").is_dir()


def build_deployments(config: RunConfig, eval_cron: str | None = None,
                      train_cron: str | None = None,
                      train_time_limit_s: float | None = None) -> list[RunnerDeployment]:
    """One deployment per flow (plus the continuation schedule); `config` fills the forms."""
    defaults = {"config": config.model_dump(mode="json")}
    tags = ["goodput", config.run.run_id]
    deployments = [
        prepare.to_deployment(name="goodput-prepare", parameters=defaults, tags=tags),
        train.to_deployment(name="goodput-train", parameters=defaults, tags=tags),
        evaluate.to_deployment(name="goodput-evaluate", parameters=defaults, tags=tags,
                               schedules=[Cron(eval_cron)] if eval_cron else None),
        pipeline.to_deployment(name="goodput-pipeline", parameters=defaults, tags=tags),
    ]
    if train_cron:
        # Serving again after the run reached its budget must not switch the schedule back on.
        finished = run_finished(config, store_from_config(config.storage))
        if finished:
            print(f"goodput serve: run '{config.run.run_id}' already reached training.max_steps="
                  f"{config.training.max_steps}: goodput-train-continue is served with its "
                  "schedule off (switch it on in the UI once the run has more to train)",
                  file=sys.stderr, flush=True)
        deployments.append(train.to_deployment(
            name="goodput-train-continue", tags=[*tags, "continue"],
            description=f"Continue run {config.run.run_id} until training.max_steps, at most "
                        f"{train_time_limit_s or 'unlimited'} s per run; resumes from the ledger.",
            parameters={**defaults, "time_limit_s": train_time_limit_s},
            schedules=[Cron(train_cron, active=not finished)],
            # A tick while the previous run still trains is dropped, not queued.
            concurrency_limit=ConcurrencyLimitConfig(
                limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        ))
    return deployments


def on_work_pools(deployments: list[RunnerDeployment]) -> list[str]:
    """Those of `deployments` whose names the API already has on a work pool (`prefect
    deploy` of prefect.yaml, `goodput server`), as "flow/deployment (work pool P)"."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    taken = []
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            name = f"{deployment.flow_name}/{deployment.name}"
            try:
                found = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            except Exception:  # the API unreachable: serve says so itself, as before
                return taken
            if found.work_pool_name:
                taken.append(f"{name} (work pool {found.work_pool_name})")
    return taken


def serve_all(config: RunConfig, eval_cron: str | None = None, train_cron: str | None = None,
              train_time_limit_s: float | None = None) -> None:
    """Serve the deployments from this process. Refused where the server has deployments of
    the same names on a work pool: Prefect matches deployments by name, so serving would take
    them over (their parameters, schedules and pull steps replaced), and their worker could no
    longer run them once this process stopped."""
    deployments = build_deployments(config, eval_cron, train_cron, train_time_limit_s)
    from prefect.settings import PREFECT_API_URL

    from flows.local_api import flow_runs_recorded_by, temporary_server

    # Prefect is imported here: its settings say whether a server is configured (the
    # environment, a profile, or settings changed in this process).
    server = None if PREFECT_API_URL.value() else temporary_server()
    try:
        with flow_runs_recorded_by(server):
            _serve(deployments, on_a_temporary_server=server is not None)
    except KeyboardInterrupt:  # before the runner started
        pass
    finally:
        if server is not None:
            server.stop()


def _serve(deployments: list[RunnerDeployment], on_a_temporary_server: bool) -> None:
    """Serve `deployments` until SIGTERM or Ctrl-C. A temporary server (infra.temporary_server,
    in a session of its own) outlives the signal that stops this process: Prefect's own,
    started in this process group, died of a terminal's Ctrl-C or systemd's SIGTERM to the
    whole service, and the stop then hung on its port until SIGKILL."""
    taken = on_work_pools(deployments)
    if taken:
        raise ConfigError(
            f"this Prefect server already has {', '.join(taken)}: deployed for a worker "
            "(prefect deploy, goodput server), which runs them; trigger those. Serving the "
            "same names from here would take them over. To serve anyway, use a server "
            "without them (a `prefect server start` of your own, another PREFECT_API_URL), "
            "or delete them first (prefect deployment delete <flow>/<deployment>)")
    runner = StopsItsRunsOnSigterm()  # what prefect.serve makes, less its SIGTERM
    for deployment in deployments:
        runner.add_deployment(deployment)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    if on_a_temporary_server:
        print("goodput serve: warning: no Prefect server is configured (PREFECT_API_URL), so "
              "this serves on a temporary Prefect server that only this process uses and that "
              "stops with it: it has no UI, and nothing else can trigger the deployments' runs. "
              "Run `goodput server` and set PREFECT_API_URL to it (or to another Prefect "
              "server) to trigger them from the UI or the prefect CLI", file=sys.stderr, flush=True)
        how = "only this process can reach them (see the warning above)"
    else:
        how = ("trigger them in the UI (Deployments) or with "
               "`prefect deployment run <flow>/<deployment>`")
    print(f"goodput serve: serving {names}; {how}. Ctrl-C or SIGTERM stops serving: "
          "runs in progress are cancelled, their workers saving an emergency checkpoint",
          flush=True)
    signal.signal(signal.SIGINT, runner.handle_sigterm)  # Ctrl-C stops it the same way
    asyncio.run(runner.start())


class StopsItsRunsOnSigterm(Runner):
    """Prefect's runner, stopped by SIGTERM (or Ctrl-C) as it stops for a cancellation: each
    flow run it started is cancelled (a training run's workers save an emergency checkpoint, and the run
    ends Cancelled on the server), then it exits.

    Prefect's own handler calls the runner's stop from inside its event loop, where that
    only makes a coroutine nobody awaits, and exits at once: `systemctl stop` or `docker
    stop` of `goodput serve` left its flow runs Running on the server, and their workers
    training until launch.orphan_timeout_s; so did Ctrl-C. A second signal exits at once."""

    sigterm_seen = False

    def handle_sigterm(self, signum: int = signal.SIGTERM, *args) -> None:
        try:
            # In the main thread, between two steps of the loop that runs the runner.
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet: nothing to cancel
            raise KeyboardInterrupt from None
        if self.sigterm_seen:
            os._exit(128 + signum)
        if not self.started:  # still starting: no flow run of its own yet
            raise KeyboardInterrupt
        self.sigterm_seen = True
        self._logger.info("%s: cancelling the flow runs this process started (their workers "
                          "save an emergency checkpoint), then stopping; once more stops at once",
                          signal.Signals(signum).name)
        # Through the loop's wakeup pipe: a task made here would wait for the loop's next wake.
        loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        self._stop_task = asyncio.ensure_future(self.astop())
