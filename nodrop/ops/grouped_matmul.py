"""Grouped matmul: the ragged-rows and ragged-contraction modes of `jax.lax.ragged_dot_general`.

`grouped_matmul` (ragged rows) and `grouped_matmul_contract` (ragged contraction) are JAX
primitives, bilinear in (lhs, rhs): their JVPs and transposes are made of the two, so forward
mode (jvp, linearize, hessian) and reverse mode, of any order, run on the engine. `ragged_dot` is
the drop-in for `jax.lax.ragged_dot`.

On the GPU the CUDA engine's kernels take bfloat16 or float16 with K and N multiples of 8 (TMA
moves 16-byte rows). Other K and N are zero-padded up to the next multiple of 8 around the call;
float32 inputs, which the engine has no kernel for, run on XLA's `jax.lax.ragged_dot_general`.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad
from jax.typing import ArrayLike, DTypeLike

from nodrop import _ffi
from nodrop.ops import _checks, _partition, _primitives


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


def grouped_matmul(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, *,
                   transpose_rhs: bool = False, out_dtype: DTypeLike | None = None) -> jax.Array:
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
    return _bind_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, _checks.checks_enabled())


def grouped_matmul_contract(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, *,
                            out_dtype: DTypeLike | None = None) -> jax.Array:
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
    return _bind_contract(lhs, rhs, group_sizes, out_dtype, _checks.checks_enabled())


def ragged_dot(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike,
               precision: jax.lax.PrecisionLike = None,
               preferred_element_type: DTypeLike | None = None,
               group_offset: ArrayLike | None = None) -> jax.Array:
    """Drop-in for `jax.lax.ragged_dot`: lhs [M, K], rhs [G, K, N], group_sizes [G] -> [M, N].

    `precision` is accepted for compatibility: nodrop always accumulates in float32.
    `group_offset` (rhs holding a slice of the groups of a longer group_sizes) is refused: the
    kernels take the groups of rhs from row 0 of lhs, so the slice's rows would have to be
    moved first, a copy of lhs that the caller can make explicitly (jax.lax.ragged_dot does not
    differentiate group_offset either).
    """
    del precision
    if group_offset is not None:
        raise NotImplementedError(
            "nodrop.ragged_dot: group_offset is not supported (got one of shape "
            f"{tuple(jnp.shape(group_offset))}); pass the rows of the local groups as lhs and "
            "their sizes as group_sizes (one entry per group of rhs) instead")
    return grouped_matmul(lhs, rhs, group_sizes, out_dtype=preferred_element_type)


# --- differentiable cores over the FFI calls ------------------------------------------------


def _checked_attr(checked):
    """The handler's `checked` attribute: the primitive's, or the current mode (None)."""
    return _checks.attr_bool(_checks.checks_enabled() if checked is None else checked)


# platform: the engine that runs the call; the CUDA handler also returns its workspace.
def _engine_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, *, platform="cpu",
                 checked=None):
    num_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    workspace = None
    if platform == "cuda":
        workspace = functools.partial(_ffi.grouped_matmul_workspace_bytes, rhs.shape[0])
    return _ffi.engine_call(
        "nodrop_grouped_matmul", jax.ShapeDtypeStruct((lhs.shape[0], num_cols), out_dtype),
        workspace_bytes=workspace, transpose_rhs=_checks.attr_bool(transpose_rhs),
        checked=_checked_attr(checked))(lhs, rhs, group_sizes)


def _engine_contract(lhs, rhs, group_sizes, out_dtype, *, platform="cpu", checked=None):
    num_groups = group_sizes.shape[0]
    workspace = None
    if platform == "cuda":
        workspace = functools.partial(_ffi.grouped_matmul_workspace_bytes, num_groups)
    return _ffi.engine_call(
        "nodrop_grouped_matmul_contract",
        jax.ShapeDtypeStruct((num_groups, lhs.shape[1], rhs.shape[1]), out_dtype),
        workspace_bytes=workspace, checked=_checked_attr(checked))(lhs, rhs, group_sizes)


def _pad_axis(x, axis: int, size: int):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _tma_size(size: int) -> int:
    return -(-size // _TMA_ELEMENTS) * _TMA_ELEMENTS


def _clamped_ends(group_sizes, num_rows: int):
    """Each group's end row under the engine's rule for invalid sizes (negative counts as 0,
    the total stops at the rows): a saturating running sum, which never overflows."""
    sizes = jnp.clip(group_sizes, 0, num_rows).astype(jnp.int32)
    return jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, num_rows), sizes)


def _clamped_group_sizes(group_sizes, num_rows: int):
    """The engine's rule for invalid sizes, for XLA's ragged dot, which has its own."""
    ends = _clamped_ends(group_sizes, num_rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(jnp.int32)


def _cuda_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, engine="cuda", checked=None):
    """The CUDA lowering of the ragged-rows primitive: padded to the TMA's 16 bytes, or XLA for
    float32.

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
    return _engine_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, platform=engine,
                        checked=checked)[:, :n]


