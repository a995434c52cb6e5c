"""This worker's place in the job (rank, device, process group), and how the ranks agree.

Every rank must take the same branch at a step boundary (save, stop, roll back): the
decisions below are collectives that give all ranks the same answer. Without torchrun (one
plain process) they return this process's own values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(par_cfg) -> Dist:
    """Join the process group torchrun set up (or run as a single process without one)."""
    want_cuda = par_cfg.device == "cuda" or (par_cfg.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
        if par_cfg.mixed_precision != "fp32":
            # Matmuls left in fp32 (outside autocast) may use TF32 tensor cores.
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    if "RANK" in os.environ:
        backend = par_cfg.backend
        if backend == "auto":
            backend = "nccl" if want_cuda else "gloo"
        if backend == "nccl":
            # gloo beside nccl: the few CPU-tensor collectives (flags the ranks agree on, DCP's
            # planning) need a CPU backend on GPU machines too.
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend=backend, device_id=device if want_cuda else None)
        return Dist(dist.get_rank(), local_rank, dist.get_world_size(), device)
    return Dist(0, 0, 1, device)


def any_rank(*flags: bool) -> list[bool]:
    """Each flag true on any rank is true on all (one small all-reduce)."""
    values = torch.tensor([1.0 if f else 0.0 for f in flags])
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def from_every_rank(value) -> list:
    """`value` of every rank, by rank (a small object; all ranks call it at the same point)."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def decided_by_rank_0(decide: Callable[[], T]) -> T:
    """`decide()` on rank 0, broadcast: every rank acts on the same answer even where the
    ranks' views of a shared filesystem differ for a moment (NFS attribute caches)."""
    choice: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice = [decide()]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
