"""Wait for a replacement node, or shrink and train on? The arithmetic behind elastic.*.

A job of `nodes` nodes loses one every `mtbf_s` on average (the job's MTBF: a node's MTBF
over the node count). Whatever the policy, a loss throws away the work since the last
checkpoint (half the checkpoint interval on average) and costs a restart of the workers
(`restart_s`: rendezvous, loading the checkpoint, the first step). Then:

- waiting: the whole job idles until the replacement joins (`replacement_s`), then
  restarts on the full world: each loss costs replacement + restart + lost work;
- shrinking (elastic.min_nodes): the others restart at once on the smaller world and
  train on (the global batch kept by accumulation, so each node does the same work per
  second); the job lacks the lost node's share while it is out, and restarts once more when
  the replacement joins (elastic.grow): each loss costs 2 restarts + lost work, and on
  average replacement_s / mtbf_s nodes are out (Little's law);
- elastic.wait_for_replacement_s = W between them: wait up to W; a replacement that comes
  in time costs as under waiting, a later one W of idling, then as under shrinking for the
  rest of its absence.

Goodput is the share of the job's capacity that trains (checkpoint saves aside, equal under
every policy). Like Young/Daly's checkpoint interval (training.metrics.young_daly_interval_s)
it is a renewal model: one loss at a time, each loss independent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLosses:
    nodes: int
    mtbf_s: float  # the job's mean time between node losses
    replacement_s: float  # from a loss to its replacement joining
    restart_s: float  # one in-job restart of the workers (rendezvous, checkpoint load, first step)
    checkpoint_interval_s: float = 0.0  # the work lost per loss is half of it on average


def goodput_waiting(p: NodeLosses) -> float:
    return goodput_after_waiting(p, math.inf)


def goodput_shrinking(p: NodeLosses) -> float:
    return goodput_after_waiting(p, 0.0)


def goodput_after_waiting(p: NodeLosses, wait_s: float) -> float:
    """The policy elastic.wait_for_replacement_s = `wait_s` (0: shrink at once; inf: wait)."""
    lost_work = p.checkpoint_interval_s / 2
    if p.replacement_s < wait_s or math.isinf(wait_s):  # the replacement came in time: the job only waited
        return p.mtbf_s / (p.mtbf_s + p.replacement_s + p.restart_s + lost_work)
    idle = wait_s + 2 * p.restart_s + lost_work  # the whole job stands still this long per loss
    # The share of the time the lost node is missing: one loss at a time (the renewal model),
    # so a replacement slower than the time between losses leaves that one node out for good,
    # never more.
    out = min(1.0, (p.replacement_s - wait_s) / p.mtbf_s)
    return p.mtbf_s / (p.mtbf_s + idle) * (1 - out / p.nodes)


def flip_replacement_s(p: NodeLosses) -> float:
    """The replacement time below which waiting beats shrinking (they tie there): waiting
    loses replacement + restart per loss, shrinking 2 restarts and the lost node's share,
    so for large jobs it is about one restart."""
    low, high = 0.0, 1.0
    while goodput_waiting(_with(p, high)) > goodput_shrinking(_with(p, high)):
        high *= 2
        if high > 1e12:
            return math.inf
    if goodput_waiting(_with(p, low)) <= goodput_shrinking(_with(p, low)):
        return 0.0
    for _ in range(100):
        mid = (low + high) / 2
        if goodput_waiting(_with(p, mid)) > goodput_shrinking(_with(p, mid)):
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _with(p: NodeLosses, replacement_s: float) -> NodeLosses:
    return NodeLosses(p.nodes, p.mtbf_s, replacement_s, p.restart_s, p.checkpoint_interval_s)


def advice(p: NodeLosses, wait_s: float) -> dict:
    """Goodput under each policy, which is better, and what elastic.wait_for_replacement_s
    should be: the replacement time where the choice flips (wait for a replacement expected
    sooner than that, shrink otherwise)."""
    waiting, shrinking, configured = (goodput_waiting(p), goodput_shrinking(p),
                                      goodput_after_waiting(p, wait_s))
    flip = flip_replacement_s(p)
    better = ("either (a tie)" if math.isclose(waiting, shrinking, rel_tol=1e-9)
              else "wait" if waiting > shrinking else "shrink")
    return {"goodput_waiting": waiting, "goodput_shrinking": shrinking,
            "goodput_configured": configured, "better": better, "flip_replacement_s": flip,
            "note": (f"replacements take {p.replacement_s:.0f}s; waiting pays off below "
                     f"{flip:.0f}s: {better} (elastic.wait_for_replacement_s="
                     f"{wait_s:g} gives goodput {configured:.4f})")}
