"""Where a prepare's tokenizing time goes: its work units' timeline from Prefect's own records.

    PREFECT_HOME=/tmp/ph goodput prepare ...              # the prepare to look at
    python benchmarks/prepare_timeline.py /tmp/ph         # then this, on that PREFECT_HOME

Reads the temporary server's database (PREFECT_HOME/prefect.db) and prints, for the newest
`tokenize-units` flow run: when its first unit started after the flow run began, the units'
own time, the gaps between a unit's end and the next unit's start, the tail after the last
unit, and how busy the pool was (the units' time over workers x the flow run's span). Prints
one JSON object. The units' task runs run on threads of the flow's process and start at once;
the first ones' time includes their processes' start (forked from the fork server, which may
still be importing the library). Until 30 Nov (fifteenth session), Prefect's process pool ran
them, and the first start was the processes' start (spawn, imports, the task engine).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
from datetime import datetime
from pathlib import Path


def seconds(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def timeline(prefect_home: Path) -> dict:
    db = sqlite3.connect(f"file:{prefect_home / 'prefect.db'}?mode=ro", uri=True)
    flow = db.execute("SELECT id, start_time, end_time FROM flow_run"
                      " WHERE flow_id IN (SELECT id FROM flow WHERE name = 'tokenize-units')"
                      " AND start_time IS NOT NULL AND end_time IS NOT NULL"
                      " ORDER BY start_time DESC LIMIT 1").fetchone()
    if flow is None:
        raise SystemExit(f"no finished tokenize-units flow run in {prefect_home / 'prefect.db'}")
    flow_id, began, ended = flow[0], seconds(flow[1]), seconds(flow[2])
    units = sorted((seconds(s), seconds(e)) for s, e in db.execute(
        "SELECT start_time, end_time FROM task_run WHERE flow_run_id = ? AND name LIKE 'tokenize-unit-%'"
        " AND start_time IS NOT NULL AND end_time IS NOT NULL", (flow_id,)))
    if not units:
        raise SystemExit("the tokenize-units flow run has no finished units")
    # Each unit after the first `workers` starts when a worker is free: pair it with the end it
    # followed (the earliest end before its start not yet taken by an earlier start).
    starts = sorted(s for s, _ in units)
    ends = sorted(e for _, e in units)
    workers = max(sum(1 for s, e in units if s <= t < e) for t in starts)
    free, gaps = list(ends), []
    for start in starts[workers:]:
        before = [e for e in free if e <= start]
        if before:
            end = min(before)
            free.remove(end)
            gaps.append(start - end)
    busy = sum(e - s for s, e in units)
    span = ended - began
    return {"units": len(units), "workers": workers, "flow_run_s": span,
            "first_unit_start_s": starts[0] - began,
            "first_wave_last_start_s": starts[min(workers, len(starts)) - 1] - began,
            "unit_s": {"median": statistics.median(e - s for s, e in units),
                       "min": min(e - s for s, e in units), "max": max(e - s for s, e in units)},
            "handoff_gap_s": {"median": statistics.median(gaps) if gaps else None,
                              "max": max(gaps) if gaps else None, "count": len(gaps)},
            "tail_s": ended - max(ends),
            "pool_busy": busy / (workers * span)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefect_home", type=Path)
    args = parser.parse_args()
    print(json.dumps(timeline(args.prefect_home), indent=1))


if __name__ == "__main__":
    main()
