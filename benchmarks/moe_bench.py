"""Expert parallelism against every rank holding every expert: tokens/s and the dispatch share.

    python benchmarks/moe_bench.py [--rounds 3] [--steps 12] [--nproc 2] [--device cpu|cuda]
                                   [--dim 256] [--experts 8] [--top-k 2] [--expert-dim 512]

The same mixture-of-experts model (training/model.py with model.moe), the same global batch
of the same tokens, the same optimizer, laid out by training.parallelize on `--nproc`
processes (torchrun) three ways:

    ddp      dp_replicate=N: every rank holds every expert, whole; gradients all-reduced
    fsdp     dp_shard=N, ep=1: every rank computes every expert, FSDP gathers their weights
    ep       dp_shard=N, ep=N: each rank holds experts/N of them; tokens travel to their
             expert's rank and back (all_to_all_single), the other weights FSDP-sharded

Per arm: tokens/s (global batch over the median step time, the first 3 steps left out) and,
for ep, the dispatch share: the wall time inside all_to_all_single (the token exchange of
forward and backward and the count exchange before it) over the step time, as rank 0 sees
it (on gloo the collectives block, so their wall time is the time the step waits on them).
Each arm runs in fresh processes; rounds alternate the order of the arms, and ratios are
taken within a round. Prints a markdown table; the results belong in benchmarks/RESULTS.md
with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import torchrun_arm  # noqa: E402

ARMS = {"ddp": {"dp_replicate": -1, "dp_shard": 1, "ep": 1},
        "fsdp": {"dp_replicate": 1, "dp_shard": -1, "ep": 1},
        "ep": {"dp_replicate": 1, "dp_shard": -1, "ep": 0}}  # ep 0: the world size


def worker(args) -> None:
    """One arm, inside torchrun: train `--steps` steps on synthetic tokens, write timings."""
    import torch
    import torch.distributed as dist

    from core.config import ParallelismConfig
    from training.model import ModelArgs, Transformer
    from training.parallelize import clip_grad_norm_, parallelize

    device = torch.device(args.device if args.device == "cpu" else f"cuda:{os.environ['LOCAL_RANK']}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))

    # Time spent inside all_to_all_single (expert dispatch and combine, and the counts).
    waited = [0.0]
    all_to_all = dist.all_to_all_single

    def timed_all_to_all(*a, **k):
        start = time.perf_counter()
        result = all_to_all(*a, **k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        waited[0] += time.perf_counter() - start
        return result

    dist.all_to_all_single = timed_all_to_all

    arm = dict(ARMS[args.arm])
    arm["ep"] = arm["ep"] or world
    moe = {"num_experts": args.experts, "top_k": args.top_k, "expert_dim": args.expert_dim,
           "first_dense_layers": 0, "bias_update_rate": 1e-3}
    model_args = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                           n_heads=args.heads, max_seq_len=args.seq, moe=moe)
    with torch.device("meta"):
        model = Transformer(model_args)
    par = ParallelismConfig(device=device.type, nproc_per_node=world,
                            mixed_precision="fp32" if device.type == "cpu" else "bf16", **arm)
    layout = parallelize(model, par, par.dims(), device, None, seed=0)
    part = layout.model_parts[0]
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)
    per_rank = args.batch // world
    generator = torch.Generator().manual_seed(0)
    times, shares, losses = [], [], []
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        waited[0] = 0.0
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=layout.autocast):
            loss = layout.loss_fn(part(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        clip_grad_norm_(layout, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        shares.append(waited[0] / elapsed)
    if rank == 0:
        steady = slice(3, None)
        Path(args.out).write_text(json.dumps({
            "step_s": statistics.median(times[steady]),
            "dispatch_share": statistics.median(shares[steady]),
            "tokens_per_s": args.batch * args.seq / statistics.median(times[steady]),
            "loss_first": losses[0], "loss_last": losses[-1]}))
    dist.destroy_process_group()


def run_arm(args, arm: str, out: Path) -> dict:
    return torchrun_arm.run_arm(__file__, args.nproc, arm, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="the layouts to run (on one GPU, --nproc 1 --arms fsdp: the arms "
                             "are the same with one process)")
    parser.add_argument("--json", type=Path, help="also write each arm's rounds as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    rows: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(args.arms) if r % 2 == 0 else list(reversed(args.arms))
            for arm in order:
                rows[arm].append(run_arm(args, arm, Path(tmp) / f"{arm}-{r}.json"))
                print(f"round {r + 1} {arm}: {rows[arm][-1]}", file=sys.stderr)
                if args.json:
                    args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                              if k not in ("json", "worker")},
                                                     "rounds": rows}, indent=1, default=str))
    print(f"\n{args.nproc} processes ({args.device}), dim {args.dim}, {args.layers} MoE layers of "
          f"{args.experts} experts (top {args.top_k}, width {args.expert_dim}), "
          f"{args.batch} x {args.seq} tokens a step, {args.steps} steps, {args.rounds} rounds\n")
    print("| layout | tokens/s (median of rounds) | vs ddp (per round) | dispatch share of the step |")
    print("| --- | --- | --- | --- |")
    for arm in args.arms:
        tps = [row["tokens_per_s"] for row in rows[arm]]
        if "ddp" in rows:
            ratio = [row["tokens_per_s"] / base["tokens_per_s"] for row, base in zip(rows[arm], rows["ddp"])]
            vs_ddp = (f"{statistics.median(ratio):.2f} (min {min(ratio):.2f}, max {max(ratio):.2f})")
        else:
            vs_ddp = "—"
        share = (f"{statistics.median(row['dispatch_share'] for row in rows[arm]):.1%}"
                 if arm == "ep" else "—")
        print(f"| {arm} | {statistics.median(tps):,.0f} | {vs_ddp} | {share} |")

if __name__ == "__main__":
    main()
