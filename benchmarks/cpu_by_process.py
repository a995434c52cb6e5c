"""Where a command's CPU goes, by kind of process: the command and every process it starts
(torchrun agents and workers, checkpoint verifiers, Prefect's server, ...), found by an
environment marker they inherit, so processes that outlive their parent still count.

    python benchmarks/cpu_by_process.py -- .venv/bin/python -m pytest -q tests/test_faults.py

CI is CPU-bound on 2 cores (each xdist worker keeps about one core busy), so the CPU seconds
per kind say what a test costs and what would cut it. Sampled every `--every` seconds: a
process that lives shorter than that may be missed, and each counts the CPU it had at its
last sample.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter

import psutil

KINDS = [  # (pattern in the command line, kind), first match wins
    (r"prefect server start|uvicorn", "prefect server"),
    (r"training\.checkpoint\.verify", "checkpoint verifier"),
    (r"torch\.distributed\.run|torchrun", "torchrun agent"),
    (r"-m training\.evaluate", "evaluation process"),
    (r"-m training( |$)", "torchrun worker"),
    (r"pytest|-m goodput|/goodput ", "flows and tasks (the command)"),
    (r"spawn_main|forkserver", "multiprocessing child"),
    (r"weed ", "SeaweedFS"),
    (r"postgres", "PostgreSQL"),
    (r"slurm|munged", "Slurm"),
    (r"mlflow", "MLflow"),
]


def kind_of(cmdline: str) -> str:
    for pattern, kind in KINDS:
        if re.search(pattern, cmdline):
            return kind
    return cmdline[:60] or "?"


def profile(argv: list[str], every_s: float) -> tuple[int, float, Counter, Counter]:
    marker = f"cpu-by-process-{os.getpid()}"
    command = subprocess.Popen(argv, env={**os.environ, "GOODPUT_CPU_PROFILE": marker})
    started, ours, seen = time.monotonic(), {}, {}
    while command.poll() is None:
        for process in psutil.process_iter():
            key = (process.pid, process.create_time())
            try:
                if key not in ours:
                    ours[key] = process.environ().get("GOODPUT_CPU_PROFILE") == marker
                if ours[key]:
                    cpu = process.cpu_times()
                    cmdline = seen.get(key, ("", 0.0))[0] or " ".join(process.cmdline())
                    seen[key] = (cmdline, cpu.user + cpu.system)
            except psutil.Error:
                ours.setdefault(key, False)
        time.sleep(every_s)
    seconds, count = Counter(), Counter()
    for cmdline, cpu in seen.values():
        seconds[kind_of(cmdline)] += cpu
        count[kind_of(cmdline)] += 1
    return command.returncode, time.monotonic() - started, seconds, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        parser.error("give the command to run after --")
    code, wall, seconds, count = profile(argv, args.every)
    total = sum(seconds.values())
    print(f"\nwall {wall:.0f} s, CPU {total:.0f} s ({total / wall:.2f} cores on average)")
    print("| process kind | CPU s | share | processes |\n|---|---|---|---|")
    for kind, cpu in seconds.most_common():
        print(f"| {kind} | {cpu:.1f} | {cpu / total:.0%} | {count[kind]} |")
    return code


if __name__ == "__main__":
    sys.exit(main())
