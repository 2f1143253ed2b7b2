"""Routers balanced from the start, for every preset, on the trainer's default data (bytes of
Python's standard library) and its default recipe.

At init the routers' inputs must be as diverse as the tokens themselves: the mean of their unit
vectors is about the square root of the sum of the squared token frequencies (0.31 for these
bytes, whose space alone is 28% of the tokens), not the 0.75 that an attention-dominated residual
stream gave. Then a short run (60 steps, warm-up 20) must hold its routers balanced after the
warm-up: the busiest expert's load over the mean load, averaged over steps 41-60, under 1.5 in
every layer, and never 2.5 (no collapse). The GPU presets run where a GPU is (`make gpu-check`);
`tiny` runs everywhere. docs/quality.md has the longer runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nodrop
from nodrop.models import PRESETS, MoELM, preset
from nodrop.moe import MoEBlock
from nodrop.train import data, trainer
from nodrop.train.metrics import read_jsonl

ON_GPU = nodrop.backends()["cuda"] and jax.default_backend() == "gpu"


def needs_device(name: str):
    if name != "tiny" and not ON_GPU:
        pytest.skip(f"the {name} preset is a GPU model: needs an NVIDIA GPU and nodrop's CUDA "
                    "engine")


@pytest.fixture(scope="module")
def dataset():
    return data.load(None, 256)


def router_inputs(config, dataset, batch: int, seq: int):
    """The input of every MoE layer's router at init, [T, H] each, for `batch` windows."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(dataset.train) - seq, batch)
    tokens = jnp.asarray(np.stack([dataset.train[s:s + seq] for s in starts]), jnp.int32)
    model = MoELM(config, rngs=nnx.Rngs(0))
    seen = []
    blocks = model.moe_blocks()
    original = MoEBlock.__call__

    def capture(block, x):
        if block in blocks:
            seen.append(x.reshape(-1, x.shape[-1]).astype(jnp.float32))
        return original(block, x)

    MoEBlock.__call__ = capture
    try:
        model(tokens)
    finally:
        MoEBlock.__call__ = original
    return [np.asarray(x) for x in seen]


@pytest.mark.parametrize("name", PRESETS)
def test_router_inputs_at_init_are_as_diverse_as_the_tokens(name, dataset):
    needs_device(name)
    config = preset(name, seq_len=256)
    counts = np.bincount(dataset.train, minlength=256) / len(dataset.train)
    floor = float(np.sqrt(np.sum(counts ** 2)))  # every token its own random direction
    for layer, x in enumerate(router_inputs(config, dataset, batch=8, seq=256)):
        units = x / np.linalg.norm(x, axis=1, keepdims=True)
        common = float(np.linalg.norm(units.mean(axis=0)))
        assert common < floor + 0.15, (
            f"{name} MoE layer {layer}: the router inputs share a direction of norm {common:.2f} "
            f"(tokens alone: {floor:.2f})")


# Not met yet on byte tokens (H200, 2026-12-01, router lr 1): mean max/mean over steps 41-60 up
# to 1.61 on mixtral, 3.9 on deepseek, 12.3 on qwen3, whose 128 experts take 8 slots of each
# space (28% of the tokens). docs/quality.md.
UNBALANCED = {"mixtral", "deepseek", "qwen3"}


@pytest.mark.parametrize("name", [pytest.param(
    name, marks=pytest.mark.xfail(reason="routers not yet balanced after warm-up on byte tokens",
                                  strict=False) if name in UNBALANCED else ())
    for name in PRESETS])
def test_routers_stay_balanced_after_warm_up(name, tmp_path, dataset):
    needs_device(name)
    trainer.run({"preset": name, "steps": 60, "warmup_steps": 20, "eval_every": 60,
                 "eval_batches": 1, "checkpoint_every": 0, "log_every": 20},
                out=tmp_path, progress=False, dataset=dataset, echo=lambda *_: None)
    steps = {r["step"]: np.asarray(r["max_over_mean"]) for r in read_jsonl(
        tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    after = np.stack([steps[s] for s in range(41, 61)])  # [steps, layers]
    assert after.mean(axis=0).max() < 1.5, f"{name}: mean max/mean load {after.mean(axis=0)}"
    assert after.max() < 2.5, f"{name}: a router collapsed, max/mean load {after.max(axis=0)}"
