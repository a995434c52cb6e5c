"""Byte-level BPE tokenizers (Hugging Face `tokenizers`): train one, or load a tokenizer.json.

Byte-level means every string is first mapped to its UTF-8 bytes, and all 256 bytes are in
the vocabulary, so any text encodes without unknown tokens and decodes back exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from core.errors import DataError

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, in order of preference (Llama 3's is
# <|end_of_text|>: a model.init_from checkpoint's tokenizer must be usable as it is).
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>")


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """A byte-level BPE with exactly `vocab_size` ids.

    Id 0 is the EOS token `<|endoftext|>`, ids 1-256 the bytes, then learned merges. When the
    texts have fewer merges to learn, the remaining ids are reserved special tokens
    (`<|reserved_N|>`) that no document encodes to: the model's vocabulary is then the
    configured size whatever the corpus, so the layout checked before preparation (tensor
    parallelism splits the vocabulary) is the one that trains.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return _as_text_encoder(tokenizer)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json that has an end-of-document token (`DataError` otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} not found; set tokenizer.path to an existing "
                        "tokenizer.json, or leave it unset to train one")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception
        raise DataError(f"{path} is not a valid tokenizer.json ({e}); save it with "
                        "`tokenizers` (Tokenizer.save) or leave tokenizer.path unset") from e
    if _find_eos(tokenizer) is None:
        raise DataError(f"tokenizer {path} has no end-of-document token: none of "
                        f"{', '.join(EOS_CANDIDATES)} is in its vocabulary; add one as a "
                        "special token, or leave tokenizer.path unset to train a tokenizer")
    return _as_text_encoder(tokenizer)


def eos_id(tokenizer: Tokenizer) -> int:
    """The id that ends every document in the token shards."""
    found = _find_eos(tokenizer)
    if found is None:
        raise DataError(f"tokenizer has none of the end-of-document tokens {EOS_CANDIDATES}")
    return found


def _find_eos(tokenizer: Tokenizer) -> int | None:
    ids = (tokenizer.token_to_id(token) for token in EOS_CANDIDATES)
    return next((i for i in ids if i is not None), None)


def _as_text_encoder(tokenizer: Tokenizer) -> Tokenizer:
    # Documents are data: a literal "<|endoftext|>" inside one must encode as its characters,
    # not as the EOS id that separates documents. (Not saved in tokenizer.json, so set here.)
    tokenizer.encode_special_tokens = True
    return tokenizer
