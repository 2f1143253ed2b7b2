"""Checkpoints: exact round trip, atomicity (an unfinished save is never picked up), and a clear
error for a checkpoint that does not fit the model."""

from __future__ import annotations

import needs_train  # noqa: F401  (first: skips this module without nodrop[train])

import errno
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from orbax.checkpoint._src.path.atomicity_types import TMP_DIR_SUFFIX

from nodrop.models import MoELM, preset
from nodrop.train.checkpoint import CheckpointError, Checkpoints

SMALL = dict(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, dense_ffn=16,
             num_experts=4, k=2, expert_ffn=16, seq_len=16)


def train_state(seed: int, **overrides):
    """The trainer's checkpointed tree for a small model, with a non-trivial optimizer state."""
    model = MoELM(preset("tiny", **{**SMALL, **overrides}), rngs=nnx.Rngs(seed))
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    _, opt_state = tx.update(grads, opt_state, params)
    model_state = jax.tree.map(lambda b: b + 0.25, model_state)  # expert biases, moved
    return {"params": params, "opt_state": opt_state, "model_state": model_state}


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def assert_bitwise_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact(tmp_path):
    state = train_state(0)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2)
    meta = {"step": 7, "elapsed_s": 1.5, "data_position": {"seed": 0, "next_step": 8}}
    checkpoints.save(7, state, meta)
    assert checkpoints.latest_step() == 7
    restored, restored_meta = checkpoints.restore(7, abstract(state))
    assert restored_meta == meta
    assert_bitwise_equal(restored, state)
    checkpoints.close()


def test_keeps_only_the_newest(tmp_path):
    state = train_state(0)
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, state, {"step": step})
    assert checkpoints.all_steps() == [2, 3]
    checkpoints.close()


def test_an_unfinished_checkpoint_is_never_picked_up(tmp_path):
    state = train_state(0)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    checkpoints.save(5, state, {"step": 5})
    checkpoints.close()
    # What a process killed while saving step 10 leaves: Orbax's temporary folder, half written.
    partial = tmp_path / "checkpoints" / f"10{TMP_DIR_SUFFIX}-1795950000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text('{"tree_metadata": {')
    (partial / "meta").mkdir()

    reopened = Checkpoints(tmp_path / "checkpoints", keep=3)
    assert reopened.latest_step() == 5
    restored, meta = reopened.restore(5, abstract(state))
    assert meta == {"step": 5}
    assert_bitwise_equal(restored, state)
    reopened.close()


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save(3, train_state(0), {"step": 3})
    other = train_state(0, hidden=32)
    with pytest.raises(CheckpointError) as error:
        checkpoints.restore(3, abstract(other))
    message = str(error.value)
    assert "does not fit this model and optimizer" in message
    assert "params/embedding is float32[256, 16] in the checkpoint but float32[256, 32] here" \
        in message
    fewer = train_state(0, num_layers=1)
    with pytest.raises(CheckpointError, match=r"the checkpoint has params/layers/1/"):
        checkpoints.restore(3, abstract(fewer))
    checkpoints.close()


def test_a_corrupt_checkpoint_gives_a_clear_error(tmp_path):
    state = train_state(0)
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save(4, state, {"step": 4})
    for path in (tmp_path / "4" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"4: cannot (read|restore) the checkpoint"):
        checkpoints.restore(4, abstract(state))
    checkpoints.close()


@pytest.mark.parametrize("missing, message", [
    ("state/_METADATA", " is incomplete: {where}/state/_METADATA is missing or lists no arrays"),
    ("state/manifest.ocdbt", ": cannot read the checkpoint (ValueError: NOT_FOUND"),
    ("meta/metadata", " cannot be read (FileNotFoundError: "),
    ("state", ": cannot read the checkpoint (KeyError: "),
])
def test_a_checkpoint_missing_a_file_is_reported_as_damaged(tmp_path, missing, message):
    """Not as a checkpoint of another model: the advice is to take an earlier one."""
    state = train_state(0)
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (4, 8):
        checkpoints.save(step, state, {"step": step})
    path = tmp_path / "8" / missing
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(CheckpointError) as error:
        checkpoints.restore(8, abstract(state))
    text = str(error.value)
    assert text.startswith(f"{tmp_path / '8'}" + message.format(where=tmp_path / "8")), text
    assert text.endswith("it is damaged: resume from an earlier one with --resume-from STEP "
                         "(this run has [4, 8]), or start again"), text
    assert "\n" not in text and len(text) < 600
    checkpoints.close()


@pytest.mark.parametrize("failure, code, text", [
    (ValueError('RESOURCE_EXHAUSTED: Error writing local file "x/d/1f": No space left on device'),
     errno.ENOSPC, "No space left on device"),
    (PermissionError(errno.EACCES, "Permission denied", "x/d/1f"), errno.EACCES,
     "Permission denied"),
], ids=["tensorstore_disk_full", "permission_denied"])
def test_a_failed_save_names_the_checkpoint_and_leaves_no_temporary_folder(
        tmp_path, monkeypatch, failure, code, text):
    state = train_state(0)
    checkpoints = Checkpoints(tmp_path, keep=3)
    checkpoints.save(4, state, {"step": 4})

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", fail)
    with pytest.raises(OSError) as error:
        checkpoints.save(8, state, {"step": 8})
    assert (error.value.errno, error.value.strerror, error.value.filename) == (
        code, text, str(tmp_path / "8"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4"]
    assert checkpoints.latest_step() == 4
    assert_bitwise_equal(checkpoints.restore(4, abstract(state))[0], state)
    checkpoints.close()
