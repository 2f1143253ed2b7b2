"""`nodrop train` and `nodrop compare` end to end, on a model small enough to train in seconds.

One reference run (in-process, with the test session's x64 on) is shared by the tests that
inspect a run folder or resume it; the kill -9 test runs `python -m nodrop train` in
subprocesses (x64 off) and compares their numbers bitwise with that reference.
"""

from __future__ import annotations

import needs_train  # noqa: F401  (first: skips this module without nodrop[train])

import dataclasses
import datetime
import errno
import json
import math
import os
import pickle
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import nodrop
from nodrop import cli, serve
from nodrop.train import compare, data, lock, plots, tokenizer, trainer
from nodrop.train.config import ConfigError, build, check_backend, overrides_from_args
from nodrop.train.metrics import read_jsonl

MODEL_FLAGS = ["--set", "num_layers=2", "--set", "hidden=32", "--set", "num_heads=2",
               "--set", "num_kv_heads=1", "--set", "head_dim=16", "--set", "dense_ffn=64",
               "--set", "num_experts=4", "--set", "expert_ffn=32"]
STEPS = 30
TIMING_KEYS = {"step_time_s", "tokens_per_s", "elapsed_s", "mfu"}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """60 kB of Python source: enough for a few hundred windows of 33 tokens."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((data.stdlib_root() / "argparse.py").read_bytes()[:60_000])
    return path


def train_flags(text_file: Path, **changes) -> list[str]:
    # The aux-loss-free bias update is on, so that resuming must restore the expert biases.
    flags = {"data": str(text_file), "steps": STEPS, "batch-size": 4, "seq-len": 32,
             "eval-every": 10, "eval-batches": 2, "checkpoint-every": 5, "log-every": 5,
             "bias-update-rate": 0.01, **changes}
    return [*MODEL_FLAGS, "--no-progress",
            *[item for key, value in flags.items() for item in (f"--{key}", str(value))]]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING_KEYS}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file) -> Path:
    """A finished run of STEPS steps, trained in this process."""
    run_dir = tmp_path_factory.mktemp("runs") / "reference"
    args = cli.build_parser().parse_args(["train", *train_flags(text_file), "--out", str(run_dir)])
    trainer.run(overrides_from_args(args), out=run_dir, progress=False)
    return run_dir


# --- a run and its folder --------------------------------------------------------------------


def test_the_run_folder_holds_config_metrics_tensorboard_checkpoints_and_plots(reference):
    config = json.loads((reference / "config.json").read_text())
    assert config["train"]["steps"] == STEPS and config["train"]["seq_len"] == 32
    assert config["train"]["warmup_steps"] == STEPS // 10  # the default: a tenth of the steps
    assert config["model"]["hidden"] == 32 and config["model"]["capacity_factor"] is None
    assert config["data"]["train_tokens"] + config["data"]["val_tokens"] == 60_000

    environment = config["environment"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", environment["git_commit"])  # a git checkout
    assert environment["argv"] == sys.argv  # the reference runs in this process
    assert environment["python"] == platform.python_version()
    for name in ("nodrop", "jax", "jaxlib", "flax", "optax", "orbax"):
        assert re.fullmatch(r"\d+\.\d+.*", environment[name]), name
    assert environment["jax"] == jax.__version__ and environment["cpu"]
    assert environment["accelerator"] is None and environment["devices"] == 1
    started = datetime.datetime.fromisoformat(environment["start_time"])
    assert abs(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() < 3600

    train = records(reference, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert all(math.isfinite(r[k]) for k in ("loss", "ce", "aux_loss", "z_loss",
                                                 "grad_norm", "lr"))
        assert not TIMING_KEYS & set(r)  # no interval's timing repeated on each step
        assert r["dropped_fraction"] == [0.0, 0.0]  # dropless, as counted by the model
        assert len(r["max_over_mean"]) == 2 and min(r["max_over_mean"]) >= 1.0
    # One timing record per log interval (every 5 steps here), an average over its steps.
    timing = records(reference, "timing")
    assert [(r["first_step"], r["step"], r["steps"]) for r in timing] == [
        (s - 4, s, 5) for s in range(5, STEPS + 1, 5)]
    for r in timing:
        assert r["mean_step_time_s"] > 0 and "mfu" not in r  # no peak FLOP/s known for a CPU
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["mean_step_time_s"])
    assert np.all(np.diff([r["elapsed_s"] for r in timing]) > 0)
    assert np.mean([r["ce"] for r in train[-5:]]) < train[0]["ce"] - 0.5
    # Linear warm-up over 3 steps, then cosine decay to a tenth of the peak at the last step.
    lrs = [r["lr"] for r in train]
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert lrs[-1] == pytest.approx(3e-4) and all(np.diff(lrs[2:]) <= 0)
    assert [r["step"] for r in records(reference, "eval")] == [10, 20, 30]
    # The routers' balance over every validation batch: between balanced and every slot on
    # one expert (E / k = 2 for 4 experts top-2).
    for r in records(reference, "eval"):
        assert len(r["val_max_over_mean"]) == 2
        assert all(1.0 <= v <= 2.0 for v in r["val_max_over_mean"])
    assert len(records(reference, "compile")) == 1
    (final,) = records(reference, "final")
    assert final["val_loss"] == records(reference, "eval")[-1]["val_loss"]

    summary = json.loads((reference / "summary.json").read_text())
    assert summary["val_loss"] == final["val_loss"] and summary["dropped_fraction"] == 0.0
    assert 0 < summary["val_loss"] < summary["unigram_loss"] + 1.0
    assert summary["unigram_loss"] == pytest.approx(
        data.unigram_loss(data.load(config["data"]["source"], 256).train, 256))

    assert sorted(int(p.name) for p in (reference / "checkpoints").iterdir()) == [20, 25, 30]
    state = ocp.StandardCheckpointer().restore(reference / "checkpoints" / "30" / "state")
    biases = np.stack([np.asarray(layer["ffn"]["expert_bias"]["value"])
                       for layer in state["model_state"]["layers"].values()])
    assert biases.shape == (2, 4) and np.abs(biases).max() > 0  # moved
    # The proportional rule (softmax routers' default): a step moves an expert by at most the
    # rate, 0.01, and by less where its load is near the mean, so not only by whole steps.
    assert config["train"]["bias_update_rule"] == "proportional"
    assert np.abs(biases).max() <= STEPS * 0.01 + 1e-6
    assert not np.allclose(biases * 100, np.round(biases * 100), atol=1e-3)
    for plot in ("loss.png", "expert_load.png"):
        assert (reference / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/ce", "timing/tokens_per_s", "eval/val_loss",
            "max_over_mean/layer_0", "dropped_fraction/layer_1"} <= tags
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([e.value for e in losses], [r["loss"] for r in train], rtol=1e-6)


def test_resume_extends_the_run_and_skips_an_unfinished_checkpoint(reference, tmp_path, capsys,
                                                                     text_file):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    # A save of step 35 killed half-way: Orbax's temporary folder, never renamed.
    partial = run_dir / "checkpoints" / "35.orbax-checkpoint-tmp-1795950000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text("{")
    code, out, err = run_cli(capsys, "train", *train_flags(text_file, steps=40), "--resume",
                             "--out", str(run_dir))
    assert code == 0, err
    assert f"resuming {run_dir} from step 30" in out
    train = records(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 41))
    # The first 30 steps are the reference's own records, kept as they were.
    assert train[:STEPS] == records(reference, "train")
    assert [r["step"] for r in records(run_dir, "eval")] == [10, 20, 30, 40]
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 40
    assert "validation loss" in out and "unigram baseline" in out
    # The summary tells this process's share from the whole run's, and says which is which.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 30 and summary["run_dir"] == str(run_dir)
    before = json.loads((reference / "summary.json").read_text())["train_time_s"]
    assert summary["train_time_s"] == pytest.approx(before + summary["process_train_time_s"])
    assert summary["tokens_per_s"] == pytest.approx(40 * 4 * 32 / summary["train_time_s"])
    assert "(all 40 steps, before and after the resume)" in out
    assert re.search(r"this process: compile \S+, wall \S+, training \S+ \(steps 31-40, "
                     r"resumed at step 30\)", out), out


def test_the_environment_record_is_not_a_setting(reference, tmp_path, capsys, text_file):
    """Another machine, commit or library version in config.json's environment neither stops a
    resume nor changes what --config repeats; the resume writes its own environment."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    saved = json.loads((run_dir / "config.json").read_text())
    saved["environment"] = {**saved["environment"], "git_commit": "0" * 40, "jax": "0.0.1",
                            "host": "elsewhere", "argv": ["elsewhere"]}
    (run_dir / "config.json").write_text(json.dumps(saved))
    args = cli.build_parser().parse_args(["train", "--config", str(run_dir / "config.json")])
    assert build(overrides_from_args(args)) == build(saved["train"])
    code, out, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir), "--steps", "31",
                             "--no-progress")
    assert code == 0, err
    environment = json.loads((run_dir / "config.json").read_text())["environment"]
    assert environment["jax"] == jax.__version__ and environment["host"] != "elsewhere"


