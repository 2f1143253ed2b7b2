"""FP8 training recipes as quantise-dequantise emulation: the numerics FP8 kernels must match.

E4M3 (`float8_e4m3fn`, largest finite value 448) operands with float32 scales, one per block:

- "blockwise" (DeepSeek-V3): activations and output gradients in 1 x 128 blocks along the
  contraction axis K (ACTIVATION_BLOCK), weights in 128 x 128 blocks of each expert
  (WEIGHT_BLOCK). The weight gradient contracts over the rows M, so there its operands (the
  activations and the output gradient) are quantised in blocks of 128 rows of one column
  (WGRAD_BLOCK) that never cross a group boundary: a group whose size is not a multiple of 128
  ends with a shorter block. Each scale then multiplies one K-block's float32 partial sum.
- "tensorwise": one scale per tensor (per expert for the weights), current scaling.

Either recipe may leave the weight gradient unquantised (`weight_gradient="unquantised"`, as
Transformer Engine's `override_linear_precision` does): the forward and the input gradient on
FP8 operands, the weight gradient the grouped matmul's own on the unquantised activations and
output gradient. It skips the transposed quantisations, and on the H200 the bf16 contraction
kernel was as fast as or faster than the blockwise FP8 one with its quantisations at every
benchmark shape but the widest; the tensorwise recipe's promoted FP8 weight gradient trained
faster than the bf16 one (docs/performance.md).

Emulated, the operands are quantised, dequantised to float32 and multiplied by an ordinary
grouped matmul, which computes what FP8 kernels do up to float32 summation order; it is not
faster than bf16. Both recipes also run for real, forward and both gradients, on the engine's
FP8 grouped matmuls (CUTLASS on the GPU, plain-loop references on the CPU):
`grouped_matmul_fp8_blockwise` (the forward, and the input gradient) on operands from
`quantize_rows`, and `grouped_matmul_fp8_blockwise_contract` (the weight gradient) on operands
from `quantize_transposed`. The tensorwise recipe runs all three on per-tensor kernels, one
scale for the rows and one per expert: `grouped_matmul_fp8_tensorwise` (the forward, and the
input gradient) and `grouped_matmul_fp8_tensorwise_contract` (the weight gradient, on the
rows' codes re-laid by `transpose_codes`: with one scale per tensor, the codes the forward and
the input gradient read are the weight gradient's, so the forward keeps lhs's codes for the
backward instead of lhs). With one scale per operand the
GPU may accumulate in the tensor cores' own sums and scale once ("fast accumulation"), or add
each 128-deep block's sums in float32 ("promoted"): the recipe's forward accumulates fast and
both gradients promoted, Transformer Engine's split (its GEMMs' split accumulator is off for
the forward and on for both gradients). `fp8_grouped_matmul` uses the kernels on the GPU for
bfloat16 (`forward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from nodrop import _ffi
from nodrop._fields import is_int
from nodrop.ops import _checks, _partition, _primitives
from nodrop.ops.grouped_matmul import (
    _clamped_ends,
    _group_sizes,
    _pad_axis,
    _shard_group_sizes,
    grouped_matmul,
)
from nodrop.ops.permute import _moved_rows, _permute_operands

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
_TINY = float(jnp.finfo(jnp.float32).tiny)  # float32's smallest normal number
BLOCK = 128
ACTIVATION_BLOCK = (1, BLOCK)
WEIGHT_BLOCK = (BLOCK, BLOCK)
WGRAD_BLOCK = (BLOCK, 1)
RECIPES = ("blockwise", "tensorwise")
WEIGHT_GRADIENTS = ("fp8", "unquantised")
FORWARDS = ("auto", "kernel", "emulated")

Block = tuple[int, int] | str


def _block_shape(block: Block, x) -> tuple[int, int]:
    """(rows, columns) of one block over x's last two axes; "tensor" is all of them."""
    if block == "tensor":
        return max(x.shape[-2], 1), max(x.shape[-1], 1)
    if not (isinstance(block, tuple) and len(block) == 2
            and all(is_int(b) and b >= 1 for b in block)):
        raise ValueError(f"block must be (rows, columns) of positive ints or 'tensor', "
                         f"got {block!r}")
    return block


def _require_matrices(name: str, x) -> None:
    if x.ndim < 2:
        raise ValueError(f"{name} must have rank 2 or more ([..., rows, columns]), got shape "
                         f"{tuple(x.shape)}")


def _scale(amax, finite):
    """The float32 scale of blocks whose largest magnitude is amax: amax / 448, so the block's
    largest value maps to E4M3's largest. A block of zeros, or one so small (amax under 5.3e-36)
    that amax / 448 falls below float32's smallest normal number, gets 1: never 0, nor a
    subnormal whose reciprocal overflows to inf (and would turn the block's zeros into NaN);
    under scale 1 its values round to (signed) zero, E4M3's smallest magnitude being 2^-9.
    (XLA on the CPU flushes subnormals to zero, the kernels do not: the threshold makes them
    agree.) A block holding
    NaN or +-inf (`finite` false) gets NaN, so
    non-finite values spread over their block instead of being clipped to finite ones (an
    overflow stays visible in the loss, as it would without FP8). `finite` is the caller's:
    XLA's CPU max reductions do not always carry a NaN to amax."""
    # Times the float32 reciprocal, as in _cast: a division by a constant may be rewritten so
    # under jit and not eagerly.
    scale = amax * jnp.float32(1 / E4M3_MAX)
    return jnp.where(finite, jnp.where(scale >= _TINY, scale, 1.0), jnp.nan)


