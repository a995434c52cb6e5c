"""How close a prepare work unit runs to the tokenizer itself, on one core.

    python benchmarks/encode_ceiling.py [--mb 40]

On prepare_bench.py's generated documents and a 16k byte-level BPE from `prepare`'s
train_tokenizer (on the first 3,000 documents), one process with the tokenizer's own threads off (a prepare worker's setup),
each over the same texts in batches of 1,024 documents:

- `encode_batch`, reading each encoding's ids (what the raw baseline of prepare_bench does);
- `encode_batch_fast` alone: the Rust work, no ids read into Python (the ceiling);
- a prepare unit's per-batch work: `encode_batch_fast`, the ids plus EOS into numpy arrays.

The last against the ceiling is the share of a unit's tokenizing time that is not the
tokenizer: what any pipeline around `tokenizers` could still win per core.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

BATCH = 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=40, help="megabytes of text to encode")
    args = parser.parse_args()
    from prepare_bench import VOCAB_SIZE, corpus_texts, generate_corpus

    from training.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="encode-ceiling-") as tmp:
        generate_corpus(Path(tmp), int(args.mb * 1e6))
        texts = list(corpus_texts(Path(tmp)))
    tokenizer = train_tokenizer(texts[:3000], vocab_size=VOCAB_SIZE, min_frequency=2)
    batches = [texts[i:i + BATCH] for i in range(0, len(texts), BATCH)]
    tokens = sum(len(e.ids) + 1 for b in batches
                 for e in tokenizer.encode_batch_fast(b, add_special_tokens=False))

    def timed(work) -> float:
        started = time.perf_counter()
        for batch in batches:
            work(batch)
        return time.perf_counter() - started

    seconds = {
        "encode_batch + ids": timed(lambda b: [e.ids for e in tokenizer.encode_batch(
            b, add_special_tokens=False)]),
        "encode_batch_fast alone (ceiling)": timed(lambda b: tokenizer.encode_batch_fast(
            b, add_special_tokens=False)),
        "prepare's per-batch work": timed(lambda b: [np.array(e.ids + [0], dtype=np.uint16)
                                                     for e in tokenizer.encode_batch_fast(
                                                         b, add_special_tokens=False)]),
    }
    ceiling = seconds["encode_batch_fast alone (ceiling)"]
    print(f"{len(texts):,} documents, {sum(map(len, texts)) / 1e6:.0f} MB, {tokens:,} tokens, one core")
    for name, s in seconds.items():
        print(f"  {name:36s} {s:6.2f} s  {tokens / s:>11,.0f} tokens/s  {s / ceiling:.3f}x the ceiling's time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