def test_resume_refuses_a_different_configuration_naming_the_fields(reference, tmp_path,
                                                                     capsys, text_file):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = (run_dir / "config.json").read_text()
    code, _, err = run_cli(capsys, "train", *train_flags(text_file, lr=0.01), "--set",
                           "hidden=64", "--resume", "--out", str(run_dir))
    assert code == 2
    assert err.startswith("nodrop train: error: cannot resume")
    assert "lr: 0.003 -> 0.01" in err and "model.hidden: 32 -> 64" in err
    assert "Traceback" not in err
    assert (run_dir / "config.json").read_text() == before
    # Given flags equal to the saved ones, or none at all, are not differences.
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir), "--steps", "29")
    assert code == 2 and "--steps 29 is below the checkpoint's step 30" in err


def test_a_run_saved_before_the_mesh_and_fp8_fields_resumes(reference, tmp_path, capsys, text_file):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    saved = json.loads((run_dir / "config.json").read_text())
    del saved["train"]["mesh"]
    for field in ("ep_buffer_factor", "expert_parallel", "fp8", "router_matmul"):
        del saved["model"][field]
    (run_dir / "config.json").write_text(json.dumps(saved))
    code, out, err = run_cli(capsys, "train", *train_flags(text_file, steps=STEPS + 1),
                             "--resume", "--out", str(run_dir))
    assert code == 0, err
    assert f"resuming {run_dir} from step {STEPS}" in out
    # A field added later and absent from an old run is still a change when it is not inert.
    saved = json.loads((run_dir / "config.json").read_text())
    del saved["train"]["z_loss_coef"]
    (run_dir / "config.json").write_text(json.dumps(saved))
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir))
    assert code == 2 and "z_loss_coef: None -> 0.001" in err, err


def test_a_run_saved_before_the_split_router_default_keeps_its_router_matmul():
    """router_matmul's default became "split" after runs were saved with "float32" (or before
    the field existed): resumed or loaded, they keep the matmul they trained with."""
    config, model = build({})
    assert model.router_matmul == "split"
    saved = {"train": config.to_dict(), "model": {**model.to_dict(), "router_matmul": "float32"}}
    _, resumed = trainer.configure({}, saved)
    assert resumed.router_matmul == "float32"
    del saved["model"]["router_matmul"]
    _, resumed = trainer.configure({}, saved)
    assert resumed.router_matmul == "float32"
    with pytest.raises(ConfigError, match="model.router_matmul: 'float32' -> 'split'"):
        trainer.configure({"model_overrides": {"router_matmul": "split"}}, saved)
    new_run = {"train": config.to_dict(), "model": model.to_dict()}
    assert trainer.configure({}, new_run)[1].router_matmul == "split"


def test_a_run_saved_before_the_unquantised_weight_gradient_default_keeps_fp8():
    """fp8_weight_gradient's default became "unquantised" after FP8 runs were saved with "fp8"
    (or before the field existed): resumed or loaded, they keep the weight gradient they
    trained with; a new run takes the new default."""
    config, model = build({"model_overrides": {"fp8": "blockwise"}})
    assert model.fp8_weight_gradient == "unquantised"
    saved = {"train": config.to_dict(), "model": {**model.to_dict(), "fp8_weight_gradient": "fp8"}}
    assert trainer.configure({}, saved)[1].fp8_weight_gradient == "fp8"
    del saved["model"]["fp8_weight_gradient"]
    assert trainer.configure({}, saved)[1].fp8_weight_gradient == "fp8"
    with pytest.raises(ConfigError, match="model.fp8_weight_gradient: 'fp8' -> 'unquantised'"):
        trainer.configure({"model_overrides": {"fp8_weight_gradient": "unquantised"}}, saved)
    new_run = {"train": config.to_dict(), "model": model.to_dict()}
    assert trainer.configure({}, new_run)[1].fp8_weight_gradient == "unquantised"


def test_a_run_saved_before_the_bias_rule_resumes_with_the_sign_rule():
    """Runs saved before bias_update_rule existed moved their biases by the sign rule; resumed,
    they keep it, where a new softmax run takes the proportional one."""
    config, model = build({})
    saved = {"train": {**config.to_dict(), "bias_update_rate": 0.1},
             "model": model.to_dict()}
    del saved["train"]["bias_update_rule"]
    resumed, _ = trainer.configure({}, saved)
    assert (resumed.bias_update_rule, resumed.bias_update_rate) == ("sign", 0.1)
    assert config.bias_update_rule == "proportional"


def test_resume_refuses_a_checkpoint_that_does_not_fit_the_model(reference, tmp_path, capsys):
    from test_checkpoint import train_state  # a small model's state, another shape

    from nodrop.train.checkpoint import Checkpoints

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    foreign = Checkpoints(run_dir / "checkpoints", keep=5)
    foreign.save(35, train_state(0), {"step": 35, "elapsed_s": 0.0})
    foreign.close()
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir), "--steps", "40")
    assert code == 2
    assert "does not fit this model and optimizer" in err
    assert "params/embedding is float32[256, 16] in the checkpoint but float32[256, 32]" in err
    assert "Traceback" not in err


def damage(folder: Path) -> None:
    """Flips one bit in the middle of the largest file under folder (the arrays' data)."""
    target = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    content = bytearray(target.read_bytes())
    content[len(content) // 2] ^= 0x01
    target.write_bytes(bytes(content))


def test_a_damaged_checkpoint_is_refused_and_an_earlier_one_can_be_taken(reference, tmp_path,
                                                                        capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    damage(run_dir / "checkpoints" / "30" / "state")
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir))
    assert code == 2 and "Traceback" not in err, err
    assert f"{run_dir / 'checkpoints' / '30'}" in err
    assert ("damaged: resume from an earlier one with --resume-from STEP (this run has "
            "[20, 25, 30])") in err, err

    code, out, err = run_cli(capsys, "train", "--resume-from", "25", "--out", str(run_dir))
    assert code == 0, err
    assert "the checkpoints of steps [30] are in" in out + err
    assert (run_dir / "checkpoints-set-aside" / "30" / "state").is_dir()  # kept, not deleted
    got = [without_timing(r) for r in records(run_dir, "train")]
    assert got == [without_timing(r) for r in records(reference, "train")]  # 26-30 retrained


def test_a_checkpoint_under_another_steps_name_is_refused(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "30")
    (run_dir / "checkpoints" / "20").rename(run_dir / "checkpoints" / "30")
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir))
    assert code == 2 and "Traceback" not in err, err
    assert "holds the state of step 20, not of step 30" in err, err
    code, _, err = run_cli(capsys, "train", "--resume-from", "20", "--out", str(run_dir))
    assert code == 2 and "--resume-from 20: " in err and "[25, 30]" in err, err


def test_a_new_run_refuses_a_folder_that_holds_one(reference, capsys, text_file):
    code, _, err = run_cli(capsys, "train", *train_flags(text_file), "--out", str(reference))
    assert code == 2 and "is not empty; continue the run there with --resume" in err


# --- configuration ---------------------------------------------------------------------------


def test_defaults_that_depend_on_the_model_or_the_steps():
    config, model = build({})
    assert (config.preset, config.steps, config.seq_len) == ("tiny", 400, model.seq_len)
    assert config.warmup_steps == 40  # softmax: the proportional rule
    assert (config.bias_update_rule, config.bias_update_rate) == ("proportional", 0.3)
    assert config.router_lr_scale == 1.0
    config, model = build({"preset": "deepseek"})
    assert model.score_function == "sigmoid"
    assert (config.bias_update_rule, config.bias_update_rate) == ("sign", 1e-2)
    assert config.lr == 3e-4 and config.warmup_steps == config.steps // 10
    assert config.router_lr_scale == 0.1  # a 2048-wide preset
    assert build({"preset": "small"})[0].router_lr_scale == 1.0
    config, _ = build({"preset": "deepseek", "bias_update_rate": 0.0, "warmup_steps": 0})
    assert config.bias_update_rate == 0.0 and config.warmup_steps == 0


def test_model_overrides_from_flags_are_typed_like_the_model_config():
    args = cli.build_parser().parse_args([
        "train", "--set", "num_layers=3", "--set", "rope_theta=5e5", "--set",
        "tie_embeddings=true", "--set", "score_function=sigmoid", "--capacity-factor", "none",
        "--moe-matmul", "ragged_dot", "--dtype", "bfloat16", "--no-remat", "--fp8", "blockwise",
        "--router-matmul", "float32"])
    overrides = overrides_from_args(args)
    assert overrides == {"model_overrides": {
        "num_layers": 3, "rope_theta": 5e5, "tie_embeddings": True, "score_function": "sigmoid",
        "capacity_factor": None, "moe_matmul": "ragged_dot", "dtype": "bfloat16",
        "remat": False, "fp8": "blockwise", "router_matmul": "float32"}}
    _, model = build(overrides)
    assert model.num_layers == 3 and model.tie_embeddings and model.dtype == np.dtype("bfloat16")
    assert model.moe_config().fp8 == "blockwise"
    assert model.moe_config().router_matmul == "float32"
    assert overrides_from_args(cli.build_parser().parse_args(["train"])) == {}


