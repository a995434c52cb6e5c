"""One arm of a layout benchmark: the benchmark script itself again, under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_arm(script: str, nproc: int, arm: str, out: Path) -> dict:
    """Start `script --worker --arm ARM --out OUT` (with this command's own arguments) on
    `nproc` torchrun processes of this machine, each thread-limited to its share of the
    cores; returns what rank 0 wrote to `out` as JSON."""
    from infra.torchrun import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", script,
           "--worker", "--arm", arm, "--out", str(out), *_without_nproc(sys.argv[1:])]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _without_nproc(args: list[str]) -> list[str]:
    """The command's arguments less --nproc N, which the workers do not need (their world
    tells them) and torchrun's own parser refuses even after the script's name ("ambiguous
    option: --nproc could match --nproc-per-node, --nproc_per_node")."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept
