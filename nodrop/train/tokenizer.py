"""Subword tokens for text data: a byte-level BPE (Hugging Face `tokenizers`) trained on the
training split, or a given `tokenizer.json`, and the token arrays it makes, cached.

TrainConfig.tokenizer chooses:
- None: no tokenizer. Text is read as bytes (ids 0-255); token-id files (.bin, .npy) as they are.
- "bpe": a byte-level BPE (GPT-2's pre-tokenizer, every byte in the base alphabet, so any text
  encodes) with model.vocab_size entries, trained on the training split only, so validation text
  stays unseen. Training is deterministic: the same text and size give the same merges.
- a path to a Hugging Face `tokenizer.json`.
Token-id files that come with nanoGPT's character-level meta.pkl (a `stoi` map) need no
tokenizer to train, but the run gets one made from that map (`from_meta`), so that generating
and evaluating text work with the ids the files hold.

The run folder keeps the tokenizer it trained with (tokenizer.json); a resumed run reads it from
there and checks it against the sha256 in config.json. Trained tokenizers and token arrays are
cached under $NODROP_CACHE (default ~/.cache/nodrop), keyed by the sha256 of what made them, so
the runs of a comparison train and encode once; a damaged cache entry is noticed (its sha256 is
stored beside it) and made again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from nodrop.train.data import Dataset, DataError, require_regular_file

FILE = "tokenizer.json"  # in the run folder
BPE = "bpe"
MAX_TRAINING_BYTES = 256 << 20  # a BPE is trained on at most the first 256 MiB of the split
_CHUNK_BYTES = 1 << 20  # text is encoded in pieces of about 1 MiB, cut before a newline
_RECIPE = "byte-level-bpe-1"  # part of the cache key: change it when training changes


def load(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer.json; raises DataError naming the file when it cannot be read or parsed."""
    path = Path(path)
    require_regular_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the tokenizer: {error}") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as error:  # the Rust parser raises a bare Exception
        raise DataError(f"{path}: not a valid Hugging Face tokenizer.json ({error})") from None


def vocab_size(path: str | os.PathLike) -> int:
    return load(path).get_vocab_size(with_added_tokens=True)


def sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def from_meta(meta: dict, path: str | os.PathLike) -> Tokenizer | None:
    """The character-level tokenizer of a nanoGPT meta.pkl: every character its `stoi` id, text
    decoded by joining the characters. None where the meta.pkl has no `stoi` (GPT-2 ids: their
    tokenizer is GPT-2's, given with --tokenizer). Raises DataError naming the file for a `stoi`
    that is not a map of distinct single characters to distinct ids >= 0."""
    stoi = meta.get("stoi")
    if stoi is None:
        return None
    bad = ([] if type(stoi) is not dict else
           [(c, i) for c, i in stoi.items() if type(c) is not str or len(c) != 1
            or type(i) is not int or i < 0])
    if type(stoi) is not dict or bad or len(set(stoi.values())) != len(stoi):
        found = (type(stoi).__name__ if type(stoi) is not dict else
                 f"the entries {bad[:3]}" if bad else "ids used twice")
        raise DataError(f"{path}: stoi must map single characters to distinct ids >= 0 "
                        f"(nanoGPT's character-level meta.pkl), got {found}")
    tokenizer = Tokenizer(models.WordLevel(vocab=stoi, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def unknown_characters(tokenizer: Tokenizer, text: str) -> list[str]:
    """The characters of `text` that a character-level tokenizer (`from_meta`) has no id for."""
    vocabulary = tokenizer.get_vocab()
    return sorted({c for c in text if c not in vocabulary})


def train_bpe(text_bytes: np.ndarray, size: int) -> Tokenizer:
    """A byte-level BPE with `size` entries trained on the text (uint8 array); cached."""
    if size <= 256:
        raise DataError(f"a byte-level BPE needs more than the 256 byte tokens; model.vocab_size "
                        f"is {size} (--set vocab_size=8192)")
    sample = np.ascontiguousarray(text_bytes[:MAX_TRAINING_BYTES])
    key = hashlib.sha256(f"{_RECIPE} {tokenizers.__version__} {size} ".encode()
                         + hashlib.sha256(sample.data).digest()).hexdigest()
    cached = _cache_read(f"bpe-{key}.json")
    if cached is not None:
        return Tokenizer.from_str(cached.decode())
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_pieces(_decode(sample)[0]), trainer)
    _cache_write(f"bpe-{key}.json", tokenizer.to_str().encode())
    return tokenizer


def encode(text_bytes: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
    """The token ids of the text (uint8 array), uint16 where they fit, else uint32; cached."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if size <= 1 << 16 else np.uint32
    raw = np.ascontiguousarray(text_bytes)
    key = hashlib.sha256(sha256(tokenizer).encode() + hashlib.sha256(raw.data).digest())
    name = f"tokens-{key.hexdigest()}.npy"
    cached = _cache_read(name)
    if cached is not None:
        return np.frombuffer(cached, dtype=dtype)
    text, _ = _decode(raw)
    ids = [np.asarray(e.ids, dtype) for e in tokenizer.encode_batch(_pieces(text),
                                                                     add_special_tokens=False)]
    tokens = np.concatenate(ids) if ids else np.zeros(0, dtype)
    _cache_write(name, tokens.tobytes())
    return tokens


def apply(kind: str, dataset: Dataset, size: int, saved: Path | None = None,
          echo=print) -> tuple[Dataset, Tokenizer]:
    """The dataset's text as tokens of the run's tokenizer: the one in the run folder (`saved`,
    when it is there: a resumed run), else a BPE of `size` trained on the training split
    (kind "bpe"), else the tokenizer.json at `kind`. Its vocabulary must fit the model's `size`."""
    if not dataset.text:
        raise DataError(f"{dataset.source} holds token ids, not text: it needs no tokenizer "
                        "(--tokenizer none)")
    if saved is not None and saved.exists():
        tokenizer = load(saved)
    elif kind == BPE:
        echo(f"nodrop: byte-level BPE of {size} tokens from {dataset.train.size / 2**20:.1f} MiB "
             f"of training text (cached in {cache_dir()})")
        tokenizer = train_bpe(dataset.train, size)
    else:
        tokenizer = load(kind)
    entries = tokenizer.get_vocab_size(with_added_tokens=True)
    if entries > size:
        raise DataError(f"the tokenizer {saved if saved and saved.exists() else kind} has "
                        f"{entries} tokens, more than model.vocab_size={size} "
                        f"(--set vocab_size={entries})")
    return tokenize(dataset, tokenizer, kind), tokenizer


def tokenize(dataset: Dataset, tokenizer: Tokenizer, kind: str) -> Dataset:
    """The dataset's text splits as token ids; `kind` ("bpe" or the tokenizer file) is recorded
    in the description with the tokenizer's sha256 and the bytes that were not UTF-8."""
    replaced = sum(_decode(split)[1] for split in (dataset.train, dataset.val))
    return Dataset(
        train=encode(dataset.train, tokenizer), val=encode(dataset.val, tokenizer),
        source=dataset.source, split=dataset.split, text=False,
        tokenizer={"kind": kind, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
                   "sha256": sha256(tokenizer), "bytes_not_utf8": replaced})


# --- text --------------------------------------------------------------------------------------


def _decode(raw: np.ndarray) -> tuple[str, int]:
    """UTF-8 text; bytes that are not UTF-8 become U+FFFD (counted: the tokenizers work on
    Unicode text, so such bytes cannot be kept)."""
    data = bytes(raw)
    text = data.decode("utf-8", errors="replace")
    valid = len(data.decode("utf-8", errors="ignore").encode("utf-8"))
    return text, len(data) - valid


def _pieces(text: str) -> list[str]:
    """The text in pieces of about _CHUNK_BYTES characters, each cut before a newline, so no
    word is split (GPT-2's pre-tokenizer never joins a newline to what precedes it)."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_BYTES)
        end = len(text) if end < 0 else end
        pieces.append(text[start:end])
        start = end
    return pieces


# --- cache -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("NODROP_CACHE") or Path.home() / ".cache" / "nodrop")


def _cache_read(name: str) -> bytes | None:
    """The entry's bytes if it is there and matches the sha256 stored beside it."""
    path = cache_dir() / name
    try:
        content = path.read_bytes()
        expected = json.loads((cache_dir() / f"{name}.sha256.json").read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return content if hashlib.sha256(content).hexdigest() == expected else None


def _cache_write(name: str, content: bytes) -> None:
    """Written atomically, the checksum last; a cache that cannot be written is skipped."""
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        for target, payload in (
                (name, content),
                (f"{name}.sha256.json",
                 json.dumps({"sha256": hashlib.sha256(content).hexdigest()}).encode())):
            with tempfile.NamedTemporaryFile(dir=folder, delete=False) as handle:
                handle.write(payload)
            os.replace(handle.name, folder / target)
    except OSError:
        pass