def test_eval_cadence_follows_the_run_length_unless_given():
    """About ten evaluations a run, however long: a 30-step run is not evaluated once."""
    assert build({"steps": 30})[0].eval_every == 3
    assert build({})[0].eval_every == 40  # 400 steps
    assert build({"steps": 5})[0].eval_every == 1
    assert build({"preset": "deepseek", "steps": 100})[0].eval_every == 10
    assert build({"steps": 30, "eval_every": 7})[0].eval_every == 7
    with pytest.raises(ConfigError, match=r"eval_every \(--eval-every\) must be a positive int, "
                                          r"got 0"):
        build({"eval_every": 0})


def write_config(path: Path, fields: dict) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_config_file_fields_are_overridden_by_flags(tmp_path, text_file):
    """--config FILE gives the fields; the flags beside it win, model fields merged one by
    one."""
    file = write_config(tmp_path / "c.json", {
        "steps": 12, "lr": 0.01, "data": str(text_file), "seed": 3,
        "model_overrides": {"hidden": 64, "num_layers": 3}})
    args = cli.build_parser().parse_args(["train", "--config", str(file), "--lr", "0.002",
                                          "--set", "hidden=32", "--capacity-factor", "1.5"])
    assert overrides_from_args(args) == {
        "steps": 12, "lr": 0.002, "data": str(text_file), "seed": 3,
        "model_overrides": {"hidden": 32, "num_layers": 3, "capacity_factor": 1.5}}


def test_a_yaml_config_file_and_yaml_without_pyyaml(tmp_path, capsys, monkeypatch):
    file = tmp_path / "c.yaml"
    file.write_text("steps: 12\nlr: 0.01\nmodel_overrides:\n  hidden: 64\n  remat: true\n")
    args = cli.build_parser().parse_args(["train", "--config", str(file)])
    assert overrides_from_args(args) == {"steps": 12, "lr": 0.01,
                                         "model_overrides": {"hidden": 64, "remat": True}}
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    code, _, err = run_cli(capsys, "train", "--config", str(file), "--out",
                           str(tmp_path / "run"))
    assert code == 2 and err == (
        f"nodrop train: error: --config {file}: reading YAML needs PyYAML (pip install pyyaml); "
        "or give the same settings as a .json file\n")


@pytest.mark.parametrize("fields, message", [
    ({"steps": 5, "stepz": 3, "lr2": 1}, "unknown keys ['lr2', 'stepz']; the training fields"),
    ({"train": {"steps": 5}, "out": "x"}, "unknown keys ['out'] beside 'train'"),
    ({"train": {"steps": 5, "hiddn": 3}}, "unknown keys ['hiddn']"),
    ({"model_overrides": {"hiddn": 3}}, "unknown model_overrides keys ['hiddn']"),
    ([1, 2], "expected a mapping of training fields, got list"),
    ({"steps": "ten"}, "steps (--steps) must be a positive int, got 'ten'"),
])
def test_a_bad_config_file_is_refused_naming_the_keys(tmp_path, capsys, fields, message):
    file = write_config(tmp_path / "c.json", fields)
    code, _, err = run_cli(capsys, "train", "--config", str(file), "--out",
                           str(tmp_path / "run"))
    assert code == 2 and err.startswith("nodrop train: error: ") and message in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_missing_or_malformed_config_file_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--config", str(tmp_path / "none.json"))
    assert code == 2 and err.startswith(f"nodrop train: error: --config {tmp_path}/none.json: "
                                        "cannot read it: No such file or directory")
    (tmp_path / "bad.json").write_text("{steps: 3")
    code, _, err = run_cli(capsys, "train", "--config", str(tmp_path / "bad.json"))
    assert code == 2 and "bad.json: not valid JSON: " in err


def test_compare_takes_a_config_file_whose_seed_seeds_replaces(tmp_path, capsys,
                                                              monkeypatch):
    """A run's config.json holds a seed; --seeds beside it is not '--seed and --seeds'."""
    file = write_config(tmp_path / "c.json", {"steps": 7, "seed": 5})
    given = {}

    def run(overrides, out, **kwargs):  # what the comparison is given, not the runs
        given.update(overrides=overrides, **kwargs)
        Path(out).mkdir()
        (Path(out) / "compare.md").write_text("the table\n")

    monkeypatch.setattr(compare, "run", run)
    code, _, err = run_cli(capsys, "compare", "--config", str(file), "--seeds", "1", "2",
                           "--out", str(tmp_path / "c"))
    assert code == 0, err
    assert given["overrides"] == {"steps": 7, "seed": 5} and given["seeds"] == [1, 2]
    code, _, err = run_cli(capsys, "compare", "--seed", "3", "--seeds", "1", "2")
    assert code == 2 and "give --seed or --seeds, not both" in err


def test_a_runs_config_json_repeats_the_run(reference, tmp_path, capsys):
    """nodrop train --config RUN/config.json trains the same run again, bit for bit; the
    banner, printed before compiling, says what and where."""
    run_dir = tmp_path / "again"
    code, out, err = run_cli(capsys, "train", "--config", str(reference / "config.json"),
                             "--out", str(run_dir), "--no-progress")
    assert code == 0, err
    saved, again = (json.loads((d / "config.json").read_text()) for d in (reference, run_dir))
    assert again["train"] == saved["train"] and again["model"] == saved["model"]
    assert again["data"] == saved["data"]
    assert records(run_dir, "train") == records(reference, "train")
    lines = out.splitlines()
    assert lines[0].startswith("nodrop 0.1.0 train: tiny, 0.05M parameters (0.04M active per "
                               "token), 30 steps of 4 x 32 tokens")
    assert lines[1].startswith("  devices: 1 x cpu (")
    assert lines[2] == f"  data: {saved['train']['data']} (tokenizer: none, bytes)"
    assert lines[3] == f"  run folder: {run_dir}"
    assert lines.index("nodrop train: compiling the steps (step 1 on)") > 3


