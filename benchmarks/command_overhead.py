"""What the orchestration costs a command: a `goodput` command with nothing to do, and the
flow machinery's share of `make pipeline`.

    python benchmarks/command_overhead.py [--parts noop,pipeline] [--repeats 5]
                                          [--pipeline-repeats 5] [--config configs/tiny.yaml]
                                          [--override training.max_steps=1200 ...]

- noop: the config's dataset is prepared once (the library); then `goodput prepare` is run
  --repeats times as a command (median wall time), beside the same command with its
  nothing-to-do check taken out (`flow` arm: the prepare flow on Prefect's temporary server,
  as every command ran before the check) and the library's decision alone, in-process.
- pipeline: `goodput pipeline` (what `make pipeline` runs) from scratch, --pipeline-repeats
  times, each beside the stage work called directly on the same config: the library's
  prepare (`prepare_dataset`), `torchrun -m training` (the trainer, as a user would start
  it) and the library's evaluation of the last checkpoint. The flow machinery's share is
  1 - direct / pipeline, per pair, and the median over pairs; the pipeline's summary.json
  splits its wall time by stage. `rerun_s`: the same `goodput pipeline` again once it has
  finished (every stage with nothing to do). `requests_retried`: the requests the temporary
  server answered 503 (SQLite busy), each one a 2 s wait for the client.

Every arm runs in a directory of its own under a temporary root, with no Prefect server
configured (PREFECT_API_URL unset), on one PREFECT_HOME there whose database is created
first (`prefect server database upgrade`), as a user's ~/.prefect is after a first command.
With `--server dedicated` the commands use a `goodput server` (PostgreSQL, no worker)
started first under that root instead, as a team's clients do (PREFECT_API_URL set): the
flow machinery without the temporary server's start.
A pipeline command's wall time is split by its own log: until its first flow run begins
(imports, the temporary server's start), the flow runs, and after the last one ends
(recording, the server's stop).
"""

from __future__ import annotations

import argparse
import json
import re
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.config import load_config  # noqa: E402

GOODPUT = [sys.executable, "-m", "flows.cli"]
# The command as it was before its nothing-to-do check: the same main(), the check taken out.
WITHOUT_CHECK = [sys.executable, "-c", "import flows.cli as cli\n"
                 "cli._without_a_flow = lambda *args, **kwargs: None\n"
                 "cli.run()"]


OVERRIDES: list[str] = []  # --override: the same in every arm (e.g. a longer run)


def dirs(work: Path) -> list[str]:
    return [*OVERRIDES, f"run.runs_dir={work / 'runs'}", f"data.data_dir={work / 'data'}",
            f"storage.uri={work / 'store'}"]


PREFECT_HOME: Path  # set by main(): one for every arm, its database made first


SERVER_ENV: dict[str, str] = {}  # --server dedicated: its URL and auth string


def environment() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE",
                           "PREFECT_PROFILES_PATH")}
    # The temporary server logs each request it answers 503: counted per pipeline.
    return env | {"PREFECT_HOME": str(PREFECT_HOME), "OMP_NUM_THREADS": "1",
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false",
                  "PREFECT_API_LOG_RETRYABLE_ERRORS": "true"} | SERVER_ENV


def dedicated_server(root: Path):
    """A `goodput server` stack (PostgreSQL, the Prefect server, no worker) under `root`,
    not yet started: entered, its clients' settings go into SERVER_ENV."""
    from infra.prefect_stack import PrefectStack
    from infra.torchrun import free_port

    root.chmod(0o711)  # PostgreSQL runs as its own user: it must reach its directory here
    return PrefectStack(root / "server", port=free_port(), worker=False, pg_port=free_port())


def run(cmd: list[str]) -> tuple[float, float, float, str]:
    """Run `cmd`: its wall time, its start and end (Unix time) and its output."""
    started, start = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=environment(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"{proc.stderr[-3000:]}")
    return wall, started, time.time(), proc.stdout + proc.stderr


def timed(cmd: list[str]) -> float:
    return run(cmd)[0]


def log_times(output: str, started: float, ended: float) -> dict:
    """From Prefect's console log (local HH:MM:SS.mmm): seconds until the first flow run
    began, and from the last flow run's end to the process's."""
    def unix(line: str) -> float:
        clock = time.strptime(time.strftime("%Y-%m-%d ", time.localtime(started)) + line[:8],
                              "%Y-%m-%d %H:%M:%S")
        at = time.mktime(clock) + float(line[8:12])
        return at + 86400 if at < started - 3600 else at  # a line past midnight

    began = [unix(line) for line in output.splitlines() if re.match(r"\d\d:\d\d:\d\d\.\d{3} .*Beginning", line)]
    finished = [unix(line) for line in output.splitlines()
                if re.match(r"\d\d:\d\d:\d\d\.\d{3} .*Flow run .* Finished in state", line)]
    return {"before_first_flow_run_s": min(began) - started, "after_last_flow_run_s": ended - max(finished)}


