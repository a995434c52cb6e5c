"""The pipeline's evaluation in the process its train flow starts as training ends, against a
new process started when the evaluate flow asks (as every evaluation ran before).

    python benchmarks/evaluation_start.py [--pairs 4] [--config configs/tiny.yaml]
                                          [--override training.max_steps=300 ...]

Each pair runs `goodput pipeline` (flows.cli.main, Prefect's temporary server) from scratch
twice, interleaved: `started` is the code as it is; `new` the same with the train flow told
that no evaluation follows (flows.train.is_evaluation_following patched to False), so the
evaluate flow starts its process itself. From each command's log: seconds from torchrun's
end (the launch task finished) to the evaluation's end (the evaluate-checkpoint task
finished), and from the evaluate flow's start to the same end. Medians over the pairs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PIPELINE = r'''
import sys
import flows.cli as cli
import flows.train
if sys.argv[1] == "new":
    flows.train.is_evaluation_following = lambda: False
sys.exit(cli.main(["pipeline", "--config", sys.argv[2], *sys.argv[4:],
                   f"run.runs_dir={sys.argv[3]}/runs", f"data.data_dir={sys.argv[3]}/data",
                   f"storage.uri={sys.argv[3]}/store"]))
'''


def seconds_of(log: str, pattern: str) -> float:
    """The time of day (s) of the last log line matching `pattern`."""
    lines = [line for line in log.splitlines() if re.search(pattern, line)]
    if not lines:
        raise RuntimeError(f"no line matches {pattern!r} in the pipeline's log")
    hours, minutes, seconds = lines[-1][:12].split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def run_pipeline(arm: str, config: str, work: Path, overrides: list[str]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", PIPELINE, arm, config, str(work), *overrides],
                          capture_output=True, text=True, cwd=REPO)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"the {arm} pipeline failed (exit {proc.returncode}):\n{log[-3000:]}")
    evaluated = seconds_of(log, r"Task run 'evaluate-checkpoint-.*Finished in state")
    return {"arm": arm,
            "torchrun_end_to_evaluated_s": round(
                evaluated - seconds_of(log, r"Task run 'launch-training-.*Finished in state"), 2),
            "evaluate_flow_s": round(
                evaluated - seconds_of(log, r"Beginning subflow run .* for flow 'evaluate'"), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="evaluation-start-") as root:
        for pair in range(args.pairs):
            for arm in ("new", "started") if pair % 2 else ("started", "new"):
                result = run_pipeline(arm, args.config, Path(root) / arm, args.override)
                results.append({"pair": pair + 1, **result})
                print(json.dumps(results[-1]), flush=True)
    for arm in ("started", "new"):
        ours = [r for r in results if r["arm"] == arm]
        print(json.dumps({"arm": arm, "median_torchrun_end_to_evaluated_s": statistics.median(
            r["torchrun_end_to_evaluated_s"] for r in ours), "median_evaluate_flow_s":
            statistics.median(r["evaluate_flow_s"] for r in ours)}))


if __name__ == "__main__":
    main()
