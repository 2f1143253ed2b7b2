"""The trainer's data: sources, the fixed split, step-keyed batches, and clear errors."""

from __future__ import annotations

import os
import pickle
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from nodrop.train import data
from nodrop.train.data import DataError


def write_tokens_bin(path: Path, tokens) -> Path:
    np.asarray(tokens, dtype="<u2").tofile(path)
    return path


# --- sources and the split -------------------------------------------------------------------


def test_stdlib_default_is_deterministic_and_split_by_file_hash():
    first = data.load(None, 256)
    second = data.load(None, 256)
    assert first.describe() == second.describe()
    assert first.train.dtype == np.uint8 and first.train.size > 1_000_000
    assert 0.02 < first.val.size / (first.train.size + first.val.size) < 0.3
    # Rebuild the split from the rule the module documents: sorted .py files outside
    # site-packages, crc32(relative path) % 10 == 0 -> validation.
    root = data.stdlib_root()
    files = sorted((p for p in root.rglob("*.py") if p.is_file()
                    and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
                    and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    val = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % 10 == 0]
    assert first.val.size == sum(p.stat().st_size for p in val)
    assert first.train.size == sum(p.stat().st_size for p in files) - first.val.size
    assert bytes(first.val[:200]) == val[0].read_bytes()[:200]


def test_text_file_keeps_its_last_tenth_for_validation(tmp_path):
    text = bytes(range(256)) * 40
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    dataset = data.load(path, 256)
    cut = len(text) - len(text) // 10
    assert bytes(dataset.train) == text[:cut] and bytes(dataset.val) == text[cut:]
    assert "last 10%" in dataset.split


def test_folder_is_split_by_relative_path_hash_and_skips_hidden_files(tmp_path):
    contents = {}
    for i in range(40):
        name = f"sub{i % 3}/file{i}.txt"
        contents[name] = f"file {i}\n".encode() * (i + 1)
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(contents[name])
    (tmp_path / ".hidden.txt").write_bytes(b"\x00" * 1000)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "objects").write_bytes(b"\x00" * 1000)
    dataset = data.load(tmp_path, 256)
    names = sorted(contents)
    val = [n for n in names if zlib.crc32(n.encode()) % 10 == 0]
    assert val, "the fixture should put some files into validation"
    assert bytes(dataset.val) == b"".join(contents[n] for n in val)
    assert bytes(dataset.train) == b"".join(contents[n] for n in names if n not in val)


def test_folder_whose_hash_split_is_one_sided_falls_back_to_the_tail(tmp_path):
    (tmp_path / "only.txt").write_bytes(b"abcdefghij" * 100)  # one file: one side is empty
    dataset = data.load(tmp_path, 256)
    assert dataset.train.size == 900 and dataset.val.size == 100


def test_folder_with_train_and_val_bins_uses_them_as_the_splits(tmp_path):
    write_tokens_bin(tmp_path / "train.bin", np.arange(1000) % 300)
    write_tokens_bin(tmp_path / "val.bin", np.arange(200) % 7)
    dataset = data.load(tmp_path, 300)
    assert dataset.train.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(dataset.train, np.arange(1000) % 300)
    np.testing.assert_array_equal(dataset.val, np.arange(200) % 7)


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_a_train_token_file_alone_is_read_as_tokens_and_split_at_its_tail(tmp_path, suffix):
    tokens = (np.arange(1000) * 7) % 300
    if suffix == ".bin":
        write_tokens_bin(tmp_path / "train.bin", tokens)
    else:
        np.save(tmp_path / "train.npy", tokens.astype(np.int32))
    (tmp_path / "README").write_text("not data")  # beside the token file, as with a pair
    said = []
    dataset = data.load(tmp_path, 300, echo=said.append)
    np.testing.assert_array_equal(dataset.train, tokens[:900])  # ids, not the file's bytes
    np.testing.assert_array_equal(dataset.val, tokens[900:])
    assert not dataset.text
    assert said == [f"nodrop: {tmp_path} holds train{suffix} but no val{suffix}: validation is "
                    f"the last 10% of train{suffix}'s tokens"]
    assert dataset.describe()["split"] == (f"train{suffix}: the last 10% of tokens -> "
                                           "validation")


