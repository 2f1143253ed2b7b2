"""Pure-JAX references for every nodrop op.

They define the semantics the C++ engines are tested against: written for clarity, not speed,
and differentiable with ordinary JAX autodiff. They compute in the dtype they are given (pass
float64 arrays with `jax_enable_x64` for a high-precision reference) and return the same dtypes
as the ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nodrop.ops import fp8

_RENORM_EPS = 1e-20  # guards a zero sum of selected scores (sigmoid scores can underflow)


def _group_row_masks(group_sizes, num_rows):
    """[G, M] bool: row m belongs to group g. Negative sizes count as zero; the total is clamped
    at num_rows (the engine's rule for invalid sizes)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    rows = jnp.arange(num_rows)
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None):
    """out[M, N] = lhs[rows_g] @ rhs[g] (or rhs[g].T) for each group g; rows past the groups are 0."""
    out_dtype = out_dtype or lhs.dtype
    acc = jnp.promote_types(lhs.dtype, jnp.float32)
    masks = _group_row_masks(group_sizes, lhs.shape[0])
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = jnp.zeros((lhs.shape[0], w.shape[2]), acc)
    for g in range(w.shape[0]):
        prod = jnp.dot(lhs.astype(acc), w[g].astype(acc), precision=jax.lax.Precision.HIGHEST)
        out = out + jnp.where(masks[g][:, None], prod, 0)
    return out.astype(out_dtype)


def grouped_matmul_contract(lhs, rhs, group_sizes, *, out_dtype=None):
    """out[G, K, N]: out[g] = lhs[rows_g].T @ rhs[rows_g]; zero for an empty group."""
    out_dtype = out_dtype or lhs.dtype
    acc = jnp.promote_types(lhs.dtype, jnp.float32)
    masks = _group_row_masks(group_sizes, lhs.shape[0])
    outs = [
        jnp.dot(jnp.where(m[:, None], lhs, 0).astype(acc).T, rhs.astype(acc),
                precision=jax.lax.Precision.HIGHEST)
        for m in masks
    ]
    if not outs:
        return jnp.zeros((0, lhs.shape[1], rhs.shape[1]), out_dtype)
    return jnp.stack(outs).astype(out_dtype)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None):
    """`jax.lax.ragged_dot` semantics (lhs [M, K], rhs [G, K, N]) through the masked reference."""
    del precision
    return grouped_matmul(lhs, rhs, group_sizes, out_dtype=preferred_element_type)


