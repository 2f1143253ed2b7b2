"""Token data for the trainer: where it comes from, how it is split, and which windows each step reads.

Sources (`load(path, vocab_size)`): text, read as bytes (nodrop.train.tokenizer turns it into
subword tokens where the run has a tokenizer), or token ids < vocab_size:
- None: the Python standard library's own `.py` files on this machine (the folder
  `sysconfig.get_paths()["stdlib"]`, without site-packages/dist-packages), read as bytes. Nothing
  to download, and the same bytes on every run on one machine.
- a text file: its bytes.
- a folder: every regular, non-hidden file under it, read as bytes; or, where the folder holds
  `train.bin` and `val.bin` (or `train.npy` and `val.npy`), those two as the splits, and where it
  holds `train.bin` (or `train.npy`) alone, that file split as a single file is. Token files are
  never read as text: a folder holding other `.bin` or `.npy` files is refused.
- `.bin`: uint16 little-endian token ids, nanoGPT's format. `.npy`: a 1-D integer array of ids.
Anything else that is not a regular file (a FIFO, a device) is refused: reading it could block.

Vocabulary of token ids (`vocabulary(dataset)`, where the run does not set vocab_size): the
`vocab_size` of nanoGPT's `meta.pkl` in the folder that holds the token files, read by an
unpickler that builds plain dicts, lists, strings and numbers only (`read_meta`), else the largest
id + 1 rounded up to a multiple of VOCAB_MULTIPLE.

Split, fixed and deterministic: files of a folder (and of the standard library) are assigned by a
hash of their relative path, crc32(path) % 10 == 0 going to validation (about 10%), so adding a
file never moves another one; a single file, and a folder whose hash split leaves a side empty,
keeps its last 10% of tokens for validation.

Batches: step n's batch is `batch_size` windows of seq_len + 1 tokens whose starts are drawn
uniformly by numpy's PCG64 seeded with (seed, n). The data position is the step itself: resuming
at step n reads exactly the batch an uninterrupted run would have read, with no loader state to
save beyond (seed, step). Evaluation reads the same evenly spaced validation windows every time.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import stat
import sysconfig
import zlib
from pathlib import Path

import numpy as np

VALIDATION_BUCKETS = 10  # crc32(relative path) % 10 == 0 -> validation
VALIDATION_FRACTION = 0.1  # tail split of a single file
_TRAIN_STREAM = 0  # seed-sequence key that keeps training windows apart from any other stream
_SPLIT_FILES = ("train", "val")
META_FILE = "meta.pkl"  # nanoGPT's description of its token files: vocab_size (itos, stoi)
# A vocabulary taken from the largest id is rounded up to a multiple of this, as nanoGPT pads
# GPT-2's 50257 tokens to 50304: the embedding and head matmuls run faster on such sizes.
VOCAB_MULTIPLE = 64


class DataError(ValueError):
    """The data cannot be used: missing, unreadable, corrupt, too short, or ids out of range."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """The two splits as 1-D token arrays (uint8, uint16, uint32 or int32; maybe
    memory-mapped)."""

    train: np.ndarray
    val: np.ndarray
    source: str  # what was read, for config.json and the summary
    split: str  # how train and validation were separated
    text: bool = False  # the arrays are the bytes of text (a tokenizer may encode them)
    tokenizer: dict | None = None  # what encoded text into these tokens (None: nothing did)
    meta: str | None = None  # nanoGPT's meta.pkl beside the token files, where there is one

    @property
    def encoding(self) -> str:
        """What a token id means: "tokenizer" (the run's tokenizer's), "bytes" (a byte of
        text) or "token ids" (whatever produced the files: nodrop cannot turn them into text)."""
        return "tokenizer" if self.tokenizer else "bytes" if self.text else "token ids"

    def describe(self) -> dict:
        """JSON-safe summary, also used on resume to notice that the data changed."""
        described = {"source": self.source, "split": self.split,
                     "train_tokens": int(self.train.size), "val_tokens": int(self.val.size),
                     "train_crc32": _fingerprint(self.train),
                     "val_crc32": _fingerprint(self.val)}
        return described if self.tokenizer is None else {**described,
                                                         "tokenizer": self.tokenizer}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load(path: str | os.PathLike | None, vocab_size: int | None, echo=print) -> Dataset:
    """Reads and splits the data; raises DataError naming the file for anything unusable, and
    for ids >= vocab_size (None: not checked here; check_ids once the text is tokenized).
    echo: where a split the user may not expect is said."""
    if path is None:
        root = stdlib_root()
        files = [p for p in _files_under(root)
                 if p.suffix == ".py" and not {"site-packages", "dist-packages"}
                 & set(p.relative_to(root).parts)]
        if not files:
            raise DataError(f"found no .py files under the standard library folder {root}")
        return _split_files(root, files, vocab_size, f"Python standard library ({root})")
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DataError(f"{path}: no such file or folder") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read it: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        return _load_folder(path, vocab_size, echo)
    require_regular_file(path, mode, "a regular file or a folder")
    dataset = _tail_split(_read_tokens(path, vocab_size), str(path),
                          text=not _is_token_file(path))
    return _with_meta(dataset, path.parent) if _is_token_file(path) else dataset


def _load_folder(path: Path, vocab_size: int | None, echo) -> Dataset:
    splits = _split_pair(path)
    if splits is not None:
        train, val = (_read_tokens(p, vocab_size) for p in splits)
        return _with_meta(Dataset(
            train, val, str(path),
            f"{splits[0].name} (training) and {splits[1].name} (validation)", text=False), path)
    for ext in (".bin", ".npy"):
        train = path / f"train{ext}"
        if train.is_file():
            echo(f"nodrop: {path} holds {train.name} but no val{ext}: validation is the last "
                 f"{VALIDATION_FRACTION:.0%} of {train.name}'s tokens")
            dataset = _tail_split(_read_tokens(train, vocab_size), str(path), text=False)
            return _with_meta(dataclasses.replace(dataset, split=f"{train.name}: {dataset.split}"),
                              path)
    files = list(_files_under(path))
    if not files:
        raise DataError(f"{path}: the folder holds no (non-hidden) files")
    tokens = [p.relative_to(path).as_posix() for p in files if _is_token_file(p)]
    if tokens:
        shown = ", ".join(tokens[:3]) + (f" and {len(tokens) - 3} more" if len(tokens) > 3
                                         else "")
        raise DataError(f"{path}: expected text files or train.bin/val.bin (train.npy/val.npy), "
                        f"got token files ({shown}) among the files, which are read as text; "
                        "name a token file itself as --data")
    return _split_files(path, files, vocab_size, str(path))


def require_regular_file(path: Path, mode: int | None = None,
                         expected: str = "a regular file") -> None:
    """Raises DataError unless path (whose st_mode is `mode`, if known) is a regular file:
    reading a FIFO or a device could block."""
    if mode is None:
        try:
            mode = path.stat().st_mode
        except OSError as error:
            raise DataError(f"{path}: cannot read it: {error.strerror or error}") from None
    if not stat.S_ISREG(mode):
        raise DataError(f"{path}: expected {expected}, got {_file_kind(mode)}")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "another kind of file")


def check_ids(dataset: Dataset, vocab_size: int, set_by: str | None = None) -> None:
    """Every token id of both splits must be below vocab_size. set_by: the flag that set
    vocab_size, where the user chose it for token ids; the error then suggests a size."""
    for split, name in ((dataset.train, "training"), (dataset.val, "validation")):
        try:
            _check_ids(split, vocab_size, f"{dataset.source} ({name} split)")
        except DataError as error:
            if set_by is None or dataset.text:
                raise
            largest = max(int(s.max()) for s in (dataset.train, dataset.val) if s.size)
            if largest < vocab_size:  # a negative id or an empty split: not the size's fault
                raise
            raise DataError(f"{error}; vocab_size={vocab_size} was set by {set_by}: leave it "
                            "unset to take the vocabulary from the data, or set at least "
                            f"{largest + 1} ({set_by}={round_vocabulary(largest + 1)})") from None


def round_vocabulary(size: int) -> int:
    """size rounded up to a multiple of VOCAB_MULTIPLE."""
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def vocabulary(dataset: Dataset) -> tuple[int, str]:
    """The vocabulary of token-id data and why, in words: meta.pkl's vocab_size where the data
    have one (every id must be below it), else the largest id + 1 rounded up to a multiple of
    VOCAB_MULTIPLE. Raises DataError for text (its vocabulary is the tokenizer's or the bytes'),
    an unusable meta.pkl, or ids past its vocab_size."""
    if dataset.text:
        raise DataError(f"{dataset.source} holds text, not token ids: its vocabulary is the "
                        "tokenizer's (--tokenizer) or the 256 bytes")
    splits = ((dataset.train, "training"), (dataset.val, "validation"))
    if dataset.meta is not None:
        size = meta_vocab_size(read_meta(dataset.meta), dataset.meta)
        for tokens, name in splits:
            if tokens.size and int(tokens.max()) >= size:  # (a negative id: check_ids says so)
                try:
                    _check_ids(tokens, size, f"{dataset.source} ({name} split)")
                except DataError as error:
                    raise DataError(f"{error}, the vocab_size of {dataset.meta}: the token files "
                                    f"and {META_FILE} disagree (is {META_FILE} from other "
                                    "data?)") from None
        return size, f"the vocab_size of {dataset.meta} (nanoGPT's {META_FILE})"
    largest = max((int(tokens.max()) for tokens, _ in splits if tokens.size), default=0)
    size = round_vocabulary(largest + 1)
    return size, (f"the largest token id, {largest}, + 1 rounded up to a multiple of "
                  f"{VOCAB_MULTIPLE}, as nanoGPT pads GPT-2's 50257 tokens to 50304 for faster "
                  "matmuls")


def read_meta(path: str | os.PathLike) -> dict:
    """nanoGPT's meta.pkl, unpickled without running any code: only dicts, lists, strings,
    ints, floats, bools and None are accepted (never a class or a function, which is how a
    pickle runs code); anything else is refused with a DataError naming the file."""
    path = Path(path)
    require_regular_file(path)
    raw = _read_bytes(path)
    try:
        value = _PlainUnpickler(io.BytesIO(raw)).load()
    except _Refused as error:
        raise DataError(f"{path}: refused to unpickle it: {error}; a {META_FILE} holds only "
                        "dicts, lists, strings and numbers (delete the file, or give "
                        "--set vocab_size=N)") from None
    except Exception as error:  # a damaged pickle raises any of a dozen kinds
        raise DataError(f"{path}: not a readable pickle ({type(error).__name__}: "
                        f"{error})") from None
    pending = [value]
    while pending:  # iterative: a deeply nested list must not overflow the stack
        item = pending.pop()
        if type(item) not in _PLAIN_TYPES:
            raise DataError(f"{path}: refused: it holds a {type(item).__name__}, where a "
                            f"{META_FILE} holds only dicts, lists, strings and numbers (delete "
                            "the file, or give --set vocab_size=N)")
        if type(item) is dict:
            pending.extend(item.keys())
            pending.extend(item.values())
        elif type(item) is list:
            pending.extend(item)
    if type(value) is not dict:
        raise DataError(f"{path}: expected a dict (nanoGPT's {META_FILE}), got a "
                        f"{type(value).__name__}")
    return value


def meta_vocab_size(meta: dict, path: str | os.PathLike) -> int:
    """The vocab_size entry of a meta.pkl's dict, a positive int."""
    size = meta.get("vocab_size")
    if type(size) is not int or size < 1:
        raise DataError(f"{path}: expected a positive int vocab_size, got "
                        f"{'no vocab_size' if 'vocab_size' not in meta else repr(size)} (keys "
                        f"{sorted(map(str, meta))}); give --set vocab_size=N")
    return size


