"""The training state as DCP saves and loads it: `{"model": ..., "optim": ..., **extras}`
over every model part (pipeline stages) of this rank."""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

# Flattened optimizer state is keyed by parameter name, so the states of several pipeline
# stages merge into one dict and load under any other layout.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def part_states(model_parts, optimizers) -> list[tuple[dict, dict]]:
    return [get_state_dict(part, opt, options=OPTIONS) for part, opt in zip(model_parts, optimizers)]


def train_state(parts: list[tuple[dict, dict]], extra: dict) -> dict:
    model_state, optim_state = {}, {}
    for m, o in parts:
        model_state.update(m)
        optim_state.update(o)
    return {"model": model_state, "optim": optim_state, **extra}