def topk_router(logits, k, *, score_function="softmax", expert_bias=None, num_groups=1,
                topk_groups=1, renormalize=False, scaling_factor=1.0):
    """logits [T, E] -> (weights [T, k] float, ids [T, k] int32). See nodrop.topk_router."""
    acc = jnp.promote_types(logits.dtype, jnp.float32)
    logits = logits.astype(acc)
    num_tokens, num_experts = logits.shape
    if score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    if expert_bias is None:
        selection = scores
    elif score_function == "softmax":  # the bias is added to the logits
        selection = scores * jnp.exp(expert_bias.astype(acc))[None, :]
    else:
        selection = scores + expert_bias.astype(acc)[None, :]
    selection = jax.lax.stop_gradient(selection)
    if num_groups > 1:
        per_group = num_experts // num_groups
        best_in_group = max(1, k // topk_groups)
        grouped = selection.reshape(num_tokens, num_groups, per_group)
        group_scores = jax.lax.top_k(grouped, best_in_group)[0].sum(-1)
        _, keep = jax.lax.top_k(group_scores, topk_groups)
        group_mask = jnp.zeros((num_tokens, num_groups), bool).at[
            jnp.arange(num_tokens)[:, None], keep].set(True)
        expert_mask = jnp.repeat(group_mask, per_group, axis=1)
        selection = jnp.where(expert_mask, selection, -jnp.inf)
    _, ids = jax.lax.top_k(selection, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + _RENORM_EPS)
    return weights * scaling_factor, ids.astype(jnp.int32)


def permute(x, ids, num_experts):
    """x [T, H], ids [T, k] -> (rows [T*k, H], group_sizes [E] int32, row_map [T*k] int32).

    Rows are ordered by (expert, token, slot); a slot whose id is outside [0, E) is dropped: its
    row_map entry is -1 and the rows after the last group are zero."""
    num_tokens, k = ids.shape
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(key, stable=True)  # flat index is t*k + s, so ties stay in (token, slot)
    row_map = jnp.zeros_like(order).at[order].set(jnp.arange(num_tokens * k, dtype=order.dtype))
    row_map = jnp.where(valid, row_map, -1).astype(jnp.int32)
    rows = jnp.where(valid[order][:, None], x[order // k], 0).astype(x.dtype)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, 0)].add(
        valid.astype(jnp.int32))
    return rows, group_sizes, row_map


def permute_fp8(x, ids, num_experts, *, scale=None):
    """permute, and the rows quantised in 1 x 128 blocks (fp8.quantize, the blockwise recipe's),
    or with scale (one float32) given, every block under it (the tensorwise recipe's) and the
    rows no slot maps to coded 0: (rows, group_sizes, row_map, rows_q, rows_scale)."""
    rows, group_sizes, row_map = permute(x, ids, num_experts)
    if scale is None:
        return (rows, group_sizes, row_map, *fp8.quantize(rows, fp8.ACTIVATION_BLOCK))
    blocks = (rows.shape[0], -(-rows.shape[1] // fp8.BLOCK))
    rows_scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(()), blocks)
    rows_q, _ = fp8.quantize(rows, fp8.ACTIVATION_BLOCK, scale=rows_scale)
    mapped = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    return (rows, group_sizes, row_map, jnp.where(mapped[:, None], rows_q, jnp.zeros_like(rows_q)),
            rows_scale)


def quantize_weights(w, *, scale=None):
    """Each expert's weight [K, N] quantised in 128 x 128 blocks (fp8.quantize, the blockwise
    recipe's), or with scale [G] given, expert g's every block under scale[g] (the tensorwise
    recipe's): (q [G, K, N], scale [G, ceil(K / 128), ceil(N / 128)])."""
    if scale is None:
        return fp8.quantize(w, fp8.WEIGHT_BLOCK)
    blocks = (w.shape[0], -(-w.shape[1] // fp8.BLOCK), -(-w.shape[2] // fp8.BLOCK))
    scales = jnp.broadcast_to(jnp.asarray(scale, jnp.float32)[:, None, None], blocks)
    return fp8.quantize(w, fp8.WEIGHT_BLOCK, scale=scales)[0], scales


def quantize_weights_transposed(w, *, scale=None):
    """quantize_weights of each expert's weight transposed: (q_t [G, N, K], scale
    [G, ceil(N / 128), ceil(K / 128)])."""
    return quantize_weights(jnp.swapaxes(w, 1, 2), scale=scale)


def unpermute(rows, row_map, weights):
    """rows [T*k, H], row_map [T*k], weights [T, k] -> [T, H] = sum_s weight * row, in float32."""
    num_tokens, k = weights.shape
    acc = jnp.promote_types(rows.dtype, jnp.float32)
    valid = (row_map >= 0) & (row_map < rows.shape[0])
    picked = jnp.where(valid[:, None], rows[jnp.clip(row_map, 0, rows.shape[0] - 1)], 0)
    picked = picked.astype(acc).reshape(num_tokens, k, -1)
    out = jnp.einsum("tkh,tk->th", picked, weights.astype(acc),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(rows.dtype)


def _fp8_rows(lhs, rhs_t, group_sizes):
    """The FP8 forwards' grouped matmul of the dequantised operands, in float32, as bfloat16."""
    return grouped_matmul(lhs, rhs_t, group_sizes, transpose_rhs=True,
                          out_dtype=jnp.float32).astype(jnp.bfloat16)


def grouped_matmul_fp8_blockwise(lhs_q, lhs_scales, rhs_q_t, rhs_scales, group_sizes):
    """The FP8 blockwise grouped matmul: the dequantised operands' grouped matmul in float32,
    as bfloat16 (lhs in 1 x 128 blocks along K, each expert's transposed weight [N, K] in
    128 x 128 blocks)."""
    return _fp8_rows(fp8.dequantize(lhs_q, lhs_scales, fp8.ACTIVATION_BLOCK),
                     fp8.dequantize(rhs_q_t, rhs_scales, fp8.WEIGHT_BLOCK), group_sizes)


def grouped_matmul_fp8_tensorwise(lhs_q, lhs_scale, rhs_q_t, rhs_scales, group_sizes):
    """The FP8 tensorwise grouped matmul: the same, with one scale for lhs ([1]) and one per
    expert's transposed weight ([G])."""
    return _fp8_rows(fp8.dequantize(lhs_q, lhs_scale.reshape(1, 1), "tensor"),
                     fp8.dequantize(rhs_q_t, rhs_scales.reshape(-1, 1, 1), "tensor"),
                     group_sizes)


def _fp8_contract(lhs, rhs, group_sizes, num_rows):
    """The FP8 weight gradients' product of the dequantised operands (lhs [P, K], rhs [P, N])
    over each group's columns in float32, as bfloat16: group g's are its rows' count from
    column 128 * (the blocks of 128 rows of the groups before it)."""
    sizes = _group_row_masks(group_sizes, num_rows).sum(axis=1)
    blocks = -(-sizes // fp8.BLOCK)
    first = fp8.BLOCK * (jnp.cumsum(blocks) - blocks)
    columns = jnp.arange(lhs.shape[0])
    masks = (columns >= first[:, None]) & (columns < (first + sizes)[:, None])
    outs = [jnp.dot(jnp.where(m[:, None], lhs, 0).T, jnp.where(m[:, None], rhs, 0),
                    precision=jax.lax.Precision.HIGHEST) for m in masks]
    if not outs:
        return jnp.zeros((0, lhs.shape[1], rhs.shape[1]), jnp.bfloat16)
    return jnp.stack(outs).astype(jnp.bfloat16)


def grouped_matmul_fp8_blockwise_contract(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *,
                                          num_rows):
    """The FP8 blockwise weight gradient: out[g] = the dequantised operands' product over group
    g's columns in float32, as bfloat16. Columns are rows transposed (lhs_t [K, P], rhs_t
    [N, P], scales [P / 128, K] and [P / 128, N] over blocks of 128 columns)."""
    return _fp8_contract(fp8.dequantize(lhs_t.T, lhs_scales, fp8.WGRAD_BLOCK),
                         fp8.dequantize(rhs_t.T, rhs_scales, fp8.WGRAD_BLOCK), group_sizes,
                         num_rows)


def grouped_matmul_fp8_tensorwise_contract(lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes, *,
                                           num_rows):
    """The FP8 tensorwise weight gradient: the same, with one scale ([1]) for each operand."""
    return _fp8_contract(fp8.dequantize(lhs_t.T, lhs_scale.reshape(1, 1), "tensor"),
                         fp8.dequantize(rhs_t.T, rhs_scale.reshape(1, 1), "tensor"),
                         group_sizes, num_rows)


def adamw_update(param, grad, mu, nu, *, step_size, count, b1, b2, eps, weight_decay=0.0,
                 update_scale=1.0, max_grad_norm=0.0, grad_norm=None):
    """optax.adamw's step after optax.clip_by_global_norm (given the global norm), written out:
    (param, mu, nu, sums) with the update's five sums (ops.adamw.NUM_SUMS); a 16-bit gradient
    widened to param's dtype first."""
    grad = grad.astype(param.dtype)
    if max_grad_norm > 0:
        grad = jax.lax.select(grad_norm < max_grad_norm, grad,
                              (grad / grad_norm.astype(grad.dtype)) * max_grad_norm)
    mu = (1 - b1) * grad + b1 * mu
    nu = (1 - b2) * (grad * grad) + b2 * nu
    update = (mu / (1 - b1 ** count)) / (jnp.sqrt(nu / (1 - b2 ** count)) + eps)
    if weight_decay != 0:
        update = update + weight_decay * param
    update = jnp.asarray(step_size, param.dtype) * update
    if update_scale != 1:
        update = update_scale * update
    param = param + update
    square = update * update
    down, up = update * 2.0 ** -70, update * 2.0 ** 70
    sums = jnp.stack([square.sum(), (down * down).sum(), (up * up).sum(),
                      (~(jnp.isfinite(update) & jnp.isfinite(param))).sum().astype(param.dtype),
                      (~jnp.isfinite(square)).sum().astype(param.dtype)])
    return param, mu, nu, sums
