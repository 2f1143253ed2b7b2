"""Batch invariance of a trained model: does a sequence's output depend on the rest of its batch?

Dropless, a token's experts and their outputs depend on that token alone, so a sequence's logits
do not change when its batch-mates do (up to float rounding: the expert matmuls see other row
counts). Under a capacity factor an expert's buffer fills with whichever tokens of the batch come
first, so the same sequence next to other sequences loses other tokens and its logits change.

`measure` loads a run's (or its export's) trained weights once per dispatch (dropless and each
capacity factor: the same weights), puts each probe sequence into two batches whose other
sequences differ, and reports how far its logits moved.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nodrop.serve import load
from nodrop.train import trainer


@dataclasses.dataclass(frozen=True)
class Change:
    """How one dispatch's logits of the probe sequences moved between the two batches."""

    dispatch: str
    max_abs: float  # largest |logit difference| over probes, positions and vocabulary
    max_rel: float  # max_abs over the largest |logit|
    argmax_changed: float  # fraction of probe positions whose most likely next token changed
    dropped_fraction: float  # mean over the MoE layers and both batches


def measure(run_dir: str | os.PathLike, *, capacity_factors=(1.0, 1.25), batch_size: int = 16,
            probes: int = 4, seed: int = 0) -> list[Change]:
    """Dropless first, then each capacity factor. Each of `probes` validation windows is
    evaluated as the last sequence of two batches of `batch_size` (the last: slot-major dispatch
    fills the buffers in batch order), whose other sequences are two sets of training windows
    drawn with `seed`."""
    if batch_size < 2 or probes < 1:
        raise ValueError(f"need batch_size >= 2 and probes >= 1, got {batch_size}, {probes}")
    config, model_config = trainer.run_config(run_dir)
    dataset, *_ = trainer.load_data(config, model_config, run_dir=Path(run_dir))
    seq_len = config.seq_len
    rng = np.random.default_rng(seed)

    def windows(tokens, count):
        starts = rng.integers(0, len(tokens) - seq_len, count)
        return np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int32)

    probe_rows = windows(dataset.val, probes)
    others = windows(dataset.train, 2 * probes * (batch_size - 1)).reshape(
        2, probes, batch_size - 1, seq_len)
    batches = [[np.concatenate([others[side, p], probe_rows[p:p + 1]]) for p in range(probes)]
               for side in range(2)]

    results = []
    for capacity_factor in (None, *capacity_factors):
        model = load(run_dir, capacity_factor=capacity_factor).model
        forward = nnx.jit(lambda m, tokens: m(tokens))
        logits, dropped = [], []
        for side in range(2):
            outs = [forward(model, jnp.asarray(batch)) for batch in batches[side]]
            logits.append(np.stack([np.asarray(out[0][-1]) for out in outs]))  # [probes, S, V]
            dropped += [float(jnp.mean(out[1].dropped_fraction)) for out in outs]
        difference = np.abs(logits[0] - logits[1])
        results.append(Change(
            dispatch="dropless" if capacity_factor is None
            else f"capacity factor {capacity_factor}",
            max_abs=float(difference.max()),
            max_rel=float(difference.max() / np.abs(logits[0]).max()),
            argmax_changed=float(np.mean(logits[0].argmax(-1) != logits[1].argmax(-1))),
            dropped_fraction=float(np.mean(dropped))))
        del model
        jax.clear_caches()
    return results


def table(changes: list[Change]) -> str:
    lines = ["| dispatch | max abs logit change | relative to max abs logit | positions whose "
             "argmax changed | dropped fraction |", "| --- | ---: | ---: | ---: | ---: |"]
    for c in changes:
        lines.append(f"| {c.dispatch} | {c.max_abs:.3g} | {c.max_rel:.3g} | "
                     f"{c.argmax_changed:.2%} | {c.dropped_fraction:.2%} |")
    return "\n".join(lines) + "\n"