def test_token_files_in_a_folder_of_text_are_refused_not_read_as_text(tmp_path):
    (tmp_path / "notes.txt").write_text("some text\n" * 50)
    write_tokens_bin(tmp_path / "shard-0.bin", np.arange(100))
    with pytest.raises(DataError, match=(
            f"^{tmp_path}: expected text files or train.bin/val.bin \\(train.npy/val.npy\\), "
            r"got token files \(shard-0.bin\) among the files, which are read as text; name a "
            r"token file itself as --data$")):
        data.load(tmp_path, 256)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    errors = []

    def load():
        try:
            data.load(fifo, 256)
        except DataError as error:
            errors.append(str(error))

    reader = threading.Thread(target=load, daemon=True)  # a blocked open would hang it
    reader.start()
    reader.join(timeout=30)
    assert errors == [f"{fifo}: expected a regular file or a folder, got a FIFO (named pipe)"]


def test_a_device_is_refused():
    with pytest.raises(DataError, match="^/dev/null: expected a regular file or a folder, got "
                                        "a character device$"):
        data.load("/dev/null", 256)


def test_npy_of_token_ids(tmp_path):
    tokens = (np.arange(5000) * 7) % 1000
    np.save(tmp_path / "ids.npy", tokens.astype(np.int32))
    dataset = data.load(tmp_path / "ids.npy", 1000)
    np.testing.assert_array_equal(np.concatenate([dataset.train, dataset.val]), tokens)


# --- errors ----------------------------------------------------------------------------------


# --- the vocabulary of token ids ----------------------------------------------------------------


def write_meta(folder: Path, meta) -> Path:
    path = folder / "meta.pkl"
    path.write_bytes(pickle.dumps(meta))
    return path


def gpt2_ids(count: int = 3000) -> np.ndarray:
    """GPT-2 token ids spread over its vocabulary, ending in <|endoftext|> (50256)."""
    ids = np.arange(count) * 17 % 50257
    ids[-1] = 50256
    return ids


def test_the_vocabulary_of_gpt2_ids_is_the_largest_id_rounded_up_to_64(tmp_path):
    write_tokens_bin(tmp_path / "train.bin", gpt2_ids())
    write_tokens_bin(tmp_path / "val.bin", np.arange(300) % 100)
    size, why = data.vocabulary(data.load(tmp_path, None))
    assert size == 50304
    assert why == ("the largest token id, 50256, + 1 rounded up to a multiple of 64, as nanoGPT "
                   "pads GPT-2's 50257 tokens to 50304 for faster matmuls")
    np.save(tmp_path / "ids.npy", np.asarray([0, 5, 64, 3]))  # 65 ids -> 128; 64 stays 64
    assert data.vocabulary(data.load(tmp_path / "ids.npy", None))[0] == 128
    np.save(tmp_path / "ids.npy", np.asarray([0, 5, 63, 3]))
    assert data.vocabulary(data.load(tmp_path / "ids.npy", None))[0] == 64


@pytest.mark.parametrize("layout", ["pair", "train alone", "file"])
def test_meta_pkl_gives_the_vocabulary_of_a_char_level_folder(tmp_path, layout):
    chars = sorted(set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))
    assert len(chars) == 65  # nanoGPT's shakespeare_char
    meta = write_meta(tmp_path, {"vocab_size": 65, "itos": dict(enumerate(chars)),
                                 "stoi": {c: i for i, c in enumerate(chars)}})
    write_tokens_bin(tmp_path / "train.bin", np.arange(1000) % 60)
    if layout == "pair":
        write_tokens_bin(tmp_path / "val.bin", np.arange(100) % 60)
    dataset = data.load(tmp_path / "train.bin" if layout == "file" else tmp_path, None)
    assert dataset.meta == str(meta)
    assert data.vocabulary(dataset) == (65, f"the vocab_size of {meta} (nanoGPT's meta.pkl)")
    assert "meta" not in dataset.describe()  # what resume compares is as before


