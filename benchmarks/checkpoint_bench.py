"""What a checkpoint costs the training loop: synchronous `dcp.save` against `dcp.async_save`
(thread and process executors, with and without a reused stager) and against the trainer's
own Checkpointer (background staging, files hashed as written, the writer at nice 19; as
controls, at normal priority and with DCP's own writer), the step-time slowdown while a save
is written in the background, and the time from process start to the first training step
when resuming.

    python benchmarks/checkpoint_bench.py [--layout ddp|fsdp] [--saves 3] [--dir DIR] [--modes M ...]

The driver launches `torchrun --nproc-per-node 2` (gloo, CPU, OMP_NUM_THREADS=1 per worker)
on a ~100M-parameter `training.model.Transformer` with AdamW state, then fresh torchrun jobs
that resume from a checkpoint it left, and prints markdown tables for benchmarks/RESULTS.md.
All ratios come from one run. A benchmark, not a test: nothing here asserts a target.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

STARTED = time.time()  # before torch is imported: the resume timeline counts imports too

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.checkpoint.reader import load_all_tensors  # noqa: E402
from training.model import ModelArgs, Transformer  # noqa: E402

IMPORTED = time.time()

# ~100M parameters: 12 layers of width 640 (10 heads of 64) and a 32k vocabulary.
MODEL = ModelArgs(vocab_size=32000, dim=640, n_layers=12, n_heads=10, max_seq_len=128)
PROBE = "model.tok_embeddings.weight"  # the tensor whose saved value is checked against a snapshot


# == inside the torchrun workers =================================================================

class Trainer:
    """The model, AdamW and a fixed batch, built as the trainer builds them (on the meta device,
    laid out by training.parallelize, AdamW from training.train); `step()` is one training step
    (forward, backward, gradient all-reduce or reduce-scatter, optimizer update). `fresh`:
    draw initial weights; else allocate only, for a checkpoint to fill (as a resume does)."""

    def __init__(self, layout: str, micro_batch: int, seq_len: int, fresh: bool = True):
        from core.config import ParallelismConfig, TrainingConfig
        from training.parallelize import parallelize
        from training.train import build_optimizer

        degrees = {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 1} if layout == "ddp" \
            else {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
        par_cfg = ParallelismConfig(device="cpu", **{k: v for k, v in degrees.items() if k != "pp"})
        with torch.device("meta"):
            model = Transformer(MODEL)
        self.wrapped = parallelize(model, par_cfg, degrees, torch.device("cpu"), None,
                                   seed=0 if fresh else None).model_parts[0]
        self.model = getattr(self.wrapped, "module", self.wrapped)  # DDP's inner module
        self.optimizer = build_optimizer(self.wrapped, TrainingConfig(lr=1e-4), torch.device("cpu"))
        g = torch.Generator().manual_seed(dist.get_rank())
        self.tokens = torch.randint(0, MODEL.vocab_size, (micro_batch, seq_len + 1), generator=g)

    def step(self, before_update=None) -> float:
        """One step; `before_update` runs between backward and the optimizer update (the last
        moment a background copy of the weights can still be finishing). Returns seconds,
        without the time `before_update` took (the caller counts that as blocking)."""
        start = time.perf_counter()
        self.wrapped(self.tokens[:, :-1], self.tokens[:, 1:]).backward()
        waited = 0.0
        if before_update is not None:
            t = time.perf_counter()
            before_update()
            waited = time.perf_counter() - t
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start - waited

    def state(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def probe(self) -> torch.Tensor:
        """A copy of the full embedding weight (a collective under FSDP)."""
        weight = self.model.tok_embeddings.weight
        return (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).detach().clone()


def cpu_clock() -> tuple[float, float]:
    """(CPU seconds of the calling thread, CPU seconds of everything else of this rank: its
    other threads and its live child processes, such as the process executor's writer).

    What a background save costs in CPU is what training loses when the cores are busy
    with training, as they are here; wall times alone would hide it behind other load.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    mine = time.thread_time()
    return mine, usage.ru_utime + usage.ru_stime - mine + _children_cpu()


def _children_cpu() -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # exited meanwhile
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def all_done(future) -> bool:
    """True once every rank's save finished; all ranks must agree, or DDP's next all-reduce
    would pair different steps."""
    return all_ranks(future.done())


def all_ranks(flag: bool) -> bool:
    agreed = torch.tensor([int(flag)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def cpu_stager(shared: bool = False, background: bool = False):
    """A DefaultStager for CPU tensors. Its defaults are for GPUs: non-blocking copies raise
    without an accelerator, and pinned memory is ignored (with a warning). Kept across saves,
    it reuses its staging buffers instead of allocating them anew each time."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=shared,
                                        use_async_staging=background, use_non_blocking_copy=False))


def save_modes() -> dict:
    """name -> None for a synchronous dcp.save; ("dcp", dcp.async_save options, a factory for
    the stager kept across that mode's saves, or None for async_save's own per-save stager);
    or ("trainer", checkpoint.async_mode, background priority, DCP's writer, whole state): the
    trainer's own saver (training.checkpoint.saving); the save counts as done once committed (its manifest written).
    The Saver at normal priority is the control arm for its background priority; the one
    with DCP's own write (torch.save computes its zip CRCs, and rank 0 hashes every file for
    the manifest after the write), for ShardWriter (no CRCs, each rank hashes as it writes);
    the one where every rank stages the whole state it holds (and DCP's dedup then picks the
    writer of each replicated tensor), for each rank staging only its share."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    process = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}

    def trainer(async_mode, background=True, dcp_writer=False, whole_state=False):
        return ("trainer", async_mode, background, dcp_writer, whole_state)

    return {
        "sync": None,
        "async thread": ("dcp", {}, None),
        "async thread, kept stager": ("dcp", {}, cpu_stager),
        "async thread, background staging": ("dcp", {}, lambda: cpu_stager(background=True)),
        "async process": ("dcp", process, None),
        # Shared memory: the staged tensors reach the writer process as handles, not bytes.
        "async process, kept shm stager": ("dcp", process, lambda: cpu_stager(shared=True)),
        "trainer sync, DCP's writer": trainer("sync", background=False, dcp_writer=True),
        "trainer sync": trainer("sync", background=False),
        "trainer thread, normal priority, DCP's writer": trainer("thread", background=False,
                                                                 dcp_writer=True),
        "trainer thread, nice 19, DCP's writer": trainer("thread", dcp_writer=True),
        "trainer thread, nice 19, whole state staged": trainer("thread", whole_state=True),
        "trainer thread, nice 19": trainer("thread"),
        "trainer process, nice 19, whole state staged": trainer("process", whole_state=True),
        "trainer process, nice 19": trainer("process"),
    }


def time_async_save(trainer: Trainer, path: Path, ckpt_group, options: dict) -> dict:
    """Blocking time of one background save, then training steps until it has finished."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    snapshot = trainer.probe()
    dist.barrier()
    cpu_before = cpu_clock()
    start = time.perf_counter()
    response = dcp.async_save(trainer.state(), checkpoint_id=str(path), process_group=ckpt_group, **options)
    returned = time.perf_counter() - start
    # With background staging, async_save returns an AsyncSaveResponse at once and the copy
    # must finish before the optimizer changes the weights: that wait is blocking time too.
    if isinstance(response, AsyncSaveResponse):
        upload, staging = response.upload_completion, response.staging_completion
    else:
        upload, staging = response, None
    waited = []

    def wait_for_staging():
        if staging is not None and not waited:
            t = time.perf_counter()
            staging.result()
            waited.append(time.perf_counter() - t)

    steps = [trainer.step(before_update=wait_for_staging)]
    while not all_done(upload):
        steps.append(trainer.step())
    upload.result()
    total = time.perf_counter() - start
    cpu = [b - a for a, b in zip(cpu_before, cpu_clock())]
    changed = trainer.probe()  # the weights moved on while the save was written
    snapshot_ok = None
    if dist.get_rank() == 0:
        saved = load_all_tensors(path, prefix=PROBE)[PROBE]
        snapshot_ok = torch.equal(saved, snapshot) and not torch.equal(saved, changed)
    return {"blocking_s": returned + sum(waited), "total_s": total, "steps_during": steps,
            "other_cpu_s": cpu[1], "snapshot_ok": snapshot_ok}


def time_trainer_save(trainer: Trainer, path: Path, checkpointer) -> dict:
    """As time_async_save, through the trainer's Saver: blocking = starting the save
    plus waiting for its staging before the next update; done = written, hashed, committed."""
    snapshot = trainer.probe()
    dist.barrier()
    cpu_before = cpu_clock()
    start = time.perf_counter()
    fields = dict(step=1, tokens_seen=0, world_size=dist.get_world_size(), layout={},
                  config_hash="", dataset_id="", model_args={}, loss=0.0)
    blocked = [checkpointer.save(path, [trainer.wrapped], [trainer.optimizer], {}, fields)]
    steps = [trainer.step(before_update=lambda: blocked.append(checkpointer.before_update()))]
    while not all_ranks(not checkpointer.in_flight):
        steps.append(trainer.step())
    checkpointer.wait()
    total = time.perf_counter() - start
    cpu = [b - a for a, b in zip(cpu_before, cpu_clock())]
    changed = trainer.probe()
    snapshot_ok = None
    if dist.get_rank() == 0:
        saved = load_all_tensors(path, prefix=PROBE)[PROBE]
        snapshot_ok = (torch.equal(saved, snapshot) and not torch.equal(saved, changed)
                       and not checkpointer.failures)
    return {"blocking_s": sum(blocked), "total_s": total, "steps_during": steps,
            "other_cpu_s": cpu[1], "snapshot_ok": snapshot_ok}


def time_sync_save(trainer: Trainer, path: Path) -> dict:
    dist.barrier()
    cpu_before = cpu_clock()
    start = time.perf_counter()
    dcp.save(trainer.state(), checkpoint_id=str(path))
    blocking = time.perf_counter() - start
    cpu = [b - a for a, b in zip(cpu_before, cpu_clock())]
    return {"blocking_s": blocking, "total_s": blocking, "steps_during": [], "main_cpu_s": cpu[0],
            "other_cpu_s": cpu[1], "snapshot_ok": None}


@contextmanager
def saver(mode, trainer: Trainer, ckpt_group):
    """The function that times one save of `mode` (see save_modes), with what the mode keeps
    across its saves (a stager; the trainer's Saver) released at the end."""
    if mode is None:
        yield lambda path: time_sync_save(trainer, path)
    elif mode[0] == "dcp":
        stager = mode[2]() if mode[2] is not None else None
        options = {**mode[1], **({"async_stager": stager} if stager else {})}
        yield lambda path: time_async_save(trainer, path, ckpt_group, options)
        if stager is not None:
            stager.close()  # caller-owned stagers must be closed (dcp.async_save docs)
    else:
        from torch.distributed.checkpoint.filesystem import FileSystem

        from training.checkpoint import replicas, saving, writer

        _, async_mode, background, dcp_writer, whole_state = mode
        controls = []  # (owner, attribute, what the control arm puts there)
        if not background:  # the control arm: the same saves, the writer and hashing at nice 0
            controls += [(writer, "lower_thread_priority", lambda: False),
                         (saving, "lower_thread_priority", lambda: False)]
        if dcp_writer:  # DCP's own write, nothing hashed as written: the commit hashes every
            controls += [  # file it finds, on rank 0
                (writer.ShardWriter, "write_data", dcp.FileSystemWriter.write_data),
                (writer._HashingFileSystem, "create_stream", FileSystem.create_stream),
                (writer._HashingFileSystem, "rename", FileSystem.rename)]
        if whole_state:  # every rank stages all it holds (DCP's dedup then picks the writers)
            controls.append((replicas.ReplicaSplit, "own_share", lambda self, state: state))
        kept = [(owner, name, getattr(owner, name)) for owner, name, _ in controls]
        for owner, name, control in controls:
            setattr(owner, name, control)
        saver = saving.Saver(async_mode)
        try:
            yield lambda path: time_trainer_save(trainer, path, saver)
        finally:
            saver.close()
            for owner, name, ours in kept:
                setattr(owner, name, ours)


def remove(path: Path) -> None:
    """Rank 0 deletes a finished checkpoint so the disk holds at most a couple."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def save_worker(args) -> dict:
    dist.init_process_group("gloo")
    trainer = Trainer(args.layout, args.micro_batch, args.seq_len)
    # Its own gloo group: the writer's collectives run beside training's, and on the default
    # group they interleave with FSDP's (a deadlock in STACK_NOTES; a gloo "received data
    # size doesn't match" abort when tried while writing this benchmark).
    ckpt_group = dist.new_group(backend="gloo")
    trainer.step()  # warm-up, and AdamW's state exists from here on

    root, runs, checkpoint_bytes = Path(args.dir), {}, 0
    # Mode by mode, each with its own baseline steps (before its saves, and between them once
    # the save is done), since load from other processes on a shared machine drifts. A kept stager holds a copy of the whole
    # state, so only one exists at a time.
    for name, mode in save_modes().items():
        if args.modes and name not in (*args.modes, "sync"):
            continue
        cpu_before = cpu_clock()
        baseline = [trainer.step() for _ in range(args.baseline_steps)]
        run = {"baseline_steps": baseline, "saves": [],
               # gloo's own threads work in every step (all-reduce); only more is the save's.
               "baseline_other_cpu_per_step": (cpu_clock()[1] - cpu_before[1]) / len(baseline)}
        with saver(mode, trainer, ckpt_group) as save:
            for i in range(args.saves):
                path = root / f"{name.replace(' ', '_').replace(',', '')}-{i}"
                run["saves"].append(save(path))
                checkpoint_bytes = checkpoint_bytes or sum(f.stat().st_size for f in path.iterdir())
                remove(path)
                baseline += [trainer.step() for _ in range(args.quiet_steps)]
        runs[name] = run
    dcp.save(trainer.state(), checkpoint_id=str(root / "resume"))  # for the resume timings

    params = sum(p.numel() for p in trainer.model.parameters())  # global sizes, also for DTensors
    del trainer
    shutdown()
    return {"layout": args.layout, "params": params, "checkpoint_bytes": checkpoint_bytes, "runs": runs}


def start_worker(args) -> dict:
    """Process start -> first training step done, optionally resuming from a checkpoint."""
    launched = float(os.environ["BENCH_LAUNCHED_AT"])
    marks = {"worker interpreter up (torchrun agent, spawn)": STARTED, "torch + training imported": IMPORTED}
    dist.init_process_group("gloo")
    marks["process group joined"] = time.time()
    trainer = Trainer(args.layout, args.micro_batch, args.seq_len, fresh=not args.resume_from)
    marks["model + optimizer built"] = time.time()
    if args.resume_from:
        state = trainer.state()  # initialises AdamW's state so there is something to load into
        if args.verify:  # as the trainer loads: each file of this rank's read plan hashed first
            from training.checkpoint.reader import VerifiedReader

            dcp.load(state, storage_reader=VerifiedReader(args.resume_from))
        else:
            dcp.load(state, checkpoint_id=args.resume_from)
        set_state_dict(trainer.model, trainer.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
        marks["checkpoint loaded"] = time.time()
    trainer.step()
    marks["first step done"] = time.time()
    del trainer
    shutdown()
    return {name: t - launched for name, t in marks.items()}


def shutdown() -> None:
    # Clean shutdown; without it gloo workers sometimes abort at exit (STACK_NOTES).
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# == the driver ==================================================================================

def torchrun(args, *worker_args: str, env: dict | None = None) -> dict:
    from infra.torchrun import free_port
    from training.allocator import THRESHOLD_ENV

    out = Path(args.dir) / "result.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", __file__, *worker_args, "--layout", args.layout,
           "--dir", args.dir, "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
           "--result", str(out)]
    full_env = {**os.environ, **THRESHOLD_ENV, "OMP_NUM_THREADS": "1", **(env or {})}  # as the trainer runs
    proc = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def save_table(result: dict) -> str:
    """One row per mode. Steady state = saves after the first (the process executor spawns
    its writer on the first); the first save's blocking time is shown on its own."""
    runs = result["runs"]
    sync_blocking = median([r["blocking_s"] for r in runs["sync"]["saves"][1:]])
    lines = ["| mode | blocking, first save (s) | blocking, steady (s) | vs sync | write finished after (s) | "
             "step time without save (s) | steps during write | step time during write (s) | slowdown | "
             "training time lost per save (s) | CPU off the training thread (s/rank/save) | "
             "snapshot consistent |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        saves, base = run["saves"], median(run["baseline_steps"])
        steady = median([r["blocking_s"] for r in saves[1:]])
        during = [s for r in saves[1:] for s in r["steps_during"]]
        # Blocking, plus whatever the steps during the write took beyond a normal step.
        lost = median([r["blocking_s"] + sum(r["steps_during"]) - len(r["steps_during"]) * base
                       for r in saves[1:]])
        extra_cpu = median([r["other_cpu_s"] - len(r["steps_during"]) * run["baseline_other_cpu_per_step"]
                            for r in saves[1:]])
        ok = {r["snapshot_ok"] for r in saves}
        lines.append(
            f"| {name} | {saves[0]['blocking_s']:.3f} | {steady:.3f} | {steady / sync_blocking:.3f} | "
            f"{median([r['total_s'] for r in saves[1:]]):.2f} | {base:.2f} | {len(during)} | "
            + (f"{median(during):.2f} | {statistics.mean(during) / base:.2f}x" if during else "– | –")
            + f" | {lost:.2f} | {extra_cpu:.2f} | {'–' if ok == {None} else ('yes' if ok == {True} else 'NO')} |")
    sync_cpu = median([r["main_cpu_s"] for r in runs["sync"]["saves"][1:]])
    return "\n".join(lines) + (
        f"\n\nStep time without save: median of the {len(runs['sync']['baseline_steps'])} steps of each mode "
        "taken before its saves and between them (none in flight). Steps during write, their median and "
        "the slowdown (their mean over the step time without save) count the saves after the first. "
        f"The synchronous save itself used {sync_cpu:.2f} s CPU on the training thread.")


def resume_table(fresh: dict, resumed: dict, verified: dict) -> str:
    """Time since launch of each mark; 'verified' also hashes the files it loads against the
    manifest first (what the trainer's VerifiedReader does)."""
    lines = ["| since launch (s) | fresh start | resume, plain dcp.load | resume, files verified |",
             "|---|---|---|---|"]
    for name in verified:
        row = [d.get(name, float("nan")) for d in (fresh, resumed, verified)]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row).replace("nan", "–") + " |")
    return "\n".join(lines)


def drive(args) -> None:
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    load_before = os.getloadavg()[0]
    result = torchrun(args, "--worker", "save", "--saves", str(args.saves),
                      "--baseline-steps", str(args.baseline_steps), "--quiet-steps", str(args.quiet_steps),
                      *(["--modes", *args.modes] if args.modes else []))
    # The manifest a committed checkpoint has (sizes and sha256), for the verified resume.
    from storage.manifests import CheckpointManifest, list_files

    CheckpointManifest(step=0, tokens_seen=0, files=list_files(root / "resume"), world_size=2,
                       layout={}, config_hash="", dataset_id="", model_args={},
                       created_at=time.time()).save(root / "resume")
    timelines = {}
    for kind, extra in (("fresh", []), ("resumed", ["--resume-from", str(root / "resume")]),
                        ("verified", ["--resume-from", str(root / "resume"), "--verify"])):
        timelines[kind] = torchrun(args, "--worker", "start", *extra,
                                   env={"BENCH_LAUNCHED_AT": repr(time.time())})
    shutil.rmtree(root, ignore_errors=True)

    print(f"model: {result['params'] / 1e6:.1f}M parameters ({MODEL}), AdamW; layout {result['layout']} "
          f"on 2 gloo workers; checkpoint {result['checkpoint_bytes'] / 1e9:.2f} GB; "
          f"batch {args.micro_batch}x{args.seq_len} tokens per rank; {args.saves} saves per mode; "
          f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
          f"({os.cpu_count()} cores)\n")
    print(save_table(result))
    print("\nTime to first training step (torchrun launch -> step 1 done, rank 0; page cache warm):\n")
    print(resume_table(timelines["fresh"], timelines["resumed"], timelines["verified"]))
    print("\nraw:", json.dumps({"save": result, "start": timelines}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--baseline-steps", type=int, default=3, help="steps before each mode's saves")
    parser.add_argument("--quiet-steps", type=int, default=2,
                        help="steps after each save is done, before the next (also baseline)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dir", default="/tmp/goodput-checkpoint-bench")
    parser.add_argument("--modes", nargs="+", metavar="MODE",
                        help="only these save modes (names as in the table; sync always runs)")
    parser.add_argument("--worker", choices=["save", "start"], help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is None:
        drive(args)
        return
    result = save_worker(args) if args.worker == "save" else start_worker(args)
    if int(os.environ["RANK"]) == 0:
        Path(args.result).write_text(json.dumps(result))


# The guard matters: the process executor starts its writer with multiprocessing "spawn",
# which re-imports this file as __mp_main__.
if __name__ == "__main__":
    main()