def test_help_lists_every_set_field_and_version(capsys):
    from nodrop.models import ModelConfig
    for command in ("train", "compare"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        table = text[text.index("--set FIELD=VALUE fields"):]
        for field in dataclasses.fields(ModelConfig):
            assert re.search(rf"^  {field.name} +\S.* +\S+ +\w", table, re.M), field.name
        assert re.search(r"^  num_experts +int +8 +experts per MoE layer$", table, re.M)
        assert re.search(r"^  capacity_factor +float \| None +None +token dropping", table,
                         re.M)
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    assert re.fullmatch(r"nodrop 0\.1\.0 \(jax \S+, jaxlib \S+\)\n", capsys.readouterr().out)


def test_the_loss_plots_ema_is_bias_corrected():
    """As Adam's moments: no pull towards zero nor towards the first value."""
    from nodrop.train.plots import _ema
    np.testing.assert_allclose(_ema(np.full(5, 3.0)), 3.0)
    steps = _ema(np.asarray([10.0, 0.0, 0.0]))
    assert steps[0] == 10.0
    assert steps[1] == pytest.approx(0.9 * 0.1 * 10 / (1 - 0.9 ** 2))  # 4.74, not 9 or 0.9
    assert steps[2] == pytest.approx(0.81 * 0.1 * 10 / (1 - 0.9 ** 3))


def test_learning_rate_schedule():
    config, _ = build({"steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.1})
    schedule = trainer.learning_rate_schedule(config)
    lrs = np.asarray([float(schedule(count)) for count in range(100)])
    np.testing.assert_allclose(lrs[:10], np.arange(1, 11) / 10, rtol=1e-6)  # no step at 0
    np.testing.assert_allclose(lrs[54], 0.1 + 0.45 * (1 + np.cos(np.pi * 0.5)), rtol=1e-6)
    assert lrs[-1] == pytest.approx(0.1) and np.all(np.diff(lrs[9:]) < 0)


def test_checkpoint_every_zero_saves_no_checkpoint(tmp_path, text_file, reference, capsys,
                                                   monkeypatch):
    """A benchmark run: the same numbers as the reference run, and no checkpoints folder, nor
    one listed. Its --out is relative: summary.json's run_dir is absolute all the same."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "train", *train_flags(text_file, **{"checkpoint-every": 0}),
                             "--out", "bench-run")
    assert code == 0, err
    run_dir = tmp_path / "bench-run"
    assert not (run_dir / "checkpoints").exists()
    assert "checkpoints/" not in out and f"outputs in {run_dir}/: config.json," in out
    assert ([without_timing(r) for r in records(run_dir, "train")]
            == [without_timing(r) for r in records(reference, "train")])
    assert json.loads((run_dir / "summary.json").read_text())["run_dir"] == str(run_dir)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1"], "lr (--lr) must be a positive finite number, got -1.0"),
    (["--lr", "nan"], "lr (--lr) must be a positive finite number, got nan"),
    (["--steps", "0"], "steps (--steps) must be a positive int, got 0"),
    (["--steps", "10", "--warmup-steps", "11"],
     "warmup_steps (--warmup-steps) must be at most steps=10, got 11"),
    (["--batch-size", "0"], "batch_size (--batch-size) must be a positive int, got 0"),
    (["--seq-len", "300"], "seq_len (--seq-len) must be at most the model's seq_len=256"),
    (["--beta2", "1.0"], "beta2 (--beta2) must be a number in [0, 1), got 1.0"),
    (["--grad-clip", "-0.5"], "grad_clip (--grad-clip) must be a finite number >= 0"),
    (["--eval-every", "0"], "eval_every (--eval-every) must be a positive int, got 0"),
    (["--checkpoint-every", "-1"], "checkpoint_every (--checkpoint-every) must be an int >= 0"),
    (["--capacity-factor", "-1"], "model.capacity_factor (--capacity-factor) must be None"),
    (["--set", "hidden=0"], "model.hidden (--set hidden=...) must be a positive int, got 0"),
    (["--set", "k=9"], "model.k (--set k=...) must be an int in [1, num_experts=8]"),
    (["--set", "fp8=fp16"], "model.fp8 (--fp8) must be one of ('off', 'blockwise', 'tensorwise'), "
                            "got 'fp16'"),
    (["--set", "widht=3"], "--set 'widht=3': expected FIELD=VALUE with FIELD one of"),
    (["--set", "hidden=big"], "--set 'hidden=big': invalid literal for int()"),
    (["--resume"], "--resume needs --out"),
    (["--profile", "5:3"], "profile (--profile) must be 'START:STOP' with 1 <= START <= STOP, "
                           "got '5:3'"),
    (["--profile", "3"], "profile (--profile) must be 'START:STOP' with 1 <= START <= STOP"),
    (["--steps", "10", "--profile", "5:11"],
     "profile (--profile) must be steps within 1..steps=10, got '5:11'"),
    (["--seed", "99999999999999999999"],
     "seed (--seed) must be an int in [0, 9223372036854775807], got 99999999999999999999"),
    (["--seed", "-1"], "seed (--seed) must be an int in [0, 9223372036854775807], got -1"),
])
def test_bad_configuration_is_refused_before_anything_runs(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    if "--resume" in flags:
        code, _, err = run_cli(capsys, "train", *flags)
    else:
        code, _, err = run_cli(capsys, "train", *flags, "--out", str(out))
    assert code == 2
    assert err.startswith("nodrop train: error: ") and message in err, err
    assert "Traceback" not in err
    assert not out.exists()


def test_float16_is_refused_on_the_cpu_before_anything_compiles(tmp_path, capsys, text_file):
    message = ("model.dtype (--dtype) must be float32 or bfloat16 on the CPU (float16 needs a "
               "GPU), got 'float16'")
    _, model = build({"model_overrides": {"dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_backend(model.replace(dtype=np.dtype("float16")), "cpu")
    check_backend(model.replace(dtype=np.dtype("float16")), "gpu")  # what GPUs run
    if jax.default_backend() == "cpu":
        code, _, err = run_cli(capsys, "train", *train_flags(text_file, steps=2), "--dtype",
                               "float16", "--out", str(tmp_path / "run"))
        assert (code, err) == (2, f"nodrop train: error: {message}\n")
        assert not (tmp_path / "run").exists()


def make_bad_data(tmp_path: Path, kind: str) -> tuple[Path, str]:
    path = tmp_path / {"missing": "missing.txt", "short": "short.txt", "npy": "corrupt.npy",
                       "bin": "odd.bin", "ids": "ids.npy", "folder": "empty",
                       "fifo": "pipe"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
        return path, "expected a regular file or a folder, got a FIFO (named pipe)"
    if kind == "short":
        path.write_bytes(b"too short\n" * 20)
        return path, "the validation split has 20 tokens, fewer than one sequence"
    if kind == "npy":
        path.write_bytes(b"\x93NUMPY garbage")
        return path, "not a valid .npy file"
    if kind == "bin":
        path.write_bytes(b"\x00" * 4001)
        return path, "4001 bytes is not a whole number of uint16 token ids"
    if kind == "ids":  # against --set vocab_size=256 (unset, the data's ids give it)
        np.save(path, np.full(5000, 256, np.int32))
        return path, ("token id 256 at position 0 is outside [0, vocab_size=256); vocab_size=256 "
                      "was set by --set vocab_size: leave it unset to take the vocabulary from "
                      "the data, or set at least 257 (--set vocab_size=320)")
    if kind == "folder":
        path.mkdir()
        return path, "the folder holds no (non-hidden) files"
    return path, "no such file or folder"


@pytest.mark.parametrize("kind", ["missing", "short", "npy", "bin", "ids", "folder", "fifo"])
def test_unusable_data_is_a_clear_error(tmp_path, capsys, kind):
    path, message = make_bad_data(tmp_path, kind)
    vocabulary = ["--set", "vocab_size=256"] if kind == "ids" else []
    code, _, err = run_cli(capsys, "train", "--data", str(path), "--seq-len", "32", *vocabulary,
                           "--out", str(tmp_path / "run"))
    assert code == 2
    assert err.startswith(f"nodrop train: error: {path}") and message in err, err
    assert not (tmp_path / "run").exists()


# --- the vocabulary of token-id data -----------------------------------------------------------


def token_flags(folder: Path, **changes) -> list[str]:
    flags = {"data": str(folder), "steps": 4, "batch-size": 2, "seq-len": 16,
             "eval-batches": 1, "checkpoint-every": 2, "log-every": 2, **changes}
    return [*MODEL_FLAGS, "--no-progress",
            *[item for key, value in flags.items() for item in (f"--{key}", str(value))]]


def test_gpt2_token_ids_train_resume_and_evaluate_with_the_vocabulary_they_need(tmp_path,
                                                                               capsys, reference):
    """nanoGPT's openwebtext layout: train.bin and val.bin of GPT-2 ids, no meta.pkl."""
    folder = tmp_path / "openwebtext"
    folder.mkdir()
    ids = np.arange(4000) * 17 % 50257
    ids[-1] = 50256  # <|endoftext|>
    ids.astype("<u2").tofile(folder / "train.bin")
    (ids[:500] % 1000).astype("<u2").tofile(folder / "val.bin")
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", *token_flags(folder), "--out", str(run_dir))
    assert code == 0, err
    assert ("nodrop: vocabulary 50304 from the data: the largest token id, 50256, + 1 rounded up "
            "to a multiple of 64, as nanoGPT pads GPT-2's 50257 tokens to 50304 for faster "
            "matmuls (--set vocab_size=N to choose; the model has") in out, out
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"]["vocab_size"] == 50304
    assert saved["train"]["model_overrides"]["vocab_size"] == 50304  # repeats and resumes alike
    # Resumed without --set vocab_size: the run's vocabulary, no "changed field" refusal.
    code, out, err = run_cli(capsys, "train", *token_flags(folder, steps=6), "--resume",
                             "--out", str(run_dir))
    assert code == 0, err
    assert f"resuming {run_dir} from step 4" in out and "vocabulary" not in out
    assert json.loads((run_dir / "config.json").read_text())["model"]["vocab_size"] == 50304
    code, out, err = run_cli(capsys, "eval", "--run", str(run_dir), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["step"] == 6 and math.isfinite(result["loss"])
    loaded = nodrop.load(run_dir)
    assert loaded.config.vocab_size == 50304 and loaded.step == 6
    assert loaded.model.embedding[...].shape == (50304, 32)
    assert json.loads((run_dir / "config.json").read_text())["tokens"] == "token ids"
    # Text in and out needs the tokenizer the ids come from, never a silent byte encoding.
    code, out, err = run_cli(capsys, "generate", "--run", str(run_dir), "--prompt", "Hi",
                             "--max-tokens", "3")
    assert code == 2 and "trained on token ids" in err and "--tokenizer FILE" in err, err
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer.train_bpe(np.frombuffer(b"hello world, " * 200, np.uint8), 300).save(
        str(tokenizer_file))
    code, out, err = run_cli(capsys, "generate", "--run", str(run_dir), "--prompt", "Hi",
                             "--max-tokens", "3", "--tokenizer", str(tokenizer_file))
    assert code == 0 and out.startswith("Hi"), err
    small = tmp_path / "small-tokenizer.json"
    tokenizer.train_bpe(np.frombuffer(b"ab" * 100, np.uint8), 258).save(str(small))
    with pytest.raises(serve.LoadError, match="tokenizer: .* has 258 tokens, more than the "
                                              "model's vocabulary of 256"):
        nodrop.load(reference, tokenizer=small)  # a model of bytes


def test_a_char_level_folder_takes_its_vocabulary_from_meta_pkl(tmp_path, capsys):
    """nanoGPT's shakespeare_char layout: train.bin, val.bin and meta.pkl (vocab_size 65)."""
    folder = tmp_path / "shakespeare_char"
    folder.mkdir()
    (np.arange(3000) * 7 % 60).astype("<u2").tofile(folder / "train.bin")
    (np.arange(300) % 60).astype("<u2").tofile(folder / "val.bin")
    chars = [chr(c) for c in range(32, 97)]
    (folder / "meta.pkl").write_bytes(pickle.dumps({
        "vocab_size": 65, "itos": dict(enumerate(chars)),
        "stoi": {c: i for i, c in enumerate(chars)}}))
    run_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", *token_flags(folder, steps=2), "--out", str(run_dir))
    assert code == 0, err
    assert (f"nodrop: vocabulary 65 from the data: the vocab_size of {folder / 'meta.pkl'} "
            "(nanoGPT's meta.pkl)") in out, out
    assert json.loads((run_dir / "config.json").read_text())["model"]["vocab_size"] == 65
    # The character map is the run's tokenizer: text in and out with the files' ids.
    assert "are the run's tokenizer (tokenizer.json" in out
    loaded = nodrop.load(run_dir)
    assert loaded.encode("AB C") == [33, 34, 0, 35] and loaded.decode([33, 34, 0, 35]) == "AB C"
    code, out, err = run_cli(capsys, "generate", "--run", str(run_dir), "--prompt", "TO BE",
                             "--max-tokens", "4")
    assert code == 0 and out.startswith("TO BE"), err
    code, out, err = run_cli(capsys, "generate", "--run", str(run_dir), "--prompt", "to be",
                             "--max-tokens", "4")
    assert code == 2, out
    assert "text: the characters ['b', 'e', 'o', 't'] are not in the model's vocabulary" in err
    assert "Traceback" not in err


def test_a_meta_pkl_that_would_run_code_stops_the_run_without_running_it(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (np.arange(3000) % 60).astype("<u2").tofile(folder / "train.bin")
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "x": Payload()}))
    code, _, err = run_cli(capsys, "train", *token_flags(folder), "--out", str(tmp_path / "run"))
    assert code == 2
    assert err.startswith(f"nodrop train: error: {folder / 'meta.pkl'}: refused to unpickle it: "
                          "it refers to "), err
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys, text_file):
    run_dir = tmp_path / "run"
    flags = train_flags(text_file, steps=10, lr=1000.0, **{
        "warmup-steps": 0, "checkpoint-every": 1, "log-every": 1, "keep-checkpoints": 20})
    code, _, err = run_cli(capsys, "train", *flags, "--out", str(run_dir))
    assert code == 1
    train = records(run_dir, "train")
    bad = train[-1]
    assert bad["grad_norm"] is None  # NaN/inf are written as null
    assert re.match(rf"nodrop train: error: the (loss and the )?gradients are not finite at step "
                    rf"{bad['step']} \(loss \S+, gradient norm nan, update norm nan\)",
                    err.splitlines()[-1]), err
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in train[:-1])
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    assert steps == list(range(1, bad["step"]))  # every good step saved, the bad one not
    assert f"The last checkpoint is step {bad['step'] - 1}" in err
    assert (run_dir / "loss.png").exists()


