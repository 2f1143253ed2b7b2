"""A trained model from a run folder (its Orbax checkpoint) or an export folder (safetensors).

An export folder holds `model.safetensors` (every variable of the model: the params and the
MoE layers' expert biases, which routing needs; named by their NNX paths joined with '.', e.g.
`layers.0.ffn.router`), `config.json` (the run's config.json with the step it was exported at)
and the run's `tokenizer.json` where it has one. No optimizer state: a fraction of the
checkpoint's size.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nodrop.models import ModelConfig, MoELM

if TYPE_CHECKING:
    from tokenizers import Tokenizer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"


class LoadError(ValueError):
    """A folder that is neither a run nor an export, or an export that does not fit its config."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A trained model ready to run, with what it was trained with.

    saved: the run's config.json ({"train": ..., "model": ...}): the data and evaluation settings.
    tokenizer: the run's subword tokenizer (or the one given to `load`); None where it trained on
      bytes, or on token ids that nodrop cannot turn into text.
    """

    model: MoELM
    config: ModelConfig
    tokenizer: Tokenizer | None
    step: int
    saved: dict[str, Any]

    @property
    def vocabulary(self) -> int:
        """The ids that mean something: the tokenizer's, or the 256 bytes."""
        if self.tokenizer is None:
            self._require_text()
            return min(256, self.config.vocab_size)
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            self._require_text()
            return list(text.encode("utf-8"))
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as error:  # the Rust tokenizer raises a bare Exception
            from nodrop.train.tokenizer import unknown_characters
            missing = unknown_characters(self.tokenizer, text)
            raise LoadError(
                f"text: the characters {missing} are not in the model's vocabulary (its "
                "tokenizer has no id for them)" if missing else
                f"text: the model's tokenizer cannot encode it ({error})") from None

    def decode(self, ids: Iterable[int]) -> str:
        if self.tokenizer is None:
            self._require_text()
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids))

    def _require_text(self) -> None:
        """Without a tokenizer only a model of bytes reads and writes text (runs saved before
        config.json said what its tokens are trained on bytes or a saved tokenizer)."""
        if self.saved.get("tokens") == "token ids":
            raise LoadError(
                f"the model was trained on token ids from {self.saved['data']['source']} with no "
                f"tokenizer (vocabulary {self.config.vocab_size}): nodrop cannot turn text into "
                "them; give the Hugging Face tokenizer.json they come from (nodrop generate "
                "--tokenizer FILE, nodrop.load(..., tokenizer=FILE); GPT-2's for nanoGPT's "
                "openwebtext)")


def load(path: str | os.PathLike[str], *, step: int | None = None,
         tokenizer: str | os.PathLike[str] | None = None, **model_changes: Any) -> Loaded:
    """The model of a run folder (its newest checkpoint, or `step`'s) or of an export folder.

    tokenizer: a Hugging Face tokenizer.json to read and write text with instead of the run's
    own (for a model trained on token ids, such as nanoGPT's GPT-2 ids); its vocabulary must fit
    the model's. model_changes replace ModelConfig fields that keep the weights as they are
    (capacity_factor, moe_matmul, fp8, fp8_weight_gradient, router_matmul, dtype, remat). Raises
    LoadError for a folder that is neither; a run folder's errors are the trainer's
    (ConfigError, CheckpointError).
    """
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        loaded = _load_export(path, step, model_changes)
    elif (path / CONFIG_FILE).is_file():
        loaded = _load_run(path, step, model_changes)
    else:
        raise LoadError(f"{path} is neither a run folder (config.json, checkpoints/) nor an "
                        f"export folder ({WEIGHTS_FILE}, config.json)")
    if tokenizer is None:
        return loaded
    from nodrop.train import tokenizer as tokenizers
    given = tokenizers.load(tokenizer)
    size = given.get_vocab_size(with_added_tokens=True)
    if size > loaded.config.vocab_size:
        raise LoadError(f"tokenizer: {tokenizer} has {size} tokens, more than the model's "
                        f"vocabulary of {loaded.config.vocab_size}")
    return dataclasses.replace(loaded, tokenizer=given)


