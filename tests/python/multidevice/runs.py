"""What the trainer tests here read back from a run folder: its metrics records, its losses, a
checkpoint restored onto one device, and states compared leaf by leaf."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from nodrop.train import trainer
from nodrop.train.checkpoint import Checkpoints
from nodrop.train.metrics import read_jsonl


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def losses(run_dir: Path) -> np.ndarray:
    return np.array([r["loss"] for r in records(run_dir, "train")])


def restored_state(run_dir: Path, step: int) -> dict:
    """The checkpoint of `step`, restored onto one device of this process."""
    config, model = trainer.run_config(run_dir)
    _, _, abstract = trainer._state_structure(config, model, trainer.optimizer(config),
                                              jax.devices()[0])
    checkpoints = Checkpoints(run_dir / "checkpoints", config.keep_checkpoints)
    try:
        return checkpoints.restore(step, trainer._checkpoint_tree(*abstract))[0]
    finally:
        checkpoints.close()


def assert_states_close(got: dict, want: dict, rtol: float) -> None:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol,
                                   err_msg=jax.tree_util.keystr(path))
