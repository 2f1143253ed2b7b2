"""Token dropping with a capacity factor: the way most JAX MoE training runs today, kept as the
baseline that dropless routing is measured against.

Each expert gets a buffer of C = ceil(capacity_factor * T * k / E) rows. Token copies are placed
slot-major (GShard): every token's first choice gets a place before any second choice, and a copy
past its expert's C rows is dropped (it contributes zero). The experts then run as one batched
einsum over the [E, C, H] buffers. Tokens move by a scatter and a gather with unique indices, not
by one-hot dispatch einsums, which cost O(T * E * C * H): quadratic in T, and several times the
experts' own FLOPs at fine-grained shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def capacity_rows(num_slots: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * num_slots / num_experts), the rows of each expert's buffer."""
    return math.ceil(capacity_factor * num_slots / num_experts)


def dispatch(x, ids, num_experts: int, capacity: int):
    """x [T, H], ids [T, k] -> (rows [E*C, H], row_map [T*k]).

    rows holds expert e's buffer in rows [e*C, (e+1)*C), zero where the buffer is not full.
    row_map[t*k + s] is the buffer row of token t's slot s, or an index past E*C when that copy was
    dropped (each dropped copy has its own, so every index is unique and needs no atomics).
    """
    num_tokens, k = ids.shape
    expert = ids.T.reshape(-1)  # slot-major: all first choices, then all second choices, ...
    one_hot = jax.nn.one_hot(expert, num_experts, dtype=jnp.int32)  # [k*T, E]
    position = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
    past_end = num_experts * capacity + jnp.arange(expert.shape[0])
    row = jnp.where(position < capacity, expert * capacity + position, past_end)
    row_map = row.reshape(k, num_tokens).T.reshape(-1).astype(jnp.int32)
    rows = jnp.zeros((num_experts * capacity, x.shape[1]), x.dtype).at[row_map].set(
        jnp.repeat(x, k, axis=0), mode="drop", unique_indices=True)
    return rows, row_map


def combine(rows, row_map, weights):
    """out[t] = sum over slots s of weights[t, s] * rows[row_map[t*k + s]] (a dropped copy: 0),
    summed in float32, returned in rows' dtype."""
    num_tokens, k = weights.shape
    picked = rows.at[row_map].get(mode="fill", fill_value=0, unique_indices=True)
    out = (picked.reshape(num_tokens, k, -1).astype(jnp.float32)
           * weights.astype(jnp.float32)[..., None]).sum(axis=1)
    return out.astype(rows.dtype)

