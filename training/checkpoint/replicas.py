"""Each rank stages and writes only its share of the tensors several ranks hold.

DCP writes one copy of a tensor several ranks hold (DDP's replicas, HSDP's replicate axis),
but only after every rank has staged (copied off the live tensors) everything it holds:
under DDP each of a node's 8 ranks would keep a whole copy of the model and optimizer in host
memory and spend the CPU to fill it. Ranks that hold identical tensors (the same names,
chunks and sizes) split them before staging instead; each leaves out what a peer writes.
Finding the peers takes one all-gather of a digest per rank, not of what every rank holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core.files import sha256_bytes
from training.logs import get_logger

log = get_logger("checkpoint")

Unit = tuple[str, str, tuple[int, ...]]  # (section, key, global offset of the chunk)


def tensor_units(state: dict) -> dict[Unit, int]:
    """The tensors of the model and optimizer sections as DCP writes them (a DTensor by its
    local chunk's global offset), with their bytes. Other values are small and stay on every
    rank (DCP writes them once)."""
    units = {}
    for section in ("model", "optim"):
        for key, value in state[section].items():
            if isinstance(value, DTensor):
                if value.device_mesh.get_coordinate() is None:
                    continue  # not on this rank's mesh: DCP writes nothing of it here either
                offsets = tuple(value.__create_chunk_list__()[0].offsets)
                units[(section, key, offsets)] = value.to_local().nbytes
            elif isinstance(value, torch.Tensor):
                units[(section, key, ())] = value.nbytes
    return units


def holdings_digest(units: dict[Unit, int]) -> str:
    """Equal on two ranks exactly when they hold the same tensors (names, chunks, sizes)."""
    return sha256_bytes(repr(sorted(units.items())).encode())


def assign_units(units: dict[Unit, int], digests: list[str], me: int) -> set[Unit]:
    """The units rank `me` stages and writes, given every rank's holdings_digest: the ranks
    that hold exactly what it holds split them, each unit (largest first) to the peer with
    the fewest bytes so far (ties: the lowest rank). Every peer computes the same split from
    its own identical units, so each unit is kept by exactly one of them."""
    peers = [rank for rank, digest in enumerate(digests) if digest == digests[me]]
    load = dict.fromkeys(peers, 0)
    mine = set()
    for unit in sorted(units, key=lambda u: (-units[u], u)):
        rank = min(peers, key=lambda r: (load[r], r))
        load[rank] += units[unit]
        if rank == me:
            mine.add(unit)
    return mine


class ReplicaSplit:
    """`own_share(state)`: `state` less the tensors a peer writes (collective on `group`)."""

    def __init__(self, group):
        self.group = group
        self.reported: str | None = None

    def own_share(self, state: dict) -> dict:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return state
        units = tensor_units(state)
        digests = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, holdings_digest(units), group=self.group)
        me = dist.get_rank(self.group)
        mine = assign_units(units, digests, me)
        if me == 0 and self.reported != digests[0]:  # once, unless the holdings change
            self.reported = digests[0]
            sharing = digests.count(digests[0])
            log.info("rank 0 stages and writes %.3f MB of the %.3f MB of tensors it holds; %s",
                     sum(units[u] for u in mine) / 1e6, sum(units.values()) / 1e6,
                     f"{sharing} ranks hold the same and split them" if sharing > 1
                     else "no other rank holds the same")
        others = {(section, key) for section, key, _ in units.keys() - mine}
        return {name: ({k: v for k, v in value.items() if (name, k) not in others}
                       if name in ("model", "optim") else value)
                for name, value in state.items()}