def _load_run(run_dir: Path, step: int | None, model_changes: dict[str, Any]) -> Loaded:
    from nodrop.train import tokenizer, trainer  # Orbax and Optax only for run folders

    model, step = trainer.load_model(run_dir, step=step, **model_changes)
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    # A run with a tokenizer must have its file; a run of token ids has one where the data
    # came with nanoGPT's character map.
    run_tokenizer = (tokenizer.load(run_dir / TOKENIZER_FILE)
                     if saved["train"].get("tokenizer") is not None
                     or (run_dir / TOKENIZER_FILE).exists() else None)
    return Loaded(model, model.config, run_tokenizer, step, saved)


def _load_export(folder: Path, step: int | None, model_changes: dict[str, Any]) -> Loaded:
    try:
        saved = json.loads((folder / CONFIG_FILE).read_text())
        config = ModelConfig.from_dict(saved["model"]).replace(**model_changes)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LoadError(f"{folder / CONFIG_FILE}: not an export's config ({error})") from None
    if step is not None and step != saved["step"]:
        raise LoadError(f"step: {folder} is the export of step {saved['step']}, got {step}")
    import safetensors.numpy  # here: `import nodrop` needs none of the serving packages

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MoELM(config, rngs=nnx.Rngs(0))))
    arrays = safetensors.numpy.load_file(folder / WEIGHTS_FILE)
    flat = nnx.to_flat_state(abstract)
    expected = {_name(path): variable for path, variable in flat}
    problems = sorted(set(arrays) ^ set(expected))
    problems += [f"{name} is {arrays[name].dtype}{list(arrays[name].shape)}, expected "
                 f"{np.dtype(v.get_value().dtype)}{list(v.get_value().shape)}"
                 for name, v in expected.items() if name in arrays
                 and (arrays[name].shape, arrays[name].dtype)
                 != (v.get_value().shape, np.dtype(v.get_value().dtype))]
    if problems:
        raise LoadError(f"{folder / WEIGHTS_FILE} does not fit its config.json: "
                        f"{', '.join(problems[:6])}")
    for name, variable in expected.items():
        variable.set_value(jnp.asarray(arrays[name]))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    tokenizer_file = folder / TOKENIZER_FILE
    run_tokenizer = None
    if tokenizer_file.exists():
        from nodrop.train import tokenizer
        run_tokenizer = tokenizer.load(tokenizer_file)
    return Loaded(model, config, run_tokenizer, saved["step"], saved)


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path)


def export(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
           step: int | None = None) -> Path:
    """Writes the run's trained weights (its newest checkpoint, or `step`'s) as an export folder
    `out` (see the module's docstring), which must be new or empty. Returns the weights file."""
    import safetensors.numpy

    run_dir, out = Path(run_dir), Path(out)
    if (run_dir / WEIGHTS_FILE).is_file():
        raise LoadError(f"--run {run_dir} is an export already; export a run folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LoadError(f"--out {out} must be a new or empty folder")
    loaded = _load_run(run_dir, step, {})
    arrays = {_name(path): np.asarray(jax.device_get(variable.get_value()))
              for path, variable in nnx.to_flat_state(nnx.state(loaded.model))}
    out.mkdir(parents=True, exist_ok=True)
    weights = out / WEIGHTS_FILE
    safetensors.numpy.save_file(arrays, weights, metadata={"format": "nodrop",
                                                           "step": str(loaded.step)})
    (out / CONFIG_FILE).write_text(json.dumps({**loaded.saved, "step": loaded.step},
                                              indent=2) + "\n")
    if loaded.tokenizer is not None:
        (out / TOKENIZER_FILE).write_text(loaded.tokenizer.to_str())
    return weights