def test_an_overflowing_update_is_named_and_no_checkpoint_is_not_step_none(tmp_path, capsys,
                                                                          text_file):
    """lr 1e39 is past float32: the loss and gradients of step 1 are finite, its update is not."""
    run_dir = tmp_path / "run"
    flags = train_flags(text_file, steps=4, lr=1e39, **{"warmup-steps": 0, "log-every": 1})
    code, _, err = run_cli(capsys, "train", *flags, "--out", str(run_dir))
    assert code == 1
    [bad] = records(run_dir, "train")
    assert err.splitlines()[-1] == (
        "nodrop train: error: the update overflowed: the updated parameters or optimizer state "
        f"are not finite at step 1 (loss {bad['loss']}, gradient norm {bad['grad_norm']}, "
        "update norm inf); stopped without saving this state. The run has no checkpoint yet")


def test_a_plot_that_cannot_be_written_does_not_hide_why_the_run_stopped(
        tmp_path, capsys, text_file, monkeypatch):
    monkeypatch.setattr(trainer.plots, "plot_losses", no_space)
    flags = train_flags(text_file, steps=4, lr=1e39, **{"warmup-steps": 0, "log-every": 1})
    code, _, err = run_cli(capsys, "train", *flags, "--out", str(tmp_path / "run"))
    assert code == 1 and "the update overflowed" in err.splitlines()[-1], err


def test_norms_do_not_overflow_where_the_values_do_not():
    """optax's norm squares each value (inf from 1.8e19); a norm of 2e30 is 2e30."""
    tree = {"a": np.full((4,), 1e30, np.float32), "b": np.zeros((2, 2), np.float32)}
    stats = trainer.tree_stats(tree)
    assert float(stats.norm) == pytest.approx(2e30, rel=1e-6)
    assert bool(stats.finite) and not bool(stats.squares_finite)
    assert float(trainer.tree_stats({"a": np.zeros(3, np.float32)}).norm) == 0.0


@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e-12, 1e-3, 1.0, 1e3, 1e18, 1e25, 3e38])
def test_the_one_pass_norm_is_the_l2_norm_at_every_magnitude(magnitude):
    """Below 1e-19 the squares underflow and past 1.8e19 they overflow: the norm holds at both
    ends, and where values of both sizes mix, and is inf only past float32's range."""
    rng = np.random.default_rng(0)
    values = lambda *shape: (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.0, shape)
                             * magnitude).astype(np.float32)
    tree = {"w": values(64, 48), "b": values(48),
            "mixed": np.array([magnitude, 1.0, 1e-30], np.float32),
            "steps": np.arange(3, dtype=np.int32)}  # not floating point: no part of the norm
    exact = np.sqrt(sum(np.sum(np.square(x.astype(np.float64)))
                        for k, x in tree.items() if k != "steps"))
    stats = jax.jit(trainer.tree_stats)(tree)
    assert bool(stats.finite)
    assert bool(stats.squares_finite) == (magnitude < 1e19)
    if exact > np.finfo(np.float32).max:
        assert float(stats.norm) == np.inf
    else:
        assert float(stats.norm) == pytest.approx(exact, rel=1e-5)


def test_a_non_finite_value_is_seen_by_the_one_pass_check():
    """A non-finite value of the tree, or of the tree read beside it (the updated parameters
    beside their updates), makes it not finite; the norm of the tree itself is NaN for a NaN
    and inf for an inf, and a square past float32 (not the value) only clears squares_finite."""
    ones = {"a": np.ones((3, 2), np.float32), "b": np.ones(4, np.float32)}

    def with_value(tree, value):
        tree = {k: v.copy() for k, v in tree.items()}
        tree["b"][2] = value
        return tree

    check = jax.jit(trainer.tree_stats)
    assert bool(check(ones, ones).finite)
    for bad in (np.nan, np.inf, -np.inf):
        stats = check(with_value(ones, bad))
        assert not bool(stats.finite) and not bool(stats.squares_finite)
        assert np.isnan(stats.norm) if np.isnan(bad) else stats.norm == np.inf
        beside = check(ones, with_value(ones, bad))
        assert not bool(beside.finite) and bool(beside.squares_finite)
        assert float(beside.norm) == pytest.approx(np.sqrt(10))
    stats = check(with_value(ones, 2e19))
    assert bool(stats.finite) and not bool(stats.squares_finite)


def test_the_clip_is_optax_clip_by_global_norm_on_the_one_pass_norm():
    """The same state (a checkpoint of either restores into the other) and the same clipped
    gradients, up to the norm's rounding, whether the clip computes the norm or is given it;
    past 1.8e19 optax's inf norm zeroes the gradients, this one scales them to the limit."""
    rng = np.random.default_rng(1)
    grads = {"w": rng.standard_normal((32, 16)).astype(np.float32),
             "b": rng.standard_normal(16).astype(np.float32)}
    ours, theirs = trainer.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    assert (jax.tree.structure(ours.init(grads)) == jax.tree.structure(theirs.init(grads)))
    for scale in (1e-3, 1.0, 10.0):
        scaled = jax.tree.map(lambda g: g * np.float32(scale), grads)
        want, _ = theirs.update(scaled, theirs.init(grads))
        given = trainer.tree_stats(scaled).norm
        for got, _ in (jax.jit(ours.update)(scaled, ours.init(grads)),
                       ours.update(scaled, ours.init(grads), grad_norm=given)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    huge = jax.tree.map(lambda g: g * np.float32(1e25), grads)
    clipped, _ = ours.update(huge, ours.init(grads))
    assert float(trainer.tree_stats(clipped).norm) == pytest.approx(1.0, rel=1e-5)


def test_the_optimizer_state_keeps_its_structure_and_the_clip_gets_the_steps_norm():
    """optimizer() takes grad_norm= (the step's gradient norm, so the gradients are read once
    for the clip and the metrics) and its state has the structure of the optax chain that runs
    saved before (optax.clip_by_global_norm, AdamW, the routers' scale): their checkpoints
    restore. Without clipping the argument is accepted and ignored."""
    params = {"ffn": {"router": np.ones((4, 2), np.float32), "w": np.ones((4, 4), np.float32)},
              "scale": np.ones(4, np.float32)}
    grads = jax.tree.map(lambda p: p * np.float32(3.0), params)
    for grad_clip, router_lr_scale in ((1.0, 0.5), (1.0, 1.0), (0.0, 1.0)):
        config, _ = build({"grad_clip": grad_clip, "router_lr_scale": router_lr_scale})
        tx = trainer.optimizer(config)
        old = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
        old += [optax.adamw(trainer.learning_rate_schedule(config),
                            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))]
        old += [optax.masked(optax.scale(router_lr_scale), trainer._router_mask)
                ] if router_lr_scale != 1 else []
        old = old[0] if len(old) == 1 else optax.chain(*old)
        assert jax.tree.structure(tx.init(params)) == jax.tree.structure(old.init(params))
        state = tx.init(params)
        norm = trainer.tree_stats(grads).norm
        given, _ = tx.update(grads, state, params, grad_norm=norm)
        computed, _ = tx.update(grads, state, params)
        for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(computed)):
            np.testing.assert_array_equal(a, b)
        if grad_clip > 0:  # the clip divides by the norm given
            nan, _ = tx.update(grads, state, params, grad_norm=np.float32(np.nan))
            assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(nan))


