"""Greedy generation with the kept keys and values (Transformer.stream, what evaluation's
samples and lm-eval's generate_until tasks run) against running the whole window again for
every new token (what both did before), on a model size's shapes with random weights.

    python benchmarks/generation_bench.py [--size gpt2-124m] [--prompt 64] [--new 32]
                                          [--threads 2] [--rounds 3]

Each arm generates --new tokens after a --prompt-token prompt, batch 1 (as both callers do);
the arms alternate per round and each round's time is reported, then the medians. The
tokens the two pick are compared: greedy, so they must be the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(size_name: str):
    import torch

    from benchmarks.mfu_bench import SIZES
    from core.config import ModelConfig
    from training.model import Transformer, model_args_from_config

    size = SIZES[size_name]
    cfg = ModelConfig(dim=size.dim, n_layers=size.n_layers, n_heads=size.n_heads,
                      ffn_multiple_of=size.ffn_multiple_of, max_seq_len=size.seq_len)
    torch.manual_seed(0)
    return Transformer(model_args_from_config(cfg, size.vocab_size)).eval()


def whole_window(model, tokens, new: int):
    """The reference: each new token from the whole (windowed) sequence run again."""
    import torch

    with torch.no_grad():
        for _ in range(new):
            logits = model(tokens[:, -model.args.max_seq_len:])[:, -1].float()
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpt2-124m")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="tokens generated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    model = build(args.size)
    prompt = torch.randint(0, model.args.vocab_size, (1, args.prompt),
                           generator=torch.Generator().manual_seed(1))
    arms = {"kept keys and values": lambda: model.generate(prompt, args.new, temperature=0),
            "whole window each token": lambda: whole_window(model, prompt, args.new)}
    times, outputs = {name: [] for name in arms}, {}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            began = time.perf_counter()
            outputs[name] = arms[name]()
            times[name].append(time.perf_counter() - began)
            print(f"round {r + 1} {name}: {times[name][-1]:.3f} s", flush=True)
    kept, whole = (statistics.median(times[name]) for name in arms)
    same = torch.equal(*outputs.values())
    print(f"\n{args.size}, prompt {args.prompt} + {args.new} new tokens, {args.threads} thread(s), "
          f"median of {args.rounds}: kept keys and values {kept:.3f} s, whole window each token "
          f"{whole:.3f} s ({whole / kept:.1f}x); same tokens: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