def _cuda_contract(lhs, rhs, group_sizes, out_dtype, engine="cuda", checked=None):
    """The CUDA lowering of the ragged-contraction primitive, as _cuda_rows."""
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
    return _engine_contract(lhs, rhs, group_sizes, out_dtype, platform=engine,
                            checked=checked)[:, :k, :n]


# --- the two primitives -------------------------------------------------------------------------
# Each mode is a JAX primitive, bilinear in (lhs, rhs): its JVP is the sum of two calls of the
# same primitive (one per tangent), and its transpose in either operand is a call of the other
# mode (or of the same one with rhs transposed). So forward mode (jvp, linearize, hessian) and
# reverse mode (grad, vjp) both run on the engine, and `jax.grad` of a loss runs exactly three
# kernels per grouped matmul: the forward, the input gradient and the weight gradient. The
# lowering is the platform switch (`_ffi.on_platform`) over the FFI calls above.


_rows_p = jax.extend.core.Primitive("nodrop_grouped_matmul")
_contract_p = jax.extend.core.Primitive("nodrop_grouped_matmul_contract")  # rules: see below


def _rows_abstract_eval(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, checked):
    del checked
    num_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return _primitives.result_aval((lhs, rhs, group_sizes), (lhs.shape[0], num_cols), out_dtype)