def test_fused_adamw_is_optaxs_step_and_update_stats():
    """fused_adamw_update (one engine call per parameter) gives optax's parameters, state and
    update statistics, over three steps (the counts and the schedule advance), for the three
    chain shapes (clip and router scale on or off), with gradients clipped and not; a
    non-finite gradient is reported as optax's path reports it."""
    with jax.enable_x64(False):  # as trainer.run traces
        keys = iter(jax.random.split(jax.random.key(3), 64))
        params = {"ffn": {"router": jax.random.normal(next(keys), (8, 4)),
                          "w": jax.random.normal(next(keys), (3, 16, 8))},
                  "scale": jax.random.normal(next(keys), (16,))}
        for grad_clip, router_lr_scale, magnitude in ((1.0, 0.5, 1.0), (1.0, 1.0, 1e-3),
                                                      (0.0, 1.0, 1.0), (0.5, 0.1, 10.0)):
            config, _ = build({"grad_clip": grad_clip, "router_lr_scale": router_lr_scale,
                               "lr": 1e-2, "steps": 10, "warmup_steps": 2})
            tx = trainer.optimizer(config)

            @jax.jit
            def optax_step(params, state, grads):
                norm = trainer.tree_stats(grads).norm
                updates, state = tx.update(grads, state, params, grad_norm=norm)
                params = optax.apply_updates(params, updates)
                return params, state, trainer.tree_stats(updates, also=params)

            fused_step = jax.jit(lambda params, state, grads: trainer.fused_adamw_update(
                config, params, state, grads, trainer.tree_stats(grads).norm))
            want = got = (params, tx.init(params))
            for _ in range(3):
                grads = jax.tree.map(lambda p: magnitude * jax.random.normal(next(keys), p.shape),
                                     params)
                *want, want_stats = optax_step(*want, grads)
                *got, got_stats = fused_step(*got, grads)
                assert jax.tree.structure(got[1]) == jax.tree.structure(want[1])
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
                assert float(got_stats.norm) == pytest.approx(float(want_stats.norm), rel=1e-5)
                assert bool(got_stats.finite) and bool(want_stats.finite)
        grads = jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
        grads["scale"][3] = np.nan
        config, _ = build({"grad_clip": 0.0})
        state = trainer.optimizer(config).init(params)
        new, _, stats = trainer.fused_adamw_update(config, params, state, grads, np.float32(0))
        assert not bool(stats.finite) and np.isnan(new["scale"][3])
        assert np.isfinite(new["ffn"]["w"]).all()


# --- kill -9 and resume ----------------------------------------------------------------------


def nodrop_train(flags: list[str], log: Path) -> subprocess.Popen:
    # Run from the log's folder: from the repository root, `-m nodrop` would import the source
    # tree, which holds no compiled engine on a fresh clone, instead of the installed package.
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "nodrop", "train", *flags],
                                stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)


def test_kill_9_then_resume_gives_bitwise_the_same_losses(reference, tmp_path, text_file):
    """`python -m nodrop train` killed with SIGKILL after its first checkpoint and resumed
    reaches bitwise the numbers of the uninterrupted reference run (trained in this process,
    with x64 on; checkpoint cadence changes no number)."""
    flags = train_flags(text_file, **{"checkpoint-every": 2})
    killed = tmp_path / "killed"
    proc = nodrop_train([*flags, "--out", str(killed)], tmp_path / "killed.log")
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (killed / "checkpoints").exists() and any(
                p.name.isdigit() for p in (killed / "checkpoints").iterdir()):
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, \
        "the run finished before it could be killed; give it more steps"
    killed_at = [r["step"] for r in records(killed, "train")]
    assert killed_at and killed_at[-1] < STEPS

    proc = nodrop_train([*flags, "--resume", "--out", str(killed)], tmp_path / "resume.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "resume.log").read_text()
    assert "resuming" in (tmp_path / "resume.log").read_text()

    for kind in ("train", "eval", "final"):
        got = [without_timing(r) for r in records(killed, kind)]
        want = [without_timing(r) for r in records(reference, kind)]
        assert [r["step"] for r in got] == [r["step"] for r in want], kind
        assert got == want, f"{kind} records differ after kill -9 and resume"


def start_stepping(run_dir: Path, log: Path, flags: list[str]) -> subprocess.Popen:
    """`nodrop train` of 1000 steps in a subprocess, returned once it has logged a step."""
    proc = nodrop_train([*flags, "--out", str(run_dir)], log)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and records(run_dir, "train"):
            return proc
        time.sleep(0.01)
    raise AssertionError(f"the run did not start stepping: {log.read_text()}")


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_checkpoint_of_the_last_step_and_stops(tmp_path, text_file, signum,
                                                                 status):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_stepping(run_dir, log, [
        *train_flags(text_file, steps=1000, **{"checkpoint-every": 500}), "--remat"])
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == status, log.read_text()
    last = records(run_dir, "train")[-1]["step"]
    assert (f"interrupted ({signal.Signals(signum).name}) at step {last}; saved a checkpoint "
            "there") in log.read_text()
    assert "Traceback" not in log.read_text()
    assert [int(p.name) for p in (run_dir / "checkpoints").iterdir()] == [last]
    assert (run_dir / "loss.png").exists()
    assert json.loads((run_dir / "config.json").read_text())["model"]["remat"] is True


def test_a_second_signal_waits_for_the_save_but_not_otherwise(tmp_path):
    with trainer._StopFlag(tmp_path) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        stop.saving = True
        signal.raise_signal(signal.SIGINT)  # during a save: no KeyboardInterrupt
        stop.saving = False
        assert stop.signum == signal.SIGTERM
        with pytest.raises(trainer.Interrupted, match="interrupted again \\(SIGINT\\): stopped at "
                           "once, without saving the current step") as stopped:
            signal.raise_signal(signal.SIGINT)
        assert stopped.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_two_signals_50_ms_apart_stop_in_one_line_leaving_no_temporary_folder(tmp_path,
                                                                               text_file):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_stepping(run_dir, log, train_flags(text_file, steps=1000,
                                                    **{"checkpoint-every": 500}))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, log.read_text()
    assert "Traceback" not in log.read_text() and "interrupted" in log.read_text()
    assert not list(run_dir.rglob("*tmp*"))


def test_a_second_process_on_a_run_folder_is_refused_and_touches_nothing(tmp_path, text_file,
                                                                         capsys):
    run_dir = tmp_path / "run"
    flags = train_flags(text_file, steps=1000, **{"checkpoint-every": 500})
    proc = start_stepping(run_dir, tmp_path / "run.log", flags)
    try:
        written = ("metrics.jsonl", "tensorboard", "checkpoints")  # by the running process

        def snapshot():
            return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()
                    if p.name not in written}

        before = snapshot()
        code, _, err = run_cli(capsys, "train", *flags, "--resume", "--out", str(run_dir))
        assert code == 2, err
        assert f"in use by another nodrop process (pid {proc.pid} on " in err, err
        code, _, err = run_cli(capsys, "train", *flags, "--seed", "1", "--out", str(run_dir))
        assert code == 2 and "is not empty" in err, err
        assert snapshot() == before
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    assert (run_dir / lock.FILE).read_text() == ""  # released on the way out
    with lock.RunLock(run_dir):
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, text_file, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / lock.FILE).write_text('{"pid": 999999, "host": "elsewhere", "since": "then"}')
    code, out, err = run_cli(capsys, "train", *train_flags(text_file, steps=2),
                             "--out", str(run_dir))
    assert code == 0, err
    assert "last held by pid 999999 on elsewhere, since then, which ended without releasing" in (
        out + err)
    assert (run_dir / lock.FILE).read_text() == ""  # released cleanly


def test_an_out_that_is_a_file_is_one_error_line(tmp_path, text_file, capsys):
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "train", *train_flags(text_file, steps=2),
                           "--out", str(tmp_path / "file"))
    assert code == 2 and "Traceback" not in err
    assert (f"cannot use --out {tmp_path / 'file'}: expected a folder (or a path to create "
            "one), got a file") in err, err


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_resumes_to_the_reference(run_dir: Path, reference: Path, capsys) -> None:
    code, _, err = run_cli(capsys, "train", "--resume", "--out", str(run_dir))
    assert code == 0, err
    assert ([without_timing(r) for r in records(run_dir, "train")]
            == [without_timing(r) for r in records(reference, "train")])


def test_a_disk_full_during_a_checkpoint_save_is_one_line_and_leaves_it_resumable(
        reference, tmp_path, text_file, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    save = ocp.JsonCheckpointHandler.async_save

    def save_until_step_10(self, directory, *args, **kwargs):
        if "10.orbax-checkpoint-tmp" in str(directory):
            no_space()
        return save(self, directory, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ocp.JsonCheckpointHandler, "async_save", save_until_step_10)
        code, _, err = run_cli(capsys, "train", *train_flags(text_file), "--out", str(run_dir))
    assert code == cli.EXIT_WRITE_FAILED and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"nodrop train: error: cannot write {run_dir / 'checkpoints' / '10'}: No space left on "
        "device; the run stopped. Free space or restore write access, then continue with "
        f"--resume --out {run_dir} (from its newest checkpoint, step 5)")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["5"]  # no tmp folder
    assert_resumes_to_the_reference(run_dir, reference, capsys)


