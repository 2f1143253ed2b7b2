"""Token permutation: tokens -> rows grouped by expert, and back.

`permute` sorts the T*k (token, slot) pairs by expert (deterministic (expert, token, slot) order)
and copies each token to its rows; `unpermute` sums each token's k rows weighted by its routing
weights, in float32, without atomics. Both are built on three linear engine ops (scatter rows,
gather rows, row dot products) that are each other's transposes, so derivatives of any order,
forward mode (jvp, linearize, hessian) and reverse mode, run on the engine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad
from jax.typing import ArrayLike

from nodrop import _ffi
from nodrop.ops import _checks, _partition, _primitives


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
    return _permute(*_permute_operands(x, ids, num_experts), int(num_experts))


def _permute_operands(x, ids, num_experts):
    """permute's operands checked (see `permute`): x as an array, ids as int32."""
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
    return _ffi.match_vma(jnp.asarray(x), ids)  # inside shard_map: see _ffi.match_vma


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


def _permute(x, ids, num_experts):
    """The sort and the rows, with rows differentiable in x (`_moved_rows`)."""
    rows, group_sizes, row_map = _sort_and_move(*jax.lax.stop_gradient((x, ids)), num_experts)
    return _moved_rows(x, rows, row_map, ids.shape[1]), group_sizes, row_map


def _sort_and_move(x, ids, num_experts):
    return tuple(_permute_p.bind(*_ffi.match_vma(x, ids), num_experts=num_experts,
                                 checked=_checks.checks_enabled()))


def _permute_lowering(x, ids, *, num_experts, checked, partition):
    """The sort and the row moves; under sharding the hidden axis H partitions locally (each
    shard sorts the same ids: group sizes and row map come out replicated)."""
    def run(x, ids):
        num_tokens, k = ids.shape
        return _ffi.call(
            "nodrop_permute",
            (jax.ShapeDtypeStruct((num_tokens * k, x.shape[1]), x.dtype),
             jax.ShapeDtypeStruct((num_experts,), jnp.int32),
             jax.ShapeDtypeStruct((num_tokens * k,), jnp.int32)),
            x, ids, cuda_workspace=lambda: _ffi.sort_by_expert_workspace_bytes(
                num_tokens, k, num_experts),
            num_experts=num_experts, checked=_checks.attr_bool(checked))

    if not partition:
        return run(x, ids)
    return _partition.partitioned(
        run, "t h, t k -> r h, e, r", (("t", "h"), ("t", "k")), (("r", "h"), ("e",), ("r",)),
        lambda axes_of, *operands: run(*operands), ("h",),
        need_replication_factors=("t", "k", "r", "e"))(x, ids)


def _permute_abstract_eval(x, ids, *, num_experts, checked):
    del checked
    num_slots = ids.shape[0] * ids.shape[1]
    return (_primitives.result_aval((x, ids), (num_slots, x.shape[1]), x.dtype),
            _primitives.result_aval((x, ids), (num_experts,), jnp.int32),
            _primitives.result_aval((x, ids), (num_slots,), jnp.int32))


