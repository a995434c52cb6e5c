"""Byte-level BPE tokenizers (Hugging Face `tokenizers`): train one, or load a tokenizer.json.

Byte-level means every string is first mapped to its UTF-8 bytes, and all 256 bytes are in
the vocabulary, so any text encodes without unknown tokens and decodes back exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from core.errors import DataError
from storage.manifests import DATASET_MANIFEST, DatasetManifest

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, in order of preference (Llama 3's is
# <|end_of_text|>: a model.init_from checkpoint's tokenizer must be usable as it is).
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>")
# What a Hugging Face tokenizer directory (a model.init_from checkpoint's, or tokenizer.path's)
# holds beside tokenizer.json that a model exported with it needs: the special tokens and
# the chat template (tokenizer_config.json and special_tokens_map.json; transformers 5 writes
# the template apart, as chat_template.jinja), and generation_config.json, whose bos, eos and
# pad ids `generate()` stops and pads with. Prepare copies them into the dataset directory
# beside tokenizer.json, export from there into the model it writes. They do not name the
# dataset (its id and manifest hash tokenizer.json alone): a dataset prepared without them
# exports with a minimal tokenizer_config.json, as before they were copied.
HF_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json",
                           "chat_template.jinja", "generation_config.json")


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


def load_tokenizer(path: str | Path, eos_token: str | None = None) -> Tokenizer:
    """A tokenizer.json that has an end-of-document token (`DataError` otherwise): `eos_token`
    where given, else one of EOS_CANDIDATES."""
    tokenizer = read_tokenizer(path)
    try:
        eos_id(tokenizer, eos_token)
    except DataError as e:
        raise DataError(f"tokenizer {path}: {e}") from None
    return tokenizer


def read_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json, to encode documents' text (where its end-of-document id is known:
    a dataset manifest states it)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} not found; set tokenizer.path to an existing "
                        "tokenizer.json, or leave it unset to train one")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception
        raise DataError(f"{path} is not a valid tokenizer.json ({e}); save it with "
                        "`tokenizers` (Tokenizer.save) or leave tokenizer.path unset") from e
    return _as_text_encoder(tokenizer)


def eos_id(tokenizer: Tokenizer, eos_token: str | None = None) -> int:
    """The id that ends every document in the token shards: that of `eos_token` (a given
    tokenizer's own, see `declared_eos_token`), else of the first of EOS_CANDIDATES it has."""
    if eos_token is not None:
        found = tokenizer.token_to_id(eos_token)
        if found is None:
            raise DataError(f"its end-of-document token {eos_token!r} is not in its vocabulary; "
                            "set tokenizer.eos_token to a token it has")
        return found
    ids = (tokenizer.token_to_id(token) for token in EOS_CANDIDATES)
    found = next((i for i in ids if i is not None), None)
    if found is None:
        raise DataError(f"it has no end-of-document token: none of {', '.join(EOS_CANDIDATES)} "
                        "is in its vocabulary; set tokenizer.eos_token to the one it uses, or "
                        "leave tokenizer.path unset to train a tokenizer")
    return found


def document_prefix(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer's template puts before a text (its post-processor: Llama's and
    Mistral's BOS); [] for one without (Qwen2's, and every tokenizer Goodput trains). Prepare
    starts every document with them, as the model was trained (and as transformers encodes),
    and evaluation starts its texts with them."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    templated = tokenizer.encode("a").ids
    for start in range(len(templated) - len(plain) + 1):
        if templated[start:start + len(plain)] == plain:
            return templated[:start]
    return []


def stated_eos_token(path: str | Path) -> str | None:
    """The end-of-document token the files beside the tokenizer.json at `path` state: a
    prepared dataset's manifest (the id its shards end with), else a Hugging Face directory's
    (declared_eos_token). None: they state none, and the first of EOS_CANDIDATES serves."""
    directory = Path(path).parent
    if (directory / DATASET_MANIFEST).is_file():
        manifest = DatasetManifest.load(directory)
        return read_tokenizer(directory / manifest.tokenizer).id_to_token(manifest.eos_id)
    return declared_eos_token(directory)


def declared_eos_token(directory: str | Path) -> str | None:
    """The end-of-document token a Hugging Face tokenizer directory declares: `eos_token` of
    its tokenizer_config.json (save_pretrained writes it), else of special_tokens_map.json."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = Path(directory) / name
        if not path.is_file():
            continue
        try:
            token = json.loads(path.read_text()).get("eos_token")
        except (ValueError, AttributeError) as e:
            raise DataError(f"{path} is not a JSON object ({e}); save the tokenizer again with "
                            "save_pretrained, or set tokenizer.eos_token") from None
        if isinstance(token, dict):  # an AddedToken written out: {"content": ..., ...}
            token = token.get("content")
        if isinstance(token, str) and token:
            return token
    return None


def tokenizer_side_files(tokenizer_json: str | Path) -> list[Path]:
    """The HF_TOKENIZER_SIDE_FILES that lie beside `tokenizer_json`."""
    directory = Path(tokenizer_json).parent
    return [directory / name for name in HF_TOKENIZER_SIDE_FILES if (directory / name).is_file()]


def _as_text_encoder(tokenizer: Tokenizer) -> Tokenizer:
    # Documents are data: a literal "<|endoftext|>" inside one must encode as its characters,
    # not as the EOS id that separates documents. (Not saved in tokenizer.json, so set here.)
    tokenizer.encode_special_tokens = True
    return tokenizer