def _contract_abstract_eval(lhs, rhs, group_sizes, *, out_dtype, checked):
    del checked
    return _primitives.result_aval((lhs, rhs, group_sizes),
                                   (group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)


def _rows_lowering(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, checked, partition):
    def run_in(dtype):  # the platform switch over the engine calls
        return lambda lhs, rhs, group_sizes: _ffi.on_platform(
            lhs, rhs, group_sizes,
            cpu=lambda *args: _engine_rows(*args, transpose_rhs, dtype, checked=checked),
            cuda=lambda *args: _cuda_rows(*args, transpose_rhs, dtype, checked=checked))

    run = run_in(out_dtype)
    if not partition:  # one device, or inside shard_map: each device's own call
        return run(lhs, rhs, group_sizes)

    def local(axes_of, lhs, rhs, group_sizes):
        if "m" in axes_of:  # this shard's rows, and the part of each group among them
            group_sizes = _shard_group_sizes(group_sizes, lhs.shape[0], axes_of["m"])
        if "k" not in axes_of:
            return run(lhs, rhs, group_sizes)
        # K (summed over) split: each shard's partial product, summed over the shards in f32.
        partial = run_in(jnp.dtype(jnp.float32))(lhs, rhs, group_sizes)
        return jax.lax.psum(partial, axes_of["k"]).astype(out_dtype)

    rhs_dims = ("g", "n", "k") if transpose_rhs else ("g", "k", "n")
    # Rows split: local with the shard's group sizes (not in checked mode, which must see the
    # global sizes to refuse them); N split: local; K split: a psum of the output; G gathered.
    return _partition.partitioned(
        run, f"m k, {' '.join(rhs_dims)}, g -> m n", (("m", "k"), rhs_dims, ("g",)),
        (("m", "n"),), local, ("n", "k") if checked else ("m", "n", "k"),
        reduction_factors=("k",), need_replication_factors=("g",))(lhs, rhs, group_sizes)


def _contract_lowering(lhs, rhs, group_sizes, *, out_dtype, checked, partition):
    def run_in(dtype):
        return lambda lhs, rhs, group_sizes: _ffi.on_platform(
            lhs, rhs, group_sizes,
            cpu=lambda *args: _engine_contract(*args, dtype, checked=checked),
            cuda=lambda *args: _cuda_contract(*args, dtype, checked=checked))

    run = run_in(out_dtype)
    if not partition:
        return run(lhs, rhs, group_sizes)

    def local(axes_of, lhs, rhs, group_sizes):
        if "m" not in axes_of:
            return run(lhs, rhs, group_sizes)
        # Rows split: each shard's sum over its rows, summed over the shards in float32.
        group_sizes = _shard_group_sizes(group_sizes, lhs.shape[0], axes_of["m"])
        partial = run_in(jnp.dtype(jnp.float32))(lhs, rhs, group_sizes)
        return jax.lax.psum(partial, axes_of["m"]).astype(out_dtype)

    # K and N split: local. M (summed over) split: a psum of [G, K, N], no gather.
    return _partition.partitioned(
        run, "m k, m n, g -> g k n", (("m", "k"), ("m", "n"), ("g",)), (("g", "k", "n"),),
        local, ("k", "n") if checked else ("m", "k", "n"), reduction_factors=("m",),
        need_replication_factors=("g",))(lhs, rhs, group_sizes)


def _shard_group_sizes(group_sizes, rows: int, axes):
    """Inside a partitioned call whose rows are split over `axes` (`rows` per shard): the
    global group sizes as this shard's own. Group g owns global rows [start_g, end_g) (the
    engine's clamping: negative sizes are 0, the ends stop at the global rows), so it owns
    the intersection with this shard's rows [lo, lo + rows), in the same order."""
    num_shards = 1
    for axis in axes:
        num_shards *= jax.lax.axis_size(axis)
    ends = _clamped_ends(group_sizes, rows * num_shards)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    low = _partition.shard_index(axes) * rows
    clip = lambda x: jnp.clip(x - low, 0, rows)  # noqa: E731
    return (clip(ends) - clip(starts)).astype(jnp.int32)


def _bind_rows(lhs, rhs, group_sizes, transpose_rhs, out_dtype, checked):
    """The ragged-rows primitive on operands of one dtype and one varying type."""
    lhs, rhs = _common_inputs(lhs, rhs)
    lhs, rhs, group_sizes = _ffi.match_vma(lhs, rhs, group_sizes)
    return _rows_p.bind(lhs, rhs, group_sizes, transpose_rhs=bool(transpose_rhs),
                        out_dtype=jnp.dtype(out_dtype), checked=bool(checked))


def _bind_contract(lhs, rhs, group_sizes, out_dtype, checked):
    lhs, rhs = _common_inputs(lhs, rhs)
    lhs, rhs, group_sizes = _ffi.match_vma(lhs, rhs, group_sizes)
    return _contract_p.bind(lhs, rhs, group_sizes, out_dtype=jnp.dtype(out_dtype),
                            checked=bool(checked))


def _rows_jvp(primals, tangents, *, transpose_rhs, out_dtype, checked):
    bind = lambda lhs, rhs, sizes: _bind_rows(lhs, rhs, sizes, transpose_rhs, out_dtype, checked)
    return _primitives.bilinear_jvp(bind, (0, 1))(primals, tangents)


def _contract_jvp(primals, tangents, *, out_dtype, checked):
    bind = lambda lhs, rhs, sizes: _bind_contract(lhs, rhs, sizes, out_dtype, checked)
    return _primitives.bilinear_jvp(bind, (0, 1))(primals, tangents)


def _linear_operand(lhs, rhs, group_sizes):
    """Which operand a transpose is taken in (the op is linear in each, not in both)."""
    if ad.is_undefined_primal(group_sizes) or not (
            ad.is_undefined_primal(lhs) ^ ad.is_undefined_primal(rhs)):
        raise NotImplementedError("nodrop's grouped matmuls are linear in lhs or in rhs, not in "
                                  "both at once nor in group_sizes")
    return "lhs" if ad.is_undefined_primal(lhs) else "rhs"


def _rows_transpose(grad, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, checked):
    del out_dtype
    operand = _linear_operand(lhs, rhs, group_sizes)
    if type(grad) is ad.Zero:
        return _primitives.zero_cotangents(lhs, rhs, group_sizes)
    if operand == "lhs":  # the input gradient: ragged rows against rhs[g].T
        return (_bind_rows(grad, rhs, group_sizes, not transpose_rhs, lhs.aval.dtype, checked),
                None, None)
    # the weight gradient: ragged contraction (rhs [G, N, K]: grad[rows_g].T @ lhs[rows_g])
    a, b = (grad, lhs) if transpose_rhs else (lhs, grad)
    return None, _bind_contract(a, b, group_sizes, rhs.aval.dtype, checked), None


def _contract_transpose(grad, lhs, rhs, group_sizes, *, out_dtype, checked):
    del out_dtype
    operand = _linear_operand(lhs, rhs, group_sizes)
    if type(grad) is ad.Zero:
        return _primitives.zero_cotangents(lhs, rhs, group_sizes)
    # out[g] = lhs_g.T @ rhs_g: grad_lhs_g = rhs_g @ grad[g].T, grad_rhs_g = lhs_g @ grad[g].
    if operand == "lhs":
        return _bind_rows(rhs, grad, group_sizes, True, lhs.aval.dtype, checked), None, None
    return None, _bind_rows(lhs, grad, group_sizes, False, rhs.aval.dtype, checked), None


def _rows_batch(args, dims, *, transpose_rhs, out_dtype, checked):
    lhs, rhs, group_sizes = args
    lhs_dim, rhs_dim, sizes_dim = dims
    params = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype, checked=checked)
    if sizes_dim is None and lhs_dim is None:  # batched weights: the batch joins N
        n_axis = 1 if transpose_rhs else 2
        rhs = jnp.moveaxis(rhs, rhs_dim, n_axis)  # [G, K, B, N] or [G, B, N, K]
        batch = rhs.shape[n_axis]
        rhs = rhs.reshape(*rhs.shape[:n_axis], -1, *rhs.shape[n_axis + 2:])
        out = _rows_p.bind(lhs, rhs, group_sizes, **params)
        return out.reshape(out.shape[0], batch, -1), 1
    if sizes_dim is None and rhs_dim is None:  # batched rows: row m becomes rows m*B .. m*B+B-1
        lhs = jnp.moveaxis(lhs, lhs_dim, 1)  # [M, B, K]
        num_rows, batch = lhs.shape[:2]
        # The engine's clamping, applied before scaling, so it is the same on M*B rows.
        sizes = _clamped_group_sizes(group_sizes, num_rows) * batch
        out = _rows_p.bind(lhs.reshape(num_rows * batch, -1), rhs, sizes, **params)
        return out.reshape(num_rows, batch, -1), 1
    return _primitives.sequential(_rows_p, args, dims, params)