# Differentiated through `_moved_rows` (its operands are stop_gradient'ed), not by JAX.
_permute_p = _primitives.define("nodrop_permute", abstract_eval=_permute_abstract_eval,
                                lower=_permute_lowering, multiple_results=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _moved_rows(x, rows, row_map, k):
    """rows (x moved to its rows by the sort), as a function of x: linear in x for the row map
    the ids give, so its tangent moves x's tangent to the same rows (permute_rows with unit
    weights) and its transpose, reverse mode, is unpermute."""
    del x, row_map
    return rows


@_moved_rows.defjvp
def _moved_rows_jvp(k, primals, tangents):
    x, rows, row_map = primals
    # ones_like: the ones vary over the mesh axes row_map does (inside shard_map).
    ones = jnp.ones_like(row_map, jnp.float32, shape=(row_map.shape[0] // k, k))
    # The primal through _moved_rows again, so that derivatives of higher order see x too.
    return _moved_rows(x, rows, row_map, k), _permute_rows(tangents[0], row_map, ones)


# --- the three row movers: primitives, bilinear in their two float operands ---------------------
# unpermute (rows, weights), permute_rows (src, weights) and gather_row_dots (a, rows) are each
# other's transposes, so forward mode (a JVP is one call per nonzero tangent) and reverse mode
# (the transpose of the JVP: the kernels of a hand-written VJP) run on the engine. Under jit on
# sharded arrays the hidden axis H partitions locally (gather_row_dots sums over it: an
# all-reduce); the rows and tokens are gathered (row_map holds global rows).


def _unpermute(rows, row_map, weights):
    return _unpermute_p.bind(*_ffi.match_vma(rows, row_map, weights))


def _permute_rows(src, row_map, weights):
    return _permute_rows_p.bind(*_ffi.match_vma(src, row_map, weights))


def _gather_row_dots(a, rows, row_map, k):
    return _gather_row_dots_p.bind(*_ffi.match_vma(a, rows, row_map), k=int(k))


def _unpermute_transpose(grad, rows, row_map, weights):
    if type(grad) is ad.Zero:
        return _primitives.zero_cotangents(rows, row_map, weights)
    if ad.is_undefined_primal(rows):
        return _permute_rows(grad, row_map, weights).astype(rows.aval.dtype), None, None
    k = weights.aval.shape[1]
    return None, None, _gather_row_dots(grad.astype(rows.dtype), rows, row_map, k)


def _permute_rows_transpose(grad, src, row_map, weights):
    if type(grad) is ad.Zero:
        return _primitives.zero_cotangents(src, row_map, weights)
    if ad.is_undefined_primal(src):
        return _unpermute(grad, row_map, weights).astype(src.aval.dtype), None, None
    k = weights.aval.shape[1]
    return None, None, _gather_row_dots(src, grad.astype(src.dtype), row_map, k)


def _gather_row_dots_transpose(grad, a, rows, row_map, *, k):
    if type(grad) is ad.Zero:
        return _primitives.zero_cotangents(a, rows, row_map)
    if ad.is_undefined_primal(a):
        return _unpermute(rows, row_map, grad).astype(a.aval.dtype), None, None
    return None, _permute_rows(a, row_map, grad).astype(rows.aval.dtype), None


def _row_lowering(target, out_shape, rule, dims, result_dims, reduce=None):
    """The lowering of a row mover: the FFI call, partitioned locally over H (factor "h");
    reduce: the factor whose split the output is summed over."""
    def lower(*operands, partition, **params):
        def run(*operands):
            shape, dtype = out_shape(*operands, **params)
            return _ffi.call(target, jax.ShapeDtypeStruct(shape, dtype), *operands)

        if not partition:
            return run(*operands)

        def local(axes_of, *operands):
            out = run(*operands)
            return jax.lax.psum(out, axes_of[reduce]) if reduce in axes_of else out

        # Shardy wants the special factors in the order the rule names them.
        order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
        rule_factors = dict(need_replication_factors=tuple(
            f for f in order if f not in ("h", reduce)))
        if reduce is not None:
            rule_factors["reduction_factors"] = (reduce,)
        return _partition.partitioned(run, rule, dims, result_dims, local, ("h",),
                                      **rule_factors)(*operands)
    return lower


_unpermute_p = _primitives.define(
    "nodrop_unpermute",
    abstract_eval=lambda rows, row_map, weights: _primitives.result_aval(
        (rows, row_map, weights), (weights.shape[0], rows.shape[1]), rows.dtype),
    lower=_row_lowering("nodrop_unpermute", lambda r, m, w: ((w.shape[0], r.shape[1]), r.dtype),
                        "r h, r, t k -> t h", (("r", "h"), ("r",), ("t", "k")), (("t", "h"),)),
    jvp=_primitives.bilinear_jvp(lambda *a: _unpermute(*a), (0, 2)), transpose=_unpermute_transpose)

_permute_rows_p = _primitives.define(
    "nodrop_permute_rows",
    abstract_eval=lambda src, row_map, weights: _primitives.result_aval(
        (src, row_map, weights), (row_map.shape[0], src.shape[1]), src.dtype),
    lower=_row_lowering("nodrop_permute_rows",
                        lambda s, m, w: ((m.shape[0], s.shape[1]), s.dtype),
                        "t h, r, t k -> r h", (("t", "h"), ("r",), ("t", "k")), (("r", "h"),)),
    jvp=_primitives.bilinear_jvp(lambda *a: _permute_rows(*a), (0, 2)), transpose=_permute_rows_transpose)

_gather_row_dots_p = _primitives.define(
    "nodrop_gather_row_dots",
    abstract_eval=lambda a, rows, row_map, *, k: _primitives.result_aval(
        (a, rows, row_map), (a.shape[0], k), jnp.float32),
    lower=_row_lowering("nodrop_gather_row_dots",
                        lambda a, r, m, *, k: ((a.shape[0], k), jnp.float32),
                        "t h, r h, r -> t k", (("t", "h"), ("r", "h"), ("r",)), (("t", "k"),),
                        reduce="h"),
    jvp=_primitives.bilinear_jvp(lambda a, r, m, *, k: _gather_row_dots(a, r, m, k), (0, 1)),
    transpose=_gather_row_dots_transpose)
