"""The held-out loss: mean next-token cross-entropy over the start of the validation split.

Used by the evaluation report, and by checkpoint validation to catch weights that are finite
but wrong. A mix's is each source's, and theirs weighted by the mix's shares."""

from __future__ import annotations

import torch

from core.errors import DataError
from training.data import TokenStream, TrainingData, sequential_batches
from training.model import Transformer
from training.model_args import LOSS_CHUNK_TOKENS


@torch.no_grad()
def held_out_loss(model: Transformer, stream: TokenStream, seq_len: int, batch_size: int,
                  max_batches: int, device: torch.device) -> tuple[float, int]:
    """Mean next-token cross-entropy over the first `max_batches` validation batches, and
    the tokens it covers."""
    total, tokens = 0.0, 0
    for inputs, targets in sequential_batches(stream, seq_len, batch_size, max_batches):
        # In chunks (loss alone under no_grad): a batch's logits are never held whole, e.g.
        # 8 x 2,048 tokens x a 128k vocabulary are 8.6 GB in fp32.
        loss = model(inputs.to(device), targets.to(device), loss_chunk_tokens=LOSS_CHUNK_TOKENS)
        total += loss.item() * targets.numel()
        tokens += targets.numel()
    if tokens == 0:
        raise DataError(f"validation split has {stream.n_tokens} tokens, not enough for one "
                        f"sample of seq_len={seq_len}; add data or raise data.validation_fraction")
    return total / tokens, tokens


def mix_held_out_loss(model: Transformer, data: TrainingData, seq_len: int, batch_size: int,
                      max_batches: int, device: torch.device,
                      weights: dict[str, float] | None = None) -> tuple[float, int, dict[str, float]]:
    """The held-out loss of each source (over its first `max_batches` validation batches),
    the mix's (theirs weighted by data.sources' shares, or by `weights`) and the tokens it
    covers."""
    losses, tokens = {}, 0
    for source in data.sources:
        losses[source.name], covered = held_out_loss(model, source.stream("validation"), seq_len,
                                                     batch_size, max_batches, device)
        tokens += covered
    return data.weighted_by_mix(losses, weights), tokens, losses