def _cast(x, scale):
    """x / scale saturated to +-448 and rounded to E4M3 (float32 past 448 would become NaN).

    The division is a multiplication by the float32 reciprocal of the scale, as a kernel does it:
    XLA rewrites x / broadcast(s) that way under jit and not eagerly, and the 1-ulp difference
    flips E4M3 roundings at ties, so spelling it out keeps eager, jit and kernels equal."""
    return jnp.clip(x * (1 / scale), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def _codes(q):
    """q as XLA must keep it: on the GPU, XLA (excess precision allowed, its default) removes a
    float32 -> E4M3 -> float32 round trip inside one jit, which would leave the emulation
    unquantised (seen on an H200, 2026-12-02: 3% off the quantised result); the barrier keeps
    the E4M3 values."""
    return jax.lax.optimization_barrier(q)


def _expand(scale, block: Block, shape):
    """Per-block scales [..., R/r, C/c] as one per element of `shape`."""
    if block == "tensor":
        return scale
    rows, cols = block
    full = jnp.repeat(jnp.repeat(scale, rows, axis=-2), cols, axis=-1)
    return full[..., :shape[-2], :shape[-1]]


def quantize(x: ArrayLike, block: Block, *, scale: ArrayLike | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """x [..., R, C] -> (q float8_e4m3fn of x's shape, scale float32 [..., ceil(R/r), ceil(C/c)]).

    block: (r, c), blocks of r rows and c columns over the last two axes, with shorter last
      blocks where r or c does not divide R or C (ACTIVATION_BLOCK, (1, 128): each row in runs
      of 128; WEIGHT_BLOCK, (128, 128), per leading index, i.e. per expert of [G, K, N]); or
      "tensor": one scale over the last two axes ([..., 1, 1]; per expert for [G, K, N]).
    scale: the scales to use instead of amax / 448 (say, delayed scaling); values past 448 *
      scale saturate to +-448.
    Each block's scale is amax(|x|) / 448 (1 for a block of zeros or of magnitudes under
    5.3e-36, whose scale would be subnormal; NaN for a block holding NaN
    or inf, whose q is then NaN too), and q = x * (1 / scale) (float32) rounded to nearest even
    in E4M3.
    """
    x = jnp.asarray(x)
    _require_matrices("x", x)
    _checks.require_float("x", x)
    rows, cols = _block_shape(block, x)
    x = x.astype(jnp.float32)
    grid = (-(-x.shape[-2] // rows), -(-x.shape[-1] // cols))
    if scale is None:
        scale = _amax_scales(x, rows, cols, grid)
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape != (*x.shape[:-2], *grid):
        raise ValueError(f"scale must have shape {(*x.shape[:-2], *grid)} (one per block of "
                         f"{block!r} over x of shape {tuple(x.shape)}), got {tuple(scale.shape)}")
    return _cast(x, _expand(scale, block, x.shape)), scale


def _amax_scales(x, rows: int, cols: int, grid: tuple[int, int]):
    """quantize's scales of float32 x [..., R, C] in blocks of rows x cols (a grid of them): each
    block's amax through `_scale`. One reduction finds amax and finiteness both: a NaN or an inf
    counts as +inf, which a max always carries (a NaN it may not, on XLA's CPU), so a block is
    finite where its amax is. (Two reductions, which XLA did not fuse, cost the tensorwise MoE
    layer 0.46 ms of 28 on Mixtral's weights on an H100.)"""
    magnitudes = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf)
    # Zero padding up to whole blocks leaves every block's amax as it is.
    padded = jnp.pad(magnitudes, [(0, 0)] * (x.ndim - 2)
                     + [(0, grid[0] * rows - x.shape[-2]), (0, grid[1] * cols - x.shape[-1])])
    amax = padded.reshape(*x.shape[:-2], grid[0], rows, grid[1], cols).max(axis=(-3, -1),
                                                                          initial=0.0)
    return _scale(amax, amax < jnp.inf)


def tensor_scale(x: ArrayLike) -> jax.Array:
    """The tensorwise recipe's scale of x [M, C] as float32 [1]: `quantize(x, "tensor")`'s,
    amax(|x|) / 448 (1 for zeros, NaN for a NaN or an inf), for `permute_fp8`'s `scale`: taken
    over the tokens, it is the scale of their permuted rows, each row being a copy of a token
    (provided every token has a slot in some group)."""
    x = jnp.asarray(x)
    _checks.require_rank("x", x, 2, "[M, C]")
    _checks.require_float("x", x)
    x = x.astype(jnp.float32)
    return _amax_scales(x, *_block_shape("tensor", x), (1, 1)).reshape(1)


def dequantize(q: ArrayLike, scale: ArrayLike, block: Block,
               dtype: DTypeLike = jnp.float32) -> jax.Array:
    """q * scale, each block's scale over its elements (the block `quantize` was given), in
    `dtype`."""
    q = jnp.asarray(q)
    _require_matrices("q", q)
    _block_shape(block, q)
    full = _expand(jnp.asarray(scale, jnp.float32), block, q.shape)
    return (_codes(q).astype(jnp.float32) * full).astype(dtype)


def _qdq(x, block: Block):
    """x quantised and dequantised, in float32; matrices in 1 x 128 blocks on the engine's
    quantize_fp8 (bitwise `quantize`'s)."""
    if block == ACTIVATION_BLOCK and x.ndim == 2:
        return dequantize(*quantize_rows(x), block)
    return dequantize(*quantize(x, block), block)


def _group_blocks(group_sizes, num_rows: int):
    """Each group's rows cut into blocks of 128 from its first row (the last one shorter), the
    blocks numbered over the groups in order (engine.h): per group, (its first row, one past its
    last, its first block's number, its block count), the sizes clamped as the engine clamps."""
    ends = _clamped_ends(group_sizes, num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    blocks = -(-(ends - starts) // BLOCK)
    return starts, ends, jnp.cumsum(blocks) - blocks, blocks


def _qdq_group_rows(x, group_sizes, recipe: str):
    """The weight gradient's operand [M, C] (contracted over M), quantised and dequantised:
    blockwise in WGRAD_BLOCK blocks that restart at each group's first row; tensorwise as one
    tensor."""
    if recipe == "tensorwise":
        return _qdq(x, "tensor")
    num_rows, num_groups = x.shape[0], group_sizes.shape[0]
    if num_groups == 0:  # no block: the matmul reads no row
        return jnp.zeros(x.shape, jnp.float32)
    starts, ends, first_block, _ = _group_blocks(group_sizes, num_rows)
    rows = jnp.arange(num_rows)
    group = jnp.searchsorted(ends, rows, side="right")  # G for rows past the groups
    # At most M // 128 + G blocks lie in groups (each group adds at most one short block); rows
    # past the groups share the one after them.
    num_blocks = num_rows // BLOCK + num_groups + 1
    in_group = group < num_groups
    safe = jnp.minimum(group, num_groups - 1)
    segment = jnp.where(in_group, first_block[safe] + (rows - starts[safe]) // BLOCK,
                        num_blocks - 1)
    x = x.astype(jnp.float32)
    amax = jax.ops.segment_max(jnp.abs(x), segment, num_blocks, indices_are_sorted=True)
    nonfinite = jax.ops.segment_sum((~jnp.isfinite(x)).astype(jnp.int32), segment, num_blocks,
                                    indices_are_sorted=True)
    # segment_max of no rows is -inf
    scale = _scale(jnp.maximum(amax, 0.0), nonfinite == 0)[segment]
    return _codes(_cast(x, scale)).astype(jnp.float32) * scale


def _rows_in_groups(x, group_sizes):
    """x with the rows past the groups zeroed: the matmul ignores them, and so must the scales
    (a tensorwise scale would otherwise see whatever they hold)."""
    if group_sizes.shape[0] == 0:  # no group: every row is past them
        return jnp.zeros_like(x)
    total = _clamped_ends(group_sizes, x.shape[0])[-1]
    return jnp.where((jnp.arange(x.shape[0]) < total)[:, None], x, 0)


def _operand_blocks(recipe: str) -> tuple[Block, Block]:
    """(the rows' block along their last axis, the weights' block per expert)."""
    return (ACTIVATION_BLOCK, WEIGHT_BLOCK) if recipe == "blockwise" else ("tensor", "tensor")


def fp8_grouped_matmul(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, *,
                       recipe: str = "blockwise",
                       matmul: Callable[..., jax.Array] = grouped_matmul,
                       forward: str = "auto", weight_gradient: str = "fp8",
                       lhs_quantized: tuple[ArrayLike, ArrayLike] | None = None) -> jax.Array:
    """The grouped matmul `matmul(lhs, rhs, group_sizes)` on FP8 operands, emulated or
    (`forward`) on nodrop's FP8 kernels.

    Args:
      lhs: [M, K] float32, float16 or bfloat16; rhs: [G, K, N]; group_sizes: [G] integers
        (as `nodrop.grouped_matmul`; rows past the groups give zero rows and zero gradient).
      recipe: "blockwise" or "tensorwise" (see the module's docstring).
      matmul: the grouped matmul over the dequantised float32 operands, (lhs, rhs, group_sizes)
        -> [M, N]: `nodrop.grouped_matmul` (the default), `nodrop.ops.reference.grouped_matmul`
        or `jax.lax.ragged_dot`. Its own transposes compute the gradients.
      forward: how the forward and both gradients run. "kernel": on FP8 operands, the
        forward and the input gradient in `grouped_matmul_fp8_blockwise` (lhs, or the output
        gradient, by `quantize_rows`; each expert's weight quantised in 128 x 128 blocks,
        transposed for the forward: a block of rhs[g] is a block of rhs[g].T), the weight
        gradient in `grouped_matmul_fp8_blockwise_contract` (lhs and the output gradient by
        `quantize_transposed`), whose results are rounded to bfloat16; the tensorwise recipe
        the same on `grouped_matmul_fp8_tensorwise` (one scale for lhs or the output gradient,
        one per expert; on the GPU fast accumulation in the forward, promoted in the input
        gradient) and `grouped_matmul_fp8_tensorwise_contract` (promoted; its operands by
        `quantize_transposed` with one scale per tensor given); "emulated": as below, on
        `matmul`; "auto" (the default): the kernels on the GPU for bfloat16 lhs, else emulated
        (the CPU engine's kernels are plain-loop references, slower than the emulation on
        oneDNN, and a float32 or float16 lhs would lose its precision to the kernels' bfloat16
        outputs).
        The two differ only in where float32 rounds (and the kernels' bfloat16 outputs; on the
        GPU the tensorwise forward's fast accumulation rounds its sums more coarsely).
      weight_gradient: "fp8" (the default), the weight gradient on FP8 operands as below; or
        "unquantised": on lhs and the output gradient as they are, by `matmul`'s transpose in
        float32 when emulated, by nodrop's grouped matmul (its contraction kernel, in lhs's
        dtype) on the kernels.
      lhs_quantized: (q, scale), lhs's quantisation made already (by `permute_fp8`, which
        quantises each token once as it permutes), read by the forward in place of quantising
        lhs again: blockwise, `quantize_rows(lhs)`; tensorwise, q [M, K] float8_e4m3fn and scale
        [1] float32 as `quantize(lhs, "tensor")` of lhs's rows in the groups gives them
        (`permute_fp8` with `tensor_scale` of the tokens). Not differentiated: lhs carries the
        gradient.

    Forward: matmul(qdq(lhs, 1 x 128), qdq(rhs, 128 x 128 per expert)). Backward, with dout
    quantised too: dlhs = matmul(qdq(dout, 1 x 128), qdq(rhs)^T), and drhs[g] = qdq(lhs)^T @
    qdq(dout) over group g's rows, both quantised in blocks of 128 rows within the group.
    Everything after dequantising is float32; the result and gradients are in lhs's and rhs's
    dtypes.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    group_sizes = _checks.as_array(group_sizes)
    _checks.require_rank("lhs", lhs, 2, "[M, K]")
    _checks.require_rank("rhs", rhs, 3, "[G, K, N]")
    _checks.require_float("lhs", lhs)
    _checks.require_float("rhs", rhs)
    _checks.require_dim("rhs", rhs, 1, lhs.shape[1], "rows along axis 1 (K, lhs's columns)")
    group_sizes = _group_sizes(group_sizes, rhs.shape[0], "rhs")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    if weight_gradient not in WEIGHT_GRADIENTS:
        raise ValueError(f"weight_gradient must be one of {WEIGHT_GRADIENTS}, "
                         f"got {weight_gradient!r}")
    if lhs_quantized is not None:
        lhs_quantized = _checked_lhs_quantized(lhs, lhs_quantized, recipe)
    return _fp8_grouped_matmul(lhs, rhs, group_sizes, lhs_quantized, recipe, matmul, forward,
                               weight_gradient)


def _checked_lhs_quantized(lhs, lhs_quantized, recipe: str):
    if recipe == "blockwise":
        made_by, scale_shape = "quantize_rows(lhs)", (lhs.shape[0], -(-lhs.shape[1] // BLOCK))
    else:
        made_by, scale_shape = 'quantize(lhs, "tensor"), its scale as [1],', (1,)
    if not (isinstance(lhs_quantized, (tuple, list)) and len(lhs_quantized) == 2):
        raise ValueError(f"lhs_quantized must be (q, scale) as {made_by} gives them, "
                         f"got {type(lhs_quantized).__name__}")
    q, scale = map(_checks.as_array, lhs_quantized)
    want = ((lhs.shape, E4M3), (scale_shape, jnp.float32))
    for name, x, (shape, dtype) in zip(("q", "scale"), (q, scale), want):
        if x.shape != shape or jnp.dtype(x.dtype) != jnp.dtype(dtype):
            raise ValueError(
                f"lhs_quantized's {name} must be {jnp.dtype(dtype).name} of shape {shape} "
                f"(the {recipe} recipe's quantisation of lhs {tuple(lhs.shape)}), got "
                f"{jnp.dtype(x.dtype).name} of shape {tuple(x.shape)}")
    return q, scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fp8_grouped_matmul(lhs, rhs, group_sizes, lhs_quantized, recipe, matmul, forward,
                        weight_gradient):
    return _forward(lhs, rhs, group_sizes, lhs_quantized, recipe, matmul, forward,
                    weight_gradient)[0]


# The engine's FP8 kernels, per recipe. The blockwise recipe runs grouped_matmul_fp8_blockwise
# (the forward and the input gradient) on rows in 1 x 128 blocks and weights in 128 x 128 blocks,
# and grouped_matmul_fp8_blockwise_contract (the weight gradient) on quantize_transposed's blocks
# of 128 rows; the weights come from quantize_weights_transposed (the forward's) and
# quantize_weights (the input gradient's), one engine pass each, faster than XLA's fusions and
# keeping no codes from the forward to the backward (design.md, "FP8 recipes"). The tensorwise
# recipe runs all three GEMMs on the per-tensor kernels,
# grouped_matmul_fp8_tensorwise and grouped_matmul_fp8_tensorwise_contract, on one scale for the
# rows (`_tensor_rows`) and one per expert (`_expert_weights`): the forward with fast
# accumulation, both gradients promoted, Transformer Engine's split (its GEMMs' split
# accumulator off for the forward, on for both gradients).


def _blockwise_rows(x, group_sizes):
    """Rows past the groups need no zeroing: no kernel reads them, and their scales scale
    nothing."""
    del group_sizes
    return quantize_rows(x)


def _tensor_rows(x, group_sizes):
    """x's codes and one scale [1] over the rows in the groups (those past them zeroed first:
    the scale must not see them)."""
    q, scale = quantize(_rows_in_groups(x, group_sizes), "tensor")
    return q, scale.reshape(1)


def _expert_scales(w):
    """Each expert's tensorwise scale, [G]: the forward's and the input gradient's (the same
    reduction, which XLA computes once)."""
    w = w.astype(jnp.float32)
    return _amax_scales(w, *_block_shape("tensor", w), (1, 1)).reshape(w.shape[0])


def _expert_weights(w, quantizer):
    """Each expert's codes from `quantizer` (`quantize_weights` or `quantize_weights_transposed`,
    the input gradient's or the forward's) at the experts' scales, and those scales, [G]."""
    scale = _expert_scales(w)
    return quantizer(w, scale=scale)[0], scale


def _keeps_codes(recipe: str, weight_gradient: str) -> bool:
    """Whether the backward reads lhs only as the forward's codes: the tensorwise recipe's FP8
    weight gradient contracts lhs's codes at the forward's one scale, re-laid by group
    (`transpose_codes`), and the input gradient does not read lhs. The forward then keeps
    those codes and that scale (one byte an element) in place of lhs."""
    return recipe == "tensorwise" and weight_gradient == "fp8"


def _kernel_forward(lhs, rhs, group_sizes, lhs_quantized, recipe):
    """The forward on the recipe's FP8 kernel: each expert's weight transposed and quantised in
    one engine pass; lhs's quantisation as given, if it is."""
    if recipe == "tensorwise":
        lhs_q = _tensor_rows(lhs, group_sizes) if lhs_quantized is None else lhs_quantized
        return grouped_matmul_fp8_tensorwise(
            *lhs_q, *_expert_weights(rhs, quantize_weights_transposed), group_sizes,
            fast_accumulation=True),
    lhs_q = _blockwise_rows(lhs, group_sizes) if lhs_quantized is None else lhs_quantized
    return grouped_matmul_fp8_blockwise(*lhs_q, *quantize_weights_transposed(rhs), group_sizes),


def _emulated_forward(lhs, rhs, group_sizes, lhs_quantized, recipe, matmul):
    rows_block, weights_block = _operand_blocks(recipe)
    if lhs_quantized is None:
        lhs_qdq = _qdq(_rows_in_groups(lhs, group_sizes), rows_block)
    else:  # zeroing rows past the groups before or after quantising is the same for the rows
        # in them (a tensorwise scale being theirs), and the matmul reads no other
        lhs_qdq = _rows_in_groups(dequantize(*lhs_quantized, rows_block), group_sizes)
    return matmul(lhs_qdq, _qdq(rhs, weights_block), group_sizes),


def _unquantised_weight_gradient(lhs, dout, group_sizes, rhs, matmul, dtype):
    """drhs[g] = lhs_g^T @ dout_g on the unquantised operands in `dtype`: matmul's transpose in
    rhs (typed as rhs, so that inside shard_map the transpose sums only where rhs is
    replicated)."""
    lhs = lhs.astype(dtype)
    drhs, = jax.linear_transpose(lambda w: matmul(lhs, w, group_sizes),
                                 _ffi.typed_like(rhs, rhs.shape, dtype))(dout.astype(dtype))
    return drhs


def _kernel_backward(kept, rhs, dout, group_sizes, recipe, weight_gradient):
    """Both gradients on the recipe's FP8 kernels, the tensorwise ones promoted (each 128-deep
    block's sums added in float32); kept: (lhs,), or lhs's codes and scale (`_keeps_codes`).
    The input gradient dout @ rhs[g].T runs on the forward's kernel: its "transposed weight"
    [G, K, N] is rhs itself, whose 128 x 128 blocks (and scales, and tensor scale) are those of
    rhs[g].T. The weight gradient is the FP8 ragged contraction, both operands laid out by
    group: the tensorwise recipe's re-laid from the rows' codes (`transpose_codes`: the codes
    `quantize_transposed` would make again at the same scale, from one byte an element). Rows
    past the groups need no zeroing for the blockwise recipe: neither kernel nor the transposed
    quantisation reads them. (One kernel writing dout's rows and its transposed copy from one
    read measured slower than the two quantisers apart on the H200, 2026-12-03.)"""
    if recipe == "tensorwise":
        dout_q, dout_scale = _tensor_rows(dout, group_sizes)
        dlhs = grouped_matmul_fp8_tensorwise(dout_q, dout_scale,
                                             *_expert_weights(rhs, quantize_weights),
                                             group_sizes, fast_accumulation=False)
    else:
        dlhs = grouped_matmul_fp8_blockwise(*_blockwise_rows(dout, group_sizes),
                                            *quantize_weights(rhs), group_sizes)
    if weight_gradient == "unquantised":  # nodrop's contraction reads only the groups' rows
        lhs, = kept
        return dlhs, _unquantised_weight_gradient(lhs, dout, group_sizes, rhs, grouped_matmul,
                                                  lhs.dtype)
    if recipe == "tensorwise":
        lhs_q, lhs_scale = kept
        drhs = grouped_matmul_fp8_tensorwise_contract(
            transpose_codes(lhs_q, group_sizes), lhs_scale, transpose_codes(dout_q, group_sizes),
            dout_scale, group_sizes, num_rows=lhs_q.shape[0], fast_accumulation=False)
    else:
        lhs, = kept
        drhs = grouped_matmul_fp8_blockwise_contract(
            *quantize_transposed(lhs, group_sizes), *quantize_transposed(dout, group_sizes),
            group_sizes, num_rows=lhs.shape[0])
    return dlhs, drhs


def _emulated_backward(kept, rhs, dout, group_sizes, recipe, weight_gradient, matmul):
    """The matmul's own transposes on the operands quantised along their contraction axes:
    the input gradient (for nodrop's matmul: the grouped matmul against rhs[g].T) with dout in
    1 x 128 blocks along N, the weight gradient (the ragged contraction) with lhs and dout in
    blocks of rows within each group, or unquantised; kept as `_kernel_backward`'s (lhs's codes
    dequantise to the forward's qdq of lhs, what the tensorwise weight gradient reads)."""
    rows_block, weights_block = _operand_blocks(recipe)
    dout = _rows_in_groups(dout, group_sizes)
    rhs_q = _qdq(rhs, weights_block)
    dlhs, = jax.linear_transpose(lambda a: matmul(a, rhs_q, group_sizes),
                                 _ffi.typed_like(kept[0], kept[0].shape, jnp.float32))(
        _qdq(dout, rows_block))
    if len(kept) == 2:
        lhs_q = _rows_in_groups(dequantize(*kept, "tensor"), group_sizes)
    else:
        lhs = _rows_in_groups(kept[0], group_sizes)
        if weight_gradient == "unquantised":
            return dlhs, _unquantised_weight_gradient(lhs, dout, group_sizes, rhs, matmul,
                                                      jnp.float32)
        lhs_q = _qdq_group_rows(lhs, group_sizes, recipe)
    drhs, = jax.linear_transpose(lambda w: matmul(lhs_q, w, group_sizes),
                                 _ffi.typed_like(rhs, rhs.shape, jnp.float32))(
        _qdq_group_rows(dout, group_sizes, recipe))
    return dlhs, drhs


def _kernel_or_emulated(kernel, emulated, operands, options, matmul, forward, dtypes):
    """kernel(*operands, *options) where `forward` puts the recipe on the engine's kernels, else
    emulated(*operands, *options, matmul) (see fp8_grouped_matmul's `forward`); options are the
    recipe and, for the backward, the weight gradient's mode; the results in `dtypes` either way.
    lhs's dtype, the first of `dtypes`, decides "auto"."""
    def cast(results):
        return tuple(r.astype(d) for r, d in zip(results, dtypes))

    if forward == "emulated":
        results = emulated(*operands, *options, matmul)
    elif forward == "kernel":
        results = kernel(*operands, *options)
    elif dtypes[0] == jnp.bfloat16:  # "auto": the kernels where they run on the GPU
        results = _ffi.on_platform(
            *operands,
            cpu=lambda *args: cast(emulated(*args, *options, matmul)),
            cuda=lambda *args: cast(kernel(*args, *options)))
    else:
        results = emulated(*operands, *options, matmul)
    return cast(results)


def _forward(lhs, rhs, group_sizes, lhs_quantized, recipe, matmul, forward, weight_gradient):
    kept = (lhs,)
    if _keeps_codes(recipe, weight_gradient):
        if lhs_quantized is None:
            lhs_quantized = _tensor_rows(lhs, group_sizes)
        kept = tuple(lhs_quantized)
    out, = _kernel_or_emulated(_kernel_forward, _emulated_forward,
                               (lhs, rhs, group_sizes, lhs_quantized), (recipe,), matmul, forward,
                               (lhs.dtype,))
    return out, (kept, rhs, group_sizes)


def _backward(recipe, matmul, forward, weight_gradient, residuals, dout):
    kept, rhs, group_sizes = residuals
    # lhs's dtype: the result's, whose cotangent dout is, where only lhs's codes were kept.
    dtype = kept[0].dtype if len(kept) == 1 else dout.dtype
    dlhs, drhs = _kernel_or_emulated(
        _kernel_backward, _emulated_backward, (kept, rhs, dout.astype(dtype), group_sizes),
        (recipe, weight_gradient), matmul, forward, (dtype, rhs.dtype))
    # Inside shard_map, each with its primal's type (the codes vary as lhs does); nothing for
    # the group sizes and lhs's quantisation.
    return (_ffi.cotangent_like(dlhs, kept[0]), _ffi.cotangent_like(drhs, rhs), None, None)


_fp8_grouped_matmul.defvjp(_forward, _backward)


# --- the engine's quantisation -------------------------------------------------------------------


def _given_scale(scale):
    """The engine's operand given_scale of an op's `scale`: [0] float32 for None (each block's
    own scale), else that one float32 value as [1]."""
    if scale is None:
        return jnp.zeros((0,), jnp.float32)
    given = jnp.asarray(scale)
    if given.dtype != jnp.float32 or given.size != 1:
        raise ValueError("scale must be one float32 value (any shape of one element), got "
                         f"{jnp.dtype(given.dtype).name}{list(given.shape)}")
    return given.reshape(1)


def quantize_rows(x: ArrayLike, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """`quantize(x, (1, block))` in one engine call: x [M, C] (float32, float16 or bfloat16) ->
    (q float8_e4m3fn [M, C], scale float32 [M, ceil(C / block)]), bitwise the same as the
    emulation's (the same float32 operations, rounding to nearest even). The activations' and
    output gradients' quantisation of the blockwise recipe, for FP8 kernels to read. Rows
    partition locally under sharding; the columns are gathered. Not differentiable (the
    recipes' custom_vjp never differentiates a quantisation)."""
    x = jnp.asarray(x)
    _checks.require_rank("x", x, 2, "[M, C]")
    _checks.require_float("x", x)
    if not is_int(block) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return tuple(_quantize_p.bind(*_ffi.match_vma(x), block=int(block)))


def _quantize_lowering(x, *, block, partition):
    def run(x):
        rows, cols = x.shape
        return _ffi.call(
            "nodrop_quantize_fp8",
            (jax.ShapeDtypeStruct((rows, cols), E4M3),
             jax.ShapeDtypeStruct((rows, -(-cols // block)), jnp.float32)),
            x, block=np.int64(block))

    if not partition:
        return run(x)
    return _partition.partitioned(
        run, "m c -> m c, m b", (("m", "c"),), (("m", "c"), ("m", "b")),
        lambda axes_of, x: run(x), ("m",), need_replication_factors=("c", "b"))(x)


_quantize_p = _primitives.define(
    "nodrop_quantize_fp8",
    abstract_eval=lambda x, *, block: (
        _primitives.result_aval((x,), x.shape, E4M3),
        _primitives.result_aval((x,), (x.shape[0], -(-x.shape[1] // block)), jnp.float32)),
    lower=_quantize_lowering, multiple_results=True)


# --- permute with the rows' quantisation ---------------------------------------------------------


def permute_fp8(x: ArrayLike, ids: ArrayLike, num_experts: int, *,
                scale: ArrayLike | None = None) -> tuple[jax.Array, ...]:
    """`nodrop.permute` and `quantize_rows` of its rows in one engine call, each token quantised
    once (a row is a copy of its token, so its 1 x 128 blocks are the token's): the blockwise
    recipe's first expert matmul reads the codes without another pass over the rows.

    Args: as `nodrop.permute` (x [T, H] float32, float16 or bfloat16; ids [T, k]; num_experts E).

    Returns (rows, group_sizes, row_map, rows_q, rows_scale): the first three are `permute`'s,
    rows_q float8_e4m3fn [T*k, H] and rows_scale float32 [T*k, ceil(H / 128)] are bitwise
    `quantize_rows(rows)` (rows no slot maps to are zero: codes 0, scale 1). rows is
    differentiable in x as `permute`'s; the codes and scales are not (the recipes' custom_vjp
    never differentiates a quantisation). Under sharding the operands are gathered.

    scale: None, or one float32 scale (one element) that every block takes instead of its
    own: the tensorwise recipe's, from an amax taken over the tokens beforehand (`tensor_scale`
    of x: every row is a copy of a token). Then rows_q holds rows * (1 / scale) rounded and
    saturated alike, bitwise the codes of `quantize(rows, "tensor", scale=...)` (rows no slot
    maps to: codes 0), and every element of rows_scale is that scale
    (`grouped_matmul_fp8_tensorwise` reads the codes with it).
    """
    x, ids = _permute_operands(x, ids, num_experts)
    x, ids, given = _ffi.match_vma(x, ids, _given_scale(scale))
    rows, group_sizes, row_map, rows_q, rows_scale = _permute_fp8_p.bind(
        *jax.lax.stop_gradient((x, ids, given)), num_experts=int(num_experts),
        checked=_checks.checks_enabled())
    return (_moved_rows(x, rows, row_map, ids.shape[1]), group_sizes, row_map, rows_q,
            rows_scale)


def _permute_fp8_abstract_eval(x, ids, given_scale, *, num_experts, checked):
    del given_scale, checked
    operands, num_slots = (x, ids), ids.shape[0] * ids.shape[1]
    return (_primitives.result_aval(operands, (num_slots, x.shape[1]), x.dtype),
            _primitives.result_aval(operands, (num_experts,), jnp.int32),
            _primitives.result_aval(operands, (num_slots,), jnp.int32),
            _primitives.result_aval(operands, (num_slots, x.shape[1]), E4M3),
            _primitives.result_aval(operands, (num_slots, -(-x.shape[1] // BLOCK)), jnp.float32))


def _permute_fp8_lowering(x, ids, given_scale, *, num_experts, checked, partition):
    """One call on whole operands: under sharding XLA gathers them (the sort needs every token's
    ids, the scales every column of a block)."""
    del partition
    num_tokens, k = ids.shape
    num_slots = num_tokens * k
    return _ffi.call(
        "nodrop_permute_fp8",
        (jax.ShapeDtypeStruct((num_slots, x.shape[1]), x.dtype),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((num_slots,), jnp.int32),
         jax.ShapeDtypeStruct((num_slots, x.shape[1]), E4M3),
         jax.ShapeDtypeStruct((num_slots, -(-x.shape[1] // BLOCK)), jnp.float32)),
        x, ids, given_scale, cuda_workspace=lambda: _ffi.sort_by_expert_workspace_bytes(
            num_tokens, k, num_experts),
        num_experts=num_experts, checked=_checks.attr_bool(checked))


# Differentiated through `_moved_rows` (its operands are stop_gradient'ed), not by JAX.
_permute_fp8_p = _primitives.define("nodrop_permute_fp8", abstract_eval=_permute_fp8_abstract_eval,
                                    lower=_permute_fp8_lowering, multiple_results=True)


# --- the experts' weights for the forward (transposed) and the input gradient -------------------


def _given_scales(scale, num_experts: int):
    """The engine's operand given_scale of the weights' quantisations' `scale`: [0] float32 for
    None (each block's own scale), else the experts' scales [G]."""
    if scale is None:
        return jnp.zeros((0,), jnp.float32)
    given = jnp.asarray(scale)
    if given.dtype != jnp.float32 or given.shape != (num_experts,):
        raise ValueError(f"scale must be float32 of shape ({num_experts},) (one per expert of w), "
                         f"got {jnp.dtype(given.dtype).name}{list(given.shape)}")
    return given


def quantize_weights(w: ArrayLike, *, scale: ArrayLike | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """The FP8 input gradient's weight operand in one engine call: w [G, K, N] (float32, float16
    or bfloat16) -> (q float8_e4m3fn [G, K, N], scale float32 [G, ceil(K / 128), ceil(N / 128)]),
    bitwise `quantize(w, WEIGHT_BLOCK)`: each expert's weight in 128 x 128 blocks, read once and
    written once. dout @ w[g].T reads w[g] as its "transposed weight", so
    `grouped_matmul_fp8_blockwise` takes these as rhs and rhs_scales. Experts partition locally
    under sharding; K and N are gathered. Not differentiable (the recipes' custom_vjp never
    differentiates a quantisation).

    scale: None, or float32 [G], one scale per expert that all of its blocks take instead of
    their own (the tensorwise recipe's, from an amax taken beforehand). Then q is bitwise
    `quantize(w, "tensor", scale=scale[:, None, None])`'s codes (values past 448 * scale
    saturate), every scale of expert g is scale[g], and `grouped_matmul_fp8_tensorwise` reads
    the codes with `scale`.
    """
    return _quantize_weights(w, scale, transposed=False)


def quantize_weights_transposed(w: ArrayLike, *, scale: ArrayLike | None = None
                                ) -> tuple[jax.Array, jax.Array]:
    """The FP8 forward's weight operand in one engine call: `quantize_weights` of each expert's
    weight transposed, (q_t float8_e4m3fn [G, N, K], scale float32 [G, ceil(N / 128),
    ceil(K / 128)]), bitwise `quantize(jnp.swapaxes(w, 1, 2), WEIGHT_BLOCK)` (Hopper's FP8 wgmma
    reads both operands K-major), or with `scale` [G] given, the tensorwise codes of
    `jnp.swapaxes(w, 1, 2)` at those scales. `grouped_matmul_fp8_blockwise` and
    `grouped_matmul_fp8_tensorwise` read it as rhs. Sharding as `quantize_weights`."""
    return _quantize_weights(w, scale, transposed=True)


def _quantize_weights(w, scale, *, transposed: bool):
    w = jnp.asarray(w)
    _checks.require_rank("w", w, 3, "[G, K, N]")
    _checks.require_float("w", w)
    return tuple(_quantize_weights_p.bind(*_ffi.match_vma(w, _given_scales(scale, w.shape[0])),
                                          transposed=transposed))


def _weights_shapes(w, transposed: bool):
    """(the codes' shape, the scales') of w [G, K, N]."""
    num_experts, k, n = w.shape
    if transposed:
        return (num_experts, n, k), (num_experts, -(-n // BLOCK), -(-k // BLOCK))
    return (num_experts, k, n), (num_experts, -(-k // BLOCK), -(-n // BLOCK))


def _quantize_weights_lowering(w, given_scale, *, transposed, partition):
    target = "nodrop_quantize_fp8_weights" + ("_transposed" if transposed else "")

    def run(w, given_scale):
        codes, scales = _weights_shapes(w, transposed)
        return _ffi.call(
            target,
            (jax.ShapeDtypeStruct(codes, E4M3), jax.ShapeDtypeStruct(scales, jnp.float32)),
            w, given_scale)

    if not partition:
        return run(w, given_scale)
    # Each expert on its own: split experts stay local (their given scales with them); a
    # weight's blocks span its rows and columns, which are gathered.
    given = "g" if given_scale.shape[0] else "s"
    codes = ("g", "n", "k") if transposed else ("g", "k", "n")
    return _partition.partitioned(
        run, f"g k n, {given} -> {' '.join(codes)}, g b c", (("g", "k", "n"), (given,)),
        (codes, ("g", "b", "c")), lambda axes_of, *args: run(*args), ("g",),
        need_replication_factors=("k", "n") + (("s",) if given == "s" else ()) + ("b", "c"))(
            w, given_scale)


_quantize_weights_p = _primitives.define(
    "nodrop_quantize_fp8_weights",
    abstract_eval=lambda w, given_scale, *, transposed: tuple(
        _primitives.result_aval((w, given_scale), shape, dtype)
        for shape, dtype in zip(_weights_shapes(w, transposed), (E4M3, jnp.float32))),
    lower=_quantize_weights_lowering, multiple_results=True)


# --- the engine's FP8 grouped matmuls on ragged rows (the forwards) -----------------------------


def _require_e4m3(name: str, q) -> None:
    if q.dtype != E4M3:
        raise TypeError(f"{name} must be float8_e4m3fn, got {jnp.dtype(q.dtype).name}")


def _require_scales(name: str, scales, shape: tuple[int, ...], what: str) -> None:
    if jnp.dtype(scales.dtype) != jnp.float32 or scales.shape != shape:
        raise ValueError(f"{name} must be float32 of shape {shape} ({what}), got "
                         f"{jnp.dtype(scales.dtype).name} of shape {tuple(scales.shape)}")


def _rows_codes(lhs_q, rhs_q_t) -> None:
    """The codes both forwards read: lhs_q [M, K] and rhs_q_t [G, N, K] float8_e4m3fn."""
    _checks.require_rank("lhs_q", lhs_q, 2, "[M, K]")
    _checks.require_rank("rhs_q_t", rhs_q_t, 3, "[G, N, K]")
    _require_e4m3("lhs_q", lhs_q)
    _require_e4m3("rhs_q_t", rhs_q_t)
    _checks.require_dim("rhs_q_t", rhs_q_t, 2, lhs_q.shape[1],
                        "columns along axis 2 (K, lhs_q's columns)")


def grouped_matmul_fp8_blockwise(lhs_q: ArrayLike, lhs_scales: ArrayLike, rhs_q_t: ArrayLike,
                                 rhs_scales: ArrayLike, group_sizes: ArrayLike) -> jax.Array:
    """The blockwise recipe's forward on FP8 operands, in one engine call: out [M, N] bfloat16.

    Args:
      lhs_q: [M, K] float8_e4m3fn and lhs_scales [M, ceil(K/128)] float32, as `quantize_rows`
        (or `quantize(lhs, ACTIVATION_BLOCK)`) gives them.
      rhs_q_t: [G, N, K] float8_e4m3fn, each expert's weight transposed, and rhs_scales
        [G, ceil(N/128), ceil(K/128)] float32, as `quantize(swapaxes(rhs, 1, 2), WEIGHT_BLOCK)`.
      group_sizes: [G] integers, as `nodrop.grouped_matmul`'s (rows past the groups are zero).
    Group g's rows are sum over k blocks kb of (lhs_q[rows_g, kb] @ rhs_q_t[g, :, kb].T) *
    lhs_scales[rows_g, kb] * rhs_scales[g, n // 128, kb], each block's product accumulated in
    float32 and scaled as it is added; the result is rounded to bfloat16. Rows partition locally
    under sharding, the rest is gathered. Not differentiable: `fp8_grouped_matmul` is the
    differentiable recipe that calls it.
    """
    lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes = map(
        _checks.as_array, (lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes))
    _rows_codes(lhs_q, rhs_q_t)
    (num_rows, depth), (num_groups, num_cols, _) = lhs_q.shape, rhs_q_t.shape
    k_blocks, n_blocks = -(-depth // BLOCK), -(-num_cols // BLOCK)
    per_block = f"one scale per block of {BLOCK}"
    _require_scales("lhs_scales", lhs_scales, (num_rows, k_blocks), per_block)
    _require_scales("rhs_scales", rhs_scales, (num_groups, n_blocks, k_blocks), per_block)
    group_sizes = _group_sizes(group_sizes, num_groups, "rhs_q_t")
    return _blockwise_p.bind(*_ffi.match_vma(lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes),
                             checked=_checks.checks_enabled())


def grouped_matmul_fp8_tensorwise(lhs_q: ArrayLike, lhs_scale: ArrayLike, rhs_q_t: ArrayLike,
                                  rhs_scales: ArrayLike, group_sizes: ArrayLike, *,
                                  fast_accumulation: bool = False) -> jax.Array:
    """The tensorwise recipe's forward and input gradient on FP8 operands, in one engine call:
    out [M, N] bfloat16.

    Args:
      lhs_q: [M, K] float8_e4m3fn and lhs_scale [1] float32, one scale for all of it, as
        `quantize(lhs, "tensor")` gives them (its scale reshaped to [1]).
      rhs_q_t: [G, N, K] float8_e4m3fn, each expert's weight transposed, and rhs_scales [G]
        float32, one per expert, as `quantize(swapaxes(rhs, 1, 2), "tensor")` (reshaped to
        [G]).
      group_sizes: [G] integers, as `nodrop.grouped_matmul`'s (rows past the groups are zero).
      fast_accumulation: how the GPU keeps its float32 sums. True: the tensor cores' own sums
        over all of K ("fast accumulation", what Transformer Engine runs its FP8 forward GEMMs
        with), which round more coarsely; False (the default, as torch._scaled_grouped_mm's
        use_fast_accum): each 128-deep block's sums added into a float32 accumulator
        ("promoted", Transformer Engine's split accumulator, its default for both gradients).
        The CPU engine's sums are float32 either way.
    Group g's rows are (lhs_q[rows_g] @ rhs_q_t[g].T) * (lhs_scale[0] * rhs_scales[g]): the
    product accumulated over all of K in float32, scaled once, rounded to bfloat16. Rows
    partition locally under sharding, the rest is gathered. Not differentiable:
    `fp8_grouped_matmul` is the differentiable recipe that calls it.
    """
    lhs_q, lhs_scale, rhs_q_t, rhs_scales, group_sizes = map(
        _checks.as_array, (lhs_q, lhs_scale, rhs_q_t, rhs_scales, group_sizes))
    _rows_codes(lhs_q, rhs_q_t)
    num_groups = rhs_q_t.shape[0]
    _require_scales("lhs_scale", lhs_scale, (1,), "one scale for all of lhs_q")
    _require_scales("rhs_scales", rhs_scales, (num_groups,), "one scale per expert")
    group_sizes = _group_sizes(group_sizes, num_groups, "rhs_q_t")
    return _tensorwise_p.bind(*_ffi.match_vma(lhs_q, lhs_scale, rhs_q_t, rhs_scales, group_sizes),
                              checked=_checks.checks_enabled(),
                              fast_accumulation=bool(fast_accumulation))


def _bool_attrs(**flags):
    """The ops' bool parameters as FFI attributes."""
    return {name: _checks.attr_bool(value) for name, value in flags.items()}


def _engine_rows(target, lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes, *, platform,
                 **flags):
    """One engine call of either forward (`target`; flags: checked, and the tensorwise one's
    fast_accumulation), K and N zero-padded to the kernels' 16 and 8 (TMA's 16-byte rows of
    E4M3 and of bfloat16). Padding never starts a new 128 block, so the scales stay as they
    are, and zeros add nothing."""
    depth, num_cols = lhs_q.shape[1], rhs_q_t.shape[1]
    padded_k, padded_n = -(-depth // 16) * 16, -(-num_cols // 8) * 8
    lhs_q = _pad_axis(lhs_q, 1, padded_k)
    rhs_q_t = _pad_axis(_pad_axis(rhs_q_t, 2, padded_k), 1, padded_n)
    workspace = None
    if platform == "cuda":  # both forwards' workspace is the blockwise one's
        workspace = functools.partial(_ffi.grouped_matmul_fp8_blockwise_workspace_bytes,
                                      rhs_q_t.shape[0])
    return _ffi.engine_call(
        target, jax.ShapeDtypeStruct((lhs_q.shape[0], padded_n), jnp.bfloat16),
        workspace_bytes=workspace, **_bool_attrs(**flags))(
        lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes)[:, :num_cols]


def _rows_lowering(target: str, lhs_scale_factors: tuple[str, ...],
                   rhs_scale_factors: tuple[str, ...]):
    """The lowering of either forward (`target`), its scales' dimensions named by the sharding
    rule's factors: the rows "m", the groups "g", the rest their own."""
    dims = (("m", "k"), lhs_scale_factors, ("g", "n", "k"), rhs_scale_factors, ("g",))
    rule = ", ".join(" ".join(factors) for factors in dims) + " -> m n"
    gathered = tuple(dict.fromkeys(f for factors in dims for f in factors if f != "m"))

    def lower(lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes, *, checked, partition,
              **flags):
        def run(*args):
            return _ffi.on_platform(
                *args, cpu=functools.partial(_engine_rows, target, platform="cpu",
                                             checked=checked, **flags),
                cuda=functools.partial(_engine_rows, target, platform="cuda", checked=checked,
                                       **flags))

        if not partition:
            return run(lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes)

        def local(axes_of, lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes):
            if "m" in axes_of:  # this shard's rows, and the part of each group among them
                group_sizes = _shard_group_sizes(group_sizes, lhs_q.shape[0], axes_of["m"])
            return run(lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes)

        # Rows split: local with the shard's group sizes (not in checked mode, which must see
        # the global sizes); everything else gathered.
        return _partition.partitioned(
            run, rule, dims, (("m", "n"),), local, () if checked else ("m",),
            need_replication_factors=gathered)(
            lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes)

    return lower


def _rows_abstract_eval(lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes, **params):
    del params  # checked (and fast_accumulation): the shape is the operands'
    return _primitives.result_aval((lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes),
                                   (lhs_q.shape[0], rhs_q_t.shape[1]), jnp.bfloat16)


# The blockwise scales [M, KB] and [G, NB, KB] split with the rows and the groups; the
# tensorwise ones are [1] (its own factor, gathered) and [G].
_blockwise_p = _primitives.define(
    "nodrop_grouped_matmul_fp8_blockwise", abstract_eval=_rows_abstract_eval,
    lower=_rows_lowering("nodrop_grouped_matmul_fp8_blockwise", ("m", "b"), ("g", "c", "b")))
_tensorwise_p = _primitives.define(
    "nodrop_grouped_matmul_fp8_tensorwise", abstract_eval=_rows_abstract_eval,
    lower=_rows_lowering("nodrop_grouped_matmul_fp8_tensorwise", ("s",), ("g",)))


# --- the weight gradient on FP8 operands ---------------------------------------------------------


def _contract_blocks(num_rows: int, num_groups: int) -> int:
    """The blocks of 128 rows that quantize_transposed lays out for any group sizes (each group
    adds at most one short block): the engine's fp8_contract_blocks."""
    return -(-num_rows // BLOCK) + num_groups


def quantize_transposed(x: ArrayLike, group_sizes: ArrayLike, *, scale: ArrayLike | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """The blockwise weight gradient's operand in one engine call: x [M, C] (float32, float16 or
    bfloat16) and group_sizes [G] -> (q_t float8_e4m3fn [C, P], scale float32 [PB, C]), with
    PB = ceil(M / 128) + G blocks and P = 128 * PB.

    Each group's rows (clamped as `nodrop.grouped_matmul` clamps them) are cut into blocks of
    128 rows from its first row, the last one shorter where 128 does not divide the group;
    the blocks are numbered over the groups in order. Row j of block b is column 128 * b + j
    of q_t, quantised with scale[b] (one scale per column of x: WGRAD_BLOCK's, the emulation's
    arithmetic bit for bit). The other columns of q_t are zero and the other scales one: rows
    past the groups are read by nothing. `grouped_matmul_fp8_blockwise_contract` reads two of
    these (Hopper's FP8 wgmma wants both operands contraction-major, hence the transpose).
    Columns partition locally under sharding; the rows are gathered. Not differentiable.

    scale: None, or one float32 scale (one element) that every block takes instead of its
    own: the tensorwise recipe's, from an amax taken over the tensor beforehand. Then q_t holds
    x * (1 / scale) rounded and saturated alike, and every scale, unused blocks' included, is
    that one (`grouped_matmul_fp8_tensorwise_contract` reads the codes and that one scale).
    """
    x, group_sizes = jnp.asarray(x), _checks.as_array(group_sizes)
    _checks.require_rank("x", x, 2, "[M, C]")
    _checks.require_float("x", x)
    _checks.require_rank("group_sizes", group_sizes, 1, "[G]")
    group_sizes = _checks.as_int32("group_sizes", group_sizes)
    return tuple(_quantize_transposed_p.bind(
        *_ffi.match_vma(x, group_sizes, _given_scale(scale)), checked=_checks.checks_enabled()))


def _quantize_transposed_lowering(x, group_sizes, given_scale, *, checked, partition):
    def run(x, group_sizes, given_scale):
        num_rows, cols = x.shape
        blocks = _contract_blocks(num_rows, group_sizes.shape[0])
        return _ffi.call(
            "nodrop_quantize_fp8_transposed",
            (jax.ShapeDtypeStruct((cols, BLOCK * blocks), E4M3),
             jax.ShapeDtypeStruct((blocks, cols), jnp.float32)),
            x, group_sizes, given_scale, checked=_checks.attr_bool(checked))

    if not partition:
        return run(x, group_sizes, given_scale)
    # Each column is quantised on its own: split columns stay local; the rows, whose blocks
    # follow the global group sizes, are gathered.
    return _partition.partitioned(
        run, "m c, g, s -> c p, b c", (("m", "c"), ("g",), ("s",)), (("c", "p"), ("b", "c")),
        lambda axes_of, *args: run(*args), ("c",),
        need_replication_factors=("m", "g", "s", "p", "b"))(x, group_sizes, given_scale)


_quantize_transposed_p = _primitives.define(
    "nodrop_quantize_fp8_transposed",
    abstract_eval=lambda x, group_sizes, given_scale, *, checked: (
        _primitives.result_aval(
            (x, group_sizes),
            (x.shape[1], BLOCK * _contract_blocks(x.shape[0], group_sizes.shape[0])), E4M3),
        _primitives.result_aval(
            (x, group_sizes), (_contract_blocks(x.shape[0], group_sizes.shape[0]), x.shape[1]),
            jnp.float32)),
    lower=_quantize_transposed_lowering, multiple_results=True)


def transpose_codes(q: ArrayLike, group_sizes: ArrayLike) -> jax.Array:
    """Codes already made, laid out as `quantize_transposed` lays its codes, in one engine call:
    q [M, C] float8_e4m3fn and group_sizes [G] -> q_t float8_e4m3fn [C, P], P = 128 * PB,
    PB = ceil(M / 128) + G.

    For q quantised at one scale s for the whole tensor (the tensorwise recipe's rows),
    q_t is bitwise `quantize_transposed(x, group_sizes, scale=s)[0]`: the same codes, moved
    instead of made again from x, reading one byte an element instead of x's two or four. No
    scales: s is the rows' one. Rows past the groups are read by nothing, and q_t's columns
    past the blocks are zero. Sharding as `quantize_transposed`. Not differentiable."""
    q, group_sizes = jnp.asarray(q), _checks.as_array(group_sizes)
    _checks.require_rank("q", q, 2, "[M, C]")
    _require_e4m3("q", q)
    _checks.require_rank("group_sizes", group_sizes, 1, "[G]")
    group_sizes = _checks.as_int32("group_sizes", group_sizes)
    return _transpose_codes_p.bind(*_ffi.match_vma(q, group_sizes),
                                   checked=_checks.checks_enabled())


def _transpose_codes_lowering(q, group_sizes, *, checked, partition):
    def run(q, group_sizes):
        num_rows, cols = q.shape
        blocks = _contract_blocks(num_rows, group_sizes.shape[0])
        return _ffi.call("nodrop_transpose_fp8_codes",
                         jax.ShapeDtypeStruct((cols, BLOCK * blocks), E4M3), q, group_sizes,
                         checked=_checks.attr_bool(checked))

    if not partition:
        return run(q, group_sizes)
    # As quantize_transposed: split columns stay local, the rows are gathered.
    return _partition.partitioned(
        run, "m c, g -> c p", (("m", "c"), ("g",)), (("c", "p"),),
        lambda axes_of, *args: run(*args), ("c",),
        need_replication_factors=("m", "g", "p"))(q, group_sizes)


_transpose_codes_p = _primitives.define(
    "nodrop_transpose_fp8_codes",
    abstract_eval=lambda q, group_sizes, *, checked: _primitives.result_aval(
        (q, group_sizes),
        (q.shape[1], BLOCK * _contract_blocks(q.shape[0], group_sizes.shape[0])), E4M3),
    lower=_transpose_codes_lowering)


def _contract_codes(lhs_t, rhs_t, group_sizes, num_rows) -> int:
    """The codes both contractions read, lhs_t [K, P] and rhs_t [N, P] float8_e4m3fn for
    num_rows rows in G groups; their blocks PB (P = 128 * PB)."""
    if not is_int(num_rows) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int (M), got {num_rows!r}")
    _checks.require_rank("lhs_t", lhs_t, 2, "[K, P]")
    _checks.require_rank("rhs_t", rhs_t, 2, "[N, P]")
    _require_e4m3("lhs_t", lhs_t)
    _require_e4m3("rhs_t", rhs_t)
    _checks.require_rank("group_sizes", group_sizes, 1, "[G]")
    num_groups = group_sizes.shape[0]
    blocks = _contract_blocks(int(num_rows), num_groups)
    why = (f"columns along axis 1 (P = 128 * (ceil(num_rows / 128) + G) for num_rows "
           f"{num_rows} and G {num_groups})")
    _checks.require_dim("lhs_t", lhs_t, 1, BLOCK * blocks, why)
    _checks.require_dim("rhs_t", rhs_t, 1, BLOCK * blocks, why)
    return blocks


def grouped_matmul_fp8_blockwise_contract(lhs_t: ArrayLike, lhs_scales: ArrayLike,
                                          rhs_t: ArrayLike, rhs_scales: ArrayLike,
                                          group_sizes: ArrayLike, *, num_rows: int) -> jax.Array:
    """The blockwise recipe's weight gradient (a ragged contraction) on FP8 operands, in one
    engine call: out [G, K, N] bfloat16.

    Args:
      lhs_t: [K, P] float8_e4m3fn and lhs_scales [PB, K] float32, `quantize_transposed(lhs,
        group_sizes)` of lhs [M, K].
      rhs_t: [N, P] float8_e4m3fn and rhs_scales [PB, N] float32, `quantize_transposed` of
        rhs [M, N] (the output gradient) with the same group sizes.
      group_sizes: [G] integers, as `nodrop.grouped_matmul_contract`'s.
      num_rows: M, the rows both were quantised from: PB = ceil(M / 128) + G, P = 128 * PB,
        and the group sizes are clamped at M.
    out[g] = sum over group g's blocks b, in order, of (lhs_t[:, block b] @ rhs_t[:, block
    b].T) * lhs_scales[b][:, None] * rhs_scales[b][None, :], block b being the columns of its
    rows; each block's product accumulated in float32 and scaled as it is added, the sum
    rounded to bfloat16; an empty group gives zeros. K and N partition locally under sharding,
    the rest is gathered. Not differentiable: `fp8_grouped_matmul` is the differentiable
    recipe that calls it.
    """
    lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes = map(
        _checks.as_array, (lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes))
    blocks = _contract_codes(lhs_t, rhs_t, group_sizes, num_rows)
    per_block = f"one scale per block of {BLOCK} rows and column"
    _require_scales("lhs_scales", lhs_scales, (blocks, lhs_t.shape[0]), per_block)
    _require_scales("rhs_scales", rhs_scales, (blocks, rhs_t.shape[0]), per_block)
    group_sizes = _checks.as_int32("group_sizes", group_sizes)
    return _blockwise_contract_p.bind(
        *_ffi.match_vma(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes),
        num_rows=int(num_rows), checked=_checks.checks_enabled())


def grouped_matmul_fp8_tensorwise_contract(lhs_t: ArrayLike, lhs_scale: ArrayLike,
                                           rhs_t: ArrayLike, rhs_scale: ArrayLike,
                                           group_sizes: ArrayLike, *, num_rows: int,
                                           fast_accumulation: bool = False) -> jax.Array:
    """The tensorwise recipe's weight gradient (a ragged contraction) on FP8 operands, in one
    engine call: out [G, K, N] bfloat16.

    Args:
      lhs_t: [K, P] float8_e4m3fn, `quantize_transposed(lhs, group_sizes, scale=lhs_scale)`'s
        codes of lhs [M, K], and lhs_scale [1] float32, that one scale.
      rhs_t: [N, P] float8_e4m3fn and rhs_scale [1] float32, the same of rhs [M, N] (the output
        gradient) with the same group sizes.
      group_sizes, num_rows: as `grouped_matmul_fp8_blockwise_contract`'s.
      fast_accumulation: as `grouped_matmul_fp8_tensorwise`'s, over the rows of each group.
    out[g] = (lhs_t[:, cols_g] @ rhs_t[:, cols_g].T) * (lhs_scale[0] * rhs_scale[0]), cols_g
    being the columns of group g's rows (as quantize_transposed lays them out): the product
    accumulated in float32, scaled once, rounded to bfloat16; an empty group gives zeros. K and
    N partition locally under sharding, the rest is gathered. Not differentiable:
    `fp8_grouped_matmul` is the differentiable recipe that calls it.
    """
    lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes = map(
        _checks.as_array, (lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes))
    _contract_codes(lhs_t, rhs_t, group_sizes, num_rows)
    _require_scales("lhs_scale", lhs_scale, (1,), "one scale for all of lhs_t")
    _require_scales("rhs_scale", rhs_scale, (1,), "one scale for all of rhs_t")
    group_sizes = _checks.as_int32("group_sizes", group_sizes)
    return _tensorwise_contract_p.bind(
        *_ffi.match_vma(lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes),
        num_rows=int(num_rows), checked=_checks.checks_enabled(),
        fast_accumulation=bool(fast_accumulation))


def _engine_contract(target, lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *, platform,
                     num_rows, **flags):
    """One engine call of either contraction (`target`; flags: checked, and the tensorwise
    one's fast_accumulation), N padded to the kernels' multiple of 8 (16-byte rows of the
    bfloat16 output): zero codes add nothing, under scale 1 where the scales are per column
    (the blockwise ones, [PB, N])."""
    num_cols = rhs_t.shape[0]
    padded_n = -(-num_cols // 8) * 8
    rhs_t = _pad_axis(rhs_t, 0, padded_n)
    if rhs_scales.ndim == 2:
        rhs_scales = jnp.pad(rhs_scales, ((0, 0), (0, padded_n - num_cols)), constant_values=1)
    workspace = None
    if platform == "cuda":  # both contractions' workspace is the blockwise one's
        workspace = functools.partial(_ffi.grouped_matmul_fp8_blockwise_workspace_bytes,
                                      group_sizes.shape[0])
    return _ffi.engine_call(
        target,
        jax.ShapeDtypeStruct((group_sizes.shape[0], lhs_t.shape[0], padded_n), jnp.bfloat16),
        workspace_bytes=workspace, num_rows=np.int64(num_rows), **_bool_attrs(**flags))(
        lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes)[:, :, :num_cols]


def _contract_lowering(target: str, lhs_scale_factors: tuple[str, ...],
                       rhs_scale_factors: tuple[str, ...]):
    """The lowering of either contraction (`target`), its scales' dimensions named by the
    sharding rule's factors: K "k", N "n", the blocks of rows "b", the rest their own."""
    dims = (("k", "p"), lhs_scale_factors, ("n", "p"), rhs_scale_factors, ("g",))
    rule = ", ".join(" ".join(factors) for factors in dims) + " -> g k n"
    gathered = tuple(dict.fromkeys(f for factors in dims for f in factors
                                   if f not in ("k", "n")))

    def lower(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *, num_rows, partition,
              **flags):
        def run(*args):
            return _ffi.on_platform(
                *args, cpu=functools.partial(_engine_contract, target, platform="cpu",
                                             num_rows=num_rows, **flags),
                cuda=functools.partial(_engine_contract, target, platform="cuda",
                                       num_rows=num_rows, **flags))

        if not partition:
            return run(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes)
        # K and N split: local (each output element reads its own row of lhs_t and of rhs_t);
        # the contraction (P, and the blocks of the scales) and the groups gathered.
        return _partition.partitioned(
            run, rule, dims, (("g", "k", "n"),), lambda axes_of, *args: run(*args), ("k", "n"),
            need_replication_factors=gathered)(
            lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes)

    return lower


def _contract_abstract_eval(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, **params):
    del params  # num_rows, checked (and fast_accumulation): the shape is the operands'
    return _primitives.result_aval((lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes),
                                   (group_sizes.shape[0], lhs_t.shape[0], rhs_t.shape[0]),
                                   jnp.bfloat16)


# The blockwise scales [PB, K] and [PB, N] split with K and N; the tensorwise ones are [1] each
# (factors of their own, gathered).
_blockwise_contract_p = _primitives.define(
    "nodrop_grouped_matmul_fp8_blockwise_contract", abstract_eval=_contract_abstract_eval,
    lower=_contract_lowering("nodrop_grouped_matmul_fp8_blockwise_contract", ("b", "k"),
                             ("b", "n")))
_tensorwise_contract_p = _primitives.define(
    "nodrop_grouped_matmul_fp8_tensorwise_contract", abstract_eval=_contract_abstract_eval,
    lower=_contract_lowering("nodrop_grouped_matmul_fp8_tensorwise_contract", ("s",), ("t",)))
