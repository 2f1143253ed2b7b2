"""Subword tokens: the byte-level BPE the trainer trains on the training split, a given
tokenizer.json, the cache, and what the run folder keeps of them."""

from __future__ import annotations

import needs_train  # noqa: F401  (first: skips this module without nodrop[train])

import json
import re
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from nodrop import cli
from nodrop.train import data, tokenizer, trainer
from nodrop.train.config import ConfigError, build, overrides_from_args

SMALL_MODEL = {"num_layers": 1, "hidden": 32, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
               "dense_ffn": 64, "num_experts": 4, "expert_ffn": 32, "vocab_size": 512}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("NODROP_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder of real Python files, about 400 kB, one of them with a byte that is not UTF-8."""
    folder = tmp_path_factory.mktemp("corpus")
    for name in ("argparse.py", "dataclasses.py", "typing.py", "inspect.py"):
        (folder / name).write_bytes((data.stdlib_root() / name).read_bytes())
    (folder / "latin1.py").write_bytes("# caf\u00e9\nx = 1\n".encode("latin-1"))
    return folder


def run_overrides(source: Path, **changes) -> dict:
    return {"data": str(source), "tokenizer": "bpe", "model_overrides": dict(SMALL_MODEL),
            "steps": 4, "batch_size": 2, "seq_len": 32, "eval_every": 4, "eval_batches": 1,
            "checkpoint_every": 2, "log_every": 2, **changes}


def test_bpe_is_trained_once_deterministically_and_round_trips_text(corpus, cache):
    dataset = data.load(corpus, None)
    first = tokenizer.train_bpe(dataset.train, 512)
    assert first.get_vocab_size() == 512
    cached = sorted(p.name for p in cache.iterdir())
    assert len(cached) == 2  # the tokenizer and its checksum
    for entry in cached:
        (cache / entry).unlink()
    again = tokenizer.train_bpe(dataset.train, 512)  # trained anew: the same merges
    assert tokenizer.sha256(again) == tokenizer.sha256(first)

    tokens = tokenizer.encode(dataset.val, first)
    assert tokens.dtype == np.uint16 and tokens.max() < 512
    assert 2.0 < dataset.val.size / tokens.size < 6.0  # bytes a token: subwords, not bytes
    text = bytes(dataset.val).decode("utf-8", errors="replace")
    assert first.decode(tokens.tolist(), skip_special_tokens=False) == text


def test_a_damaged_cache_entry_is_made_again(corpus, cache):
    dataset = data.load(corpus, None)
    bpe = tokenizer.train_bpe(dataset.train, 300)
    tokens = tokenizer.encode(dataset.train, bpe)
    [entry] = [p for p in cache.glob("tokens-*.npy")]
    damaged = bytearray(entry.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    entry.write_bytes(bytes(damaged))
    np.testing.assert_array_equal(tokenizer.encode(dataset.train, bpe), tokens)


def test_a_run_trains_saves_and_resumes_with_its_tokenizer(corpus, tmp_path):
    run_dir = tmp_path / "run"
    trainer.run(run_overrides(corpus), out=run_dir, progress=False, echo=lambda *_: None)
    saved = tokenizer.load(run_dir / tokenizer.FILE)
    described = json.loads((run_dir / trainer.CONFIG_FILE).read_text())["data"]["tokenizer"]
    assert described["kind"] == "bpe" and described["vocab_size"] == 512
    assert described["sha256"] == tokenizer.sha256(saved)
    assert described["bytes_not_utf8"] == 1  # the latin-1 é, on whichever side it fell

    summary = trainer.run(run_overrides(corpus, steps=6), out=run_dir, resume=True,
                          progress=False, echo=lambda *_: None)
    assert summary.steps == 6

    # A different tokenizer in the folder changes the tokens: the resume is refused.
    other = tokenizer.train_bpe(data.load(corpus, None).train, 400)
    (run_dir / tokenizer.FILE).write_text(other.to_str())
    with pytest.raises(ConfigError, match="the data differs"):
        trainer.run(run_overrides(corpus, steps=8), out=run_dir, resume=True, progress=False,
                    echo=lambda *_: None)
    (run_dir / tokenizer.FILE).write_text("{not json")
    with pytest.raises(data.DataError, match=r"tokenizer\.json: not a valid"):
        trainer.run(run_overrides(corpus, steps=8), out=run_dir, resume=True, progress=False,
                    echo=lambda *_: None)


def test_a_given_tokenizer_file_sets_the_vocabulary(corpus, tmp_path):
    path = tmp_path / "my-tokenizer.json"
    path.write_text(tokenizer.train_bpe(data.load(corpus, None).train, 300).to_str())
    model = dict(SMALL_MODEL)
    del model["vocab_size"]
    config, model_config = build(run_overrides(corpus, tokenizer=str(path),
                                               model_overrides=model))
    assert model_config.vocab_size == 300
    dataset, *_ = trainer.load_data(config, model_config, echo=lambda *_: None)
    assert dataset.describe()["tokenizer"]["kind"] == str(path)
    assert int(dataset.train.max()) < 300


@pytest.mark.parametrize("case, message", [
    ("token ids", "holds token ids, not text: it needs no tokenizer"),
    ("vocab 256", "needs more than the 256 byte tokens; model.vocab_size is 256"),
    ("too large", "has 300 tokens, more than model.vocab_size=280"),
    ("not a file", "missing.json: cannot read it: No such file or directory"),
])
def test_unusable_tokenizer_settings_are_clear_errors(corpus, tmp_path, case, message):
    overrides = run_overrides(corpus)
    if case == "token ids":
        np.save(tmp_path / "ids.npy", np.arange(1000) % 256)
        overrides["data"] = str(tmp_path / "ids.npy")
    elif case == "vocab 256":
        overrides["model_overrides"]["vocab_size"] = 256
    elif case == "too large":
        path = tmp_path / "t.json"
        path.write_text(tokenizer.train_bpe(data.load(corpus, None).train, 300).to_str())
        overrides.update(tokenizer=str(path))
        overrides["model_overrides"]["vocab_size"] = 280
    else:
        overrides["tokenizer"] = str(tmp_path / "missing.json")
    with pytest.raises(data.DataError, match=message):
        config, model_config = build(overrides)
        trainer.load_data(config, model_config, echo=lambda *_: None)


def test_the_flag_and_the_presets_defaults(tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--tokenizer", "none"])
    assert overrides_from_args(args)["tokenizer"] is None
    args = parser.parse_args(["train", "--tokenizer", "bpe"])
    assert overrides_from_args(args)["tokenizer"] == "bpe"
    args = parser.parse_args(["train", "--tokenizer", "t.json"])
    assert Path(overrides_from_args(args)["tokenizer"]).is_absolute()
    for name, aux in (("small", 0.01), ("mixtral", 0.1), ("deepseek", 0.1), ("qwen3", 0.1)):
        config, model = build({"preset": name})
        assert (config.tokenizer, model.vocab_size, config.aux_loss_coef) == ("bpe", 8192, aux)
    config, model = build({"preset": "tiny"})
    assert (config.tokenizer, model.vocab_size) == (None, 256)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_tokenizer_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    path = tmp_path / "tokenizer.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    errors = []

    def load():
        try:
            tokenizer.load(path)
        except data.DataError as error:
            errors.append(str(error))

    reader = threading.Thread(target=load, daemon=True)  # a blocked open would hang it
    reader.start()
    reader.join(timeout=30)
    got = "a FIFO (named pipe)" if kind == "fifo" else "a folder"
    assert errors == [f"{path}: expected a regular file, got {got}"]


def test_a_character_map_round_trips_text_and_refuses_what_is_not_one():
    stoi = {c: i for i, c in enumerate("\n !abc")}
    characters = tokenizer.from_meta({"vocab_size": 6, "stoi": stoi}, "meta.pkl")
    text = "abc cab!\n\nba"
    ids = characters.encode(text, add_special_tokens=False).ids
    assert ids == [stoi[c] for c in text] and characters.decode(ids) == text
    assert tokenizer.unknown_characters(characters, "abXcY") == ["X", "Y"]
    assert tokenizer.from_meta({"vocab_size": 50257}, "meta.pkl") is None  # no map: GPT-2 ids
    for stoi, found in [([("a", 0)], "got list"), ({"ab": 0}, "got the entries [('ab', 0)]"),
                        ({"a": -1}, "got the entries [('a', -1)]"),
                        ({"a": 0, "b": 0}, "got ids used twice")]:
        with pytest.raises(data.DataError, match=r"^m.pkl: stoi must map single characters to "
                           r"distinct ids >= 0 \(nanoGPT's character-level meta.pkl\), "
                           + re.escape(found) + "$"):
            tokenizer.from_meta({"stoi": stoi}, "m.pkl")