def test_ids_past_meta_pkls_vocab_size_name_both(tmp_path):
    meta = write_meta(tmp_path, {"vocab_size": 65})
    tokens = np.arange(1000) % 60
    tokens[123] = 70
    write_tokens_bin(tmp_path / "train.bin", tokens)
    write_tokens_bin(tmp_path / "val.bin", np.arange(100) % 60)
    with pytest.raises(DataError) as error:
        data.vocabulary(data.load(tmp_path, None))
    assert str(error.value) == (
        f"{tmp_path} (training split): token id 70 at position 123 is outside [0, "
        f"vocab_size=65), the vocab_size of {meta}: the token files and meta.pkl disagree (is "
        "meta.pkl from other data?)")


def test_a_meta_pkl_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    raw = pickle.dumps({"vocab_size": 65, "itos": Payload()})
    (tmp_path / "meta.pkl").write_bytes(raw)
    write_tokens_bin(tmp_path / "train.bin", np.arange(1000) % 60)
    dataset = data.load(tmp_path, None)
    with pytest.raises(DataError, match=(
            rf"^{tmp_path / 'meta.pkl'}: refused to unpickle it: it refers to "
            r"(posix|os)\.system; a meta.pkl holds only dicts, lists, strings and numbers")):
        data.vocabulary(dataset)
    assert not marker.exists()
    pickle.loads(raw)  # the payload is live: an ordinary unpickler runs it
    assert marker.exists()


@pytest.mark.parametrize("meta, message", [
    ({"vocab_size": 65, "shape": (1, 2)}, "refused: it holds a tuple, where a meta.pkl holds "
                                          "only dicts, lists, strings and numbers"),
    ({"vocab_size": 65, "raw": b"ab"}, "refused: it holds a bytes"),
    ([65], "expected a dict \\(nanoGPT's meta.pkl\\), got a list"),
    ({"itos": {}}, "expected a positive int vocab_size, got no vocab_size \\(keys \\['itos'\\]\\)"),
    ({"vocab_size": True}, "expected a positive int vocab_size, got True"),
    ({"vocab_size": 0}, "expected a positive int vocab_size, got 0"),
])
def test_an_unusable_meta_pkl_is_refused_naming_it(tmp_path, meta, message):
    path = write_meta(tmp_path, meta)
    write_tokens_bin(tmp_path / "train.bin", np.arange(1000) % 60)
    with pytest.raises(DataError, match=f"^{path}: {message}"):
        data.vocabulary(data.load(tmp_path, None))


def test_a_damaged_meta_pkl_is_one_clear_error(tmp_path):
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65})[:-3])
    write_tokens_bin(tmp_path / "train.bin", np.arange(1000) % 60)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'meta.pkl'}: not a readable pickle"):
        data.vocabulary(data.load(tmp_path, None))


def test_text_has_no_vocabulary_of_its_own(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    with pytest.raises(DataError, match="holds text, not token ids"):
        data.vocabulary(data.load(tmp_path / "a.txt", None))


def test_an_explicit_vocabulary_below_the_ids_names_the_flag(tmp_path):
    write_tokens_bin(tmp_path / "train.bin", gpt2_ids())
    write_tokens_bin(tmp_path / "val.bin", np.arange(300) % 100)
    dataset = data.load(tmp_path, None)
    with pytest.raises(DataError) as error:
        data.check_ids(dataset, 256, "--set vocab_size")
    assert str(error.value) == (  # the largest id, and where it first is
        f"{tmp_path} (training split): token id 50256 at position 2999 is outside [0, "
        "vocab_size=256); vocab_size=256 was set by --set "
        "vocab_size: leave it unset to take the vocabulary from the data, or set at least 50257 "
        "(--set vocab_size=50304)")


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt: no such file or folder"):
        data.load(tmp_path / "nope.txt", 256)


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("x" * 100)

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # root ignores file modes
    with pytest.raises(DataError, match=r"secret\.txt: cannot read it: Permission denied"):
        data.load(path, 256)


def test_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt: holds no tokens"):
        data.load(tmp_path / "empty.txt", 256)


@pytest.mark.parametrize("suffix", [".bin", ".npy", ".txt"])
def test_ids_out_of_range_are_named_with_the_file(tmp_path, suffix):
    tokens = np.arange(100) % 50
    tokens[37] = 300
    path = tmp_path / f"ids{suffix}"
    if suffix == ".bin":
        write_tokens_bin(path, tokens)
        vocab = 256
    elif suffix == ".npy":
        np.save(path, tokens.astype(np.int64))
        vocab = 256
    else:  # bytes against a vocabulary smaller than 256
        path.write_bytes(bytes(np.where(tokens == 300, 200, tokens).astype(np.uint8)))
        vocab = 128
    bad = 200 if suffix == ".txt" else 300
    with pytest.raises(DataError, match=rf"ids{suffix}: token id {bad} at position 37 is "
                                        rf"outside \[0, vocab_size={vocab}\)"):
        data.load(path, vocab)


def test_negative_ids_in_npy(tmp_path):
    np.save(tmp_path / "neg.npy", np.asarray([1, 2, -5, 3], np.int32))
    with pytest.raises(DataError, match=r"neg\.npy: token id -5 at position 2"):
        data.load(tmp_path / "neg.npy", 256)


def test_corrupt_npy(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.arange(1000, dtype=np.int32))
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(good.read_bytes()[:500])
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"this is not numpy" * 10)
    for path in (truncated, garbage):
        with pytest.raises(DataError, match=rf"{path.name}: not a valid \.npy file"):
            data.load(path, 256)


