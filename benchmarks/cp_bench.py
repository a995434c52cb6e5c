"""Context parallelism at a long sequence: activation memory per rank and tokens/s, CP=2 vs CP=1.

    python benchmarks/cp_bench.py [--rounds 2] [--steps 5] [--seq 4096] [--device cpu|cuda]

The same dense model (training/model.py, grouped-query attention), the same tokens, the same
optimizer, on the same `--nproc` processes (torchrun, gloo on CPU), laid out by
training.parallelize two ways:

    cp1   dp_shard=N: each rank trains whole sequences (FSDP), one per rank per step
    cp2   cp=2, dp_shard=N/2: each sequence split over two ranks (chunks i and 2cp-1-i, keys
          and values all-gathered every layer), the weights FSDP-sharded over dp_shard x cp

cp2 trains half the sequences per step on the same ranks, each rank holding half of each.
Per arm, on rank 0:

    activation memory  the bytes of the tensors autograd saves for backward during one
                       forward (torch.autograd.graph.saved_tensors_hooks; weights left out,
                       each storage counted once): what a rank holds between forward and
                       backward, the memory CP exists to cut
    tokens/s           tokens of the step's sequences over the median step time (the first
                       2 steps left out), both arms on the same cores

Each arm runs in fresh processes; rounds alternate the order of the arms, and the ratios
cp2 / cp1 are taken within a round. Prints a markdown table; the results belong in
benchmarks/RESULTS.md with this command.
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

ARMS = {"cp1": 1, "cp2": 2}  # parallelism.cp


def saved_activation_bytes(run_forward) -> tuple[object, int]:
    """run_forward()'s result and the bytes of what autograd saved for backward meanwhile:
    each storage once, leaving out parameters (and views of them: the weights a matmul keeps)."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, torch.nn.Parameter) and not (base.is_leaf and base.requires_grad):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run_forward()
    return result, sum(storages.values())


def worker(args) -> None:
    """One arm, inside torchrun: train `--steps` steps on random tokens, write the figures."""
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

    cp = ARMS[args.arm]
    model_args = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                           n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq)
    with torch.device("meta"):
        model = Transformer(model_args)
    par = ParallelismConfig(device=device.type, nproc_per_node=world, dp_replicate=1,
                            dp_shard=world // cp, cp=cp,
                            mixed_precision="fp32" if device.type == "cpu" else "bf16")
    dims = par.dims()
    layout = parallelize(model, par, dims, device, None, seed=0, microbatch=(1, args.seq))
    part = layout.model_parts[0]
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)
    sequences = dims.dp_size  # one per data-parallel rank: whole, or split over its cp ranks
    generator = torch.Generator().manual_seed(0)
    times, activations, losses = [], [], []
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (sequences, args.seq + 1), generator=generator)
        mine = tokens[layout.dp_rank:layout.dp_rank + 1].to(device)
        inputs, targets = layout.sequence_part(mine[:, :-1], mine[:, 1:])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=layout.autocast):
            loss, saved = saved_activation_bytes(lambda: layout.loss_fn(part(inputs), targets))
        loss.backward()
        clip_grad_norm_(layout, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        activations.append(saved)
    if rank == 0:
        steady = times[2:] if len(times) > 2 else times
        step_s = statistics.median(steady)
        Path(args.out).write_text(json.dumps({
            "step_s": step_s, "tokens_per_s": sequences * args.seq / step_s,
            "activation_bytes": max(activations), "tokens_per_rank": inputs.numel(),
            "loss_first": losses[0], "loss_last": losses[-1]}))
    dist.destroy_process_group()


def run_arm(args, arm: str, out: Path) -> dict:
    return torchrun_arm.run_arm(__file__, args.nproc, arm, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.nproc % 2:
        raise SystemExit("--nproc must be even: the cp2 arm splits each sequence over 2 ranks")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            arms = list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS))
            found = {arm: run_arm(args, arm, Path(tmp) / f"{arm}-{round_}.json") for arm in arms}
            rows.append(found)
            print(f"round {round_ + 1}: " + json.dumps(found), file=sys.stderr)
    memory = [r["cp2"]["activation_bytes"] / r["cp1"]["activation_bytes"] for r in rows]
    speed = [r["cp2"]["tokens_per_s"] / r["cp1"]["tokens_per_s"] for r in rows]
    print(f"seq {args.seq}, dim {args.dim}, {args.layers} layers, {args.heads} heads "
          f"({args.kv_heads} kv), {args.nproc} processes on {args.device}\n")
    print("| arm | tokens per rank | activation MiB per rank | tokens/s |")
    print("|---|---|---|---|")
    for arm in ARMS:
        mib = statistics.median(r[arm]["activation_bytes"] for r in rows) / 2**20
        tps = statistics.median(r[arm]["tokens_per_s"] for r in rows)
        print(f"| {arm} | {rows[0][arm]['tokens_per_rank']} | {mib:.1f} | {tps:,.0f} |")
    print(f"\ncp2 / cp1 per round: activation memory {', '.join(f'{m:.3f}' for m in memory)}; "
          f"tokens/s {', '.join(f'{s:.3f}' for s in speed)}")


if __name__ == "__main__":
    main()