def test_metrics_that_cannot_be_written_stop_the_run_in_one_line(reference, tmp_path, text_file,
                                                                 capsys, monkeypatch):
    """fsync of metrics.jsonl (before the first checkpoint) fails: no checkpoint yet."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", no_space)
        code, _, err = run_cli(capsys, "train", *train_flags(text_file), "--out", str(run_dir))
    assert code == cli.EXIT_WRITE_FAILED and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"nodrop train: error: cannot write {run_dir / 'metrics.jsonl'}: No space left on "
        "device; the run stopped. Free space or restore write access, then continue with "
        f"--resume --out {run_dir} (from step 0: it has no checkpoint)")
    assert_resumes_to_the_reference(run_dir, reference, capsys)


# --- compare ---------------------------------------------------------------------------------


def test_compare_dropless_capacity_and_ragged_dot(tmp_path, capsys, text_file, monkeypatch):
    out = tmp_path / "compare"
    plotted_caveats, plot = [], plots.plot_compare

    def plot_compare(*args, caveat=None, **kwargs):
        plotted_caveats.append(caveat)
        plot(*args, caveat=caveat, **kwargs)

    monkeypatch.setattr(plots, "plot_compare", plot_compare)
    flags = train_flags(text_file, steps=6, **{"eval-every": 3, "checkpoint-every": 6})
    code, stdout, err = run_cli(capsys, "compare", *flags, "--capacity-factors", "0.5",
                                "--with-ragged-dot", "--out", str(out))
    assert code == 0, err
    table = (out / "compare.md").read_text()
    assert stdout.count("| dropless (nodrop) |") == 1 and table in stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == [
        "dropless (nodrop)", "dropless (jax.lax.ragged_dot)", "capacity factor 0.5"]
    assert "one seed: no estimate of the noise" in table
    caveat = "one seed: a difference between the variants may be seed noise"
    assert f"**Caveat: {caveat}" in table and f"nodrop compare: caveat: {caveat}" in stdout
    assert plotted_caveats == [compare.ONE_SEED_CAVEAT]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    results = json.loads((out / "compare.json").read_text())
    dropless, ragged, capacity = (results[name]["seeds"]["0"] for name in (
        "dropless (nodrop)", "dropless (jax.lax.ragged_dot)", "capacity factor 0.5"))
    assert dropless["dropped_fraction"] == 0.0 and ragged["dropped_fraction"] == 0.0
    # Capacity 0.5 * T * k / E per expert: at least about half of the slots are dropped.
    assert capacity["dropped_fraction"] > 0.4
    for record in records(out / "capacity-0.5" / "seed-0", "train"):
        assert min(record["dropped_fraction"]) > 0.4
    # The same math on two grouped-matmul implementations.
    assert ragged["val_loss"] == pytest.approx(dropless["val_loss"], rel=1e-3)
    assert capacity["val_loss"] != dropless["val_loss"]


def test_compare_bf16_against_fp8_recipes_without_capacity_factors(tmp_path, capsys, text_file):
    """--fp8-recipes adds a dropless run per recipe (and --fp8-weight-gradients per weight
    gradient) on the same batches and weights; the bare --capacity-factors flag leaves out token
    dropping."""
    out = tmp_path / "compare"
    flags = train_flags(text_file, steps=4, **{"eval-every": 2, "checkpoint-every": 0})
    code, stdout, err = run_cli(capsys, "compare", *flags, "--fp8-recipes", "blockwise",
                                "tensorwise", "--fp8-weight-gradients", "fp8", "unquantised",
                                "--capacity-factors", "--out", str(out))
    assert code == 0, err
    table = (out / "compare.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    # A variant names its weight gradient where it is not the default (unquantised).
    names = ["dropless (nodrop)", "dropless (nodrop, FP8 blockwise, FP8 weight gradients)",
             "dropless (nodrop, FP8 blockwise)",
             "dropless (nodrop, FP8 tensorwise, FP8 weight gradients)",
             "dropless (nodrop, FP8 tensorwise)"]
    assert [row.split("|")[1].strip() for row in rows[1:]] == names
    assert "MFU" not in rows[0]  # the CPU has no known peak
    results = json.loads((out / "compare.json").read_text())
    bf16, *fp8_runs = (results[name]["seeds"]["0"] for name in names)
    saved = [json.loads((Path(run["run_dir"]) / "config.json").read_text())["model"]
             for run in fp8_runs]
    assert [(model["fp8"], model["fp8_weight_gradient"]) for model in saved] == [
        ("blockwise", "fp8"), ("blockwise", "unquantised"), ("tensorwise", "fp8"),
        ("tensorwise", "unquantised")]
    assert sorted(path.name for path in out.iterdir() if path.is_dir()) == [
        "dropless", "dropless-fp8-blockwise", "dropless-fp8-blockwise-fp8-wgrad",
        "dropless-fp8-tensorwise", "dropless-fp8-tensorwise-fp8-wgrad"]
    for run in fp8_runs:
        # The same training, rounded differently: close, not equal.
        assert run["val_loss"] != bf16["val_loss"]
        assert run["val_loss"] == pytest.approx(bf16["val_loss"], rel=0.05)
    assert len({run["val_loss"] for run in fp8_runs}) == 4
    assert json.loads((Path(bf16["run_dir"]) / "config.json").read_text())["model"]["fp8"] == "off"
    code, _, err = run_cli(capsys, "compare", *flags, "--capacity-factors", "--out",
                           str(tmp_path / "alone"))
    assert code != 0 and "nothing to compare dropless with" in err


def test_compare_mfu_is_the_timing_records_flops_at_the_runs_tokens_per_s():
    summary = trainer.Summary(run_dir="r", steps=4, train_loss=1.0, val_loss=1.0,
                              unigram_loss=2.0, tokens_per_s=150.0, train_time_s=1.0,
                              compile_s=1.0, wall_s=2.0, dropped_fraction=0.0, num_params=1,
                              num_active_params=1)
    timing = [{"kind": "train", "step": 1}, {"kind": "timing", "step": 2, "tokens_per_s": 100.0,
                                             "mfu": 0.2}]
    assert compare.run_mfu(timing, summary) == pytest.approx(0.3)
    assert compare.run_mfu([{"kind": "timing", "step": 2, "tokens_per_s": 100.0}], summary) is None


def test_compare_on_token_ids_gives_every_run_the_datas_vocabulary(tmp_path, capsys):
    """Taken once, recorded in every run's settings: a comparison started again finds its
    finished runs its own."""
    folder = tmp_path / "data"
    folder.mkdir()
    (np.arange(3000) * 7 % 301).astype("<u2").tofile(folder / "train.bin")  # ids up to 300
    out = tmp_path / "compare"
    flags = [*token_flags(folder, steps=2, **{"checkpoint-every": 0}), "--capacity-factors",
             "0.5", "--out", str(out)]
    code, stdout, err = run_cli(capsys, "compare", *flags)
    assert code == 0, err
    assert stdout.count("nodrop: vocabulary 320 from the data") == 1, stdout
    for variant in ("dropless", "capacity-0.5"):
        saved = json.loads((out / variant / "seed-0" / "config.json").read_text())
        assert saved["model"]["vocab_size"] == 320
    code, stdout, err = run_cli(capsys, "compare", *flags)
    assert code == 0, err
    assert stdout.count("finished before") == 2, stdout


def test_compare_over_seeds_reports_the_spread_and_the_noise(tmp_path, capsys, text_file):
    out = tmp_path / "compare"
    flags = train_flags(text_file, steps=4, **{"checkpoint-every": 0})
    at = flags.index("--eval-every")
    del flags[at:at + 2]
    code, stdout, err = run_cli(capsys, "compare", *flags, "--capacity-factors", "0.5",
                                "--seeds", "0", "1", "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "compare.json").read_text())
    for name in ("dropless (nodrop)", "capacity factor 0.5"):
        losses = [results[name]["seeds"][seed]["val_loss"] for seed in ("0", "1")]
        assert losses[0] != losses[1]  # other weights, other batches
        assert results[name]["val_loss_mean"] == pytest.approx(np.mean(losses))
        assert results[name]["val_loss_half_range"] == pytest.approx(
            abs(losses[0] - losses[1]) / 2)
        for seed in (0, 1):
            evals = records(out / name_folder(name) / f"seed-{seed}", "eval")
            # Without --eval-every, evaluations spread over the run: steps // 20 apart.
            assert [r["step"] for r in evals] == [1, 2, 3, 4]
    capacity = results["capacity factor 0.5"]
    differences = [capacity["seeds"][s]["val_loss"] - results["dropless (nodrop)"]["seeds"][s][
        "val_loss"] for s in ("0", "1")]
    assert capacity["difference_to_dropless"] == pytest.approx(differences)
    table = (out / "compare.md").read_text()
    assert " ± " in table and capacity["verdict"] in table
    assert "Caveat" not in table and "caveat" not in stdout  # two seeds
    assert ("inside the noise" in capacity["verdict"]) or ("on every seed" in capacity["verdict"])


def name_folder(name: str) -> str:
    return {"dropless (nodrop)": "dropless", "capacity factor 0.5": "capacity-0.5"}[name]


def test_compare_failing_to_write_its_table_is_one_line(capsys):
    """compare.md, compare.png and compare.json are written outside any run."""
    def body():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/c/compare.md")

    assert cli._training("compare", body) == cli.EXIT_WRITE_FAILED
    assert capsys.readouterr().err == (
        "nodrop compare: error: [Errno 28] No space left on device: '/runs/c/compare.md'\n")


def test_compare_refuses_seed_and_seeds_together(tmp_path, capsys, text_file):
    code, _, err = run_cli(capsys, "compare", *train_flags(text_file), "--seed", "1",
                           "--seeds", "0", "1", "--out", str(tmp_path / "c"))
    assert code == 2 and "give --seed or --seeds, not both" in err

def test_verdict_needs_every_seed_to_agree_and_to_clear_the_spread():
    from nodrop.train.compare import verdict
    assert verdict([0.10, 0.12], 0.01, 0.02).startswith("higher on every seed")
    assert verdict([-0.10, -0.12], 0.01, 0.02).startswith("lower on every seed")
    assert verdict([0.10, -0.05], 0.01, 0.01).startswith("inside the noise")
    assert verdict([0.01, 0.02], 0.03, 0.001).startswith("inside the noise")
    assert verdict([0.5], 0.0, 0.0) == "one seed: no estimate of the noise"


def test_a_trained_models_logits_ignore_the_batch_dropless_but_not_under_a_capacity(reference):
    """nodrop's promise at the model level: next to other batch-mates a sequence's logits stay
    the same dropless (to float32 rounding) and move with a capacity factor (same weights)."""
    from nodrop.train import invariance
    dropless, capacity = invariance.measure(reference, capacity_factors=(1.0,), batch_size=4,
                                            probes=3)
    assert (dropless.dispatch, capacity.dispatch) == ("dropless", "capacity factor 1.0")
    assert dropless.dropped_fraction == 0.0 and dropless.max_rel < 1e-5
    assert capacity.dropped_fraction > 0.0 and capacity.max_rel > 1e-3
    assert "| dropless |" in invariance.table([dropless, capacity])


def test_load_model_restores_the_trained_weights(reference):
    from nodrop.train import trainer
    model, step = trainer.load_model(reference)
    twin, _ = trainer.load_model(reference, capacity_factor=1.0)
    assert step == STEPS
    np.testing.assert_array_equal(model.layers[0].ffn.router[...], twin.layers[0].ffn.router[...])
    assert twin.config.capacity_factor == 1.0 and model.config.capacity_factor is None
    from flax import nnx
    from nodrop.models import MoELM
    fresh = MoELM(model.config, rngs=nnx.Rngs(0))
    assert not np.array_equal(model.layers[0].ffn.router[...], fresh.layers[0].ffn.router[...])
    assert np.any(np.asarray(model.layers[0].ffn.expert_bias[...]) != 0)  # restored, not reset


def test_load_model_names_what_is_missing(tmp_path):
    from nodrop.train import trainer
    from nodrop.train.config import ConfigError
    with pytest.raises(ConfigError, match="holds no config.json"):
        trainer.load_model(tmp_path)


def test_compare_started_again_reuses_finished_runs_and_refuses_other_settings(
        tmp_path, capsys, text_file):
    out = tmp_path / "compare"
    flags = [*train_flags(text_file, steps=3, **{"checkpoint-every": 0}),
             "--capacity-factors", "0.5", "--out", str(out)]
    assert run_cli(capsys, "compare", *flags)[0] == 0
    first = json.loads((out / "compare.json").read_text())
    # A comparison stopped during its second run: that run's folder is half-written.
    shutil.rmtree(out / "capacity-0.5" / "seed-0" / "tensorboard")
    (out / "capacity-0.5" / "seed-0" / "summary.json").unlink()
    code, stdout, err = run_cli(capsys, "compare", *flags)
    assert code == 0, err
    assert "dropless (nodrop), seed 0: finished before" in stdout
    assert "capacity factor 0.5, seed 0 ->" in stdout
    again = json.loads((out / "compare.json").read_text())
    for name in first:
        assert again[name]["seeds"]["0"]["val_loss"] == first[name]["seeds"]["0"]["val_loss"]
    code, _, err = run_cli(capsys, "compare", *flags, "--lr", "0.002")
    assert code == 2 and "holds a finished run of other settings" in err


@pytest.mark.parametrize("fused_adamw", [True, False], ids=["fused", "optax"])
def test_compute_dtype_gradients_give_the_same_step_bit_for_bit(fused_adamw):
    """The weights cast to bfloat16 before the step (nodrop.models.cast_compute_weights): the
    same parameters, optimizer state and metrics, bit for bit, over three steps, as casting
    them at each use; the fused AdamW then reads the bfloat16 gradients themselves. A model
    with dense and MoE layers, shared experts and an untied head covers every COMPUTE_WEIGHTS."""
    import jax.numpy as jnp
    from flax import nnx

    from nodrop.models import cast_compute_weights
    flags = ["train", *MODEL_FLAGS, "--dtype", "bfloat16", "--set", "shared_ffn=32",
             "--set", "first_dense=1", "--batch-size", "2", "--seq-len", "32",
             "--fused-adamw" if fused_adamw else "--no-fused-adamw"]
    with jax.enable_x64(False):  # as trainer.run traces
        steps = {}
        for cast in (True, False):
            config, model_config = build(overrides_from_args(cli.build_parser().parse_args(
                flags + ["--compute-dtype-gradients" if cast else
                         "--no-compute-dtype-gradients"])))
            tx = trainer.optimizer(config)
            graphdef, init, _ = trainer._state_structure(config, model_config, tx,
                                                         jax.devices()[0])
            steps[cast] = jax.jit(trainer.make_steps(config, graphdef, tx)[0])
        batch = jax.random.randint(jax.random.key(1), (2, 33), 0, model_config.vocab_size,
                                   jnp.int32)
        halted = jnp.bool_(False)
        state = got = want = init()
        for step in (1, 2, 3):
            *got, got_metrics, _ = steps[True](*got, batch, jnp.int32(step), halted)
            *want, want_metrics, _ = steps[False](*want, batch, jnp.int32(step), halted)
            for a, b in zip(jax.tree.leaves((got, got_metrics)),
                            jax.tree.leaves((want, want_metrics))):
                np.testing.assert_array_equal(a, b)
        assert float(got_metrics["grad_norm"]) > 0 and bool(got_metrics["finite"]["state"])
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(got[0]))

        # What is cast: every COMPUTE_WEIGHTS weight; nothing the model reads in float32.
        model = nnx.merge(graphdef, state[0], state[2], copy=True)
        cast_compute_weights(model)
        dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in
                  jax.tree_util.tree_leaves_with_path(nnx.split(model, nnx.Param, ...)[1])}
        cast_names = [name for name, dtype in dtypes.items() if dtype == jnp.bfloat16]
        assert all(re.search(r"'(query|key|value|output|gate_up|down|shared_gate_up|"
                             r"shared_down|lm_head)'\]", name) for name in cast_names)
        # Two attention layers, one dense feed-forward, one MoE block with shared experts, head.
        assert len(cast_names) == 4 * 2 + 2 + 4 + 1, cast_names
        assert all(dtype == jnp.float32 for dtype in dtypes.values() if dtype != jnp.bfloat16)
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state[0]))
        if fused_adamw:  # the engine reads the bfloat16 gradients: no float32 copy in between
            text = steps[True].lower(*state, batch, jnp.int32(1), halted).as_text()
            calls = [line for line in text.splitlines() if "nodrop_adamw_update" in line]
            assert sum("xbf16>" in line for line in calls) == len(cast_names), calls


def test_router_lr_scale_scales_only_the_routers_updates():
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nodrop.models import MoELM
    config, model_config = build(overrides_from_args(cli.build_parser().parse_args(
        ["train", *MODEL_FLAGS])))
    params = nnx.split(MoELM(model_config, rngs=nnx.Rngs(0)), nnx.Param, ...)[1]
    grads = jax.tree.map(jnp.ones_like, params)

    def first_update(scale):
        tx = trainer.optimizer(dataclasses.replace(config, router_lr_scale=scale))
        return tx.update(grads, tx.init(params), params)[0]

    full, tenth = first_update(1.0), first_update(0.1)
    scaled = []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree.leaves(tenth)):
        name = jax.tree_util.keystr(path)
        ratio = float(jnp.abs(b).sum() / jnp.abs(a).sum())
        assert ratio == pytest.approx(0.1 if "router" in name else 1.0, rel=1e-5), name
        scaled += ["router" in name]
    assert sum(scaled) == model_config.num_layers  # one router per MoE layer, all scaled


def test_a_run_older_than_a_field_loads_and_resuming_it_names_the_field(reference, tmp_path):
    """config.json of a run that predates router_lr_scale: its model loads (today's default for
    the missing field), and --resume refuses it naming the field instead of failing on a key."""
    old = tmp_path / "old"
    shutil.copytree(reference, old)
    saved = json.loads((old / "config.json").read_text())
    del saved["train"]["router_lr_scale"]
    (old / "config.json").write_text(json.dumps(saved))
    assert trainer.run_config(old)[0].router_lr_scale == 1.0
    trainer.load_model(old)
    from nodrop.train.config import ConfigError
    with pytest.raises(ConfigError, match=r"router_lr_scale: None -> 1\.0"):
        trainer.configure({}, saved)
