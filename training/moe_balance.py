"""What a mixture-of-experts run does after each optimizer step, beside the loop.

The MoE layers count, during the step's forwards, how many (token, expert) choices each
expert got and the sequences' balance statistic (training.moe). After the step,
ExpertBalance sums them over every data-parallel rank (one all-reduce of a small vector
holding every layer, whichever pipeline stage has it), so that:

- DeepSeek-V3's aux-loss-free bias update sees the load of the whole global batch, the same
  under every layout (training.moe.update_expert_bias);
- the metrics record per layer the load of the least and the most loaded expert (relative to
  the mean: 1 is perfect balance), the normalised entropy of the load (1: even), the balance
  statistic, and the bias range; and over the layers the auxiliary loss and the experts that
  have been without tokens for model.moe.collapse_steps steps;
- router collapse is a warning in the log, once per expert and episode.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from training.logs import get_logger
from training.moe import MoEArgs, moe_layers, update_expert_bias

log = get_logger("moe")


class ExpertBalance:
    def __init__(self, model_args, layout, device: torch.device, is_main: bool):
        self.moe: MoEArgs = model_args.moe_args
        # Every MoE layer of the whole model, in order; this rank holds those of its stages.
        self.names = [str(i) for i in range(model_args.n_layers) if model_args.is_moe_layer(i)]
        self.held = {name: layer for part in layout.model_parts
                     for name, layer in moe_layers(part).items()}
        # Each layer's bias once: from data-parallel rank 0, TP rank 0.
        self.fills_bias = layout.dp_rank == 0 and (layout.mesh is None
                                                   or layout.mesh.get_local_rank("tp") == 0)
        self.device, self.is_main = device, is_main
        self.idle_steps = torch.zeros(len(self.names), self.moe.num_experts, dtype=torch.long)

    @torch.no_grad()
    def after_step(self) -> dict:
        """Update the routing biases from the step's loads, reset the counters; return the
        step's MoE metrics (identical on every rank)."""
        experts = self.moe.num_experts
        # Per layer: choices per expert, balance sum, sequences, bias min, bias max.
        table = torch.zeros(len(self.names), experts + 4, device=self.device)
        for row, name in enumerate(self.names):
            layer = self.held.get(name)
            if layer is None:
                continue
            table[row, :experts] = layer.tokens_per_expert
            table[row, experts:experts + 2] = layer.balance_sum
            if self.fills_bias:
                table[row, experts + 2] = layer.expert_bias.min()
                table[row, experts + 3] = layer.expert_bias.max()
        if dist.is_initialized():
            dist.all_reduce(table)
        counts = table[:, :experts]
        for row, name in enumerate(self.names):
            layer = self.held.get(name)
            if layer is not None:
                update_expert_bias(layer, counts[row])
                layer.tokens_per_expert.zero_()
                layer.balance_sum.zero_()
        return self._metrics(table.cpu())

    def _metrics(self, table: torch.Tensor) -> dict:
        experts = self.moe.num_experts
        counts = table[:, :experts]
        balance = table[:, experts] / table[:, experts + 1].clamp(min=1)
        mean = counts.mean(1, keepdim=True).clamp(min=1e-9)
        load = counts / mean
        share = counts / counts.sum(1, keepdim=True).clamp(min=1e-9)
        entropy = -(share * share.clamp(min=1e-30).log()).sum(1) / math.log(experts)
        record = {}
        for row, name in enumerate(self.names):
            prefix = f"moe/layer{name}/"
            record[prefix + "load_min"] = load[row].min().item()
            record[prefix + "load_max"] = load[row].max().item()
            record[prefix + "load_entropy"] = entropy[row].item()
            record[prefix + "balance"] = balance[row].item()
            if self.moe.bias_update_rate > 0:  # the bias before this step's update
                record[prefix + "bias_min"] = table[row, experts + 2].item()
                record[prefix + "bias_max"] = table[row, experts + 3].item()
        record["moe/load_max"] = load.max().item()
        record["moe/load_entropy_min"] = entropy.min().item()
        if self.moe.aux_loss_coeff > 0:  # the term the balance loss adds to the training loss
            record["moe/aux_loss"] = self.moe.aux_loss_coeff * balance.sum().item()
        record["moe/dead_experts"] = self._collapse(counts)
        return record

    def _collapse(self, counts: torch.Tensor) -> int:
        """Count the steps each expert has gone without a token; warn when one reaches
        model.moe.collapse_steps. Returns how many experts are at or past it."""
        idle = counts == 0
        self.idle_steps = torch.where(idle, self.idle_steps + 1, torch.zeros_like(self.idle_steps))
        limit = self.moe.collapse_steps
        newly = (self.idle_steps == limit).nonzero().tolist()
        if newly and self.is_main:
            named = ", ".join(f"layer {self.names[row]} expert {e}" for row, e in newly)
            log.warning("router collapse: %s got no token for %d steps in a row; balance the "
                        "load with model.moe.bias_update_rate (e.g. 1e-3) or "
                        "model.moe.aux_loss_coeff (e.g. 1e-2)", named, limit)
        return int((self.idle_steps >= limit).sum())
