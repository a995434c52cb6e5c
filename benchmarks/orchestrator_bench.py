"""What the orchestrator costs and keeps under load, and what Slurm adds to a start.

    python benchmarks/orchestrator_bench.py [--pipelines 8] [--parts postgres,sqlite,slurm]

- postgres: the production stack (infra/prefect_stack.py: PostgreSQL, Prefect server with
  API auth, work pool, worker, deployments). The dataset is prepared once; then
  --pipelines tiny pipelines are triggered at once through the work pool. Reported: wall
  time until all are final, how many completed, the API's latency while they ran (a client
  timing `POST /flow_runs/filter` every 0.5 s: p50 and p95) and the task runs recorded in
  the database against those the flow runs logged as finished.
- sqlite: the same pipelines as --pipelines `goodput pipeline` commands started at once with
  no server configured, each on Prefect's temporary server over one SQLite file (the local
  default). Reported: wall time, completed, task runs recorded against logged.
- slurm: a two-node Slurm job (infra/local_slurm.py, as root) against two local nodes: time
  from the start of the attempt to the first step, 2 workers per node.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.config import load_config  # noqa: E402
from infra.launchers import free_port  # noqa: E402

TINY = ("data.max_docs=400", "data.shard_tokens=32768", "data.validation_fraction=0.1",
        "tokenizer.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
        "model.max_seq_len=64", "training.seq_len=64", "training.micro_batch_size=4",
        "training.max_steps=4", "training.warmup_steps=1", "checkpoint.every_steps=2",
        "parallelism.nproc_per_node=1", "eval.max_batches=2", "eval.num_samples=1",
        "checkpoint.async_mode=sync")


def overrides(work: Path, run_id: str) -> list[str]:
    return [f"run.runs_dir={work / 'runs'}", f"run.run_id={run_id}", f"data.data_dir={work / 'data'}",
            f"storage.uri={work / 'store'}", *TINY]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def postgres(work: Path, n: int) -> dict:
    from infra.prefect_stack import PrefectStack

    # The database runs as the user postgres, which must reach its directory.
    with PrefectStack(tempfile.mkdtemp(prefix="goodput-bench-stack-"), port=free_port()) as stack:
        api = stack.client()
        form = lambda run_id: load_config(None, overrides(work, run_id)).model_dump(mode="json")  # noqa: E731
        prepared = api.wait_final(api.trigger("prepare/goodput-prepare", {"config": form("prep")}), 900)
        assert prepared["state"]["type"] == "COMPLETED", prepared["state"]
        latencies: list[float] = []
        done = threading.Event()

        def sample():
            while not done.wait(0.5):
                began = time.perf_counter()
                api.post("/flow_runs/filter", {"limit": 10})
                latencies.append(time.perf_counter() - began)

        sampler = threading.Thread(target=sample, daemon=True)
        since = time.time()
        started = time.monotonic()
        runs = [api.trigger("pipeline/goodput-pipeline", {"config": form(f"pg-{i}")}) for i in range(n)]
        sampler.start()
        final = [api.wait_final(run, 3600) for run in runs]
        wall = time.monotonic() - started
        done.set()
        sampler.join()
        logged, states = stack.task_runs_since(since)
        return {"wall_s": wall, "completed": sum(r["state"]["type"] == "COMPLETED" for r in final),
                "p50_ms": 1000 * statistics.median(latencies), "p95_ms": 1000 * percentile(latencies, 0.95),
                "logged": logged, "recorded": sum(states.values()),
                "recorded_final": states.get("COMPLETED", 0)}


def sqlite(work: Path, n: int) -> dict:
    home = work / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    goodput = str(Path(sys.executable).with_name("goodput"))
    prepared = subprocess.run([goodput, "prepare", *overrides(work, "prep")], env=env, cwd=REPO,
                              capture_output=True, text=True)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    since = time.time()
    started = time.monotonic()
    procs = [subprocess.Popen([goodput, "pipeline", *overrides(work, f"sq-{i}")], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n)]
    outputs = [proc.communicate()[0] for proc in procs]
    wall = time.monotonic() - started
    db = sqlite3.connect(home / "prefect.db")
    after = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since))
    logged = db.execute("SELECT count(DISTINCT task_run_id) FROM log WHERE task_run_id IS NOT NULL "
                        "AND message LIKE 'Finished in state%' AND timestamp > ?", (after,)).fetchone()[0]
    states = dict(db.execute(
        "SELECT state_type, count(*) FROM task_run WHERE created > ? AND id NOT IN (SELECT "
        "parent_task_run_id FROM flow_run WHERE parent_task_run_id IS NOT NULL) GROUP BY state_type",
        (after,)).fetchall())
    return {"wall_s": wall, "completed": sum(proc.returncode == 0 for proc in procs),
            "p50_ms": None, "p95_ms": None, "logged": logged, "recorded": sum(states.values()),
            "recorded_final": states.get("COMPLETED", 0),
            "tracebacks": sum(out.count("Traceback") for out in outputs),
            "locked": sum(out.count("database is locked") for out in outputs)}


def slurm(work: Path) -> dict:
    from goodput.runs import write_run_config
    from infra.local_slurm import LocalSlurm, ensure_names_resolve, forget_names
    from infra.torchrun import run_attempt
    from tests.helpers import small_config, synthetic_dataset

    dataset = synthetic_dataset(work / "slurm-data")
    added = ensure_names_resolve(["n1", "n2"])
    first_step = {}
    try:
        with LocalSlurm(work / "slurm") as cluster:
            os.environ.update(cluster.env)
            for kind in ("slurm", "local"):
                config = small_config(work / kind, f"launch.kind={kind}", "launch.poll_s=0.5",
                                      f"launch.rdzv_port={free_port()}", "parallelism.nnodes=2",
                                      "parallelism.nproc_per_node=2", "training.max_steps=4",
                                      "training.warmup_steps=1", "checkpoint.every_steps=4")
                started = time.monotonic()
                seen: list[float] = []
                result = run_attempt(config, write_run_config(config), dataset, "b1", lambda line: None,
                                     poll_s=0.1, on_progress=lambda beat: seen.append(time.monotonic()))
                assert result.failure_class == "done", result
                first_step[kind] = seen[0] - started
    finally:
        if added:
            forget_names()
    return first_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", type=int, default=8)
    parser.add_argument("--parts", default="postgres,sqlite,slurm")
    parser.add_argument("--workdir", help="default: a new temporary directory")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="orchestrator-bench-"))
    parts = args.parts.split(",")
    rows = {}
    if "postgres" in parts:
        rows["PostgreSQL stack (work pool)"] = postgres(work / "pg", args.pipelines)
        print(json.dumps(rows, indent=1), flush=True)  # kept should a later part fail
    if "sqlite" in parts:
        rows["temporary SQLite servers (goodput pipeline)"] = sqlite(work / "sq", args.pipelines)
    if rows:
        print(f"\n{args.pipelines} tiny pipelines at once\n")
        print("| server | wall | completed | API p50 / p95 | task runs recorded / logged finished "
              "| final |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            latency = (f"{r['p50_ms']:.0f} / {r['p95_ms']:.0f} ms" if r["p50_ms"] is not None
                       else "n/a (a server per command)")
            print(f"| {name} | {r['wall_s']:.0f} s | {r['completed']}/{args.pipelines} | {latency} "
                  f"| {r['recorded']} / {r['logged']} | {r['recorded_final']} |")
        print(json.dumps(rows, indent=1))
    if "slurm" in parts:
        first = slurm(work / "slurm")
        print(f"\ntime to the first step, 2 nodes x 2 workers: Slurm {first['slurm']:.1f} s, "
              f"local {first['local']:.1f} s ({first['slurm'] / first['local']:.2f}x)")


if __name__ == "__main__":
    main()
