"""Checkpoints with Orbax: the train state (params, optimizer state, expert biases) and a JSON
record of the step, the data position and the elapsed time.

Atomic: Orbax writes each checkpoint into `<step>.orbax-checkpoint-tmp-*` and renames it to
`<step>` only once every file is written (and records commit_success.txt), and the manager lists
only finished steps, so a run killed mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this model and optimizer."""


class Checkpoints:
    """The run's checkpoints/ folder: save(step, state, meta), latest_step(), restore(...)."""

    def __init__(self, directory: str | os.PathLike, keep: int):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            # Named handlers, so a manager that has not saved yet (a resumed run) can read the
            # items' metadata.
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()},
            # Synchronous: the saved arrays are this step's, and a save returns only once the
            # checkpoint is complete (its tmp folder renamed).
            options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                 enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state):
        """(state, meta) of `step`, restored into the structure, shapes and dtypes of
        `abstract_state` (a pytree of jax.ShapeDtypeStruct); CheckpointError if they differ."""
        where = self.directory / str(step)
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception as error:  # noqa: BLE001 - any unreadable metadata means the same
            raise CheckpointError(f"{where}: cannot read the checkpoint ({error})") from None
        problems = mismatches(stored, abstract_state)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more"
                                               if len(problems) > 6 else "")
            raise CheckpointError(f"{where} does not fit this model and optimizer: {shown}")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except Exception as error:  # noqa: BLE001 - a corrupt file in any of Orbax's layers
            raise CheckpointError(f"{where}: cannot restore the checkpoint ({error})") from None
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self._manager.close()


def _path_name(path) -> str:
    """A key path as 'params/layers/0/ffn/router', whatever key types the tree uses."""
    parts = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _leaves(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in leaves:
        name = _path_name(path)
        # nnx.State keeps a Variable's array under 'value' in some layouts and not in others.
        name = name[:-len("/value")] if name.endswith("/value") else name
        out[name] = (tuple(leaf.shape), np.dtype(leaf.dtype).name)
    return out


def mismatches(stored, expected) -> list[str]:
    """Differences between the stored tree's metadata and the expected abstract tree."""
    have, want = _leaves(stored), _leaves(expected)
    problems = []  # (name, message)
    problems += [(name, f"{name} is missing from the checkpoint") for name in want.keys() - have]
    problems += [(name, f"the checkpoint has {name}, which this model does not")
                 for name in have.keys() - want]
    for name in have.keys() & want.keys():
        if have[name] != want[name]:
            (shape, dtype), (want_shape, want_dtype) = have[name], want[name]
            problems.append((name, f"{name} is {dtype}{list(shape)} in the checkpoint but "
                                   f"{want_dtype}{list(want_shape)} here"))
    # The parameters first: the optimizer state only mirrors them.
    problems.sort(key=lambda item: (not item[0].startswith("params/"), item[0]))
    return [message for _, message in problems]
