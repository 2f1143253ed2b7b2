"""Grouped matmul: the ragged-rows and ragged-contraction modes of `jax.lax.ragged_dot_general`.

`grouped_matmul` (ragged rows) and `grouped_matmul_contract` (ragged contraction) are each
differentiable, and each one's gradient is made of the two, so gradients of any order run on the
engine. `ragged_dot` is the drop-in for `jax.lax.ragged_dot`.

On the GPU the CUDA engine's kernels take bfloat16 or float16 with K and N multiples of 8 (TMA
moves 16-byte rows). Other K and N are zero-padded up to the next multiple of 8 around the call;
float32 inputs, which the engine has no kernel for, run on XLA's `jax.lax.ragged_dot_general`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nodrop import _ffi
from nodrop.ops import _checks


_CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TMA_ELEMENTS = 8  # 16 bytes of a 2-byte dtype


def _common_inputs(lhs, rhs):
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)  # numpy float64 is float32 with x64 off
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
      group_sizes: [G] integers of any integer dtype (or a list); group g owns the next
        group_sizes[g] rows of lhs. Sizes past int32 saturate (see `_checks.as_int32`).
      out_dtype: output dtype (default: the promoted input dtype). Accumulation is float32.
    """
    lhs, rhs, group_sizes = map(_checks.as_array, (lhs, rhs, group_sizes))
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
    lhs, rhs, group_sizes = _ffi.match_vma(lhs, rhs, group_sizes)  # see match_vma
    return _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, out_dtype)


def grouped_matmul_contract(lhs, rhs, group_sizes, *, out_dtype=None):
    """Ragged contraction: out[G, K, N] with out[g] = lhs[rows_g].T @ rhs[rows_g].

    This is the weight gradient of `grouped_matmul`; an empty group gives zeros.

    Args:
      lhs: [M, K]; rhs: [M, N]; group_sizes: [G] integers over the M rows.
      out_dtype: output dtype (default: the promoted input dtype). Accumulation is float32.
    """
    lhs, rhs, group_sizes = map(_checks.as_array, (lhs, rhs, group_sizes))
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
    lhs, rhs, group_sizes = _ffi.match_vma(lhs, rhs, group_sizes)
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


# platform: the engine that runs the call; the CUDA handler also returns its workspace.
def _engine_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, *, platform="cpu"):
    num_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    workspace = None
    if platform == "cuda":
        workspace = functools.partial(_ffi.grouped_matmul_workspace_bytes, rhs.shape[0])
    return _ffi.engine_call(
        "nodrop_grouped_matmul", jax.ShapeDtypeStruct((lhs.shape[0], num_cols), out_dtype),
        workspace_bytes=workspace, transpose_rhs=_checks.attr_bool(transpose_rhs),
        checked=_checks.attr_bool(_checks.checks_enabled()))(lhs, rhs, group_sizes)


def _engine_contract(lhs, rhs, group_sizes, out_dtype, *, platform="cpu"):
    num_groups = group_sizes.shape[0]
    workspace = None
    if platform == "cuda":
        workspace = functools.partial(_ffi.grouped_matmul_workspace_bytes, num_groups)
    return _ffi.engine_call(
        "nodrop_grouped_matmul_contract",
        jax.ShapeDtypeStruct((num_groups, lhs.shape[1], rhs.shape[1]), out_dtype),
        workspace_bytes=workspace,
        checked=_checks.attr_bool(_checks.checks_enabled()))(lhs, rhs, group_sizes)


def _pad_axis(x, axis: int, size: int):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _tma_size(size: int) -> int:
    return -(-size // _TMA_ELEMENTS) * _TMA_ELEMENTS


def _clamped_group_sizes(group_sizes, num_rows: int):
    """The engine's rule for invalid sizes (negative counts as 0, the total stops at the rows),
    for XLA's ragged dot, which has its own."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), num_rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(jnp.int32)


def _cuda_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, engine="cuda"):
    """The CUDA lowering of _grouped_matmul: padded to the TMA's 16 bytes, or XLA for float32.

    engine="cpu" runs the same adaptation around the CPU engine (how the tests check it)."""
    if lhs.dtype not in _CUDA_DTYPES:
        weights = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        sizes = _clamped_group_sizes(group_sizes, lhs.shape[0])
        out = jax.lax.ragged_dot(lhs, weights, sizes, precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    k, n = lhs.shape[1], rhs.shape[n_axis]
    if k % _TMA_ELEMENTS or n % _TMA_ELEMENTS:
        lhs = _pad_axis(lhs, 1, _tma_size(k))
        rhs = _pad_axis(_pad_axis(rhs, k_axis, _tma_size(k)), n_axis, _tma_size(n))
    return _engine_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, platform=engine)[:, :n]


def _cuda_contract(lhs, rhs, group_sizes, out_dtype, engine="cuda"):
    """The CUDA lowering of _grouped_matmul_contract, as _cuda_rows."""
    if lhs.dtype not in _CUDA_DTYPES:
        sizes = _clamped_group_sizes(group_sizes, lhs.shape[0])
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[])
        out = jax.lax.ragged_dot_general(lhs, rhs, sizes, dims,
                                         precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    k, n = lhs.shape[1], rhs.shape[1]
    if k % _TMA_ELEMENTS or n % _TMA_ELEMENTS:
        lhs, rhs = _pad_axis(lhs, 1, _tma_size(k)), _pad_axis(rhs, 1, _tma_size(n))
    return _engine_contract(lhs, rhs, group_sizes, out_dtype, platform=engine)[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, out_dtype):
    return _ffi.on_platform(
        lhs, rhs, group_sizes,
        cpu=lambda *args: _engine_rows(*args, transpose_rhs, out_dtype),
        cuda=lambda *args: _cuda_rows(*args, transpose_rhs, out_dtype))


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
    return _ffi.on_platform(
        lhs, rhs, group_sizes, cpu=lambda *args: _engine_contract(*args, out_dtype),
        cuda=lambda *args: _cuda_contract(*args, out_dtype))


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
