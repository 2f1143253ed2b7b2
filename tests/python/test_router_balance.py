"""Routers balanced from the start, for every preset, on the trainer's default data (Python's
standard library: bytes for `tiny`, the trainer's BPE for the GPU presets) and default recipe.

At init the routers' inputs must be as diverse as the tokens themselves: the mean of their unit
vectors is about the square root of the sum of the squared token frequencies (0.31 for the bytes,
whose space alone is 28% of them; 0.10 for the BPE's tokens), not the 0.75 that an
attention-dominated residual stream gave. Then a short run (60 steps, warm-up 20) must have its
routers balanced from step 20 on: the busiest expert's load over the mean load, averaged over
steps 20-60, at most 1.5 in every layer, and never 2.5 (no collapse); with capacity factor 1.25,
at most 5% of the slots dropped after the warm-up. The GPU presets run where a GPU is (this
file under pytest on the GPU machine); `tiny` runs everywhere. docs/quality.md has the longer
runs.
"""

from __future__ import annotations

import needs_train  # noqa: F401  (first: skips this module without nodrop[train])

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nodrop
from nodrop.models import PRESETS, MoELM, preset
from nodrop.moe import MoEBlock
from nodrop.train import data, trainer
from nodrop.train.config import build
from nodrop.train.metrics import read_jsonl

ON_GPU = nodrop.backends()["cuda"] and jax.default_backend() == "gpu"


def needs_device(name: str):
    if name != "tiny" and not ON_GPU:
        pytest.skip(f"the {name} preset is a GPU model: needs an NVIDIA GPU and nodrop's CUDA "
                    "engine")


@pytest.fixture(scope="module")
def text():
    return data.load(None, None)


def training_tokens(name: str, text) -> np.ndarray:
    """The preset's training split as its default tokenizer encodes it."""
    return trainer.load_data(*build({"preset": name}), dataset=text, echo=lambda *_: None)[0].train


def router_inputs(config, tokens, batch: int, seq: int):
    """The input of every MoE layer's router at init, [T, H] each, for `batch` windows."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(tokens) - seq, batch)
    tokens = jnp.asarray(np.stack([tokens[s:s + seq] for s in starts]), jnp.int32)
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
def test_router_inputs_at_init_are_as_diverse_as_the_tokens(name, text):
    needs_device(name)
    config = preset(name, seq_len=256)
    tokens = training_tokens(name, text)
    counts = np.bincount(tokens, minlength=config.vocab_size) / len(tokens)
    floor = float(np.sqrt(np.sum(counts ** 2)))  # every token its own random direction
    for layer, x in enumerate(router_inputs(config, tokens, batch=8, seq=256)):
        units = x / np.linalg.norm(x, axis=1, keepdims=True)
        common = float(np.linalg.norm(units.mean(axis=0)))
        assert common < floor + 0.15, (
            f"{name} MoE layer {layer}: the router inputs share a direction of norm {common:.2f} "
            f"(tokens alone: {floor:.2f})")


def short_run(tmp_path, text, name: str, **changes) -> dict[int, dict]:
    """60 steps (warm-up 20) of the preset; its training records by step."""
    trainer.run({"preset": name, "steps": 60, "warmup_steps": 20, "eval_every": 60,
                 "eval_batches": 1, "checkpoint_every": 0, "log_every": 20, **changes},
                out=tmp_path, progress=False, dataset=text, echo=lambda *_: None)
    return {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"}


def load(records: dict[int, dict], first: int, last: int) -> np.ndarray:
    """max/mean load, [steps first..last, MoE layers]."""
    return np.stack([np.asarray(records[s]["max_over_mean"]) for s in range(first, last + 1)])


# max/mean is a statistic of one batch. With fine-grained experts one sequence is a large part
# of an expert's share: at 16 sequences of deepseek (6 of 64 experts) or qwen3 (8 of 128), a
# sequence whose tokens all pick one expert (a table, a long list: code has many) adds 0.67 or
# 1.0 of the mean load to it by itself, whatever the router. These two are measured on 64
# sequences a step, where one sequence adds 0.17 or 0.25; docs/quality.md has both batches.
BALANCE_BATCH = {"deepseek": 64, "qwen3": 64}


@pytest.mark.parametrize("name", PRESETS)
def test_routers_balanced_by_step_20(name, tmp_path, text):
    """From step 20 on, every layer's max/mean load averages at most 1.5 and never reaches 2.5
    (a collapse), each preset on its default data and tokenizer."""
    needs_device(name)
    batch = {"batch_size": BALANCE_BATCH[name]} if name in BALANCE_BATCH else {}
    after = load(short_run(tmp_path, text, name, **batch), 20, 60)
    assert after.mean(axis=0).max() <= 1.5, f"{name}: mean max/mean load {after.mean(axis=0)}"
    assert after.max() < 2.5, f"{name}: a router collapsed, max/mean load {after.max(axis=0)}"


def test_capacity_1_25_drops_few_slots_after_warm_up(tmp_path, text):
    records = short_run(tmp_path, text, "tiny", model_overrides={"capacity_factor": 1.25})
    dropped = np.mean([records[s]["dropped_fraction"] for s in range(21, 61)])  # [steps, layers]
    assert dropped <= 0.05, f"capacity 1.25 dropped {dropped:.1%} of slots after warm-up"