_PLAIN_TYPES = (dict, list, str, int, float, bool, type(None))


class _Refused(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes make; a class or function (the only way a pickle
    can run code: it calls them) and persistent ids are refused before anything is called."""

    def find_class(self, module, name):
        raise _Refused(f"it refers to {module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id")


def check_length(dataset: Dataset, seq_len: int) -> None:
    """Each split must hold at least one window of seq_len + 1 tokens."""
    for name, tokens in (("training", dataset.train), ("validation", dataset.val)):
        if tokens.size < seq_len + 1:
            raise DataError(
                f"{dataset.source}: the {name} split has {tokens.size} tokens, fewer than one "
                f"sequence of seq_len + 1 = {seq_len + 1} ({dataset.split})")


def train_batch(tokens: np.ndarray, step: int, seed: int, batch_size: int,
                seq_len: int, *, rows: slice = slice(None)) -> np.ndarray:
    """int32 [batch_size, seq_len + 1]: step `step`'s windows (inputs [:, :-1], targets [:, 1:]);
    with `rows`, only those rows of it (what one process of several reads)."""
    rng = np.random.Generator(np.random.PCG64([seed, _TRAIN_STREAM, step]))
    starts = rng.integers(0, tokens.size - seq_len, size=batch_size)  # last start: size-seq_len-1
    return _windows(tokens, starts[rows], seq_len)


def eval_batches(tokens: np.ndarray, num_batches: int, batch_size: int,
                 seq_len: int) -> list[np.ndarray]:
    """The validation windows, evenly spaced over the split, the same for every evaluation."""
    count = num_batches * batch_size
    starts = np.linspace(0, tokens.size - seq_len - 1, count).round().astype(np.int64)
    return [_windows(tokens, starts[i * batch_size:(i + 1) * batch_size], seq_len)
            for i in range(num_batches)]


def unigram_loss(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


# --- reading -----------------------------------------------------------------------------------


def _files_under(root: Path):
    """Regular, non-hidden files under root, sorted by relative path (not following links to
    folders, so the walk ends)."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(Path(folder) / n for n in names
                     if not n.startswith(".") and (Path(folder) / n).is_file())
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _with_meta(dataset: Dataset, folder: Path) -> Dataset:
    """The dataset with the folder's meta.pkl, where it has one (read when it is needed)."""
    meta = folder / META_FILE
    return dataclasses.replace(dataset, meta=str(meta)) if meta.is_file() else dataset


