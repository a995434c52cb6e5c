"""Chaos soak: N faults of random kinds at random steps, each in a real train flow run.

    python benchmarks/chaos_soak.py --faults 104 --seed 7 [--kinds crash,hang,nan,...]

Starts a Prefect server and a SeaweedFS (the store of every run), prepares the tiny test
dataset once and trains one uninterrupted run for reference. Then each case trains a fresh
run id of the same config under one fault, drawn with the seed:

    crash    SIGKILL of a worker (faults.crash_at_step, a random rank): torchrun's in-job restart
    hang     SIGSTOP of a worker (faults.hang_at_step): the supervisor kills the job, Prefect retries
    nan      a non-finite loss (faults.nan_at_step): rollback past the bad data window
    sigterm  a preemption (faults.sigterm_at_step): emergency checkpoint, Prefect retries
    corrupt  bytes of a shard flip right after a checkpoint's commit, before its validation,
             and a worker is killed a few steps later: the restart must not resume from it
    s3       SeaweedFS stops as the upload of a checkpoint starts and comes back after 3-15 s
    savekill SIGKILL of a worker at a random moment of a checkpoint's save (its staging, its
             write, before or right after its commit): torchrun's in-job restart
    diskfull the checkpoint directory is a tmpfs with room for 1 or 2 checkpoints and a half:
             the save that runs out of space stops the run (disk_full, never retried); space
             is freed (the tmpfs grows) and the flow is run again (needs root, for mount)
    nodeloss the run is elastic on 2 local nodes of 1 worker (parallelism.nnodes=1:2) and
             node 1's torchrun agent is killed (SIGKILL): torchrun restarts the workers in
             the job on node 0 alone (accumulation 2), with elastic.grow drawn: true starts
             node 1 again and the world grows back; no Prefect retry. Losses match the
             reference within 1e-4 relative (another summation order), not bit for bit

Kinds take turns in a seeded order, so every kind runs floor(N / kinds) times or once more.

A case has recovered when the flow completed to max_steps with every checkpoint uploaded
(except a corrupted one, which must be rejected; a copy saved again at its step is judged
on its own), and every resume point (a step the metrics go back to) was a validated
checkpoint. Losses must equal the reference run except after a
rollback, which skips data on purpose. Prints one row per case and a summary per kind;
results belong in benchmarks/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.torchrun import AGENT_MODULE  # noqa: E402
from tests.helpers import (Watcher, agents_not_hosting, committed,  # noqa: E402
                           corrupt_largest_shard)

KINDS = ("crash", "hang", "nan", "sigterm", "corrupt", "s3", "savekill", "diskfull", "nodeloss")
BUCKET = "goodput-soak"


def start_prefect_server(home: Path) -> subprocess.Popen:
    """`prefect server start` on a free port; PREFECT_API_URL of this process points at it."""
    import httpx

    from infra.torchrun import free_port

    url = f"http://127.0.0.1:{free_port()}"
    os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=f"{url}/api",
                      PREFECT_SERVER_ANALYTICS_ENABLED="false")
    prefect = str(Path(sys.executable).with_name("prefect"))
    host, port = url.removeprefix("http://").split(":")
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([prefect, "server", "start", "--host", host, "--port", port],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited: {(home / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("prefect server not healthy after 120 s")


def stop_process_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ledger_entries(config) -> dict:
    from storage.ledger import Ledger

    return Ledger(config.run_dir).read().entries


def resume_points(run_dir: Path) -> list[int]:
    """The checkpoints training resumed from: where a new attempt starts, or where the steps
    go back (an in-job restart)."""
    from training.metrics import read_metrics

    points, last, attempt = [], 0, None
    for m in read_metrics(run_dir):
        if m["step"] != last + 1 or (attempt is not None and m["attempt"] != attempt):
            points.append(m["step"] - 1)
        last, attempt = m["step"], m["attempt"]
    return points


def recovery_s(run_dir: Path) -> float:
    """The longest pause between two logged steps: for a fault that stopped training, the
    time from the last step before it to the first step after the recovery."""
    from training.metrics import read_metrics

    times = [m["time"] for m in read_metrics(run_dir)]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def worker_pids(config) -> dict[int, int]:
    """The training workers of `config`'s run on this machine, by global rank (from each
    process's command line and environment; torchrun's agents are left out)."""
    config_file = str(config.run_dir.config_file.resolve())
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if config_file.encode() not in cmdline or AGENT_MODULE.encode() in cmdline:
                continue
            environ = dict(line.split(b"=", 1) for line in (entry / "environ").read_bytes().split(b"\0")
                           if b"=" in line)
        except OSError:
            continue
        if b"RANK" in environ:
            pids[int(environ[b"RANK"])] = int(entry.name)
    return pids


def kill_a_node(config) -> list[int]:
    """SIGKILL the torchrun agents of the run's nodes that do not host the rendezvous (node
    1 here); their workers die with them (training.__main__.die_with_agent)."""
    killed = agents_not_hosting(config)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    if not killed:
        raise RuntimeError("no node 1 agent to kill")
    return killed


def trained_to(config, step: int) -> bool:
    from core.protocol import read_heartbeat

    return ((read_heartbeat(config.run_dir) or {}).get("step") or 0) >= step


def save_started(config, step: int) -> bool:
    """Rank 0 announced the save of `step` (its heartbeat, written just before the save)."""
    from core.protocol import read_heartbeat

    beat = read_heartbeat(config.run_dir) or {}
    return beat.get("phase") == "checkpoint" and beat.get("step") == step


def save_phase(path: Path) -> str:
    """How far the save at `path` had come: writing (no .metadata yet), before the commit,
    or committed (and not yet judged)."""
    if (path / "manifest.json").is_file():
        return "after commit"
    return "before commit" if (path / ".metadata").is_file() else "staging/writing"


def kill_during_save(config, step: int, rank: int, delay_s: float) -> str:
    time.sleep(delay_s)
    pid = worker_pids(config)[rank]
    phase = save_phase(config.run_dir.checkpoint(step))
    os.kill(pid, signal.SIGKILL)
    return phase


def mount_tmpfs(path: Path, size: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                   capture_output=True, text=True)


def run_case(i: int, kind: str, rng: random.Random, make_config, steps: int, every: int,
             server, clean: dict[int, float], checkpoint_bytes: int, workdir: Path) -> dict:
    from flows.train import train
    from goodput.runs import read_outcomes, read_summary
    from tests.helpers import losses_by_step

    at = rng.randint(every + 1, steps - 2)  # a checkpoint exists before the fault
    rank = rng.randint(0, 1)
    overrides = [f"run.run_id=soak-{i:02d}-{kind}"]
    fault = None
    detail = f"step {at}"
    if kind == "crash":
        overrides += [f"faults.crash_at_step={at}", f"faults.crash_rank={rank}"]
        detail += f", rank {rank}"
    elif kind == "hang":
        overrides += [f"faults.hang_at_step={at}", f"faults.crash_rank={rank}", "run.hang_min_s=4"]
        detail += f", rank {rank}"
    elif kind == "nan":
        overrides += [f"faults.nan_at_step={at}"]
    elif kind == "sigterm":
        overrides += [f"faults.sigterm_at_step={at}"]
    elif kind == "nodeloss":
        grow = rng.choice([True, False])
        overrides += ["parallelism.nnodes=1:2", "parallelism.nproc_per_node=1",
                      "elastic.wait_for_replacement_s=3", f"elastic.grow={str(grow).lower()}"]
        detail += f", grow {str(grow).lower()}"
    ckpt = -(-at // every) * every  # the first checkpoint from `at` on
    if kind == "corrupt":
        ckpt = ckpt - every if ckpt >= steps else ckpt  # a crash must come after it
        crash = ckpt + rng.randint(1, every - 1)
        overrides += [f"faults.crash_at_step={crash}", f"faults.crash_rank={rank}"]
    if kind == "savekill":
        ckpt = rng.randrange(every, steps, every)  # a periodic save, not the final one
        delay_s = rng.uniform(0.0, 0.6)  # the tiny model's background save takes 0.1-0.5 s
    config = make_config(*overrides)
    disk = None
    if kind == "savekill":
        fault = Watcher(lambda: save_started(config, ckpt),
                        lambda: kill_during_save(config, ckpt, rank, delay_s), timeout_s=900)
        detail = f"checkpoint {ckpt} + {delay_s:.2f}s, rank {rank}"
    elif kind == "nodeloss":
        fault = Watcher(lambda: trained_to(config, at), lambda: kill_a_node(config), timeout_s=900)
    elif kind == "diskfull":
        room = rng.choice([1, 2])  # checkpoints that fit before a save runs out of space
        disk = workdir / f"disk-{i:02d}"
        detail = f"room for {room}.5 checkpoints"
    if kind == "corrupt":
        fault = Watcher(lambda: committed(config, ckpt),
                        lambda: corrupt_largest_shard(config.run_dir.checkpoint(ckpt)), timeout_s=900)
        detail = f"checkpoint {ckpt}, crash at {crash}"
    elif kind == "s3":
        down_s = rng.uniform(3, 15)
        detail = f"checkpoint {ckpt}, down {down_s:.1f}s"

        def outage() -> float:
            started = time.monotonic()
            server.stop(grace=0)
            time.sleep(down_s)
            server.start(same_ports=True)
            return time.monotonic() - started

        # The upload task starts right after validation: stop the store as it does.
        fault = Watcher(lambda: getattr(ledger_entries(config).get(ckpt), "state", None) == "validated",
                        outage, timeout_s=900)
    shutil.rmtree(config.run_dir, ignore_errors=True)
    if disk is not None:
        mount_tmpfs(disk, int(checkpoint_bytes * (room + 0.5)))
        config.run_dir.path.mkdir(parents=True)
        config.run_dir.checkpoints.symlink_to(disk, target_is_directory=True)

    started = time.monotonic()
    if fault is not None:
        fault.start()
    error = None
    try:
        result = train(config)
    except Exception as e:  # a case that did not recover is a result, not a crash of the soak
        result, error = {}, f"{type(e).__name__}: {e}"
    if disk is not None:
        # The run stopped on the full disk, not retried; someone frees space and reruns it.
        if error is None or "disk_full" not in error:
            error = f"expected the run to stop on a full disk, got: {error or 'it finished'}"
        else:
            error = None
            subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
            try:
                result = train(config)
            except Exception as e:
                result, error = {}, f"after freeing space: {type(e).__name__}: {e}"
    if fault is not None:
        fault.join(timeout=120)
        if fault.error is not None:
            error = error or f"fault not injected: {fault.error}"
        elif kind == "savekill":
            detail += f", hit {fault.result}"
    wall = time.monotonic() - started

    outcomes = read_outcomes(config)
    entries = ledger_entries(config)
    # A corrupted copy is rejected; training that passes its step again saves a new copy,
    # which is judged on its own (the entry's history keeps the rejection).
    rejected = {s for s, e in entries.items() if any(h.state == "rejected" for h in e.history)}
    good = {s for s, e in entries.items() if e.state in ("validated", "uploaded")}
    points = resume_points(config.run_dir)
    problems = []
    if error:
        problems.append(error)
    if result.get("final_step") != steps:
        problems.append(f"final step {result.get('final_step')}")
    expected_rejected = {ckpt} if kind == "corrupt" else set()
    if rejected != expected_rejected:
        problems.append(f"rejected {sorted(rejected)}")
    not_uploaded = [s for s, e in entries.items() if e.state not in ("uploaded", "rejected")]
    if not_uploaded:
        problems.append(f"not uploaded {not_uploaded}")
    bad_points = [p for p in points if p and p not in good]
    if bad_points:
        problems.append(f"resumed from unvalidated {bad_points}")
    losses = losses_by_step(config.run_dir) if (config.run_dir / "metrics.jsonl").is_file() else {}
    if kind == "nan":
        losses_match = "n/a (data skipped)"
    elif kind == "nodeloss":  # accumulation 2 on one worker: another summation order
        close = sorted(losses) == sorted(clean) and all(
            abs(losses[s] - clean[s]) <= 1e-4 * abs(clean[s]) for s in clean)
        losses_match = "within 1e-4" if close else "NO"
        if not close:
            problems.append("losses differ from the reference run by more than 1e-4")
    else:
        losses_match = "yes" if losses == clean else "NO"
        if losses != clean:
            problems.append("losses differ from the reference run")
    goodput = read_summary(config.run_dir).get("goodput", {})
    if disk is not None:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    return {"case": i, "kind": kind, "fault": detail,
            "attempts": "+".join(o["class"] for o in outcomes),
            "in_job_restarts": sum(o.get("restarts", 0) for o in outcomes),
            "resumed_from": points, "recovered": not problems, "problems": problems,
            "losses_match": losses_match, "goodput": goodput.get("goodput"),
            "lost_work_s": goodput.get("lost_work_s"), "recovery_s": recovery_s(config.run_dir),
            "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8, help="cases to run (default 8)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {KINDS}")
    parser.add_argument("--steps", type=int, default=30, help="training steps per case")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--max-restarts", type=int, default=1, help="launch.max_restarts")
    parser.add_argument("--workdir", type=Path, help="keep runs here (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. a "
                        "larger model: model.dim=256 model.n_layers=4 (default: the test suite's "
                        "tiny model, whose steps are short next to fixed costs)")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prefect").mkdir(exist_ok=True)
    prefect_server = start_prefect_server(workdir / "prefect")
    from infra.seaweedfs import REGION, SeaweedFS

    key, secret = "soak-" + secrets.token_hex(4), secrets.token_urlsafe(24)
    os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_DEFAULT_REGION=REGION)
    s3 = SeaweedFS(workdir / "seaweedfs", access_key=key, secret_key=secret, bucket=BUCKET)
    s3.start()
    try:
        from flows.prepare import prepare
        from flows.train import train
        from tests.helpers import losses_by_step, small_config

        def make_config(*overrides: str):
            """The test suite's small model and run (tests/helpers.py), stored in SeaweedFS."""
            return small_config(workdir, f"storage.uri=s3://{BUCKET}/soak",
                                f"storage.endpoint_url={s3.endpoint_url}",
                                f"training.max_steps={args.steps}",
                                f"checkpoint.every_steps={args.every}",
                                f"launch.max_restarts={args.max_restarts}", *args.overrides,
                                *overrides)

        print(f"soak in {workdir}: {args.faults} faults, seed {args.seed}, kinds {kinds}, "
              f"overrides {args.overrides}", flush=True)
        started = time.monotonic()
        prepare(make_config())
        reference = make_config("run.run_id=soak-reference")
        shutil.rmtree(reference.run_dir, ignore_errors=True)
        train(reference)
        clean = losses_by_step(reference.run_dir)
        from goodput.runs import read_summary

        reference_goodput = read_summary(reference.run_dir)["goodput"]["goodput"]
        checkpoint_bytes = sum(f.stat().st_size for f in reference.run_dir.checkpoint(args.every).iterdir())
        print(f"reference run: goodput {reference_goodput:.3f} "
              f"({time.monotonic() - started:.0f}s with the dataset)", flush=True)

        rng = random.Random(args.seed)
        order = [kinds[i % len(kinds)] for i in range(args.faults)]  # the kinds take turns
        rng.shuffle(order)
        rows = []
        for i, kind in enumerate(order):
            row = run_case(i, kind, rng, make_config, args.steps, args.every, s3, clean,
                           checkpoint_bytes, workdir)
            rows.append(row)
            print(f"case {i}: {kind} ({row['fault']}): attempts {row['attempts']}, in-job restarts "
                  f"{row['in_job_restarts']}, resumed from {row['resumed_from']}, recovered "
                  f"{row['recovered']} {row['problems'] or ''}, goodput {_fmt(row['goodput'])}, "
                  f"{row['wall_s']:.0f}s", flush=True)
    finally:
        s3.stop()
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all()  # deliver queued logs and events while the server is up
        EventsWorker.drain_all()
        stop_process_group(prefect_server)

    print_tables(rows, reference_goodput)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0 if all(r["recovered"] for r in rows) else 1


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def print_tables(rows: list[dict], reference_goodput: float) -> None:
    def relative(r) -> str:
        return "–" if r["goodput"] is None else f"{r['goodput'] / reference_goodput:.2f}"

    print("\n| case | kind | fault | attempts | in-job restarts | resumed from | recovered | "
          "losses = reference | goodput | vs reference | lost work (s) | longest pause (s) | "
          "wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kind']} | {r['fault']} | {r['attempts']} | {r['in_job_restarts']} "
              f"| {', '.join(map(str, r['resumed_from'])) or '–'} | "
              f"{'yes' if r['recovered'] else 'NO: ' + '; '.join(r['problems'])} | {r['losses_match']} "
              f"| {_fmt(r['goodput'])} | {relative(r)} | {_fmt(r['lost_work_s'])} "
              f"| {r['recovery_s']:.1f} | {r['wall_s']:.0f} |")
    print(f"\nreference run (no fault): goodput {reference_goodput:.3f}\n")
    print("| kind | ran | recovered | goodput per case (vs reference) | longest pause per case (s) |")
    print("|---|---|---|---|---|")
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            per_case = ", ".join(f"{_fmt(r['goodput'])} ({relative(r)})" for r in mine)
            pauses = ", ".join(f"{r['recovery_s']:.1f}" for r in mine)
            print(f"| {kind} | {len(mine)} | {sum(r['recovered'] for r in mine)} | {per_case} "
                  f"| {pauses} |")


if __name__ == "__main__":
    sys.exit(main())
