"""Checkpoints with Orbax: the train state (params, optimizer state, expert biases) and a JSON
record of the step, the data position, the elapsed time and a CRC32 of every array.

Verified: a restore checks the record's step against the folder's name and every restored array
against its CRC32, so a damaged or misplaced checkpoint is reported, never used. (Checkpoints
written before the CRC32s were recorded restore with the step check only.)

Atomic: Orbax writes each checkpoint into `<step>.orbax-checkpoint-tmp-*` and renames it to
`<step>` only once every file is written (and records commit_success.txt), and the manager lists
only finished steps, so a run killed mid-save resumes from the previous checkpoint. A save that
fails (a full disk, lost permissions) removes its temporary folder and raises OSError naming
the checkpoint.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this model and optimizer."""


# TensorStore reports a failed write as a ValueError led by its status code.
_STORAGE_ERRNO = {"RESOURCE_EXHAUSTED": errno.ENOSPC, "PERMISSION_DENIED": errno.EACCES,
                  "NOT_FOUND": errno.ENOENT, "DATA_LOSS": errno.EIO, "UNAVAILABLE": errno.EIO}


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
        """meta must hold "step" (= step); the arrays' CRC32s are added to it."""
        meta = {**meta, "crc32": checksums(state)}
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
            self._manager.wait_until_finished()
        except BaseException as error:
            # The next save of this step would replace it, but a resumed run may never get
            # there: nothing half-written stays in the run folder.
            for unfinished in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(unfinished, ignore_errors=True)
            code = _storage_errno(error)
            if code is None:
                raise
            text = (error.strerror if isinstance(error, OSError) and error.strerror
                    else os.strerror(code))
            raise OSError(code, text, str(self.directory / str(step))) from None

    def restore(self, step: int, abstract_state, *, partial: bool = False):
        """(state, meta) of `step`, restored into the structure, shapes and dtypes of
        `abstract_state` (a pytree of jax.ShapeDtypeStruct); CheckpointError if they differ, if
        the checkpoint is damaged, or if it holds another step's state. With `partial`,
        abstract_state is a dict holding some of the saved top-level entries (the params
        without the optimizer state), and only those are read and checked."""
        where = self.directory / str(step)
        advice = (f"it is damaged: resume from an earlier one with --resume-from STEP (this "
                  f"run has {self.all_steps()}), or start again")
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception as error:  # noqa: BLE001 - any unreadable metadata means the same
            raise CheckpointError(f"{where}: cannot read the checkpoint ({_first_line(error)}); "
                                  f"{advice}") from None
        # Without its metadata file Orbax reports an empty tree, which is damage, not a
        # checkpoint of another model.
        if not _leaves(stored):
            raise CheckpointError(f"{where} is incomplete: {where / 'state' / '_METADATA'} is "
                                  f"missing or lists no arrays; {advice}")
        if partial:
            stored = {key: stored[key] for key in abstract_state if key in stored}
        problems = mismatches(stored, abstract_state)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more"
                                               if len(problems) > 6 else "")
            raise CheckpointError(f"{where} does not fit this model and optimizer: {shown}")
        try:
            if partial:
                # The manager's StandardCheckpointHandler restores whole trees only.
                with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
                    state = checkpointer.restore(where / "state", args=ocp.args.PyTreeRestore(
                        abstract_state, partial_restore=True,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(
                            abstract_state)))
                meta = self._manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
            else:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                state, meta = restored["state"], restored["meta"]
        except Exception as error:  # noqa: BLE001 - a corrupt file in any of Orbax's layers
            raise CheckpointError(f"{where} cannot be read ({_first_line(error)}); "
                                  f"{advice}") from None
        if meta.get("step") != step:
            raise CheckpointError(f"{where} holds the state of step {meta.get('step')}, not of "
                                  f"step {step}; {advice}")
        if "crc32" in meta:
            bad = sorted(name for name, crc in checksums(state).items()
                         if meta["crc32"].get(name) != crc)
            if bad:
                shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
                raise CheckpointError(f"{where}: {shown} differ from what was saved (CRC32); "
                                      f"{advice}")
        return state, {key: value for key, value in meta.items() if key != "crc32"}

    def close(self) -> None:
        self._manager.close()


def _storage_errno(error: BaseException) -> int | None:
    """The errno of a failed write (an OSError, or TensorStore's status); None for others."""
    if isinstance(error, OSError):
        return error.errno or errno.EIO
    match = re.search(r"\b(" + "|".join(_STORAGE_ERRNO) + r"):", str(error))
    return _STORAGE_ERRNO[match[1]] if isinstance(error, ValueError) and match else None


def _first_line(error: Exception) -> str:
    """The error's type and first line, at most 200 characters (TensorStore's are pages)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


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


class NoCheckpoints:
    """The checkpoints of a run that saves none (--checkpoint-every 0) and has none: no folder
    is made; there is nothing to list or restore."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).absolute()

    def latest_step(self) -> int | None:
        return None

    def all_steps(self) -> list[int]:
        return []

    def save(self, step: int, state, meta: dict) -> None:
        raise RuntimeError("a run with --checkpoint-every 0 saves no checkpoints")

    def close(self) -> None:
        pass


def checksums(tree) -> dict[str, int]:
    """CRC32 of every array's bytes, by key path (fetched to the host; on several processes
    each gathers the global values, so every process must call it)."""
    from nodrop.parallel import distributed
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    values = distributed.gather([leaf for _, leaf in leaves])
    return {_path_name(path): zlib.crc32(np.ascontiguousarray(value).tobytes())
            for (path, _), value in zip(leaves, values)}


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