def _split_pair(folder: Path):
    for ext in (".bin", ".npy"):
        pair = tuple(folder / f"{name}{ext}" for name in _SPLIT_FILES)
        if all(p.is_file() for p in pair):
            return pair
    return None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read it: {error.strerror or error}") from None


def _is_token_file(path: Path) -> bool:
    return path.suffix in (".bin", ".npy")


def _read_tokens(path: Path, vocab_size: int | None) -> np.ndarray:
    """A 1-D token array from a .bin, .npy or text file, with every id checked < vocab_size."""
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except OSError as error:
            raise DataError(f"{path}: cannot read it: {error.strerror or error}") from None
        except ValueError as error:
            raise DataError(f"{path}: not a valid .npy file ({error})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"{path}: expected a 1-D integer array of token ids, got "
                            f"{tokens.ndim}-D {tokens.dtype}")
    elif path.suffix == ".bin":
        size = _file_size(path)
        if size % 2:
            raise DataError(f"{path}: {size} bytes is not a whole number of uint16 token ids; "
                            "is it a nanoGPT-style .bin (uint16 little-endian)?")
        if size == 0:
            raise DataError(f"{path}: the file is empty")
        try:
            tokens = np.memmap(path, dtype="<u2", mode="r")
        except (OSError, ValueError) as error:
            raise DataError(f"{path}: cannot read it: {error}") from None
    else:
        tokens = np.frombuffer(_read_bytes(path), dtype=np.uint8)
    if vocab_size is not None:
        _check_ids(tokens, vocab_size, str(path))
    return tokens


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as error:
        raise DataError(f"{path}: cannot read it: {error.strerror or error}") from None


