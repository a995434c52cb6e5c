"""Shrink and train on, or wait for a replacement node? Measured small, modelled at scale.

    python benchmarks/elastic_bench.py [--steps 40] [--lose-at 10] [--replacement-s 30]

Measured: the tiny model on 2 local torchrun nodes x 2 workers (the local launcher, real
agents). Node 1's agent is killed once the checkpoint of step --lose-at is committed:

    shrink  parallelism.nnodes=1:2: torchrun's rendezvous restarts node 0's workers in the
            job on world 2 (accumulation 2); the run finishes there
    wait    parallelism.nnodes=2: the attempt fails as node_lost; the replacement takes
            --replacement-s, then a new attempt resumes on 2 nodes from the checkpoint

Each prints its wall time, the restart it paid (from the loss to the first step after it)
and its goodput (the step time the final model contains over the wall time; measured
capacity-weighted: a step on 2 of 4 workers counts as half the capacity it held).

Modelled (goodput.elastic_plan): the same choice for Llama 3 405B's pretraining (16,384 GPUs
as 2,048 nodes of 8; 419 interruptions in 54 days, all taken as node losses) for
replacement times of 10 min, 1 h and 4 h and restart costs of 2, 5 and 10 min, with the
replacement time where the policy's choice flips.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.protocol import ResumeSpec  # noqa: E402
from goodput.elastic_plan import NodeLosses, advice, flip_replacement_s  # noqa: E402
from goodput.runs import write_run_config  # noqa: E402
from infra.torchrun import run_attempt  # noqa: E402
from tests.helpers import (agents_not_hosting, committed, small_config,  # noqa: E402
                           synthetic_dataset)
from training.metrics import read_metrics  # noqa: E402


def lose_a_node_at(config, step: int, lost: dict) -> threading.Thread:
    def watch():
        while not committed(config, step):
            time.sleep(0.02)
        pids = agents_not_hosting(config)
        lost["time"] = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def measured_goodput(config, wall_s: float, full_world: int) -> float:
    """Step time the final model contains, weighted by the share of the workers it ran on,
    over the wall time."""
    last: dict[int, tuple[float, int]] = {}
    for record in read_metrics(config.run_dir):
        last[record["step"]] = (record["step_time_s"], record.get("world_size", full_world))
    return sum(t * world / full_world for t, world in last.values()) / wall_s


def first_step_after(config, moment: float) -> float:
    """When the first step after `moment` was logged (metrics records carry a time)."""
    times = [r["time"] for r in read_metrics(config.run_dir) if r.get("time", 0) > moment]
    return min(times) if times else float("nan")


def run(policy: str, root: Path, dataset: Path, steps: int, lose_at: int, replacement_s: float,
        log) -> dict:
    common = (f"training.max_steps={steps}", "training.warmup_steps=2", "checkpoint.every_steps=5",
              "run.hang_min_s=120", "parallelism.nproc_per_node=2", f"run.run_id={policy}",
              "launch.max_restarts=2", "elastic.wait_for_replacement_s=3", "elastic.grow=false")
    nodes = "parallelism.nnodes=1:2" if policy == "shrink" else "parallelism.nnodes=2"
    config = small_config(root / policy, *common, nodes)
    path, lost = write_run_config(config), {}
    started = time.time()
    watcher = lose_a_node_at(config, lose_at, lost)
    result = run_attempt(config, path, dataset, "a1", log, poll_s=0.2,
                         start=ResumeSpec.newest_committed())
    watcher.join(timeout=60)
    attempts = [result.failure_class.value]
    if policy == "wait":
        time.sleep(replacement_s)  # the replacement node comes up; then the job starts again
        result = run_attempt(config, path, dataset, "a2", log, poll_s=0.2,
                             start=ResumeSpec.newest_committed())
        attempts.append(result.failure_class.value)
    wall = time.time() - started
    restart = first_step_after(config, lost["time"]) - lost["time"] - (
        replacement_s if policy == "wait" else 0.0)
    return {"policy": policy, "attempts": attempts, "wall_s": wall, "restart_s": restart,
            "goodput": measured_goodput(config, wall, config.parallelism.world_size),
            "final_step": result.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lose-at", type=int, default=10)
    parser.add_argument("--replacement-s", type=float, default=30.0)
    parser.add_argument("--model-only", action="store_true", help="skip the measured runs")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    measured = []
    if not args.model_only:
        root = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
        dataset = synthetic_dataset(root / "dataset")
        for policy in ("shrink", "wait"):
            row = run(policy, root, dataset, args.steps, args.lose_at, args.replacement_s,
                      log=lambda line: None)
            measured.append(row)
        print(f"measured: 2 local nodes x 2 workers, tiny model, {args.steps} steps, node 1 "
              f"lost after step {args.lose_at}, replacement {args.replacement_s:.0f}s")
        print("| policy | attempts | wall (s) | restart (s) | goodput |")
        print("|---|---|---:|---:|---:|")
        for row in measured:
            print(f"| {row['policy']} | {' -> '.join(row['attempts'])} | {row['wall_s']:.1f} | "
                  f"{row['restart_s']:.1f} | {row['goodput']:.3f} |")
        shrink = next(r for r in measured if r["policy"] == "shrink")
        small = NodeLosses(2, mtbf_s=shrink["wall_s"], replacement_s=args.replacement_s,
                           restart_s=shrink["restart_s"])
        print(f"model at this scale (one loss per run, restart {shrink['restart_s']:.1f}s): "
              f"waiting pays off for replacements under {flip_replacement_s(small):.1f}s")

    mtbf = 54 * 86400 / 419
    print(f"\nmodelled: Llama 3 405B, 2,048 nodes x 8 GPUs, a node lost every {mtbf / 3600:.2f} h "
          "(419 in 54 days), checkpoint every 30 min")
    print("| replacement | restart | goodput waiting | goodput shrinking | "
          "elastic.wait_for_replacement_s=30 | better | waiting pays off below |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for replacement in (600, 3600, 14400):
        for restart in (120, 300, 600):
            plan = advice(NodeLosses(2048, mtbf, replacement, restart, 1800), wait_s=30)
            print(f"| {replacement / 60:.0f} min | {restart / 60:.0f} min | "
                  f"{plan['goodput_waiting']:.3f} | {plan['goodput_shrinking']:.3f} | "
                  f"{plan['goodput_configured']:.3f} | {plan['better']} | "
                  f"{plan['flip_replacement_s'] / 60:.1f} min |")


if __name__ == "__main__":
    main()