@pytest.mark.parametrize("array, what", [
    (np.zeros((10, 10), np.int32), "2-D int32"),
    (np.linspace(0, 1, 100), "1-D float64"),
])
def test_npy_must_be_a_1d_integer_array(tmp_path, array, what):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(DataError, match=rf"bad\.npy: expected a 1-D integer array .* got {what}"):
        data.load(tmp_path / "bad.npy", 256)


def test_bin_with_an_odd_byte_count(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.bin: 3 bytes is not a whole number of uint16"):
        data.load(tmp_path / "odd.bin", 256)


def test_data_too_short_for_one_sequence(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"x" * 300)
    dataset = data.load(tmp_path / "short.txt", 256)
    data.check_length(dataset, 29)  # validation has 30 tokens: exactly one window of 30
    with pytest.raises(DataError, match=r"short\.txt: the validation split has 30 tokens, fewer "
                                        r"than one sequence of seq_len \+ 1 = 31"):
        data.check_length(dataset, 30)


# --- batches ---------------------------------------------------------------------------------


def test_train_batches_are_keyed_by_seed_and_step():
    tokens = np.arange(10_000, dtype=np.int32)
    batch = data.train_batch(tokens, step=5, seed=3, batch_size=8, seq_len=16)
    assert batch.dtype == np.int32 and batch.shape == (8, 17)
    # Each row is a contiguous window of the data.
    np.testing.assert_array_equal(batch, batch[:, :1] + np.arange(17))
    np.testing.assert_array_equal(batch, data.train_batch(tokens, 5, 3, 8, 16))
    assert not np.array_equal(batch, data.train_batch(tokens, 6, 3, 8, 16))
    assert not np.array_equal(batch, data.train_batch(tokens, 5, 4, 8, 16))


def test_train_windows_reach_both_ends_of_the_data():
    tokens = np.arange(20, dtype=np.int32)
    starts = {int(data.train_batch(tokens, step, 0, 16, 9)[i, 0])
              for step in range(20) for i in range(16)}
    assert starts == set(range(11))  # every start from 0 to size - (seq_len + 1)


def test_eval_batches_are_fixed_and_evenly_spaced():
    tokens = np.arange(1000, dtype=np.int32)
    batches = data.eval_batches(tokens, num_batches=3, batch_size=4, seq_len=9)
    assert len(batches) == 3 and all(b.shape == (4, 10) for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert starts[0] == 0 and starts[-1] == 990  # the last window ends at the last token
    assert np.all(np.diff(starts) > 0)
    again = data.eval_batches(tokens, 3, 4, 9)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))


def test_unigram_loss():
    assert data.unigram_loss(np.arange(256 * 4) % 256, 256) == pytest.approx(np.log(256))
    assert data.unigram_loss(np.zeros(100, np.uint8), 256) == 0.0
    two = np.asarray([0] * 3 + [1], np.uint8)
    assert data.unigram_loss(two, 256) == pytest.approx(-(0.75 * np.log(0.75)
                                                           + 0.25 * np.log(0.25)))