def noop(config_file: str, root: Path, repeats: int) -> dict:
    from goodput.data import prepare as lib
    from storage.store import store_from_config

    work = root / "noop"
    args = ["prepare", "--config", config_file, *dirs(work)]
    config = load_config(config_file, dirs(work))
    lib.prepare_dataset(config)
    start = time.perf_counter()
    found = lib.nothing_to_prepare(config, store_from_config(config.storage))
    decide_s = time.perf_counter() - start
    assert found is not None, "the dataset was just prepared"
    command, flow = [], []
    for _ in range(repeats):  # interleaved: both arms see the same load
        command.append(timed([*GOODPUT, *args]))
        flow.append(timed([*WITHOUT_CHECK, *args]))
    return {"decide_s": decide_s, "command_s": command, "flow_s": flow,
            "command_median_s": statistics.median(command), "flow_median_s": statistics.median(flow)}


def direct_stage_work(config_file: str, work: Path) -> dict:
    """Prepare, train and evaluate as plain calls: the library, torchrun, the library."""
    from goodput.data import prepare as lib
    from goodput.evaluation import evaluate
    from goodput.runs import write_run_config
    from infra.torchrun import free_port
    from storage.store import store_from_config

    config = load_config(config_file, dirs(work))
    times = {}
    start = time.perf_counter()
    lib.prepare_dataset(config)
    times["prepare_s"] = time.perf_counter() - start
    start = time.perf_counter()
    dataset = lib.dataset_for_training(config, store_from_config(config.storage))
    cmd = [sys.executable, "-m", "torch.distributed.run",
           f"--nproc-per-node={config.parallelism.nproc_per_node}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "training",
           "--config", str(write_run_config(config)), "--dataset", str(dataset), "--resume", "none"]
    timed(cmd)
    times["train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    newest = max(config.run_dir.checkpoints.glob("step-*"))
    evaluate(config, newest, dataset)
    times["evaluate_s"] = time.perf_counter() - start
    return times | {"total_s": sum(times.values())}


def pipeline(config_file: str, root: Path, repeats: int) -> dict:
    pairs = []
    for i in range(repeats):
        work = root / f"pipeline-{i}"
        wall, started, ended, output = run([*GOODPUT, "pipeline", "--config", config_file,
                                            *dirs(work / "flow")])
        summary = json.loads(next((work / "flow" / "runs").glob("*/summary.json")).read_text())
        stages = {stage: summary[stage].get("wall_time_s") for stage in ("prepare", "train", "evaluate")}
        rerun_s = timed([*GOODPUT, "pipeline", "--config", config_file, *dirs(work / "flow")])
        direct = direct_stage_work(config_file, work / "direct")
        pairs.append({"pipeline_s": wall, "pipeline_stages_s": stages,
                      "pipeline_command_s": log_times(output, started, ended), "direct": direct,
                      "share": 1 - direct["total_s"] / wall, "rerun_s": rerun_s,
                      "requests_retried": output.count("Encountered retryable exception")})
        print(json.dumps(pairs[-1]), flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"pairs": pairs, "pipeline_median_s": statistics.median(p["pipeline_s"] for p in pairs),
            "direct_median_s": statistics.median(p["direct"]["total_s"] for p in pairs),
            "share_median": statistics.median(p["share"] for p in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="noop,pipeline")
    parser.add_argument("--repeats", type=int, default=5, help="no-op commands per arm")
    parser.add_argument("--pipeline-repeats", type=int, default=5)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--server", choices=("temporary", "dedicated"), default="temporary",
                        help="the commands' Prefect server: each one's temporary server (no "
                             "server configured, as `make pipeline` runs), or a `goodput "
                             "server` started first")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every arm, e.g. training.max_steps=1200")
    args = parser.parse_args()
    OVERRIDES.extend(args.override)
    os.environ["OMP_NUM_THREADS"] = "1"
    root = Path(tempfile.mkdtemp(prefix="goodput-command-overhead-"))
    global PREFECT_HOME
    PREFECT_HOME = root / "prefect-home"
    PREFECT_HOME.mkdir()
    subprocess.run([str(Path(sys.executable).with_name("prefect")), "server", "database",
                    "upgrade", "-y"], env=environment(), check=True, capture_output=True)
    try:
        with dedicated_server(root) if args.server == "dedicated" else nullcontext() as stack:
            if stack is not None:
                SERVER_ENV.update(stack.client_env())
            measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace, root: Path) -> None:
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"server: {SERVER_ENV.get('PREFECT_API_URL', 'temporary')}", flush=True)
    results = {}
    if "noop" in args.parts:
        results["noop"] = noop(args.config, root, args.repeats)
        print(json.dumps(results["noop"]), flush=True)
    if "pipeline" in args.parts:
        results["pipeline"] = pipeline(args.config, root, args.pipeline_repeats)
    print(json.dumps(results, indent=2))
    print(f"load at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
