"""Small real inputs the tests build for themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from core.config import RunConfig, load_config
from core.files import sha256_file
from storage.manifests import DatasetManifest, ShardInfo
from storage.shards import write_shard

REPO = Path(__file__).resolve().parents[1]


# `python -c` this with a goodput command's arguments: the command in a fresh process, then
# which heavy modules it imported on the way ("imported: [...]").
COMMAND_THEN_MODULES = (
    "import sys, flows.cli\n"
    "rc = flows.cli.main(sys.argv[1:])\n"
    "print('imported:', sorted(m for m in ('prefect', 'torch', 'datasets', 'transformers') "
    "if m in sys.modules))\n"
    "sys.exit(rc)\n")


def synthetic_dataset(directory: Path, vocab_size: int = 256, docs_per_shard: int = 200) -> Path:
    """A tokenized dataset of learnable counting sequences, in the real shard format."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, n_shards in (("train", 2), ("validation", 1)):
        infos = []
        for i in range(n_shards):
            docs = [((np.arange(rng.integers(40, 120)) + rng.integers(0, vocab_size)) % (vocab_size - 1)
                     + 1).tolist() + [0] for _ in range(docs_per_shard)]
            path = directory / f"{split}-{i:05d}.arrow"
            n_tokens, n_docs = write_shard(path, docs, "uint16")
            infos.append(ShardInfo(path=path.name, n_tokens=n_tokens, n_docs=n_docs,
                                   size=path.stat().st_size, sha256=sha256_file(path)))
        splits[split] = infos
    DatasetManifest(dataset_id="synthetic", source="counting sequences", tokenizer="tokenizer.json",
                    tokenizer_sha256="", vocab_size=vocab_size, eos_id=0, dtype="uint16",
                    splits=splits, created_at=time.time()).save(directory)
    return directory


def small_config(tmp_path: Path, *overrides: str) -> RunConfig:
    """A model and run small enough for a test: seconds per training stage on 2 cores."""
    return load_config(None, [
        f"run.runs_dir={tmp_path / 'runs'}", "run.run_id=test", "run.retry_delay_s=0",
        f"data.data_dir={tmp_path / 'data'}", f"storage.uri={tmp_path / 'store'}",
        "data.max_docs=400", "data.shard_tokens=32768", "data.validation_fraction=0.1",
        "tokenizer.vocab_size=512",
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
        "training.seq_len=64", "training.micro_batch_size=4", "training.max_steps=30",
        "training.warmup_steps=3", "checkpoint.every_steps=10", "eval.max_batches=5",
        # Synchronous saves: tests that crash right after a checkpoint step assert which
        # checkpoint the retry resumes from (async saves are tested on their own).
        "checkpoint.async_mode=sync",
        # Crashes go to the launch task's retry (what most fault tests assert); tests of
        # torchrun's in-job restarts turn them on with launch.max_restarts=1.
        "launch.max_restarts=0",
        "eval.num_samples=2", "eval.sample_tokens=8", *overrides])


