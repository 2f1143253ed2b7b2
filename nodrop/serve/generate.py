"""Autoregressive sampling with MoELM's KV cache, and the loss of a model on data.

generate: the prompt goes through MoELM.decode in one call (the prefill), then one jitted step
per new token feeds the last token and samples the next; the step's shapes never change, so it
compiles once. Every MoE layer runs dropless on nodrop's ops for the new tokens, whatever the
batch. Greedy (argmax) at temperature 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nodrop.serve.weights import Loaded


def check_sampling(*, max_tokens: int, temperature: float, top_k: int | None,
                   top_p: float | None) -> None:
    """ValueError naming the first setting that is out of range."""
    for name, value, ok, expected in (
            ("max_tokens", max_tokens, max_tokens >= 1, "an int >= 1"),
            ("temperature", temperature, math.isfinite(temperature) and temperature >= 0,
             "a finite number >= 0"),
            ("top_k", top_k, top_k is None or top_k >= 1, "an int >= 1"),
            ("top_p", top_p, top_p is None or 0 < top_p <= 1, "a number in (0, 1]")):
        if not ok:
            raise ValueError(f"{name} must be {expected}, got {value!r}")


def _sample(logits: jax.Array, key: jax.Array, *, vocabulary: int, temperature: float,
            top_k: int | None, top_p: float | None) -> jax.Array:
    """The next token of each row of logits [B, V] (ids past `vocabulary` never)."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocabulary, logits, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        # Keep the most likely tokens until their probability reaches top_p (the first always).
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        before = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) - jax.nn.softmax(
            ordered, axis=-1)
        cutoff = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(loaded: Loaded, prompt: Sequence[int], *, max_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0) -> list[int]:
    """Up to max_tokens new token ids after `prompt`; fewer where the sequence reaches the
    model's seq_len. ValueError for an empty prompt, one longer than seq_len, or a sampling
    setting out of range."""
    check_sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    seq_len = loaded.config.seq_len
    if not 1 <= len(prompt) <= seq_len:
        raise ValueError(f"prompt must be 1 to seq_len={seq_len} tokens, got {len(prompt)}")
    # The last new token is sampled, never fed: the sequence may reach seq_len + 1 tokens.
    max_tokens = min(max_tokens, seq_len + 1 - len(prompt))
    sample = functools.partial(_sample, vocabulary=loaded.vocabulary,
                                   temperature=temperature, top_k=top_k, top_p=top_p)

    @nnx.jit
    def prefill(model, tokens, key):
        logits, cache = model.decode(tokens, model.init_cache(tokens.shape[0]))
        return sample(logits[:, -1], key), cache

    @nnx.jit
    def step(model, token, cache, key):
        logits, cache = model.decode(token[:, None], cache)
        return sample(logits[:, -1], key), cache

    keys = jax.random.split(jax.random.key(seed), max_tokens)
    token, cache = prefill(loaded.model, jnp.asarray([prompt], jnp.int32), keys[0])
    tokens = [token]
    for key in keys[1:]:
        token, cache = step(loaded.model, token, cache, key)
        tokens.append(token)
    return [int(t) for t in np.asarray(jnp.concatenate(tokens))]


def evaluate(loaded: Loaded, batches: list[np.ndarray]) -> float:
    """The mean next-token cross-entropy (nats) over windows [B, S + 1] int32, as the trainer
    evaluates: inputs [:, :-1], targets [:, 1:], the mean of each batch's mean."""
    @nnx.jit
    def loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            model(batch[:, :-1])[0], batch[:, 1:]).mean()

    return float(np.mean([float(loss(loaded.model, jnp.asarray(b))) for b in batches]))
