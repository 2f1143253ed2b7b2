"""`nodrop train --mesh` on 8 host devices: the tiny preset reaches the single-device losses on
a data-parallel and on an expert-parallel mesh, an overflowing receive buffer is undone and rerun
with a larger one (nothing dropped, the same state as a run without overflow), bad meshes and
batches are refused before anything compiles, and a run resumed on its mesh continues exactly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import devices  # noqa: F401  (first: 8 host devices)
import needs_train  # noqa: F401  (skips this module without nodrop[train])
from runs import assert_states_close, losses, records, restored_state
import jax
import numpy as np
import pytest

from nodrop import cli
from nodrop.train import data, trainer
from nodrop.train.config import overrides_from_args

STEPS = 20
EP_MESH = "data=2,expert=4"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((data.stdlib_root() / "argparse.py").read_bytes()[:60_000])
    return path


def flags(text_file: Path, *extra: str) -> list[str]:
    # log-every 5: an overflow at step n is noticed only after the steps queued behind it ran.
    return ["--preset", "tiny", "--data", str(text_file), "--steps", str(STEPS),
            "--batch-size", "8", "--seq-len", "32", "--eval-every", "10", "--eval-batches", "2",
            "--checkpoint-every", "10", "--log-every", "5", "--no-progress", *extra]


def train(run_dir: Path, argv: list[str]) -> Path:
    args = cli.build_parser().parse_args(["train", *argv, "--out", str(run_dir)])
    trainer.run(overrides_from_args(args), out=run_dir, progress=False, echo=lambda *_: None)
    return run_dir










@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    """Runs trained once for the module, by name."""
    root = tmp_path_factory.mktemp("runs")
    made = {}

    def get(name: str, *extra: str) -> Path:
        if name not in made:
            made[name] = train(root / name, flags(text_file, *extra))
        return made[name]

    return get


@pytest.mark.parametrize("mesh", [EP_MESH, "data=8", "fsdp=8", "data=2,fsdp=2,expert=2"])
def test_a_mesh_reaches_the_single_device_losses(runs, mesh):
    single = runs("single")
    meshed = runs(mesh, "--mesh", mesh)
    assert [r["step"] for r in records(meshed, "train")] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(losses(meshed), losses(single), rtol=2e-5)
    np.testing.assert_allclose([r["val_loss"] for r in records(meshed, "eval")],
                               [r["val_loss"] for r in records(single, "eval")], rtol=2e-5)
    assert all(v == 0 for r in records(meshed, "train") for v in r["dropped_fraction"])
    assert_states_close(restored_state(meshed, STEPS), restored_state(single, STEPS),
                        rtol=1e-4)


def test_an_overflowing_step_changes_nothing_and_reruns_with_a_larger_buffer(runs):
    """A buffer of 0.25 x the balanced load overflows at step 1: the steps queued behind it
    change nothing either, the buffer grows to 2 and then as far as the routing needs, and the
    run ends with the numbers of a run sized for the worst case, which never overflows."""
    worst = runs("worst", "--mesh", EP_MESH, "--ep-buffer", "worst")
    small = runs("small", "--mesh", EP_MESH, "--ep-buffer", "0.25")
    assert records(worst, "ep_rerun") == []
    reruns = records(small, "ep_rerun")
    assert reruns[:2] == [
        {"kind": "ep_rerun", "step": 1, "evaluation": False, "old_factor": 0.25,
         "new_factor": 2.0},
        {"kind": "ep_rerun", "step": 1, "evaluation": False, "old_factor": 2.0,
         "new_factor": 4.0}], reruns
    assert [(r["old_factor"], r["new_factor"]) for r in reruns[2:]] in ([], [(4.0, None)])
    compiled = [r["ep_buffer_factor"] for r in records(small, "compile")]
    assert compiled == [0.25] + [r["new_factor"] for r in reruns]
    # The recompiles are not training time: counted, they would add their whole time to the
    # steps'; the steps took about what the worst-case run's did (half the recompiles' time is
    # the margin for a loaded machine, not a single compile, which a busy CI host exceeded).
    training_s = records(small, "timing")[-1]["elapsed_s"]
    recompile_s = sum(r["train_step_s"] for r in records(small, "compile")[1:])
    worst_s = records(worst, "timing")[-1]["elapsed_s"]
    assert training_s < worst_s + recompile_s / 2, (training_s, worst_s, recompile_s)
    # Every step logged once, in order, each from the state of the step before it.
    assert [r["step"] for r in records(small, "train")] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(losses(small), losses(worst), rtol=1e-6)
    assert all(v == 0 for r in records(small, "train") for v in r["dropped_fraction"])
    small_state, worst_state = restored_state(small, STEPS), restored_state(worst, STEPS)
    assert_states_close(small_state, worst_state, rtol=1e-6)
    counts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
        small_state["opt_state"])[0] if "count" in jax.tree_util.keystr(path)]
    assert counts and all(int(count) == STEPS for count in counts)


@pytest.mark.parametrize(("extra", "message"), [
    (["--mesh", "data=3"], "--mesh must use all 8 devices, got data=3 x fsdp=1 x expert=1 = 3"),
    (["--mesh", "data:8"], "--mesh must be comma-separated axis=size pairs like "
                           "'data=2,fsdp=1,expert=4', got 'data:8'"),
    (["--mesh", "data=8", "--batch-size", "12"],
     "--batch-size must be divisible by data=8 x fsdp=1 x expert=1 = 8, got 12"),
    (["--mesh", "expert=8", "--set", "num_experts=4"],
     "--mesh expert=8: model.num_experts must be divisible by the mesh's expert axis (8), "
     "got 4"),
    (["--mesh", EP_MESH, "--capacity-factor", "1.25"],
     "model.capacity_factor (--capacity-factor) must be none (dropless) on a mesh with an "
     "expert axis (--mesh data=2,expert=4), got 1.25"),
    (["--ep-buffer", "big"], "argument --ep-buffer: expected a number or 'worst', got 'big'"),
    (["--ep-buffer", "0"], "model.ep_buffer_factor (--ep-buffer) must be None (the worst case) "
                           "or a positive finite number, got 0.0"),
])
def test_bad_meshes_and_batches_are_refused_before_anything_compiles(
        tmp_path, capsys, text_file, extra, message):
    out = tmp_path / "never"
    try:
        code = cli.main(["train", *flags(text_file), *extra, "--out", str(out)])
    except SystemExit as exit:  # argparse's, for a flag it cannot parse
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2
    # One line (after argparse's usage, for a flag it cannot parse).
    assert err.strip().splitlines()[-1] == f"nodrop train: error: {message}", err
    assert "Traceback" not in err
    assert not out.exists()


def test_kill_9_on_the_mesh_then_resume_gives_the_same_numbers(runs, tmp_path, text_file):
    """`python -m nodrop train --mesh` (8 host devices) killed with SIGKILL after its step-10
    checkpoint and resumed ends with the numbers of the uninterrupted run of this process."""
    want = runs(EP_MESH, "--mesh", EP_MESH)
    killed = tmp_path / "killed"
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices.NUM_DEVICES)}

    def nodrop_train(*extra: str, log: str) -> subprocess.Popen:
        # From tmp_path: from the repository root, `-m nodrop` would import the source tree.
        with open(tmp_path / log, "w") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "nodrop", "train", *flags(text_file, "--mesh", EP_MESH),
                 "--out", str(killed), *extra], stdout=out, stderr=subprocess.STDOUT,
                cwd=tmp_path, env=env)

    proc = nodrop_train(log="killed.log")
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not (
            (killed / "checkpoints" / "10").is_dir()):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    assert records(killed, "train")[-1]["step"] < STEPS, "finished before it could be killed"

    proc = nodrop_train("--resume", log="resume.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "resume.log").read_text()
    assert "resuming" in (tmp_path / "resume.log").read_text()
    timing = {"elapsed_s"}
    for kind in ("train", "eval", "final"):
        got = [{k: v for k, v in r.items() if k not in timing} for r in records(killed, kind)]
        assert got == [{k: v for k, v in r.items() if k not in timing}
                       for r in records(want, kind)], kind
    assert_states_close(restored_state(killed, STEPS), restored_state(want, STEPS), rtol=0)


def test_resume_on_the_mesh_continues_exactly(runs, tmp_path):
    """Resumed from its step-10 checkpoint on the same mesh, a run rewrites steps 11-20 with
    the numbers it had, keeping the receive buffer it had grown to."""
    run_dir = runs(EP_MESH, "--mesh", EP_MESH)
    before = {kind: records(run_dir, kind) for kind in ("train", "eval")}
    state_before = restored_state(run_dir, STEPS)
    grown = records(run_dir, "compile")[-1]["ep_buffer_factor"]
    args = cli.build_parser().parse_args(
        ["train", "--resume-from", "10", "--out", str(run_dir), "--no-progress"])
    trainer.run(overrides_from_args(args), out=run_dir, resume_from=10, progress=False,
                echo=lambda *_: None)
    compiles = records(run_dir, "compile")
    assert compiles[-1]["step"] == 10 and compiles[-1]["ep_buffer_factor"] == grown
    assert [r for r in records(run_dir, "ep_rerun") if r["step"] > 10] == []
    timing = {"step_time_s", "tokens_per_s", "elapsed_s", "mfu"}
    for kind, want in before.items():
        got = records(run_dir, kind)
        assert [{k: v for k, v in r.items() if k not in timing} for r in got] == \
            [{k: v for k, v in r.items() if k not in timing} for r in want], kind
    assert_states_close(restored_state(run_dir, STEPS), state_before, rtol=0)


def test_a_checkpoint_restores_onto_another_mesh(runs, tmp_path):
    """A run on the expert-parallel mesh, resumed from its step-10 checkpoint on data=8 (Orbax
    reshards the state), ends where the single-device run does, within float32 rounding."""
    run_dir = tmp_path / "resharded"
    shutil.copytree(runs(EP_MESH, "--mesh", EP_MESH), run_dir)
    args = cli.build_parser().parse_args(
        ["train", "--resume-from", "10", "--mesh", "data=8", "--out", str(run_dir),
         "--no-progress"])
    trainer.run(overrides_from_args(args), out=run_dir, resume_from=10, progress=False,
                echo=lambda *_: None)
    assert trainer.run_config(run_dir)[0].mesh == "data=8"
    assert not trainer.run_config(run_dir)[1].expert_parallel
    single = runs("single")
    np.testing.assert_allclose(losses(run_dir), losses(single), rtol=2e-5)
    assert_states_close(restored_state(run_dir, STEPS), restored_state(single, STEPS),
                        rtol=1e-4)


@pytest.mark.parametrize("mesh", ["data=8", EP_MESH])
def test_on_a_mesh_the_weights_are_cast_at_use_and_gradients_stay_float32(mesh):
    """compute_dtype_gradients applies on one device only: on a mesh the gradients' reductions
    across devices stay float32, so the AdamW calls read float32 gradients."""
    import jax.numpy as jnp

    from nodrop.parallel import make_mesh
    config, model_config = trainer.build(overrides_from_args(cli.build_parser().parse_args(
        ["train", "--preset", "tiny", "--dtype", "bfloat16", "--batch-size", "8",
         "--seq-len", "32"])))
    assert config.compute_dtype_gradients
    tx = trainer.optimizer(config)
    graphdef, init, _ = trainer._state_structure(config, model_config, tx, jax.devices()[0])
    train_step, _ = trainer.make_steps(config, graphdef, tx)
    batch = jnp.zeros((8, 33), jnp.int32)
    with jax.enable_x64(False), jax.set_mesh(make_mesh(mesh)):
        text = jax.jit(train_step).lower(*init(), batch, jnp.int32(1),
                                         jnp.bool_(False)).compile().as_text()
    calls = [line for line in text.splitlines()
             if 'custom_call_target="nodrop_adamw_update' in line]
    assert calls and not [line for line in calls if "bf16[" in line], calls