def _contract_batch(args, dims, *, out_dtype, checked):
    lhs, rhs, group_sizes = args
    lhs_dim, rhs_dim, sizes_dim = dims
    params = dict(out_dtype=out_dtype, checked=checked)
    if sizes_dim is None and (lhs_dim is None) != (rhs_dim is None):
        # One operand batched: its batch joins its columns (K of lhs, N of rhs).
        batched, dim = (lhs, lhs_dim) if rhs_dim is None else (rhs, rhs_dim)
        batched = jnp.moveaxis(batched, dim, 1)  # [M, B, C]
        batch = batched.shape[1]
        batched = batched.reshape(batched.shape[0], -1)
        if rhs_dim is None:
            out = _contract_p.bind(batched, rhs, group_sizes, **params)  # [G, B*K, N]
            return out.reshape(out.shape[0], batch, -1, out.shape[2]), 1
        out = _contract_p.bind(lhs, batched, group_sizes, **params)  # [G, K, B*N]
        return out.reshape(*out.shape[:2], batch, -1), 2
    return _primitives.sequential(_contract_p, args, dims, params)


for _primitive, _abstract_eval, _lowering, _jvp, _transpose, _batch in (
        (_rows_p, _rows_abstract_eval, _rows_lowering, _rows_jvp, _rows_transpose, _rows_batch),
        (_contract_p, _contract_abstract_eval, _contract_lowering, _contract_jvp,
         _contract_transpose, _contract_batch)):
    _primitives.define(_primitive, abstract_eval=_abstract_eval, lower=_lowering, jvp=_jvp,
                       transpose=_transpose, batch=_batch)
