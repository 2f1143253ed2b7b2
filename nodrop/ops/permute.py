"""Token permutation: tokens -> rows grouped by expert, and back.

`permute` sorts the T*k (token, slot) pairs by expert (deterministic (expert, token, slot) order)
and copies each token to its rows; `unpermute` sums each token's k rows weighted by its routing
weights, in float32, without atomics. Both are built on three linear engine ops (scatter rows,
gather rows, row dot products) that are each other's transposes, so gradients of any order run
on the engine.
"""

from __future__ import annotations

import functools

import jax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp

from nodrop import _ffi
from nodrop.ops import _checks


def permute(x: ArrayLike, ids: ArrayLike,
            num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Groups token copies by expert.

    Args:
      x: [T, H] tokens (float32, float16 or bfloat16).
      ids: [T, k] expert ids of any integer dtype. An id outside [0, num_experts) drops that
        slot (it is in no group and its row_map entry is -1); in checked mode it is an error.
        Ids past int32 saturate, so they stay out of range (see `_checks.as_int32`).
      num_experts: E.

    Returns:
      rows [T*k, H] ordered by (expert, token, slot), zero past the last group;
      group_sizes [E] int32; row_map [T*k] int32 (row of token t, slot s at t*k + s, or -1).
    """
    x, ids = map(_checks.as_array, (x, ids))
    _checks.require_rank("x", x, 2, "[T, H]")
    _checks.require_rank("ids", ids, 2, "[T, k]")
    _checks.require_float("x", x)
    _checks.require_dim("ids", ids, 0, x.shape[0], "tokens (rows) as x has")
    if ids.shape[1] < 1:
        raise ValueError(f"ids must have at least one slot per token, got shape {tuple(ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    ids = _checks.as_int32("ids", ids)
    x, ids = _ffi.match_vma(jnp.asarray(x), ids)  # inside shard_map: see _ffi.match_vma
    return _permute(x, ids, int(num_experts))


def unpermute(rows: ArrayLike, row_map: ArrayLike, weights: ArrayLike) -> jax.Array:
    """out[T, H] = sum over slots s of weights[t, s] * rows[row_map[t*k + s]].

    Args:
      rows: [T*k, H] expert outputs in permuted order.
      row_map: [T*k] int32 from `permute`; entries outside [0, T*k) contribute nothing.
      weights: [T, k] routing weights (float32; other float dtypes are cast).

    Returns [T, H] in rows' dtype, accumulated in float32.
    """
    rows, row_map, weights = map(_checks.as_array, (rows, row_map, weights))
    _checks.require_rank("rows", rows, 2, "[T*k, H]")
    _checks.require_rank("row_map", row_map, 1, "[T*k]")
    _checks.require_rank("weights", weights, 2, "[T, k]")
    _checks.require_float("rows", rows)
    _checks.require_float("weights", weights)
    num_slots = weights.shape[0] * weights.shape[1]
    _checks.require_dim("row_map", row_map, 0, num_slots, "entries (T*k from weights)")
    _checks.require_dim("rows", rows, 0, num_slots, "rows (T*k from weights)")
    row_map = _checks.as_int32("row_map", row_map)
    return _unpermute(*_ffi.match_vma(jnp.asarray(rows), row_map,
                                      jnp.asarray(weights, jnp.float32)))


# --- differentiable cores over the FFI calls ------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(x, ids, num_experts):
    num_tokens, k = ids.shape
    return _ffi.call(
        "nodrop_permute",
        (jax.ShapeDtypeStruct((num_tokens * k, x.shape[1]), x.dtype),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((num_tokens * k,), jnp.int32)),
        x, ids,
        cuda_workspace=lambda: _ffi.sort_by_expert_workspace_bytes(num_tokens, k, num_experts),
        num_experts=num_experts, checked=_checks.attr_bool(_checks.checks_enabled()))


def _permute_fwd(x, ids, num_experts):
    rows, group_sizes, row_map = _permute(x, ids, num_experts)
    return (rows, group_sizes, row_map), (row_map, ids.shape[1])


def _permute_bwd(num_experts, residuals, grads):
    row_map, k = residuals
    grad_rows = grads[0]
    # ones_like: the ones vary over the mesh axes row_map does (inside shard_map).
    ones = jnp.ones_like(row_map, jnp.float32, shape=(row_map.shape[0] // k, k))
    return _unpermute(grad_rows, row_map, ones), None


_permute.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def _unpermute(rows, row_map, weights):
    out_type = jax.ShapeDtypeStruct((weights.shape[0], rows.shape[1]), rows.dtype)
    return _ffi.call("nodrop_unpermute", out_type, rows, row_map, weights)


def _unpermute_fwd(rows, row_map, weights):
    return _unpermute(rows, row_map, weights), (rows, row_map, weights)


def _unpermute_bwd(residuals, grad):
    rows, row_map, weights = residuals
    return (_permute_rows(grad, row_map, weights).astype(rows.dtype), None,
            _gather_row_dots(grad.astype(rows.dtype), rows, row_map, weights.shape[1]))


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


@jax.custom_vjp
def _permute_rows(src, row_map, weights):
    out_type = jax.ShapeDtypeStruct((row_map.shape[0], src.shape[1]), src.dtype)
    return _ffi.call("nodrop_permute_rows", out_type, src, row_map, weights)


def _permute_rows_fwd(src, row_map, weights):
    return _permute_rows(src, row_map, weights), (src, row_map, weights)


def _permute_rows_bwd(residuals, grad):
    src, row_map, weights = residuals
    grad = grad.astype(src.dtype)
    return (_unpermute(grad, row_map, weights), None,
            _gather_row_dots(src, grad, row_map, weights.shape[1]))


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_row_dots(a, rows, row_map, k):
    out_type = jax.ShapeDtypeStruct((a.shape[0], k), jnp.float32)
    return _ffi.call("nodrop_gather_row_dots", out_type, a, rows, row_map)


def _gather_row_dots_fwd(a, rows, row_map, k):
    return _gather_row_dots(a, rows, row_map, k), (a, rows, row_map)


def _gather_row_dots_bwd(k, residuals, grad):
    a, rows, row_map = residuals
    return (_unpermute(rows, row_map, grad).astype(a.dtype),
            _permute_rows(a, row_map, grad).astype(rows.dtype), None)


_gather_row_dots.defvjp(_gather_row_dots_fwd, _gather_row_dots_bwd)
