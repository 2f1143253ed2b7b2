"""Every FFI target nodrop registers is called directly through jax.ffi.ffi_call.

A target whose handler XLA rejects (wrong attribute types, buffer types, or an ABI mismatch with
the installed jaxlib) fails here by name, independently of the ops built on top of it. Each call
is checked against a small numpy computation of the engine contract (csrc/include/nodrop/engine.h).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import as_f64, int32, moe_layer, moe_params, random_normal
from jax.errors import JaxRuntimeError

import nodrop  # noqa: F401  (registers the targets)
from nodrop import _ffi
from nodrop.ops import reference

CALLED: set[str] = set()


def ffi(target, result_shape_dtypes, *args, **attrs):
    """jax.ffi.ffi_call of one target, recording that it was called."""
    CALLED.add(target)
    return jax.ffi.ffi_call(target, result_shape_dtypes, vmap_method="sequential")(
        *args, **attrs)


def offsets(sizes, rows):
    return np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0))]), rows)


def numpy_grouped_matmul(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    bounds = offsets(sizes, lhs.shape[0])
    for g in range(rhs.shape[0]):
        out[bounds[g]:bounds[g + 1]] = lhs[bounds[g]:bounds[g + 1]] @ rhs[g]
    return out


def row_map_of(ids, num_experts):
    """Stable counting sort of the (token, slot) pairs by expert: row_map[t*k+s], -1 if dropped."""
    flat = ids.reshape(-1)
    row_map = -np.ones(flat.size, np.int64)
    row = 0
    for e in range(num_experts):
        for i in np.flatnonzero(flat == e):
            row_map[i] = row
            row += 1
    return row_map


def check_grouped_matmul():
    rng = np.random.default_rng(0)
    lhs, rhs, sizes = random_normal(rng, (7, 3)), random_normal(rng, (2, 3, 4)), [2, 3]
    out = ffi("nodrop_grouped_matmul", jax.ShapeDtypeStruct((7, 4), jnp.float32),
              lhs, rhs, int32(sizes), transpose_rhs=np.bool_(False), checked=np.bool_(False))
    np.testing.assert_allclose(as_f64(out), numpy_grouped_matmul(as_f64(lhs), as_f64(rhs), sizes),
                               rtol=1e-5, atol=1e-6)
    out_t = ffi("nodrop_grouped_matmul", jax.ShapeDtypeStruct((7, 4), jnp.bfloat16),
                lhs, jnp.swapaxes(rhs, 1, 2), int32(sizes), transpose_rhs=np.bool_(True),
                checked=np.bool_(True))
    np.testing.assert_allclose(as_f64(out_t), as_f64(out), rtol=1e-2, atol=1e-2)


def check_grouped_matmul_contract():
    rng = np.random.default_rng(1)
    lhs, rhs, sizes = random_normal(rng, (7, 3)), random_normal(rng, (7, 4)), [0, 5, 1]
    out = ffi("nodrop_grouped_matmul_contract", jax.ShapeDtypeStruct((3, 3, 4), jnp.float32),
              lhs, rhs, int32(sizes), checked=np.bool_(False))
    bounds = offsets(sizes, 7)
    lhs64, rhs64 = as_f64(lhs), as_f64(rhs)
    expected = np.stack([lhs64[bounds[g]:bounds[g + 1]].T @ rhs64[bounds[g]:bounds[g + 1]]
                         for g in range(3)])
    np.testing.assert_allclose(as_f64(out), expected, rtol=1e-5, atol=1e-6)


def check_permute():
    x = random_normal(np.random.default_rng(2), (4, 3), jnp.bfloat16)
    ids = np.asarray([[1, 0], [0, 2], [2, -1], [1, 1]])
    rows, sizes, row_map = ffi(
        "nodrop_permute",
        (jax.ShapeDtypeStruct((8, 3), jnp.bfloat16), jax.ShapeDtypeStruct((3,), jnp.int32),
         jax.ShapeDtypeStruct((8,), jnp.int32)),
        x, int32(ids), num_experts=np.int64(3), checked=np.bool_(False))
    expected_map = row_map_of(ids, 3)
    np.testing.assert_array_equal(np.asarray(row_map), expected_map)
    np.testing.assert_array_equal(np.asarray(sizes), [2, 3, 2])
    expected_rows = np.zeros((8, 3))
    for slot, row in enumerate(expected_map):
        if row >= 0:
            expected_rows[row] = as_f64(x)[slot // 2]
    np.testing.assert_array_equal(as_f64(rows), expected_rows)


PERMUTATION = np.asarray([4, 0, 5, 1, 2, 3])  # row_map of 3 tokens with k=2


def check_permute_rows():
    rng = np.random.default_rng(3)
    src, weights = random_normal(rng, (3, 5)), random_normal(rng, (3, 2))
    out = ffi("nodrop_permute_rows", jax.ShapeDtypeStruct((6, 5), jnp.float32),
              src, int32(PERMUTATION), weights)
    expected = np.zeros((6, 5))
    for slot, row in enumerate(PERMUTATION):
        expected[row] = as_f64(weights).reshape(-1)[slot] * as_f64(src)[slot // 2]
    np.testing.assert_allclose(as_f64(out), expected, rtol=1e-6)


def check_unpermute():
    rng = np.random.default_rng(4)
    rows, weights = random_normal(rng, (6, 5)), random_normal(rng, (3, 2))
    out = ffi("nodrop_unpermute", jax.ShapeDtypeStruct((3, 5), jnp.float32),
              rows, int32(PERMUTATION), weights)
    picked = as_f64(rows)[PERMUTATION].reshape(3, 2, 5)
    expected = np.einsum("tkh,tk->th", picked, as_f64(weights))
    np.testing.assert_allclose(as_f64(out), expected, rtol=1e-5, atol=1e-6)


def check_gather_row_dots():
    rng = np.random.default_rng(5)
    a, rows = random_normal(rng, (3, 5)), random_normal(rng, (6, 5))
    out = ffi("nodrop_gather_row_dots", jax.ShapeDtypeStruct((3, 2), jnp.float32),
              a, rows, int32(PERMUTATION))
    picked = as_f64(rows)[PERMUTATION].reshape(3, 2, 5)
    expected = np.einsum("tkh,th->tk", picked, as_f64(a))
    np.testing.assert_allclose(as_f64(out), expected, rtol=1e-5, atol=1e-6)


ROUTER_ATTRS = dict(k=np.int64(2), score_function="softmax", num_groups=np.int64(1),
                    topk_groups=np.int64(1), renormalize=np.bool_(False),
                    scaling_factor=np.float32(1.0))
ROUTER_LOGITS = np.asarray([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 0.25, 2.5]])


def check_topk_router():
    weights, ids = ffi(
        "nodrop_topk_router",
        (jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((2, 2), jnp.int32)),
        jnp.asarray(ROUTER_LOGITS, jnp.float32), jnp.zeros((4,), jnp.float32), **ROUTER_ATTRS)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 3], [0, 3]])
    probs = np.exp(ROUTER_LOGITS) / np.exp(ROUTER_LOGITS).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights),
                               np.take_along_axis(probs, np.asarray([[1, 3], [0, 3]]), -1),
                               rtol=1e-6)


def check_topk_router_grad():
    ids = np.asarray([[1, 3], [0, 3]])
    grad_weights = np.asarray([[1.0, -2.0], [0.5, 3.0]])
    out = ffi("nodrop_topk_router_grad", jax.ShapeDtypeStruct((2, 4), jnp.float32),
              jnp.asarray(ROUTER_LOGITS, jnp.float32), int32(ids),
              jnp.asarray(grad_weights, jnp.float32), **ROUTER_ATTRS)
    _, vjp = jax.vjp(lambda x: reference.topk_router(x, 2)[0],
                     jnp.asarray(ROUTER_LOGITS, jnp.float64))
    np.testing.assert_allclose(np.asarray(out), np.asarray(vjp(jnp.asarray(grad_weights))[0]),
                               rtol=1e-5, atol=1e-7)


def check_quantize_fp8():
    x = np.asarray([[1.0, -2.0, 0.0, 448.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    q, scale = ffi("nodrop_quantize_fp8",
                   (jax.ShapeDtypeStruct((2, 4), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((2, 2), jnp.float32)), jnp.asarray(x), block=np.int64(2))
    amax = np.abs(x).reshape(2, 2, 2).max(axis=2)
    want_scale = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    back = np.asarray(q, np.float32) * np.repeat(want_scale, 2, axis=1)
    np.testing.assert_allclose(back, x, rtol=2 ** -4)


def check_permute_fp8():
    # H = 130: two blocks of a row, the second of 2 columns.
    x = random_normal(np.random.default_rng(8), (3, 130))
    ids = np.asarray([[1, 0], [-1, 1], [0, 0]])

    def permute_fp8(given_scale):
        return ffi(
            "nodrop_permute_fp8",
            (jax.ShapeDtypeStruct((6, 130), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32),
             jax.ShapeDtypeStruct((6,), jnp.int32),
             jax.ShapeDtypeStruct((6, 130), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((6, 2), jnp.float32)),
            x, int32(ids), jnp.asarray(given_scale, jnp.float32), num_experts=np.int64(2),
            checked=np.bool_(False))

    rows, sizes, row_map, q, scale = permute_fp8(np.zeros((0,)))
    expected_map = row_map_of(ids, 2)
    np.testing.assert_array_equal(np.asarray(row_map), expected_map)
    np.testing.assert_array_equal(np.asarray(sizes), [3, 2])
    expected_rows = np.zeros((6, 130), np.float32)
    for slot, row in enumerate(expected_map):
        if row >= 0:
            expected_rows[row] = np.asarray(x)[slot // 2]
    np.testing.assert_array_equal(np.asarray(rows), expected_rows)
    blocks = [expected_rows[:, :128], expected_rows[:, 128:]]
    amax = np.stack([np.abs(b).max(axis=1) for b in blocks], axis=1)
    want_scale = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)  # row 5 (dropped slot): 1
    back = np.asarray(q, np.float32) * np.repeat(want_scale, [128, 2], axis=1)
    np.testing.assert_allclose(back, expected_rows, rtol=2 ** -4, atol=2 ** -9 * want_scale.max())
    # A given scale (one element) for every block, the dropped slot's row's included: the codes
    # are the rows' over it, saturated at 448.
    given = np.float32(np.abs(expected_rows).max() / 448 / 2)
    rows, _, _, q, scale = permute_fp8([given])
    np.testing.assert_array_equal(np.asarray(rows), expected_rows)
    np.testing.assert_array_equal(np.asarray(scale), np.full((6, 2), given, np.float32))
    want_q = np.clip(expected_rows * (1 / given), -448, 448).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
    assert np.abs(np.asarray(q, np.float32)).max() == 448


def check_grouped_matmul_fp8_blockwise():
    # K = 144 (two k blocks, the second 16 deep), N = 8, groups of 2 and 1 rows of 4.
    rng = np.random.default_rng(7)
    lhs = rng.choice([-2.0, -0.5, 0.0, 1.0, 1.5], (4, 144)).astype(np.float32)
    rhs_t = rng.choice([-1.0, 0.25, 0.0, 3.0], (2, 8, 144)).astype(np.float32)
    lhs_scales = np.asarray([[1.0, 2.0], [0.5, 1.0], [4.0, 0.25], [1.0, 1.0]], np.float32)
    rhs_scales = np.asarray([[[2.0, 0.5]], [[1.0, 8.0]]], np.float32)
    out = ffi("nodrop_grouped_matmul_fp8_blockwise", jax.ShapeDtypeStruct((4, 8), jnp.bfloat16),
              jnp.asarray(lhs, jnp.float8_e4m3fn), jnp.asarray(lhs_scales),
              jnp.asarray(rhs_t, jnp.float8_e4m3fn), jnp.asarray(rhs_scales), int32([2, 1]),
              checked=np.bool_(False))
    lhs_dq = lhs * np.repeat(lhs_scales, 128, axis=1)[:, :144]
    rhs_dq = np.swapaxes(rhs_t * np.repeat(rhs_scales, 128, axis=2)[:, :, :144], 1, 2)
    want = numpy_grouped_matmul(lhs_dq.astype(np.float64), rhs_dq.astype(np.float64), [2, 1])
    np.testing.assert_allclose(as_f64(out), want, rtol=2 ** -8)
    assert not np.any(as_f64(out)[3])


def check_grouped_matmul_fp8_tensorwise():
    # K = 144, N = 8, groups of 2 and 1 rows of 4; one scale for lhs, one per expert; either
    # accumulation (the CPU engine's sums are float32 for both).
    rng = np.random.default_rng(9)
    lhs = rng.choice([-2.0, -0.5, 0.0, 1.0, 1.5], (4, 144)).astype(np.float32)
    rhs_t = rng.choice([-1.0, 0.25, 0.0, 3.0], (2, 8, 144)).astype(np.float32)
    lhs_scale, rhs_scales = np.asarray([0.5], np.float32), np.asarray([2.0, 0.125], np.float32)
    rhs_dq = np.swapaxes(rhs_t * rhs_scales[:, None, None], 1, 2)
    want = numpy_grouped_matmul(lhs.astype(np.float64) * lhs_scale[0], rhs_dq.astype(np.float64),
                                [2, 1])
    for fast_accumulation in (True, False):
        out = ffi("nodrop_grouped_matmul_fp8_tensorwise",
                  jax.ShapeDtypeStruct((4, 8), jnp.bfloat16),
                  jnp.asarray(lhs, jnp.float8_e4m3fn), jnp.asarray(lhs_scale),
                  jnp.asarray(rhs_t, jnp.float8_e4m3fn), jnp.asarray(rhs_scales), int32([2, 1]),
                  checked=np.bool_(False), fast_accumulation=np.bool_(fast_accumulation))
        np.testing.assert_allclose(as_f64(out), want, rtol=2 ** -8)
        assert not np.any(as_f64(out)[3])


def check_quantize_fp8_transposed():
    # Groups of 1 and 2 rows of 3: blocks 0 (row 0) and 1 (rows 1-2) of PB = 1 + 2; block 2 unused.
    x = np.asarray([[1.0, -2.0], [0.0, 448.0], [3.0, 0.0]], np.float32)
    q_t, scale = ffi("nodrop_quantize_fp8_transposed",
                     (jax.ShapeDtypeStruct((2, 384), jnp.float8_e4m3fn),
                      jax.ShapeDtypeStruct((3, 2), jnp.float32)),
                     jnp.asarray(x), int32([1, 2]), jnp.zeros((0,), jnp.float32),
                     checked=np.bool_(True))
    amax = np.stack([np.abs(x[:1]).max(axis=0), np.abs(x[1:]).max(axis=0), [0, 0]])
    want_scale = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    back = np.asarray(q_t, np.float32) * np.repeat(want_scale.T, 128, axis=1)
    want = np.zeros((2, 384), np.float32)
    want[:, 0], want[:, 128:130] = x[0], x[1:].T
    np.testing.assert_allclose(back, want, rtol=2 ** -4)
    # A given scale (one element) for every block, unused ones included: under 0.5 the codes
    # are 2x exactly, and 448 saturates (896 -> 448, back to 224).
    q_t, scale = ffi("nodrop_quantize_fp8_transposed",
                     (jax.ShapeDtypeStruct((2, 384), jnp.float8_e4m3fn),
                      jax.ShapeDtypeStruct((3, 2), jnp.float32)),
                     jnp.asarray(x), int32([1, 2]), jnp.asarray([0.5], jnp.float32),
                     checked=np.bool_(True))
    np.testing.assert_array_equal(np.asarray(scale), np.full((3, 2), 0.5, np.float32))
    want[1, 128] = 224
    np.testing.assert_array_equal(np.asarray(q_t, np.float32) * 0.5, want)


def check_transpose_fp8_codes():
    # Groups of 1 and 2 rows of 3, as check_quantize_fp8_transposed: row 0 in block 0, rows 1-2
    # in block 1 of PB = 1 + 2; every other byte zero.
    codes = np.asarray([[1.0, -2.0], [0.0, 448.0], [3.0, 0.5]], np.float32)
    q_t = ffi("nodrop_transpose_fp8_codes", jax.ShapeDtypeStruct((2, 384), jnp.float8_e4m3fn),
              jnp.asarray(codes, jnp.float8_e4m3fn), int32([1, 2]), checked=np.bool_(True))
    want = np.zeros((2, 384), np.float32)
    want[:, 0], want[:, 128:130] = codes[0], codes[1:].T
    np.testing.assert_array_equal(np.asarray(q_t, np.float32), want)


def check_quantize_fp8_weights(transposed=False):
    # Two experts' w [3, 130] (K = 3, N = 130): blocks (k 0-2, n 0-127) and (k 0-2, n 128-129),
    # so scale [2, 1, 2] (transposed [2, 2, 1]); expert 1's second block is all zero (scale 1).
    # q [G, K, N] is w's layout, q_t [G, N, K] each expert's w.T: `layout` maps either way.
    w = np.zeros((2, 3, 130), np.float32)
    w[0, :, :2] = [[1.0, -2.0], [0.0, 448.0], [3.0, 0.0]]
    w[0, 1, 129] = 7.0
    w[1, :, :2] = [[0.5, 0.25], [-1.0, 0.0], [0.0, 0.125]]
    layout = (lambda a: np.swapaxes(a, 1, 2)) if transposed else (lambda a: a)
    target = "nodrop_quantize_fp8_weights" + ("_transposed" if transposed else "")

    def quantize(given_scale, q_shape=layout(w).shape,
                 scale_shape=layout(np.empty((2, 1, 2))).shape):
        q, scale = ffi(target, (jax.ShapeDtypeStruct(q_shape, jnp.float8_e4m3fn),
                                jax.ShapeDtypeStruct(scale_shape, jnp.float32)),
                       jnp.asarray(w), jnp.asarray(given_scale, jnp.float32))
        return layout(np.asarray(q, np.float32)), layout(np.asarray(scale))  # in w's layout

    q, scale = quantize(np.zeros((0,)))
    amax = np.asarray([[448.0, 7.0], [1.0, 0.0]], np.float32)  # [G, NB]
    block_scale = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
    np.testing.assert_array_equal(scale, block_scale[:, None, :])
    assert block_scale[0, 0] == 1  # 448 * float32(1 / 448): expert 0's first codes are w exactly
    np.testing.assert_array_equal(q[0, :, :2], w[0, :, :2])
    per_column = np.repeat(block_scale, 128, axis=1)[:, None, :130]  # [G, 1, N]
    want_q = np.clip(w * (np.float32(1) / per_column), -448, 448).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(q, np.asarray(want_q, np.float32))
    np.testing.assert_allclose(q * per_column, w, rtol=2 ** -4)
    # A given scale per expert (0.5 and 0.25) for all of its blocks: the codes are 2x and 4x the
    # weights exactly, and expert 0's 448 saturates (896 -> 448, back to 224).
    given = np.asarray([0.5, 0.25], np.float32)
    q, scale = quantize(given)
    np.testing.assert_array_equal(scale, np.broadcast_to(given[:, None, None], (2, 1, 2)))
    want = w.copy()
    want[0, 1, 1] = 224
    np.testing.assert_array_equal(q * given[:, None, None], want)
    # given_scale of neither 0 nor G elements, and codes or scales in the other layout: errors
    # that name them.
    with pytest.raises(JaxRuntimeError, match=re.escape(
            "given_scale must hold 0 or G = 2 elements, got 1")):
        quantize(given[:1])
    with pytest.raises(JaxRuntimeError, match=r"\bq_t has " if transposed else r"\bq has "):
        quantize(given, q_shape=np.swapaxes(layout(w), 1, 2).shape)
    with pytest.raises(JaxRuntimeError, match=r"\bscale has "):
        quantize(given, scale_shape=np.swapaxes(layout(np.empty((2, 1, 2))), 1, 2).shape)


def check_quantize_fp8_weights_transposed():
    check_quantize_fp8_weights(transposed=True)


def check_grouped_matmul_fp8_blockwise_contract():
    # M = 3 rows in groups of 1 and 2: columns 0 and 128-129 of P = 128 * (1 + 2); K = 2, N = 8.
    rng = np.random.default_rng(8)
    lhs_t = np.zeros((2, 384), np.float32)
    rhs_t = np.zeros((8, 384), np.float32)
    for t in (lhs_t, rhs_t):
        t[:, [0, 128, 129]] = rng.choice([-2.0, -0.5, 1.0, 1.5, 3.0], (t.shape[0], 3))
    lhs_scales = np.asarray([[1.0, 2.0], [0.5, 4.0], [1.0, 1.0]], np.float32)
    rhs_scales = rng.choice([0.25, 1.0, 2.0], (3, 8)).astype(np.float32)
    out = ffi("nodrop_grouped_matmul_fp8_blockwise_contract",
              jax.ShapeDtypeStruct((2, 2, 8), jnp.bfloat16),
              jnp.asarray(lhs_t, jnp.float8_e4m3fn), jnp.asarray(lhs_scales),
              jnp.asarray(rhs_t, jnp.float8_e4m3fn), jnp.asarray(rhs_scales), int32([1, 2]),
              num_rows=np.int64(3), checked=np.bool_(False))
    lhs_dq = lhs_t * np.repeat(lhs_scales.T, 128, axis=1)
    rhs_dq = rhs_t * np.repeat(rhs_scales.T, 128, axis=1)
    want = np.stack([lhs_dq[:, :1] @ rhs_dq[:, :1].T, lhs_dq[:, 128:130] @ rhs_dq[:, 128:130].T])
    np.testing.assert_allclose(as_f64(out), want, rtol=2 ** -8)


def check_grouped_matmul_fp8_tensorwise_contract():
    # The blockwise contraction's layout (M = 3 rows in groups of 1 and 2, K = 2, N = 8) with
    # one scale per operand, and an empty third group: zeros.
    rng = np.random.default_rng(10)
    lhs_t = np.zeros((2, 512), np.float32)
    rhs_t = np.zeros((8, 512), np.float32)
    for t in (lhs_t, rhs_t):
        t[:, [0, 128, 129]] = rng.choice([-2.0, -0.5, 1.0, 1.5, 3.0], (t.shape[0], 3))
    lhs_scale, rhs_scale = np.asarray([0.5], np.float32), np.asarray([4.0], np.float32)
    want = 2.0 * np.stack([lhs_t[:, :1] @ rhs_t[:, :1].T, lhs_t[:, 128:130] @ rhs_t[:, 128:130].T,
                           np.zeros((2, 8))])
    for fast_accumulation in (True, False):
        out = ffi("nodrop_grouped_matmul_fp8_tensorwise_contract",
                  jax.ShapeDtypeStruct((3, 2, 8), jnp.bfloat16),
                  jnp.asarray(lhs_t, jnp.float8_e4m3fn), jnp.asarray(lhs_scale),
                  jnp.asarray(rhs_t, jnp.float8_e4m3fn), jnp.asarray(rhs_scale), int32([1, 2, 0]),
                  num_rows=np.int64(3), checked=np.bool_(True),
                  fast_accumulation=np.bool_(fast_accumulation))
        np.testing.assert_allclose(as_f64(out), want, rtol=2 ** -8)


def check_adamw_update():
    # Two elements in two chunks of 4 (the second empty); step 1, no decay, no clip: the step is
    # step_size * g / (|g| + eps).
    param, grad = np.asarray([1.0, -2.0], np.float32), np.asarray([0.5, -4.0], np.float32)
    zeros = np.zeros(2, np.float32)
    like = jax.ShapeDtypeStruct((2,), jnp.float32)
    new_param, mu, nu, partials = ffi(
        "nodrop_adamw_update", (like, like, like, jax.ShapeDtypeStruct((2, 5), jnp.float32)),
        param, grad, zeros, zeros, np.asarray([-0.1, 0.0, 0.1, 0.05], np.float32),
        b1=np.float32(0.9), b2=np.float32(0.95), eps=np.float32(0.0),
        weight_decay=np.float32(0.0), update_scale=np.float32(1.0),
        max_grad_norm=np.float32(0.0))
    np.testing.assert_allclose(np.asarray(new_param), [0.9, -1.9], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mu), 0.1 * grad, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nu), 0.05 * grad ** 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(partials)[:, 0], [0.02, 0.0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(partials)[:, 3:], 0)


CHECKS = {
    "nodrop_adamw_update": check_adamw_update,
    "nodrop_grouped_matmul": check_grouped_matmul,
    "nodrop_grouped_matmul_contract": check_grouped_matmul_contract,
    "nodrop_permute": check_permute,
    "nodrop_permute_rows": check_permute_rows,
    "nodrop_unpermute": check_unpermute,
    "nodrop_gather_row_dots": check_gather_row_dots,
    "nodrop_topk_router": check_topk_router,
    "nodrop_topk_router_grad": check_topk_router_grad,
    "nodrop_quantize_fp8": check_quantize_fp8,
    "nodrop_permute_fp8": check_permute_fp8,
    "nodrop_grouped_matmul_fp8_blockwise": check_grouped_matmul_fp8_blockwise,
    "nodrop_grouped_matmul_fp8_tensorwise": check_grouped_matmul_fp8_tensorwise,
    "nodrop_quantize_fp8_transposed": check_quantize_fp8_transposed,
    "nodrop_transpose_fp8_codes": check_transpose_fp8_codes,
    "nodrop_quantize_fp8_weights": check_quantize_fp8_weights,
    "nodrop_quantize_fp8_weights_transposed": check_quantize_fp8_weights_transposed,
    "nodrop_grouped_matmul_fp8_blockwise_contract": check_grouped_matmul_fp8_blockwise_contract,
    "nodrop_grouped_matmul_fp8_tensorwise_contract":
        check_grouped_matmul_fp8_tensorwise_contract,
}


@pytest.mark.parametrize("target", sorted(_ffi.CPU_TARGETS))
def test_registered_target_runs_through_ffi_call(target):
    assert target in CHECKS, f"no direct call written for the registered target {target}"
    CALLED.discard(target)
    CHECKS[target]()
    assert target in CALLED


def test_every_registered_target_is_called():
    CALLED.clear()
    for check in CHECKS.values():
        check()
    assert CALLED == set(_ffi.CPU_TARGETS)


def test_ops_and_their_gradients_lower_to_every_registered_target():
    """The gradient of a MoE layer (router, permute, grouped matmuls, unpermute) lowers to a
    custom call of each registered target, and XLA compiles and runs it."""
    rng = np.random.default_rng(6)
    x = random_normal(rng, (8, 4))
    params = tuple(p[0] for p in moe_params(rng, layers=1, hidden=4, ffn=3, experts=4))

    def loss(x, params):
        return jnp.sum(moe_layer(nodrop, x, params, k=2) ** 2)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    lowered = grad_fn.lower(x, params).as_text()
    # Every target but the FP8 recipes' (test_fp8.py lowers those) and the optimizer's.
    assert set(re.findall(r"custom_call @(nodrop_\w+)", lowered)) == set(_ffi.CPU_TARGETS) - {
        "nodrop_adamw_update", "nodrop_quantize_fp8", "nodrop_permute_fp8",
        "nodrop_grouped_matmul_fp8_blockwise", "nodrop_grouped_matmul_fp8_tensorwise",
        "nodrop_quantize_fp8_transposed", "nodrop_transpose_fp8_codes",
        "nodrop_quantize_fp8_weights", "nodrop_quantize_fp8_weights_transposed",
        "nodrop_grouped_matmul_fp8_blockwise_contract",
        "nodrop_grouped_matmul_fp8_tensorwise_contract"}
    grads = jax.block_until_ready(grad_fn(x, params))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
