"""Grouped matmul: the ragged-rows and ragged-contraction modes of `jax.lax.ragged_dot_general`.

`grouped_matmul` (ragged rows) and `grouped_matmul_contract` (ragged contraction) are each
differentiable, and each one's gradient is made of the two, so gradients of any order run on the
engine. `ragged_dot` is the drop-in for `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nodrop import _ffi
from nodrop.ops import _checks


def _common_inputs(lhs, rhs):
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype)


def _group_sizes(group_sizes, num_groups: int, what: str):
    _checks.require_rank("group_sizes", group_sizes, 1, "[G]")
    if group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} groups but {what} has {num_groups}")
    return _checks.as_int32("group_sizes", group_sizes)


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, out_dtype=None):
    """Ragged rows: out[M, N] = lhs[rows_g] @ rhs[g] for each group g, rows past the groups zero.

    Args:
      lhs: [M, K] float32, float16 or bfloat16.
      rhs: [G, K, N], or [G, N, K] with `transpose_rhs=True` (then rhs[g].T is used).
      group_sizes: [G] integers; group g owns the next group_sizes[g] rows of lhs.
      out_dtype: output dtype (default: the promoted input dtype). Accumulation is float32.
    """
    _checks.require_rank("lhs", lhs, 2, "[M, K]")
    _checks.require_rank("rhs", rhs, 3, "[G, N, K]" if transpose_rhs else "[G, K, N]")
    _checks.require_float("lhs", lhs)
    _checks.require_float("rhs", rhs)
    contraction_axis = 2 if transpose_rhs else 1
    if rhs.shape[contraction_axis] != lhs.shape[1]:
        raise ValueError(
            f"rhs has contraction size {rhs.shape[contraction_axis]} (axis {contraction_axis} of "
            f"shape {tuple(rhs.shape)}) but lhs has K={lhs.shape[1]} (shape {tuple(lhs.shape)})")
    group_sizes = _group_sizes(group_sizes, rhs.shape[0], "rhs")
    lhs, rhs = _common_inputs(lhs, rhs)
    out_dtype = _checks.out_dtype("out_dtype", out_dtype, lhs.dtype)
    return _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, out_dtype)


def grouped_matmul_contract(lhs, rhs, group_sizes, *, out_dtype=None):
    """Ragged contraction: out[G, K, N] with out[g] = lhs[rows_g].T @ rhs[rows_g].

    This is the weight gradient of `grouped_matmul`; an empty group gives zeros.

    Args:
      lhs: [M, K]; rhs: [M, N]; group_sizes: [G] integers over the M rows.
      out_dtype: output dtype (default: the promoted input dtype). Accumulation is float32.
    """
    _checks.require_rank("lhs", lhs, 2, "[M, K]")
    _checks.require_rank("rhs", rhs, 2, "[M, N]")
    _checks.require_float("lhs", lhs)
    _checks.require_float("rhs", rhs)
    if rhs.shape[0] != lhs.shape[0]:
        raise ValueError(
            f"rhs has {rhs.shape[0]} rows but lhs has {lhs.shape[0]} "
            f"(shapes {tuple(rhs.shape)} and {tuple(lhs.shape)})")
    _checks.require_rank("group_sizes", group_sizes, 1, "[G]")
    group_sizes = _checks.as_int32("group_sizes", group_sizes)
    lhs, rhs = _common_inputs(lhs, rhs)
    out_dtype = _checks.out_dtype("out_dtype", out_dtype, lhs.dtype)
    return _grouped_matmul_contract(lhs, rhs, group_sizes, out_dtype)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None):
    """Drop-in for `jax.lax.ragged_dot`: lhs [M, K], rhs [G, K, N], group_sizes [G] -> [M, N].

    `precision` is accepted for compatibility: nodrop always accumulates in float32.
    """
    del precision
    if group_offset is not None:
        raise NotImplementedError("nodrop.ragged_dot: group_offset is not supported")
    return grouped_matmul(lhs, rhs, group_sizes, out_dtype=preferred_element_type)


# --- differentiable cores over the FFI calls ------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, out_dtype):
    num_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return _ffi.call(
        "nodrop_grouped_matmul", jax.ShapeDtypeStruct((lhs.shape[0], num_cols), out_dtype),
        lhs, rhs, group_sizes,
        cuda_workspace=lambda: _ffi.grouped_matmul_workspace_bytes(rhs.shape[0]),
        transpose_rhs=_checks.attr_bool(transpose_rhs),
        checked=_checks.attr_bool(_checks.checks_enabled()))


def _grouped_matmul_fwd(lhs, rhs, group_sizes, transpose_rhs, out_dtype):
    out = _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, out_dtype)
    return out, (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(transpose_rhs, out_dtype, residuals, grad):
    lhs, rhs, group_sizes = residuals
    grad_lhs = grouped_matmul(grad, rhs, group_sizes, transpose_rhs=not transpose_rhs,
                              out_dtype=lhs.dtype)
    if transpose_rhs:  # rhs [G, N, K]: grad_rhs[g] = grad[rows_g].T @ lhs[rows_g]
        grad_rhs = grouped_matmul_contract(grad, lhs, group_sizes, out_dtype=rhs.dtype)
    else:
        grad_rhs = grouped_matmul_contract(lhs, grad, group_sizes, out_dtype=rhs.dtype)
    return grad_lhs, grad_rhs, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul_contract(lhs, rhs, group_sizes, out_dtype):
    return _ffi.call(
        "nodrop_grouped_matmul_contract",
        jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype),
        lhs, rhs, group_sizes,
        cuda_workspace=lambda: _ffi.grouped_matmul_workspace_bytes(group_sizes.shape[0]),
        checked=_checks.attr_bool(_checks.checks_enabled()))


def _grouped_matmul_contract_fwd(lhs, rhs, group_sizes, out_dtype):
    out = _grouped_matmul_contract(lhs, rhs, group_sizes, out_dtype)
    return out, (lhs, rhs, group_sizes)


def _grouped_matmul_contract_bwd(out_dtype, residuals, grad):
    lhs, rhs, group_sizes = residuals
    # out[g] = lhs_g.T @ rhs_g: grad_lhs_g = rhs_g @ grad[g].T, grad_rhs_g = lhs_g @ grad[g].
    grad_lhs = grouped_matmul(rhs, grad, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype)
    grad_rhs = grouped_matmul(lhs, grad, group_sizes, out_dtype=rhs.dtype)
    return grad_lhs, grad_rhs, None


_grouped_matmul_contract.defvjp(_grouped_matmul_contract_fwd, _grouped_matmul_contract_bwd)