def _check_ids(tokens: np.ndarray, vocab_size: int | None, where: str) -> None:
    if tokens.size == 0:
        raise DataError(f"{where}: holds no tokens")
    if vocab_size is None:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        position = int(np.argmax(tokens == bad))
        raise DataError(f"{where}: token id {bad} at position {position} is outside "
                        f"[0, vocab_size={vocab_size})")


def _split_files(root: Path, files: list[Path], vocab_size: int | None, source: str) -> Dataset:
    parts = {True: [], False: []}  # validation?
    for path in files:
        relative = path.relative_to(root).as_posix()
        parts[zlib.crc32(relative.encode()) % VALIDATION_BUCKETS == 0].append(
            _read_bytes(path))
    train, val = (np.frombuffer(b"".join(parts[v]), dtype=np.uint8) for v in (False, True))
    if train.size == 0 or val.size == 0:  # too few files (or only empty ones) on one side
        tokens = train if train.size else val
        _check_ids(tokens, vocab_size, source)
        return _tail_split(tokens, source, text=True)
    for split, name in ((train, "training"), (val, "validation")):
        _check_ids(split, vocab_size, f"{source} ({name} files)")
    return Dataset(train, val, source,
                   f"by file: crc32(relative path) % {VALIDATION_BUCKETS} == 0 -> validation "
                   f"({len(parts[True])} of {len(files)} files)", text=True)


def _tail_split(tokens: np.ndarray, source: str, text: bool) -> Dataset:
    if tokens.size == 0:
        raise DataError(f"{source}: holds no tokens")
    cut = tokens.size - max(1, int(tokens.size * VALIDATION_FRACTION))
    return Dataset(tokens[:cut], tokens[cut:], source,
                   f"the last {VALIDATION_FRACTION:.0%} of tokens -> validation", text=text)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens[index], dtype=np.int32)


def _fingerprint(tokens: np.ndarray, edge: int = 1 << 20) -> int:
    """crc32 of the first and last `edge` tokens: cheap even for a multi-GB .bin."""
    crc = zlib.crc32(np.ascontiguousarray(tokens[:edge]).tobytes())
    return zlib.crc32(np.ascontiguousarray(tokens[-edge:]).tobytes(), crc)