def torchrun_training(config: RunConfig, dataset_dir: Path, resume: str = "auto") -> subprocess.CompletedProcess:
    """Plain torchrun, no orchestrator: the path users take when debugging."""
    from goodput.runs import write_run_config
    from infra.torchrun import free_port

    config_path = write_run_config(config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "training",
           "--config", str(config_path), "--dataset", str(dataset_dir), "--resume", resume]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Per-step training loss; where a step ran twice (after a resume), the later one."""
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def flip_bytes(path: Path, count: int = 1) -> None:
    """Invert `count` bytes in the middle of a file, in place: damage a checksum catches."""
    middle = path.stat().st_size // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        data = f.read(count)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))


def corrupt_largest_shard(checkpoint_dir: Path) -> str:
    """Damage 64 bytes of a checkpoint's largest shard file (with AdamW, a training-state
    file: the optimizer's moments are twice the weights); its name."""
    shard = max(checkpoint_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    flip_bytes(shard, 64)
    return shard.name


def committed(config: RunConfig, step: int) -> bool:
    """The checkpoint of `step` has its manifest: training committed it."""
    return (config.run_dir.checkpoint(step) / "manifest.json").is_file()


class Watcher(threading.Thread):
    """Runs `act` once `ready()` holds (polled every 20 ms) while the flow runs in the test's
    thread; `act`'s result or error is kept for the test to check."""

    def __init__(self, ready: Callable[[], bool], act: Callable[[], object], timeout_s: float = 600):
        super().__init__(daemon=True)
        self.ready, self.act, self.timeout_s = ready, act, timeout_s
        self.result, self.error = None, None

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            while not self.ready():
                if time.monotonic() > deadline:
                    raise TimeoutError("the watcher's condition never held")
                time.sleep(0.02)
            self.result = self.act()
        except BaseException as e:  # reported by check()
            self.error = e

    def check(self):
        self.join(timeout=120)
        if self.error is not None:
            raise self.error
        return self.result


def imported_here(module: str) -> bool:
    """Whether this process has imported `module` (asked of another process, by pickle)."""
    return module in sys.modules


class RebuiltNowhereElse:
    """An argument that pickles here and cannot be rebuilt in another process."""

    def __reduce__(self):
        return _refuse_to_be_rebuilt, ()


def _refuse_to_be_rebuilt():
    raise RuntimeError("this argument cannot be rebuilt in another process")


def thread_nice() -> int:
    """The calling thread's nice value (Linux keeps one per thread; core.cpu_priority)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def task_runs_of(flow_run_id, *named: str, timeout_s: float = 30.0) -> dict[str, object]:
    """The flow run's task runs by task name (names are `<task>-<suffix>`). With `named`,
    once the API has those task runs and every task run it has is final: task runs and their
    states reach the API as events, which its recorder may not have stored yet (a busy
    machine: seconds after the flow run ended)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    def read() -> dict[str, object]:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return {run.name.rsplit("-", 1)[0]: run for run in runs}

    def settled() -> dict[str, object] | None:
        runs = read()
        final = all(run.state and run.state.is_final() for run in runs.values())
        return runs if set(named) <= set(runs) and final else None

    if not named:
        return read()
    return wait_for(settled, timeout_s, f"task runs {', '.join(named)} recorded final", every_s=0.5)


def wait_for(probe, timeout_s: float, what: str, every_s: float = 1.0):
    """`probe()`'s first truthy value, asked every `every_s` (TimeoutError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"no {what} after {timeout_s:.0f}s")


def logs_of(*flow_run_ids) -> list[str]:
    """The log lines the API has of these flow runs (logs arrive in batches: wait_for them)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    runs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(flow_run_ids)))
    lines: list[str] = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(runs, limit=200, offset=len(lines)):
            lines += [log.message for log in page]
    return lines


def subflow_runs(parent) -> dict[str, object]:
    """The child flow runs of `parent` by flow name (prepare, train, evaluate)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])))
        return {client.read_flow(run.flow_id).name: run for run in runs}


def stop_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a CLI's process group and every process below it, wherever it went (`serve`
    ignores SIGTERM; torchrun and its workers run in sessions of their own), then reap it."""
    from infra.launchers import descendants

    tree = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def spawn_ranks(worker, world: int, *args, timeout_s: float = 180) -> dict[int, object]:
    """Run `worker(rank, world, *args, port, results)` in `world` spawned processes that form
    one process group on a free port; each puts (rank, its result) on `results`. Returns the
    results by rank, once every process exited cleanly."""
    import torch.multiprocessing as mp

    from infra.torchrun import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, *args, port, results))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout_s)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return dict(results.get() for _ in range(world))


def agents_not_hosting(config: RunConfig) -> list[int]:
    """The pids of the run's torchrun agents other than node 0's (those started with
    PET_RDZV_CONF=is_host=0), found in /proc."""
    from infra.torchrun import AGENT_MODULE

    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (AGENT_MODULE.encode() in cmdline and str(config.run_dir.path).encode() in cmdline
                and any(e.startswith(b"PET_RDZV_CONF=is_host=0") for e in environ)):
            found.append(int(entry.name))
    return found

