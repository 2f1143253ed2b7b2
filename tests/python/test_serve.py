"""Using a trained model: nodrop.load, nodrop export, nodrop generate, nodrop eval, on tiny runs
trained here (bytes and BPE)."""

from __future__ import annotations

import needs_train  # noqa: F401  (first: skips this module without nodrop[train])

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import nodrop
from nodrop import cli
from nodrop.serve.generate import generate
from nodrop.train import data, invariance, trainer
from nodrop.train.config import overrides_from_args

MODEL_FLAGS = ["--set", "num_layers=2", "--set", "hidden=32", "--set", "num_heads=2",
               "--set", "num_kv_heads=1", "--set", "head_dim=16", "--set", "dense_ffn=64",
               "--set", "num_experts=4", "--set", "expert_ffn=32", "--set", "seq_len=64"]


def train(out: Path, text_file: Path, *extra: str) -> Path:
    args = cli.build_parser().parse_args([
        "train", *MODEL_FLAGS, "--no-progress", "--data", str(text_file), "--steps", "30",
        "--batch-size", "4", "--seq-len", "32", "--eval-every", "30", "--eval-batches", "2",
        "--checkpoint-every", "30", "--bias-update-rate", "0.01", "--out", str(out), *extra])
    trainer.run(overrides_from_args(args), out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((data.stdlib_root() / "argparse.py").read_bytes()[:60_000])
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, text_file) -> Path:
    return train(tmp_path_factory.mktemp("runs") / "bytes", text_file)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exports") / "bytes"
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    return out


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_an_export_is_much_smaller_and_gives_bitwise_the_same_logits(run, exported):
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    assert size(exported) < size(run / "checkpoints" / "30") / 2  # no optimizer state
    from_run, from_export = nodrop.load(run), nodrop.load(exported)
    assert (from_run.step, from_export.step) == (30, 30)
    assert from_run.config == from_export.config and from_export.tokenizer is None
    tokens = jnp.asarray([from_run.encode("def parse_args(self, args=None):")], jnp.int32)
    np.testing.assert_array_equal(np.asarray(from_run.model(tokens)[0]),
                                  np.asarray(from_export.model(tokens)[0]))


def test_greedy_generation_with_the_cache_equals_rerunning_the_full_sequence(run):
    loaded = nodrop.load(run)
    prompt = loaded.encode("    def add_argument(self")
    cached = generate(loaded, prompt, max_tokens=24, temperature=0)
    sequence = list(prompt)
    for _ in range(24):
        logits = loaded.model(jnp.asarray([sequence], jnp.int32))[0]
        sequence.append(int(jnp.argmax(logits[0, -1])))
    assert cached == sequence[len(prompt):]
    assert len(set(cached)) > 1  # a trained model, not one repeated token


def test_generation_stops_at_seq_len_and_sampling_follows_the_seed(run):
    loaded = nodrop.load(run)
    prompt = loaded.encode("x" * 60)
    assert len(generate(loaded, prompt, max_tokens=50, temperature=0)) == 64 + 1 - 60
    sampled = [generate(loaded, prompt[:5], max_tokens=20, temperature=1.0, top_k=20,
                        top_p=0.9, seed=seed) for seed in (0, 0, 1)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_the_cli_generates_and_evaluates_a_run_and_its_export(run, exported, capsys):
    assert cli.main(["generate", "--run", str(exported), "--prompt", "import ",
                     "--temperature", "0", "--max-tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import ") and len(out) > len("import \n")
    results = []
    for folder in (run, exported):
        assert cli.main(["eval", "--run", str(folder), "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["loss"] == results[1]["loss"]
    summary = json.loads((run / "summary.json").read_text())
    assert results[0]["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert results[0]["perplexity"] == pytest.approx(np.exp(results[0]["loss"]))


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "y" * 65], "--prompt must be 1 to seq_len=64 tokens, got 65"),
    (["--prompt", "", "--temperature", "0"], "--prompt must be 1 to seq_len=64 tokens, got 0"),
    (["--prompt", "a", "--temperature", "-1"], "--temperature must be a finite number >= 0, "
                                               "got -1.0"),
    (["--prompt", "a", "--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
])
def test_bad_generation_input_is_one_line(run, capsys, argv, message):
    assert cli.main(["generate", "--run", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"nodrop generate: error: {message}\n"


def test_a_folder_that_is_neither_a_run_nor_an_export_is_one_line(tmp_path, capsys):
    assert cli.main(["eval", "--run", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"nodrop eval: error: {tmp_path} is neither a run folder (config.json, checkpoints/) "
        "nor an export folder (model.safetensors, config.json)\n")


def test_loading_a_run_checks_the_params_crc32_and_names_a_missing_step(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    meta = copy / "checkpoints" / "30" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record["crc32"]["params/embedding/value"] ^= 1  # as if the embedding's bytes had changed
    meta.write_text(json.dumps(record))
    assert cli.main(["eval", "--run", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "params/embedding/value differ from what was saved" in err
    assert cli.main(["export", "--run", str(run), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == (f"nodrop export: error: {run / 'checkpoints'} holds no "
                                       "checkpoint of step 7; it has [30]\n")


def test_a_dropless_models_logits_ignore_the_batch_and_a_capacity_models_do_not(exported):
    """nodrop.train.invariance's measurement, on the exported weights (test_train.py runs it on
    the run folder): a probe sequence next to two sets of batch-mates."""
    dropless, capacity = invariance.measure(exported, capacity_factors=(1.0,), batch_size=4,
                                            probes=3)
    assert dropless.dropped_fraction == 0.0 and dropless.max_rel < 1e-5
    assert capacity.dropped_fraction > 0.0 and capacity.max_rel > 1e-3


def test_a_bpe_run_generates_and_evaluates_text(tmp_path_factory, text_file, capsys):
    run = train(tmp_path_factory.mktemp("runs") / "bpe", text_file, "--tokenizer", "bpe",
                "--set", "vocab_size=320")
    out = tmp_path_factory.mktemp("exports") / "bpe"
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    loaded = nodrop.load(out)
    prompt = loaded.encode("def parse_args(self")
    assert len(prompt) < len("def parse_args(self")  # subword tokens, not bytes
    text = loaded.decode(generate(loaded, prompt, max_tokens=12, temperature=0))
    assert isinstance(text, str) and text
    capsys.readouterr()
    assert cli.main(["eval", "--run", str(out), "--data", str(text_file), "--batches", "1",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 4 * 32
