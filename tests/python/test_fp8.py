"""The FP8 recipes' emulation (nodrop/ops/fp8.py): E4M3 quantisation, fp8_grouped_matmul against
the reference on explicitly dequantised operands, its gradients against the recipes' formulas,
the transforms, MoEBlock and the trainer with fp8 set, bad input."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (F32_TOL, as_f64, assert_close, f64, group_offsets, int32,
                      invalid_group_sizes, needs_train, numpy_quantize_transposed,
                      random_normal, relative_error, seeds, valid_group_sizes)
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import nodrop
from nodrop.models import ModelConfig
from nodrop.moe import MoEBlock, MoEConfig
from nodrop.ops import fp8, reference
from nodrop.ops.grouped_matmul import grouped_matmul

E4M3_EPS = 2.0 ** -4  # half the spacing of E4M3's 3 mantissa bits, relative
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # E4M3's subnormal spacing (times the scale)
RECIPES = pytest.mark.parametrize("recipe", fp8.RECIPES)

# name -> (M, K, N, group_sizes): K and N span one full and one short 128-block.
CASES = {
    "unaligned_groups_and_rows_past_them": (330, 200, 136, [130, 0, 100, 50]),
    "all_rows_in_one_group": (300, 200, 136, [0, 300, 0]),
    "empty_groups": (40, 200, 136, [0, 0, 0]),
    "aligned": (256, 128, 128, [128, 128]),
}


@functools.partial(jax.jit, static_argnums=1)  # one compilation per shape, not one per op
def qdq(x, block):
    return fp8.dequantize(*fp8.quantize(x, block), block)


def within_groups(x, sizes):
    """x with the rows past the groups zeroed (fp8_grouped_matmul's scales never see them)."""
    return jnp.where((jnp.arange(x.shape[0]) < sum(sizes))[:, None], x, 0)


def assert_within_e4m3(x, block):
    """Every element of qdq(x) within E4M3's rounding of x / scale: 2^-4 relative for normal
    values, half a subnormal step below them; each block's amax maps onto +-448."""
    q, scale = fp8.quantize(x, block)
    back = as_f64(fp8.dequantize(q, scale, block))
    full = as_f64(fp8._expand(scale, block, x.shape)) * np.ones(x.shape)
    x = as_f64(x)
    bound = np.maximum(E4M3_EPS * np.abs(x), E4M3_SUBNORMAL_STEP / 2 * full) * (1 + 1e-6)
    assert np.all(np.abs(back - x) <= bound), np.max(np.abs(back - x) / bound)
    assert float(np.max(np.abs(as_f64(q)))) == fp8.E4M3_MAX


# --- quantisation ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape, block, scales", [
    ((5, 300), fp8.ACTIVATION_BLOCK, (5, 3)),
    ((3, 130, 300), fp8.WEIGHT_BLOCK, (3, 2, 3)),
    ((300, 7), fp8.WGRAD_BLOCK, (3, 7)),
    ((3, 130, 300), "tensor", (3, 1, 1)),
])
def test_round_trip_is_within_e4m3_bounds(shape, block, scales):
    # Magnitudes over eight decades, so blocks hold E4M3's subnormals too.
    rng = np.random.default_rng(0)
    x = random_normal(rng, shape) * jnp.asarray(10.0 ** rng.uniform(-4, 4, shape), jnp.float32)
    q, scale = fp8.quantize(x, block)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == shape
    assert scale.dtype == jnp.float32 and scale.shape == scales
    assert_within_e4m3(x, block)


def test_a_short_last_block_has_its_own_scale():
    x = jnp.concatenate([jnp.full((2, 256), 1000.0, jnp.float32),
                         jnp.full((2, 44), 1e-3, jnp.float32)], axis=1)
    q, scale = fp8.quantize(x, fp8.ACTIVATION_BLOCK)
    np.testing.assert_allclose(scale, [[1000 / 448, 1000 / 448, 1e-3 / 448]] * 2, rtol=1e-6)
    np.testing.assert_allclose(fp8.dequantize(q, scale, fp8.ACTIVATION_BLOCK), x, rtol=1e-6)


@pytest.mark.parametrize("block", [fp8.ACTIVATION_BLOCK, fp8.WEIGHT_BLOCK, "tensor"])
def test_an_all_zero_block_has_scale_one_and_zeros(block):
    x = jnp.zeros((130, 260), jnp.float32).at[0, 0].set(3.0)
    q, scale = fp8.quantize(x, block)
    zero_blocks = np.ones(scale.shape, bool)
    zero_blocks[0, 0] = False
    assert np.all(np.asarray(scale)[zero_blocks] == 1.0)
    assert scale[0, 0] == np.float32(3) * np.float32(1 / 448)  # amax times 1/448 in float32
    back = fp8.dequantize(q, scale, block)
    assert float(back[0, 0]) == pytest.approx(3.0, rel=1e-6)
    assert np.count_nonzero(np.asarray(back)) == 1
    q, scale = fp8.quantize(jnp.zeros((4, 4), jnp.float32), block)
    assert np.all(np.asarray(scale) == 1.0) and not np.any(np.asarray(q, np.float32))


@pytest.mark.parametrize("block", [fp8.ACTIVATION_BLOCK, fp8.WEIGHT_BLOCK, "tensor"])
def test_a_block_too_small_for_a_normal_scale_has_scale_one_and_no_nan(block):
    # amax / 448 under float32's smallest normal number: a subnormal scale's reciprocal would be
    # inf, and its zeros NaN.
    x = jnp.zeros((130, 260), jnp.float32).at[0, :5].set([1e-37, -2e-37, 0.0, 3e-38, 1e-36])
    q, scale = fp8.quantize(x, block)
    assert np.all(np.asarray(scale) == 1.0)
    np.testing.assert_array_equal(np.abs(np.asarray(q, np.float32)), 0.0)
    assert np.signbit(np.asarray(q, np.float32)[0, 1])  # -2e-37 rounds to -0
    if block == fp8.ACTIVATION_BLOCK:  # the engine's quantiser, bitwise
        engine_q, engine_scale = fp8.quantize_rows(x)
        np.testing.assert_array_equal(np.asarray(engine_scale), np.asarray(scale))
        np.testing.assert_array_equal(np.asarray(engine_q).view(np.uint8),
                                      np.asarray(q).view(np.uint8))


def test_values_past_the_scale_saturate_instead_of_becoming_nan():
    x = jnp.asarray([[1.0, -1.0, 0.5, 1e30, -jnp.finfo(jnp.float32).max]], jnp.float32)
    q, _ = fp8.quantize(x, fp8.ACTIVATION_BLOCK, scale=jnp.full((1, 1), 1e-3, jnp.float32))
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[448, -448, 448, 448, -448]])
    # Without a given scale the amax maps onto 448 exactly, whatever the float32 division does.
    q, _ = fp8.quantize(jnp.asarray([[3.0, 7.0, -7.0]], jnp.float32), fp8.ACTIVATION_BLOCK)
    np.testing.assert_array_equal(np.asarray(q, np.float32)[0, 1:], [448, -448])


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_a_non_finite_value_makes_its_block_nan_and_only_it(bad):
    x = jnp.ones((2, 256), jnp.float32).at[0, 5].set(bad)
    q, scale = fp8.quantize(x, fp8.ACTIVATION_BLOCK)
    finite = np.asarray(scale)[[0, 1, 1], [1, 0, 1]]
    assert np.isnan(scale[0, 0]) and finite == pytest.approx([1 / 448] * 3, rel=1e-6)
    back = np.asarray(fp8.dequantize(q, scale, fp8.ACTIVATION_BLOCK))
    assert np.all(np.isnan(back[0, :128])) and np.all(back[0, 128:] == 1) and np.all(back[1] == 1)
    # The weight gradient's blocks of 128 rows within a group follow the same rule.
    back = np.asarray(fp8._qdq_group_rows(x.T, int32([150, 106]), "blockwise"))
    assert np.all(np.isnan(back[:128, 0])) and np.all(back[128:, 0] == 1)
    assert np.all(back[:, 1] == 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_nan_reaches_its_block_scale_whatever_the_shape(dtype):
    """At [37, 300] XLA's CPU max reduction returned a finite amax for a block holding a NaN
    (the scale was 0.0156): finiteness is counted apart from the amax."""
    x = jax.random.normal(jax.random.key(0), (37, 300), dtype).at[5, 200].set(jnp.nan)
    for quantize in (fp8.quantize, jax.jit(fp8.quantize, static_argnums=1)):
        scale = np.asarray(quantize(x, fp8.ACTIVATION_BLOCK)[1])
        assert np.isnan(scale[5, 1]) and np.isfinite(np.delete(scale.ravel(), 5 * 3 + 1)).all()
    back = np.asarray(fp8._qdq_group_rows(x, int32([3, 30, 4]), "blockwise"))
    assert np.isnan(back[3:33, 200]).all() and np.isfinite(np.delete(back, 200, axis=1)).all()


def test_quantize_under_jit_is_bitwise_the_eager_one():
    """Data on which x / scale, rewritten by XLA under jit as x * (1 / scale), rounded one
    element to the other side of an E4M3 tie."""
    x = operands(*CASES["aligned"])[2][128:]
    for block in (fp8.WGRAD_BLOCK, fp8.ACTIVATION_BLOCK, "tensor"):
        eager = fp8.quantize(x, block)
        jitted = jax.jit(fp8.quantize, static_argnums=1)(x, block)
        for a, b in zip(eager, jitted):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_dequantize_returns_the_dtype_asked_for():
    q, scale = fp8.quantize(jnp.ones((2, 3), jnp.bfloat16), "tensor")
    assert fp8.dequantize(q, scale, "tensor", jnp.bfloat16).dtype == jnp.bfloat16
    assert fp8.dequantize(q, scale, "tensor").dtype == jnp.float32


# --- fp8_grouped_matmul: forward -------------------------------------------------------------


def operands(m, k, n, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return (random_normal(rng, (m, k)), random_normal(rng, (len(sizes), k, n)),
            random_normal(rng, (m, n)))


def blocks_of(recipe):
    return ((fp8.ACTIVATION_BLOCK, fp8.WEIGHT_BLOCK) if recipe == "blockwise"
            else ("tensor", "tensor"))


@RECIPES
@pytest.mark.parametrize("case", list(CASES))
def test_forward_is_the_matmul_of_the_dequantised_operands(case, recipe):
    m, k, n, sizes = CASES[case]
    lhs, rhs, _ = operands(m, k, n, sizes)
    lhs = lhs.at[sum(sizes):].set(jnp.nan)  # rows past the groups take no part, even NaN
    out = nodrop.fp8_grouped_matmul(lhs, rhs, int32(sizes), recipe=recipe)
    rows_block, weights_block = blocks_of(recipe)
    expected = reference.grouped_matmul(qdq(within_groups(lhs, sizes), rows_block),
                                        qdq(rhs, weights_block), int32(sizes))
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert_close(out, expected, F32_TOL)
    assert not np.any(np.asarray(out[sum(sizes):]))
    # and it is close to the unquantised product: E4M3's rounding of two operands
    exact = reference.grouped_matmul(within_groups(lhs, sizes), rhs, int32(sizes))
    assert relative_error(out, exact, floor=1.0) < 0.1


@pytest.mark.parametrize("matmul", [reference.grouped_matmul, jax.lax.ragged_dot],
                         ids=["reference", "ragged_dot"])
def test_forward_on_any_grouped_matmul(matmul):
    m, k, n, sizes = CASES["unaligned_groups_and_rows_past_them"]
    lhs, rhs, _ = operands(m, k, n, sizes)
    expected = nodrop.fp8_grouped_matmul(lhs, rhs, int32(sizes))
    assert_close(nodrop.fp8_grouped_matmul(lhs, rhs, int32(sizes), matmul=matmul), expected,
                 F32_TOL)


def test_output_in_lhs_dtype():
    m, k, n, sizes = CASES["aligned"]
    lhs, rhs, _ = operands(m, k, n, sizes)
    out = nodrop.fp8_grouped_matmul(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16),
                                    int32(sizes))
    assert out.dtype == jnp.bfloat16
    grads = jax.grad(lambda a, b: nodrop.fp8_grouped_matmul(a, b, int32(sizes)).astype(
        jnp.float32).sum(), (0, 1))(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16))
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


# --- gradients -------------------------------------------------------------------------------


def expected_grads(lhs, rhs, dout, sizes, recipe):
    """The recipe's formulas, written out: dlhs = qdq(dout) @ qdq(rhs)^T along N; drhs[g] =
    qdq(lhs_g)^T @ qdq(dout_g), quantised per group in blocks of 128 rows (blockwise)."""
    rows_block, weights_block = blocks_of(recipe)
    lhs, dout = within_groups(lhs, sizes), within_groups(dout, sizes)
    dlhs = reference.grouped_matmul(qdq(dout, rows_block),
                                    jnp.swapaxes(qdq(rhs, weights_block), 1, 2), int32(sizes))
    if recipe == "tensorwise":
        lhs, dout = qdq(lhs, "tensor"), qdq(dout, "tensor")
    ends = np.cumsum(sizes)
    drhs = []
    for start, end in zip(ends - sizes, ends):
        a, b = lhs[start:end], dout[start:end]
        if recipe == "blockwise" and end > start:  # each group's rows on their own
            a, b = qdq(a, fp8.WGRAD_BLOCK), qdq(b, fp8.WGRAD_BLOCK)
        drhs.append(jnp.dot(a.T, b, precision=jax.lax.Precision.HIGHEST))
    return dlhs, jnp.stack(drhs)


@RECIPES
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_follow_the_recipe(case, recipe):
    m, k, n, sizes = CASES[case]
    lhs, rhs, dout = operands(m, k, n, sizes)
    # Jitted: one compilation instead of one per op (eager gradients: the transforms' test).
    dlhs, drhs = jax.jit(lambda a, b, d: jax.vjp(
        lambda a, b: nodrop.fp8_grouped_matmul(a, b, int32(sizes), recipe=recipe), a, b)[1](d))(
        lhs, rhs, dout)
    expected_dlhs, expected_drhs = expected_grads(lhs, rhs, dout, sizes, recipe)
    assert_close(dlhs, expected_dlhs, F32_TOL, "dlhs")
    assert_close(drhs, expected_drhs, F32_TOL, "drhs")
    assert not np.any(np.asarray(dlhs[sum(sizes):]))
    for g, size in enumerate(sizes):
        if size == 0:
            assert not np.any(np.asarray(drhs[g])), f"empty group {g}'s gradient is not zero"


PROPERTY_SHAPE = (300, 136, 24, 4)  # M, K, N, G: one shape, so each side compiles once


@jax.jit
def blockwise_by_masks(lhs, rhs, dout, sizes):
    """The blockwise recipe's output and gradients another way: each group's rows masked and
    rolled to row 0, so that plain WGRAD_BLOCK blocks start at its first row."""
    rows = jnp.arange(lhs.shape[0])
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(sizes.astype(jnp.int64), 0)), lhs.shape[0])
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    lhs, dout = (jnp.where((rows < ends[-1])[:, None], x, 0) for x in (lhs, dout))
    rhs_q = qdq(rhs, fp8.WEIGHT_BLOCK)
    out = reference.grouped_matmul(qdq(lhs, fp8.ACTIVATION_BLOCK), rhs_q, sizes)
    dlhs = reference.grouped_matmul(qdq(dout, fp8.ACTIVATION_BLOCK), jnp.swapaxes(rhs_q, 1, 2),
                                    sizes)
    drhs = []
    for start, end in zip(starts, ends):
        mask = ((rows >= start) & (rows < end))[:, None]
        a, b = (qdq(jnp.roll(jnp.where(mask, x, 0), -start, axis=0), fp8.WGRAD_BLOCK)
                for x in (lhs, dout))
        drhs.append(jnp.dot(a.T, b, precision=jax.lax.Precision.HIGHEST))
    return out, dlhs, jnp.stack(drhs)


@jax.jit
def fp8_and_grads(lhs, rhs, dout, sizes):
    out, vjp = jax.vjp(lambda a, b: nodrop.fp8_grouped_matmul(a, b, sizes), lhs, rhs)
    return out, *vjp(dout)


@settings(max_examples=30)
@given(sizes=st.one_of(valid_group_sizes(PROPERTY_SHAPE[0], PROPERTY_SHAPE[3]),
                       invalid_group_sizes(PROPERTY_SHAPE[0], PROPERTY_SHAPE[3])),
       seed=seeds)
def test_property_blockwise_matches_the_masked_formulation(sizes, seed):
    """Any group sizes, invalid ones included (clamped as the engine clamps them)."""
    m, k, n, g = PROPERTY_SHAPE
    lhs, rhs, dout = operands(m, k, n, [0] * g, seed)
    got = fp8_and_grads(lhs, rhs, dout, int32(sizes))
    expected = blockwise_by_masks(lhs, rhs, dout, int32(sizes))
    for name, a, b in zip(("out", "dlhs", "drhs"), got, expected):
        assert_close(a, b, F32_TOL, name)
    total = group_offsets(sizes, m)[-1]
    assert not np.any(np.asarray(got[0][total:])) and not np.any(np.asarray(got[1][total:]))


@RECIPES
def test_grad_runs_nodrops_three_kernels(recipe):
    """The backward takes nodrop's own transposes: the input gradient is the grouped matmul
    against rhs[g].T and the weight gradient the ragged contraction, one call each."""
    m, k, n, sizes = CASES["unaligned_groups_and_rows_past_them"]
    lhs, rhs, _ = operands(m, k, n, sizes)
    nonlinear = lambda a, b: jnp.sum(jnp.sin(  # noqa: E731  (keeps the forward's output used)
        nodrop.fp8_grouped_matmul(a, b, int32(sizes), recipe=recipe)))
    hlo = jax.jit(jax.grad(nonlinear, (0, 1))).lower(lhs, rhs).compile().as_text()
    calls = {target: hlo.count(f'custom_call_target="{target}"')
             for target in ("nodrop_grouped_matmul", "nodrop_grouped_matmul_contract")}
    assert calls == {"nodrop_grouped_matmul": 2, "nodrop_grouped_matmul_contract": 1}


def test_blockwise_weight_gradient_blocks_restart_at_each_group():
    """Blocks that crossed the boundary between groups 0 and 1 would give group 1's first rows
    group 0's large scale, flushing them to zero."""
    sizes = [100, 60]
    lhs = jnp.concatenate([jnp.full((100, 1), 1e4), jnp.full((60, 1), 1e-3)]).astype(jnp.float32)
    rhs = jnp.ones((2, 1, 1), jnp.float32)
    _, vjp = jax.vjp(lambda b: nodrop.fp8_grouped_matmul(lhs, b, int32(sizes)), rhs)
    drhs, = vjp(jnp.ones((160, 1), jnp.float32))
    np.testing.assert_allclose(drhs[:, 0, 0], [100 * 1e4, 60 * 1e-3], rtol=1e-6)


def loss(lhs, rhs, sizes, dout):
    return jnp.sum(nodrop.fp8_grouped_matmul(lhs, rhs, sizes) * dout)


def test_jit_grad_remat_and_scan_give_the_eager_gradients():
    m, k, n, sizes = CASES["unaligned_groups_and_rows_past_them"]
    lhs, rhs, dout = operands(m, k, n, sizes)
    sizes = int32(sizes)
    eager = jax.grad(loss, (0, 1))(lhs, rhs, sizes, dout)
    for name, fn in [("jit", jax.jit(jax.grad(loss, (0, 1)))),
                     ("remat", jax.jit(jax.grad(jax.checkpoint(loss), (0, 1))))]:
        for got, want in zip(fn(lhs, rhs, sizes, dout), eager):
            assert_close(got, want, F32_TOL, name)

    def scanned(lhs, rhs):  # the same layer twice: the gradient is twice the one layer's
        def body(total, weights):
            return total + loss(lhs, weights, sizes, dout), None
        return jax.lax.scan(body, jnp.float32(0), jnp.stack([rhs, rhs]))[0]

    dlhs, drhs = jax.jit(jax.grad(scanned, (0, 1)))(lhs, rhs)
    assert_close(dlhs, 2 * eager[0], F32_TOL, "scan dlhs")
    assert_close(drhs, 2 * eager[1], F32_TOL, "scan drhs")


# --- the MoE block and the trainer -----------------------------------------------------------


BLOCK = MoEConfig(num_experts=4, k=2, hidden=160, ffn=136, renormalize=True, dtype=jnp.float32)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_moe_block_with_fp8_is_close_to_without(capacity_factor):
    x = random_normal(np.random.default_rng(1), (2, 96, BLOCK.hidden))
    config = dataclasses.replace(BLOCK, capacity_factor=capacity_factor)
    outputs, grads = {}, {}
    for recipe in ("off", *fp8.RECIPES):
        block = MoEBlock(dataclasses.replace(config, fp8=recipe), rngs=nnx.Rngs(0))
        outputs[recipe] = nnx.jit(lambda b: b(x)[0])(block)
        grads[recipe] = nnx.jit(nnx.grad(lambda b: jnp.sum(b(x)[0] ** 2)))(block)
    for recipe in fp8.RECIPES:
        # Four E4M3 roundings (x, gate_up, the hidden rows, down), each up to 2^-4 relative.
        err = float(jnp.linalg.norm(outputs[recipe] - outputs["off"])
                    / jnp.linalg.norm(outputs["off"]))
        assert 0 < err < 0.1, (recipe, err)
        for name in ("gate_up", "down", "router"):
            got, want = grads[recipe][name][...], grads["off"][name][...]
            err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            assert err < 0.15, (recipe, name, err)


@pytest.mark.parametrize("recipe, quantisers", [("blockwise", ((1, 1), (0, 2))),
                                                ("tensorwise", ((1, 0), (0, 0)))])
def test_the_fp8_moe_block_permutes_and_quantises_in_one_call(monkeypatch, recipe, quantisers):
    """With either recipe the dropless block permutes with permute_fp8 (the tensorwise one with
    the tokens' scale given) and its first expert matmul reads those codes: outputs and
    gradients bitwise those of permute followed by the matmul's own quantisation of the rows
    (the tensorwise one's in XLA, over the rows)."""
    from nodrop.moe import block as block_module
    x = random_normal(np.random.default_rng(3), (2, 48, BLOCK.hidden))
    model = MoEBlock(dataclasses.replace(BLOCK, fp8=recipe), rngs=nnx.Rngs(0))

    def run():
        forward = nnx.jit(lambda b: b(x)[0])
        text = jax.jit(lambda: model(x)[0]).lower().as_text()
        return (forward(model), nnx.jit(nnx.grad(lambda b: jnp.sum(b(x)[0] ** 2)))(model),
                text.count("custom_call @nodrop_permute_fp8("),
                text.count("custom_call @nodrop_quantize_fp8("))

    fused = run()
    monkeypatch.setattr(block_module, "_permute", lambda cfg, tokens, ids, experts: (
        *nodrop.permute(tokens, ids, experts), None))
    unfused = run()
    # (permute_fp8, quantize_fp8) calls: the blockwise hidden rows are quantised alone
    assert (fused[2:], unfused[2:]) == quantisers
    np.testing.assert_array_equal(fused[0], unfused[0])
    for name in ("gate_up", "down", "router"):
        np.testing.assert_array_equal(fused[1][name][...], unfused[1][name][...], err_msg=name)


def test_moe_block_with_unquantised_weight_gradients():
    """fp8_weight_gradient="unquantised" changes only the experts' weight gradients: the output
    and the router's gradient are bitwise the FP8 ones, the experts' weight gradients closer to
    the unquantised block's."""
    x = random_normal(np.random.default_rng(2), (2, 96, BLOCK.hidden))
    outputs, grads = {}, {}
    for fp8_mode, weight_gradient in [("off", "fp8"), ("blockwise", "fp8"),
                                      ("blockwise", "unquantised")]:
        block = MoEBlock(dataclasses.replace(BLOCK, fp8=fp8_mode,
                                             fp8_weight_gradient=weight_gradient),
                         rngs=nnx.Rngs(0))
        key = fp8_mode, weight_gradient
        outputs[key] = nnx.jit(lambda b: b(x)[0])(block)
        grads[key] = nnx.jit(nnx.grad(lambda b: jnp.sum(b(x)[0] ** 2)))(block)
    fp8_run, unquantised_run, off = (("blockwise", "fp8"), ("blockwise", "unquantised"),
                                     ("off", "fp8"))
    np.testing.assert_array_equal(outputs[unquantised_run], outputs[fp8_run])
    np.testing.assert_array_equal(grads[unquantised_run]["router"][...],
                                  grads[fp8_run]["router"][...])
    for name in ("gate_up", "down"):
        want = grads[off][name][...]
        errors = [float(jnp.linalg.norm(grads[run][name][...] - want) / jnp.linalg.norm(want))
                  for run in (unquantised_run, fp8_run)]
        assert 0 < errors[0] < errors[1], (name, errors)


def test_fp8_outside_the_recipes_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^MoEConfig\.fp8 must be one of \('off', 'blockwise', "
                                         r"'tensorwise'\), got 'fp16'$"):
        dataclasses.replace(BLOCK, fp8="fp16")
    with pytest.raises(ValueError, match=r"^ModelConfig\.fp8 must be one of .*got 'e5m2'$"):
        ModelConfig(fp8="e5m2")
    with pytest.raises(ValueError, match=r"^MoEConfig\.fp8_weight_gradient must be one of "
                                         r"\('fp8', 'unquantised'\), got 'bf16'$"):
        dataclasses.replace(BLOCK, fp8_weight_gradient="bf16")
    with pytest.raises(ValueError, match=r"^ModelConfig\.fp8_weight_gradient must be one of "):
        ModelConfig(fp8_weight_gradient=None)


def test_bad_operands_are_refused_naming_them():
    lhs, rhs = jnp.ones((8, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"recipe must be one of \('blockwise', 'tensorwise'\), "
                                         "got 'off'"):
        nodrop.fp8_grouped_matmul(lhs, rhs, int32([4, 4]), recipe="off")
    with pytest.raises(ValueError, match=r"weight_gradient must be one of \('fp8', "
                                         r"'unquantised'\), got 'bf16'"):
        nodrop.fp8_grouped_matmul(lhs, rhs, int32([4, 4]), weight_gradient="bf16")
    with pytest.raises(ValueError, match="rhs has 5 rows along axis 1 .* but expected 4"):
        nodrop.fp8_grouped_matmul(lhs, jnp.ones((2, 5, 3), jnp.float32), int32([4, 4]))
    with pytest.raises(ValueError, match="group_sizes has 3 groups but rhs has 2"):
        nodrop.fp8_grouped_matmul(lhs, rhs, int32([4, 4, 0]))
    with pytest.raises(ValueError, match=r"block must be \(rows, columns\) .* got \(0, 128\)"):
        fp8.quantize(lhs, (0, 128))
    with pytest.raises(ValueError, match=r"scale must have shape \(8, 1\) .* got \(1, 1\)"):
        fp8.quantize(lhs, fp8.ACTIVATION_BLOCK, scale=jnp.ones((1, 1), jnp.float32))


@needs_train
def test_a_short_fp8_training_run_tracks_the_unquantised_one(tmp_path, capsys):
    from test_train import MODEL_FLAGS, records, run_cli

    from nodrop.train import data
    text = tmp_path / "corpus.txt"
    text.write_bytes((data.stdlib_root() / "argparse.py").read_bytes()[:20_000])
    losses = {}
    for recipe in ("off", "blockwise"):
        out = tmp_path / recipe
        code, _, err = run_cli(
            capsys, "train", *MODEL_FLAGS, "--set", "num_layers=1", "--no-progress", "--data",
            str(text), "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4",
            "--eval-batches", "1", "--checkpoint-every", "0", "--fp8", recipe, "--out", str(out))
        assert code == 0, err
        losses[recipe] = [r["loss"] for r in records(out, "train")]
        config = (out / "config.json").read_text()
        assert f'"fp8": "{recipe}"' in config
    assert all(math.isfinite(v) for v in losses["blockwise"])
    assert losses["blockwise"] != losses["off"]  # the recipe ran
    np.testing.assert_allclose(losses["blockwise"], losses["off"], rtol=0.03)


# --- the engine's quantisation: bitwise the emulation's ------------------------------------------


def bits(q):
    return np.asarray(jnp.asarray(q).view(jnp.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block", [128, 45, 1, 300, 512])
def test_quantize_rows_is_bitwise_quantize(dtype, block):
    rng = np.random.default_rng(block)
    x = (rng.standard_normal((37, 300)) * np.exp2(rng.integers(-12, 12, (37, 1))))
    x = jnp.asarray(x, dtype).at[3, :block].set(0).at[5, 200].set(jnp.nan).at[6, 10].set(jnp.inf)
    q, scale = fp8.quantize_rows(x, block)
    want_q, want_scale = fp8.quantize(x, (1, block))
    assert q.dtype == fp8.E4M3 and scale.shape == (37, -(-300 // block))
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))  # NaN == NaN here
    jitted = jax.jit(fp8.quantize_rows, static_argnums=1)(x, block)
    np.testing.assert_array_equal(bits(jitted[0]), bits(q))


def test_quantize_rows_of_empty_and_batched_inputs():
    q, scale = fp8.quantize_rows(jnp.zeros((0, 300), jnp.float32))
    assert q.shape == (0, 300) and scale.shape == (0, 3)
    x = jax.random.normal(jax.random.key(1), (3, 5, 260), jnp.bfloat16)
    q, scale = jax.vmap(fp8.quantize_rows)(x)
    want = [fp8.quantize(row, fp8.ACTIVATION_BLOCK) for row in x]
    np.testing.assert_array_equal(bits(q), np.stack([bits(w[0]) for w in want]))
    np.testing.assert_array_equal(np.asarray(scale), np.stack([np.asarray(w[1]) for w in want]))


@pytest.mark.parametrize("x, block, error, message", [
    (jnp.ones((4,), jnp.float32), 128, ValueError, "x must have rank 2"),
    (jnp.ones((4, 4), jnp.int32), 128, TypeError, "x must be"),
    (jnp.ones((4, 4), jnp.float32), 0, ValueError, "block must be a positive int, got 0"),
    (jnp.ones((4, 4), jnp.float32), 2.5, ValueError, "block must be a positive int, got 2.5"),
])
def test_quantize_rows_refuses_bad_input(x, block, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fp8.quantize_rows(x, block)


def test_the_blockwise_recipe_quantises_its_rows_on_the_engine():
    lhs = jax.random.normal(jax.random.key(2), (12, 256), jnp.float32)
    rhs = jax.random.normal(jax.random.key(3), (2, 256, 8), jnp.float32)
    loss = lambda a, b: fp8.fp8_grouped_matmul(a, b, int32([5, 7])).sum()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = step.lower(lhs, rhs).compile().as_text()
    # The forward's lhs and the output gradient (the weight gradient's row blocks stay JAX's).
    assert text.count('custom_call_target="nodrop_quantize_fp8"') == 2


# --- permute with the rows' quantisation -------------------------------------------------------

# name -> (tokens, hidden, k, experts, ids): ids "random" (some out of range: dropped slots),
# "one_expert" (every slot to expert 1, the others empty).
PERMUTE_CASES = {
    "short_last_block_and_dropped_slots": (37, 300, 3, 5, "random"),
    "whole_blocks": (20, 256, 2, 4, "random"),
    "under_one_block": (9, 7, 1, 3, "random"),
    "all_to_one_expert": (16, 130, 2, 4, "one_expert"),
    "no_tokens": (0, 128, 2, 4, "random"),
}


def permute_inputs(case, dtype, seed=0):
    tokens, hidden, k, experts, ids_kind = PERMUTE_CASES[case]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)) * np.exp2(rng.integers(-8, 8, (tokens, 1)))
    x = jnp.asarray(x, dtype)
    if tokens:
        x = x.at[tokens // 2, hidden // 2].set(jnp.nan)
    ids = (rng.integers(-1, experts + 1, (tokens, k)) if ids_kind == "random"
           else np.ones((tokens, k), np.int64))
    return x, int32(ids), experts


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", list(PERMUTE_CASES))
def test_permute_fp8_is_permute_then_quantize_rows(case, dtype):
    x, ids, experts = permute_inputs(case, dtype)
    got = fp8.permute_fp8(x, ids, experts)
    rows, sizes, row_map = nodrop.permute(x, ids, experts)
    for name, a, b in zip(("rows", "group_sizes", "row_map", "rows_q", "rows_scale"), got,
                          (rows, sizes, row_map, *fp8.quantize_rows(rows))):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)
    for name, a, b in zip(("rows", "group_sizes", "row_map", "rows_q", "rows_scale"), got,
                          reference.permute_fp8(x, ids, experts)):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} against the reference")
    jitted = jax.jit(fp8.permute_fp8, static_argnums=2)(x, ids, experts)
    for a, b in zip(jitted, got):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_permute_fp8_rows_differentiate_as_permutes():
    """Through the rows, gradients (reverse and forward mode, under jit, remat and scan) are
    permute's; the codes and scales carry none."""
    x, ids, experts = permute_inputs("short_last_block_and_dropped_slots", jnp.float32, seed=1)
    x = jnp.nan_to_num(x)
    weight = jax.random.normal(jax.random.key(4), (ids.size, x.shape[1]), jnp.float32)

    def loss(permute_fn, x):
        out = permute_fn(x)
        return jnp.sum(out[0] * weight) + jnp.sum(out[-1])  # the scales: no gradient

    fused = functools.partial(loss, lambda x: fp8.permute_fp8(x, ids, experts))
    plain = functools.partial(
        loss, lambda x: (*nodrop.permute(x, ids, experts), fp8.quantize_rows(
            jax.lax.stop_gradient(nodrop.permute(x, ids, experts)[0]))[1]))
    want = jax.grad(plain)(x)
    for name, fn in [("eager", jax.grad(fused)), ("jit", jax.jit(jax.grad(fused))),
                     ("remat", jax.jit(jax.grad(jax.checkpoint(fused))))]:
        np.testing.assert_array_equal(fn(x), want, err_msg=name)
    tangent = jnp.ones_like(x)
    np.testing.assert_array_equal(jax.jvp(fused, (x,), (tangent,))[1],
                                  jax.jvp(plain, (x,), (tangent,))[1])
    scanned = jax.grad(lambda x: jax.lax.scan(lambda c, _: (c + fused(x), None), 0.0,
                                              None, length=2)[0])(x)
    np.testing.assert_array_equal(scanned, 2 * want)


@pytest.mark.parametrize("args, error, message", [
    ((jnp.ones((4,), jnp.float32), int32(np.zeros((4, 2))), 2), ValueError,
     "x must have rank 2"),
    ((jnp.ones((4, 8), jnp.float32), int32(np.zeros((3, 2))), 2), ValueError, "ids has 3 tokens"),
    ((jnp.ones((4, 8), jnp.int32), int32(np.zeros((4, 2))), 2), TypeError, "x must be"),
    ((jnp.ones((4, 8), jnp.float32), int32(np.zeros((4, 2))), 0), ValueError,
     "num_experts must be at least 1, got 0"),
])
def test_permute_fp8_refuses_bad_input_as_permute_does(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fp8.permute_fp8(*args)
    with pytest.raises(error, match=re.escape(message)):
        nodrop.permute(*args)


def test_checked_mode_refuses_an_out_of_range_id_in_permute_fp8():
    with nodrop.checks(), pytest.raises(jax.errors.JaxRuntimeError,
                                        match=re.escape("ids[1, 0] = 7 is not an expert")):
        jax.block_until_ready(fp8.permute_fp8(jnp.ones((2, 8), jnp.float32),
                                              int32([[0], [7]]), 4))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", list(PERMUTE_CASES))
def test_permute_fp8_with_a_given_scale_is_the_tensorwise_quantisation_of_its_rows(case, dtype):
    """The tensorwise recipe's call: permute's rows, and codes bitwise `quantize`'s of the rows
    under the given scale, which every scale is; the tokens' own scale (no code saturates), a
    quarter of it (the largest do) and NaN (every code). Rows no slot maps to: codes 0."""
    x, ids, experts = permute_inputs(case, dtype)
    rows, sizes, row_map = nodrop.permute(x, ids, experts)
    mapped = int(np.sum(sizes))
    own = fp8.tensor_scale(jnp.nan_to_num(x))
    for given_scale in (own, own / 4, jnp.float32(jnp.nan)):
        got = jax.jit(fp8.permute_fp8, static_argnums=2)(x, ids, experts, scale=given_scale)
        for name, a, b in zip(("rows", "group_sizes", "row_map"), got, (rows, sizes, row_map)):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)
        if rows.shape[0]:  # (quantize's "tensor" of no rows has no scale to give)
            want_q, _ = fp8.quantize(rows, "tensor", scale=given_scale.reshape(1, 1))
            np.testing.assert_array_equal(bits(got[3][:mapped]), bits(want_q[:mapped]))
        assert not np.any(bits(got[3][mapped:]))
        assert got[4].shape == (ids.size, -(-x.shape[1] // fp8.BLOCK))
        np.testing.assert_array_equal(
            bits(got[4]), bits(jnp.broadcast_to(jnp.reshape(given_scale, ()), got[4].shape)))
        eager = fp8.permute_fp8(x, ids, experts, scale=given_scale)
        for a, b in zip(eager, got):
            np.testing.assert_array_equal(bits(a), bits(b))
        for name, a, b in zip(("rows", "group_sizes", "row_map", "rows_q", "rows_scale"), got,
                              reference.permute_fp8(x, ids, experts, scale=given_scale)):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} against the reference")


@pytest.mark.parametrize("scale, message", [
    (jnp.ones((2,), jnp.float32), "scale must be one float32 value (any shape of one element), "
     "got float32[2]"),
    (jnp.ones((), jnp.bfloat16), "got bfloat16[]"),
    (jnp.ones((1, 0), jnp.float32), "got float32[1, 0]"),
])
def test_permute_fp8_refuses_a_bad_given_scale(scale, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fp8.permute_fp8(jnp.ones((4, 8), jnp.float32), int32(np.zeros((4, 2))), 2, scale=scale)


@pytest.mark.parametrize("forward", ["kernel", "emulated"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_tensorwise_recipe_on_permute_fp8_with_the_tokens_scale_changes_nothing(dtype,
                                                                                    forward):
    """permute_fp8 with the tokens' tensor scale given (every id in range: each token has a row)
    as the tensorwise recipe's lhs_quantized: the output and the gradients of the tokens and the
    weights bitwise those of the recipe quantising the permuted rows itself."""
    tokens, hidden, k, experts, ffn = 40, 160, 2, 4, 24
    rng = np.random.default_rng(5)
    x = rng.standard_normal((tokens, hidden)) * np.exp2(rng.integers(-4, 4, (tokens, 1)))
    x = jnp.asarray(x, dtype)
    ids = int32(rng.integers(0, experts, (tokens, k)))
    rhs = jax.random.normal(jax.random.key(6), (experts, hidden, ffn), dtype)

    def loss(x, rhs, given):
        scale = fp8.tensor_scale(x)
        rows, sizes, _, rows_q, _ = fp8.permute_fp8(x, ids, experts, scale=scale)
        out = fp8.fp8_grouped_matmul(rows, rhs, sizes, recipe="tensorwise", forward=forward,
                                     lhs_quantized=(rows_q, scale) if given else None)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
    for got, want in zip(jax.tree.leaves(step(x, rhs, True)),
                         jax.tree.leaves(step(x, rhs, False))):
        np.testing.assert_array_equal(as_f64(got), as_f64(want))
    rows, sizes, _, rows_q, _ = fp8.permute_fp8(x, ids, experts, scale=fp8.tensor_scale(x))
    np.testing.assert_array_equal(bits(fp8.tensor_scale(x)),
                                  bits(fp8.quantize(rows, "tensor")[1].reshape(1)))
    # The forward reads the scale given: twice it, twice the output (exactly: a power of two).
    forward_with = jax.jit(lambda scale: fp8.fp8_grouped_matmul(
        rows, rhs, sizes, recipe="tensorwise", forward=forward, lhs_quantized=(rows_q, scale)))
    once, twice = forward_with(fp8.tensor_scale(x)), forward_with(2 * fp8.tensor_scale(x))
    np.testing.assert_array_equal(as_f64(twice), 2 * as_f64(once))


@pytest.mark.parametrize("forward", ["kernel", "emulated"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_given_lhs_quantisation_changes_nothing(case, forward):
    """fp8_grouped_matmul with lhs_quantized=quantize_rows(lhs): bitwise the output and both
    gradients of quantising lhs itself."""
    m, k, n, sizes = CASES[case]
    lhs, rhs, _ = fp8_operands(m, k, n, len(sizes), seed=7)
    sizes = int32(sizes)

    def loss(lhs, rhs, given):
        given = fp8.quantize_rows(jax.lax.stop_gradient(lhs)) if given else None
        out = fp8.fp8_grouped_matmul(lhs, rhs, sizes, forward=forward, lhs_quantized=given)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
    for got, want in zip(jax.tree.leaves(step(lhs, rhs, True)),
                         jax.tree.leaves(step(lhs, rhs, False))):
        np.testing.assert_array_equal(as_f64(got), as_f64(want))


def test_a_given_lhs_quantisation_replaces_the_forwards_quantiser():
    lhs, rhs = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 8), jnp.bfloat16)
    loss = lambda a, b: jnp.sum(fp8.fp8_grouped_matmul(  # noqa: E731
        a, b, int32([3, 5]), forward="kernel",
        lhs_quantized=jax.lax.stop_gradient(fp8.quantize(a, fp8.ACTIVATION_BLOCK))
    ).astype(jnp.float32))
    text = jax.jit(jax.grad(loss, (0, 1))).lower(lhs, rhs).as_text()
    # The output gradient's rows only: lhs came quantised (by XLA's quantize, here).
    assert text.count("custom_call @nodrop_quantize_fp8(") == 1


@pytest.mark.parametrize("recipe, given, message", [
    ("tensorwise", "quantised", "lhs_quantized's scale must be float32 of shape (1,) (the "
     "tensorwise recipe's quantisation of lhs (8, 256)), got float32 of shape (8, 2)"),
    ("tensorwise", "one", 'lhs_quantized must be (q, scale) as quantize(lhs, "tensor")'),
    ("blockwise", "one", "lhs_quantized must be (q, scale) as quantize_rows(lhs)"),
    ("blockwise", "bf16_codes", "lhs_quantized's q must be float8_e4m3fn of shape (8, 256)"),
    ("blockwise", "short_scale", "lhs_quantized's scale must be float32 of shape (8, 2)"),
])
def test_a_bad_lhs_quantisation_is_refused_naming_it(recipe, given, message):
    lhs, rhs = jnp.ones((8, 256), jnp.float32), jnp.ones((2, 256, 8), jnp.float32)
    q, scale = fp8.quantize_rows(lhs)
    given = {"quantised": (q, scale), "one": q, "bf16_codes": (lhs.astype(jnp.bfloat16), scale),
             "short_scale": (q, scale[:, :1])}[given]
    with pytest.raises(ValueError, match=re.escape(message)):
        fp8.fp8_grouped_matmul(lhs, rhs, int32([3, 5]), recipe=recipe, lhs_quantized=given)


# --- the engine's blockwise-scaled grouped matmul ----------------------------------------------

# K and N off the kernels' multiples of 16 and 8 (padded around the call), and invalid sizes.
FP8_GEMM_CASES = {**CASES, "k_and_n_padded_for_the_kernels": (50, 100, 13, [20, 25]),
                  "negative_and_overlong_sizes": (50, 144, 24, [-3, 40, 100])}


def fp8_operands(m, k, n, groups, seed=0):
    """lhs [M, K] and rhs [G, K, N] in bfloat16, and their FP8 forms for the kernel."""
    lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(seed + 1), (groups, k, n), jnp.bfloat16)
    return lhs, rhs, (*fp8.quantize_rows(lhs), *fp8.quantize(jnp.swapaxes(rhs, 1, 2),
                                                             fp8.WEIGHT_BLOCK))


def assert_bf16_close(got, want, what=""):
    """Within one bfloat16 rounding (and float32 summation order) of want, elementwise."""
    got, want = as_f64(got), as_f64(want)
    bound = 2.0 ** -7 * np.abs(want) + 2.0 ** -16 * np.max(np.abs(want), initial=0)
    assert np.all(np.abs(got - want) <= bound), (what, np.max(np.abs(got - want) - bound))


@pytest.mark.parametrize("case", FP8_GEMM_CASES)
def test_grouped_matmul_fp8_blockwise_matches_the_reference(case):
    m, k, n, sizes = FP8_GEMM_CASES[case]
    _, _, operands = fp8_operands(m, k, n, len(sizes))
    got = nodrop.grouped_matmul_fp8_blockwise(*operands, int32(sizes))
    want = reference.grouped_matmul_fp8_blockwise(*operands, int32(sizes))
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    assert_bf16_close(got, want)
    used = min(m, sum(max(s, 0) for s in sizes))
    assert not np.any(as_f64(got)[used:]), "rows past the groups"
    jitted = jax.jit(nodrop.grouped_matmul_fp8_blockwise)(*operands, int32(sizes))
    np.testing.assert_array_equal(as_f64(jitted), as_f64(got))


@pytest.mark.parametrize("weight_gradient", fp8.WEIGHT_GRADIENTS)
@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("case", FP8_GEMM_CASES)
def test_the_kernel_forward_and_gradients_are_the_emulated_ones(case, recipe, weight_gradient):
    """Up to float32 summation order and the kernels' bfloat16 outputs, the weight gradient
    (the FP8 contraction, or the unquantised one) included; each recipe on its own kernels."""
    m, k, n, sizes = FP8_GEMM_CASES[case]
    lhs, rhs, _ = fp8_operands(m, k, n, len(sizes), seed=3)
    dout = jax.random.normal(jax.random.key(9), (m, n), jnp.bfloat16)
    results = {}
    for forward in ("kernel", "emulated"):
        f = lambda a, b: fp8.fp8_grouped_matmul(  # noqa: E731
            a, b, int32(sizes), recipe=recipe, forward=forward,
            weight_gradient=weight_gradient)
        out, vjp = jax.vjp(f, lhs, rhs)
        results[forward] = out, vjp(dout)
    (kernel, kernel_grads), (emulated, emulated_grads) = results["kernel"], results["emulated"]
    assert kernel.dtype == emulated.dtype == jnp.bfloat16
    assert_bf16_close(kernel, emulated)
    assert kernel_grads[0].dtype == kernel_grads[1].dtype == jnp.bfloat16
    assert_bf16_close(kernel_grads[0], emulated_grads[0], "dlhs")
    assert_bf16_close(kernel_grads[1], emulated_grads[1], "drhs")
    used = group_offsets(sizes, m)[-1]
    assert not np.any(as_f64(kernel_grads[0])[used:]), "input gradient past the groups"
    for g, size in enumerate(np.diff(group_offsets(sizes, m))):
        if size == 0:
            assert not np.any(as_f64(kernel_grads[1][g])), f"empty group {g}'s gradient"


@pytest.mark.parametrize("forward", ["kernel", "emulated"])
@RECIPES
@pytest.mark.parametrize("case", CASES)
def test_an_unquantised_weight_gradient_is_the_matmuls_own(case, recipe, forward):
    """weight_gradient="unquantised": the output and the input gradient are bitwise the FP8
    recipe's; the weight gradient is the grouped matmul's own on the unquantised operands (on
    the kernels: bitwise nodrop.grouped_matmul's, the engine's contraction; emulated: within
    float32 summation order and bfloat16's rounding of the float64 reference)."""
    m, k, n, sizes = CASES[case]
    lhs, rhs, _ = fp8_operands(m, k, n, len(sizes), seed=4)
    dout = jax.random.normal(jax.random.key(8), (m, n), jnp.bfloat16)
    sizes = int32(sizes)
    results = {}
    for weight_gradient in fp8.WEIGHT_GRADIENTS:
        out, vjp = jax.vjp(lambda a, b: fp8.fp8_grouped_matmul(  # noqa: B023
            a, b, sizes, recipe=recipe, forward=forward, weight_gradient=weight_gradient),
            lhs, rhs)
        results[weight_gradient] = out, *vjp(dout)
    (out, dlhs, drhs), (fp8_out, fp8_dlhs, fp8_drhs) = (results["unquantised"], results["fp8"])
    np.testing.assert_array_equal(as_f64(out), as_f64(fp8_out))
    np.testing.assert_array_equal(as_f64(dlhs), as_f64(fp8_dlhs))
    assert drhs.dtype == jnp.bfloat16 and drhs.shape == rhs.shape
    if forward == "kernel":
        _, vjp = jax.vjp(lambda b: grouped_matmul(lhs, b, sizes), rhs)
        np.testing.assert_array_equal(as_f64(drhs), as_f64(vjp(dout)[0]))
    _, vjp = jax.vjp(lambda b: reference.grouped_matmul(f64(lhs), b, sizes), f64(rhs))
    want = vjp(f64(dout))[0]
    assert_bf16_close(drhs, want)
    if np.any(as_f64(want)):  # the FP8 weight gradient is further from it
        assert np.max(np.abs(as_f64(fp8_drhs) - as_f64(want))) > np.max(
            np.abs(as_f64(drhs) - as_f64(want)))


# recipe -> its FP8 kernels: (ragged rows, the forward and the input gradient; the ragged
# contraction, the weight gradient).
KERNELS = {"blockwise": ("nodrop_grouped_matmul_fp8_blockwise",
                         "nodrop_grouped_matmul_fp8_blockwise_contract"),
           "tensorwise": ("nodrop_grouped_matmul_fp8_tensorwise",
                          "nodrop_grouped_matmul_fp8_tensorwise_contract")}


def kernel_calls(text, recipe, rows, contractions):
    """Each FP8 kernel's custom calls in `text`, and what the recipe's should be: `rows` of its
    ragged-rows kernel and `contractions` of its contraction, none of the other recipe's."""
    got = {target: text.count(f"custom_call @{target}(") for kernels in KERNELS.values()
           for target in kernels}
    want = {target: 0 for target in got}
    want.update(zip(KERNELS[recipe], (rows, contractions)))
    return got, want


@pytest.mark.parametrize("recipe, engine_row_quantisers, transposed, re_laid",
                         [("blockwise", 2, 2, 0), ("tensorwise", 0, 0, 2)])
def test_both_gradients_run_on_the_fp8_kernels(recipe, engine_row_quantisers, transposed,
                                               re_laid):
    """With forward="kernel": the recipe's FP8 kernel for the forward and the input gradient,
    its FP8 contraction once on two operands laid out by group on the engine (the weight
    gradient), the weights quantised on the engine in the forward's layout and the input
    gradient's, and none of nodrop's bf16 grouped matmuls: no float32 contraction of
    dequantised operands. The blockwise recipe quantises the rows on the engine, and lhs and
    dout again for the weight gradient; the tensorwise one quantises the rows in XLA (one amax
    per tensor) and re-lays those codes (transpose_codes) for the weight gradient."""
    lhs, rhs = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 8), jnp.bfloat16)
    loss = lambda a, b: jnp.sum(jnp.sin(fp8.fp8_grouped_matmul(  # noqa: E731
        a, b, int32([3, 5]), recipe=recipe, forward="kernel").astype(jnp.float32)))
    text = jax.jit(jax.grad(loss, (0, 1))).lower(lhs, rhs).as_text()
    got, want = kernel_calls(text, recipe, rows=2, contractions=1)
    assert got == want
    calls = {target: text.count(f"custom_call @{target}(") for target in (
        "nodrop_quantize_fp8", "nodrop_quantize_fp8_transposed", "nodrop_transpose_fp8_codes",
        "nodrop_quantize_fp8_weights", "nodrop_quantize_fp8_weights_transposed",
        "nodrop_grouped_matmul", "nodrop_grouped_matmul_contract")}
    assert calls == {"nodrop_quantize_fp8": engine_row_quantisers,
                     "nodrop_quantize_fp8_transposed": transposed,
                     "nodrop_transpose_fp8_codes": re_laid,
                     "nodrop_quantize_fp8_weights": 1, "nodrop_quantize_fp8_weights_transposed": 1,
                     "nodrop_grouped_matmul": 0, "nodrop_grouped_matmul_contract": 0}
    # and the emulation's segment reductions of the weight gradient's blocks are gone
    assert "scatter" not in text


@pytest.mark.parametrize("weight_gradient, contractions", [("fp8", 1), ("unquantised", 0)])
def test_the_tensorwise_recipe_accumulates_fast_forward_and_promoted_backward(weight_gradient,
                                                                              contractions):
    """Transformer Engine's split: the forward's tensorwise GEMM with fast_accumulation, the
    input gradient's and the weight gradient's without."""
    lhs, rhs = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 8), jnp.bfloat16)
    loss = lambda a, b: jnp.sum(jnp.sin(fp8.fp8_grouped_matmul(  # noqa: E731
        a, b, int32([3, 5]), recipe="tensorwise", forward="kernel",
        weight_gradient=weight_gradient).astype(jnp.float32)))
    text = jax.jit(jax.grad(loss, (0, 1))).lower(lhs, rhs).as_text()
    calls = re.findall(r"custom_call @(nodrop_grouped_matmul_fp8_tensorwise\w*)\(.*"
                       r"fast_accumulation = (true|false)", text)
    want = [("nodrop_grouped_matmul_fp8_tensorwise", "true"),
            ("nodrop_grouped_matmul_fp8_tensorwise", "false")]
    want += [("nodrop_grouped_matmul_fp8_tensorwise_contract", "false")] * contractions
    assert sorted(calls) == sorted(want)


@RECIPES
def test_an_unquantised_weight_gradient_runs_the_bf16_contraction(recipe):
    """With weight_gradient="unquantised" on the kernels: the FP8 kernels for the forward and the
    input gradient, nodrop's bf16 contraction for the weight gradient, and no transposed
    quantisation."""
    lhs, rhs = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 8), jnp.bfloat16)
    loss = lambda a, b: jnp.sum(jnp.sin(fp8.fp8_grouped_matmul(  # noqa: E731
        a, b, int32([3, 5]), recipe=recipe, forward="kernel",
        weight_gradient="unquantised").astype(jnp.float32)))
    text = jax.jit(jax.grad(loss, (0, 1))).lower(lhs, rhs).as_text()
    got, want = kernel_calls(text, recipe, rows=2, contractions=0)
    assert got == want
    calls = {target: text.count(f"custom_call @{target}(") for target in (
        "nodrop_quantize_fp8_transposed", "nodrop_grouped_matmul_contract")}
    assert calls == {"nodrop_quantize_fp8_transposed": 0, "nodrop_grouped_matmul_contract": 1}


@pytest.mark.parametrize("forward", ["kernel", "emulated"])
@pytest.mark.parametrize("case", FP8_GEMM_CASES)
def test_the_tensorwise_fp8_weight_gradient_reads_the_forwards_codes(case, forward):
    """The tensorwise recipe's FP8 weight gradient contracts lhs's codes as the forward made
    them, re-laid: bitwise the contraction of quantize_transposed's codes of lhs and dout at
    their tensor scales (the rows in the groups'), what it ran before it kept the codes; the
    emulation on the same codes dequantised. The backward keeps lhs's codes and scale, not
    lhs; with lhs_quantized given, those."""
    m, k, n, sizes = FP8_GEMM_CASES[case]
    lhs, rhs, _ = fp8_operands(m, k, n, len(sizes), seed=6)
    dout = jax.random.normal(jax.random.key(10), (m, n), jnp.bfloat16)
    sizes = int32(sizes)

    def vjp(lhs_quantized=None):
        return jax.vjp(lambda a, b: fp8.fp8_grouped_matmul(
            a, b, sizes, recipe="tensorwise", forward=forward, weight_gradient="fp8",
            lhs_quantized=lhs_quantized), lhs, rhs)[1]

    backward = vjp()
    kept = [x for x in jax.tree.leaves(backward) if x.shape == lhs.shape]
    assert [x.dtype for x in kept] == [fp8.E4M3], "lhs's codes kept, not lhs"
    drhs = backward(dout)[1]
    lhs_q, lhs_scale = fp8._tensor_rows(lhs, sizes)
    dout_q, dout_scale = fp8._tensor_rows(dout, sizes)
    if forward == "kernel":
        want = fp8.grouped_matmul_fp8_tensorwise_contract(
            fp8.quantize_transposed(lhs, sizes, scale=lhs_scale)[0], lhs_scale,
            fp8.quantize_transposed(dout, sizes, scale=dout_scale)[0], dout_scale, sizes,
            num_rows=m, fast_accumulation=False)
        np.testing.assert_array_equal(as_f64(drhs), as_f64(want))
    else:
        _, transpose = jax.vjp(lambda w: reference.grouped_matmul(
            fp8.dequantize(lhs_q, lhs_scale, "tensor"), w, sizes), rhs.astype(jnp.float32))
        want, = transpose(fp8._rows_in_groups(fp8.dequantize(dout_q, dout_scale, "tensor"),
                                              sizes))
        assert_bf16_close(drhs, want, "drhs")
    # Codes given (permute_fp8's): the weight gradient reads those, at their scale.
    halved = (lhs_q, lhs_scale * 2)  # as if another scale had made them: each value doubles
    np.testing.assert_array_equal(as_f64(vjp(halved)(dout)[1]), 2 * as_f64(drhs))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_kernel_forward_under_jit_remat_and_scan(recipe):
    m, k, n, sizes = CASES["unaligned_groups_and_rows_past_them"]
    lhs, rhs, _ = fp8_operands(m, k, n, len(sizes), seed=5)
    sizes = int32(sizes)

    def loss(lhs, rhs):
        out = fp8.fp8_grouped_matmul(lhs, rhs, sizes, recipe=recipe, forward="kernel")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    eager = jax.value_and_grad(loss, (0, 1))(lhs, rhs)
    for name, fn in [("jit", jax.jit(jax.value_and_grad(loss, (0, 1)))),
                     ("remat", jax.jit(jax.value_and_grad(jax.checkpoint(loss), (0, 1))))]:
        for got, want in zip(jax.tree.leaves(fn(lhs, rhs)), jax.tree.leaves(eager)):
            np.testing.assert_array_equal(as_f64(got), as_f64(want), err_msg=name)

    def scanned(lhs, rhs):  # the same layer twice
        def body(total, weights):
            return total + loss(lhs, weights), None
        return jax.lax.scan(body, jnp.float32(0), jnp.stack([rhs, rhs]))[0]

    value, (dlhs, drhs) = jax.jit(jax.value_and_grad(scanned, (0, 1)))(lhs, rhs)
    assert float(value) == 2 * float(eager[0])
    assert_close(dlhs, 2 * as_f64(eager[1][0]), 1e-2, "scan dlhs")
    assert_close(drhs, 2 * as_f64(eager[1][1]), 1e-2, "scan drhs")


@pytest.mark.parametrize("forward, dtype, kernel_calls", [
    ("kernel", jnp.bfloat16, 1), ("kernel", jnp.float32, 1), ("emulated", jnp.bfloat16, 0),
    # "auto" takes the kernel on the GPU only: the CPU engine's is a plain-loop reference.
    ("auto", jnp.bfloat16, 0), ("auto", jnp.float32, 0)])
def test_which_forward_runs_on_the_cpu(forward, dtype, kernel_calls):
    lhs, rhs = jnp.ones((8, 128), dtype), jnp.ones((2, 128, 8), dtype)
    f = jax.jit(lambda a, b: fp8.fp8_grouped_matmul(a, b, int32([3, 5]), forward=forward))
    text = f.lower(lhs, rhs).as_text()
    assert text.count("custom_call @nodrop_grouped_matmul_fp8_blockwise(") == kernel_calls


def test_checked_mode_refuses_invalid_group_sizes_in_the_fp8_kernel():
    _, _, operands = fp8_operands(20, 128, 8, 2)
    with nodrop.checks(), pytest.raises(jax.errors.JaxRuntimeError, match="group_sizes"):
        jax.block_until_ready(nodrop.grouped_matmul_fp8_blockwise(*operands, int32([10, 100])))


def _fp8_gemm_args(**changes):
    _, _, (lhs_q, lhs_scales, rhs_q_t, rhs_scales) = fp8_operands(6, 200, 16, 2)
    args = dict(lhs_q=lhs_q, lhs_scales=lhs_scales, rhs_q_t=rhs_q_t, rhs_scales=rhs_scales,
                group_sizes=int32([2, 4]))
    return {**args, **{name: change(args[name]) for name, change in changes.items()}}


@pytest.mark.parametrize("changes, error, message", [
    (dict(lhs_q=lambda x: x[0]), ValueError, "lhs_q must have rank 2 ([M, K]), got shape (200,)"),
    (dict(rhs_q_t=lambda x: x[0]), ValueError, "rhs_q_t must have rank 3 ([G, N, K])"),
    (dict(lhs_q=lambda x: x.astype(jnp.bfloat16)), TypeError,
     "lhs_q must be float8_e4m3fn, got bfloat16"),
    (dict(rhs_q_t=lambda x: x.astype(jnp.float32)), TypeError,
     "rhs_q_t must be float8_e4m3fn, got float32"),
    (dict(rhs_q_t=lambda x: x[:, :, :128]), ValueError,
     "rhs_q_t has 128 columns along axis 2 (K, lhs_q's columns) but expected 200"),
    (dict(lhs_scales=lambda s: s[:, :1]), ValueError,
     "lhs_scales must be float32 of shape (6, 2) (one scale per block of 128), got float32 of "
     "shape (6, 1)"),
    (dict(rhs_scales=lambda s: s.astype(jnp.bfloat16)), ValueError,
     "rhs_scales must be float32 of shape (2, 1, 2)"),
    (dict(group_sizes=lambda g: g[:1]), ValueError,
     "group_sizes has 1 groups but rhs_q_t has 2"),
])
def test_grouped_matmul_fp8_blockwise_refuses_bad_input(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        nodrop.grouped_matmul_fp8_blockwise(**_fp8_gemm_args(**changes))


# --- the engine's tensorwise-scaled grouped matmul ---------------------------------------------

TENSORWISE_CASES = {**FP8_GEMM_CASES, "no_groups": (6, 32, 16, [])}


def tensorwise_operands(m, k, n, groups, seed=0):
    """lhs [M, K] and rhs [G, K, N] in bfloat16 quantised per tensor (per expert for rhs), as
    the kernel takes them: (lhs_q, lhs_scale [1], rhs_q_t [G, N, K], rhs_scales [G])."""
    lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(seed + 1), (groups, k, n), jnp.bfloat16) * (
        jnp.asarray(np.exp2(np.arange(groups)), jnp.bfloat16)[:, None, None])  # its own scale
    lhs_q, lhs_scale = fp8.quantize(lhs, "tensor")
    rhs_q_t, rhs_scales = fp8.quantize(jnp.swapaxes(rhs, 1, 2), "tensor")
    return lhs_q, lhs_scale.reshape(1), rhs_q_t, rhs_scales.reshape(groups)


@pytest.mark.parametrize("case", TENSORWISE_CASES)
def test_grouped_matmul_fp8_tensorwise_matches_the_reference(case):
    m, k, n, sizes = TENSORWISE_CASES[case]
    operands = tensorwise_operands(m, k, n, len(sizes))
    got = nodrop.grouped_matmul_fp8_tensorwise(*operands, int32(sizes))
    want = reference.grouped_matmul_fp8_tensorwise(*operands, int32(sizes))
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    assert_bf16_close(got, want)
    used = group_offsets(sizes, m)[-1]
    assert not np.any(as_f64(got)[used:]), "rows past the groups"
    jitted = jax.jit(nodrop.grouped_matmul_fp8_tensorwise)(*operands, int32(sizes))
    np.testing.assert_array_equal(as_f64(jitted), as_f64(got))


@pytest.mark.parametrize("case", ["aligned", "k_and_n_padded_for_the_kernels",
                                  "unaligned_groups_and_rows_past_them"])
def test_grouped_matmul_fp8_tensorwise_is_the_blockwise_op_on_repeated_scales(case):
    """The blockwise op with the tensorwise scales repeated over its blocks: bitwise the same
    within one 128-deep block (K <= 128: the same float32 dot times the same scale product),
    else up to float32 summation order."""
    m, k, n, sizes = FP8_GEMM_CASES[case]
    lhs_q, lhs_scale, rhs_q_t, rhs_scales = tensorwise_operands(m, k, n, len(sizes), seed=2)
    grid = (-(-n // fp8.BLOCK), -(-k // fp8.BLOCK))
    blockwise = nodrop.grouped_matmul_fp8_blockwise(
        lhs_q, jnp.broadcast_to(lhs_scale, (m, grid[1])), rhs_q_t,
        jnp.broadcast_to(rhs_scales[:, None, None], (len(sizes), *grid)), int32(sizes))
    got = nodrop.grouped_matmul_fp8_tensorwise(lhs_q, lhs_scale, rhs_q_t, rhs_scales,
                                               int32(sizes))
    if k <= fp8.BLOCK:
        np.testing.assert_array_equal(as_f64(got), as_f64(blockwise))
    else:
        assert_bf16_close(got, blockwise)


def test_grouped_matmul_fp8_tensorwise_under_vmap_scan_and_checked_mode():
    m, k, n, sizes = 40, 32, 16, int32([10, 30])
    lhs_q, lhs_scale, rhs_q_t, rhs_scales = tensorwise_operands(m, k, n, 2, seed=6)
    batch_q = jnp.stack([lhs_q, lhs_q[::-1]])
    batch_scale = jnp.stack([lhs_scale, 2 * lhs_scale])
    run = lambda q, s: nodrop.grouped_matmul_fp8_tensorwise(  # noqa: E731
        q, s, rhs_q_t, rhs_scales, sizes)
    np.testing.assert_array_equal(as_f64(jax.vmap(run)(batch_q, batch_scale)),
                                  np.stack([as_f64(run(q, s)) for q, s in
                                            zip(batch_q, batch_scale)]))

    def body(total, operand):  # the same call on each element of a scan
        return total, run(*operand)

    _, scanned = jax.jit(lambda q, s: jax.lax.scan(body, 0, (q, s)))(batch_q, batch_scale)
    np.testing.assert_array_equal(as_f64(scanned), as_f64(jax.vmap(run)(batch_q, batch_scale)))
    with nodrop.checks(), pytest.raises(jax.errors.JaxRuntimeError,
                                        match=re.escape("group_sizes sum to 50")):
        jax.block_until_ready(nodrop.grouped_matmul_fp8_tensorwise(
            lhs_q, lhs_scale, rhs_q_t, rhs_scales, int32([10, 40])))


def _tensorwise_args(**changes):
    lhs_q, lhs_scale, rhs_q_t, rhs_scales = tensorwise_operands(6, 200, 16, 2)
    args = dict(lhs_q=lhs_q, lhs_scale=lhs_scale, rhs_q_t=rhs_q_t, rhs_scales=rhs_scales,
                group_sizes=int32([2, 4]))
    return {**args, **{name: change(args[name]) for name, change in changes.items()}}


@pytest.mark.parametrize("changes, error, message", [
    (dict(lhs_q=lambda x: x[0]), ValueError, "lhs_q must have rank 2 ([M, K]), got shape (200,)"),
    (dict(rhs_q_t=lambda x: x[0]), ValueError, "rhs_q_t must have rank 3 ([G, N, K])"),
    (dict(lhs_q=lambda x: x.astype(jnp.bfloat16)), TypeError,
     "lhs_q must be float8_e4m3fn, got bfloat16"),
    (dict(rhs_q_t=lambda x: x.astype(jnp.float32)), TypeError,
     "rhs_q_t must be float8_e4m3fn, got float32"),
    (dict(rhs_q_t=lambda x: x[:, :, :128]), ValueError,
     "rhs_q_t has 128 columns along axis 2 (K, lhs_q's columns) but expected 200"),
    (dict(lhs_scale=lambda s: s.reshape(1, 1)), ValueError,
     "lhs_scale must be float32 of shape (1,) (one scale for all of lhs_q), got float32 of "
     "shape (1, 1)"),
    (dict(lhs_scale=lambda s: s.astype(jnp.bfloat16)), ValueError,
     "lhs_scale must be float32 of shape (1,) (one scale for all of lhs_q), got bfloat16 of "
     "shape (1,)"),
    (dict(rhs_scales=lambda s: s[:, None, None]), ValueError,
     "rhs_scales must be float32 of shape (2,) (one scale per expert), got float32 of shape "
     "(2, 1, 1)"),
    (dict(rhs_scales=lambda s: s[:1]), ValueError,
     "rhs_scales must be float32 of shape (2,) (one scale per expert), got float32 of shape "
     "(1,)"),
    (dict(group_sizes=lambda g: g[:1]), ValueError,
     "group_sizes has 1 groups but rhs_q_t has 2"),
])
def test_grouped_matmul_fp8_tensorwise_refuses_bad_input(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        nodrop.grouped_matmul_fp8_tensorwise(**_tensorwise_args(**changes))


def test_bad_forward_is_refused():
    with pytest.raises(ValueError, match=re.escape("forward must be one of ('auto', 'kernel', "
                                                   "'emulated'), got 'fast'")):
        fp8.fp8_grouped_matmul(jnp.ones((4, 8), jnp.float32), jnp.ones((1, 8, 8), jnp.float32),
                               int32([4]), forward="fast")


# --- the engine's quantisation of the experts' weights for the forward --------------------------

# name -> (G, K, N)
WEIGHT_CASES = {
    "unaligned": (3, 300, 260),
    "aligned": (2, 256, 384),
    "under_one_chunk": (2, 7, 5),
    "one_expert_one_block": (1, 128, 128),
    "no_experts": (0, 128, 128),
}


def expert_weights(case, dtype, seed):
    """[G, K, N] with magnitudes over 24 binades across the columns (subnormal codes), a zero
    128 x 128 block, and a NaN and an inf in blocks of their own where there are enough."""
    g, k, n = WEIGHT_CASES[case]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((g, k, n)) * np.exp2(rng.integers(-12, 12, (1, 1, n)))
    w = jnp.asarray(w, dtype)
    if g > 1 and k > 128 and n > 128:
        w = w.at[0, :128, :128].set(0).at[1, 5, 200].set(jnp.nan).at[1, 140, 3].set(-jnp.inf)
    return w


# name -> (the engine's quantisation, the reference)
WEIGHT_LAYOUTS = {
    "in_place": (fp8.quantize_weights, reference.quantize_weights),
    "transposed": (fp8.quantize_weights_transposed, reference.quantize_weights_transposed),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", WEIGHT_CASES)
@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_quantize_weights_is_bitwise_the_reference(layout, case, dtype):
    """Each 128 x 128 block's own scale: `quantize(w, WEIGHT_BLOCK)` in w's layout, or of each
    expert's transpose."""
    op, reference_op = WEIGHT_LAYOUTS[layout]
    w = expert_weights(case, dtype, seed=len(case))
    q, scale = op(w)
    want_q, want_scale = reference_op(w)
    g, k, n = w.shape
    shape = (g, n, k) if layout == "transposed" else (g, k, n)
    assert q.dtype == fp8.E4M3 and q.shape == shape
    assert scale.dtype == jnp.float32 and scale.shape == (g, -(-shape[1] // 128),
                                                          -(-shape[2] // 128))
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))  # NaN == NaN here
    jitted = jax.jit(op)(w)
    np.testing.assert_array_equal(bits(jitted[0]), bits(q))
    if layout == "in_place":  # the layouts hold the same codes and scales
        q_t, scale_t = fp8.quantize_weights_transposed(w)
        np.testing.assert_array_equal(bits(q), bits(jnp.swapaxes(q_t, 1, 2)))
        np.testing.assert_array_equal(np.asarray(scale), np.asarray(jnp.swapaxes(scale_t, 1, 2)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [c for c in WEIGHT_CASES if c != "no_experts"])
@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_quantize_weights_with_given_scales_is_the_tensorwise_quantisation(layout, case, dtype):
    """The tensorwise recipe's call: expert g's scale for all of its blocks; each expert's own
    (no code saturates), a quarter of it (the largest do), and NaN for the first expert (every
    one of its codes, and none of the others')."""
    op, reference_op = WEIGHT_LAYOUTS[layout]
    w = expert_weights(case, dtype, seed=len(case) + 1)
    own = fp8._expert_scales(w)
    for given in (own, own / 4, own.at[0].set(jnp.nan)):
        q, scale = jax.jit(op)(w, scale=given)
        want_q, want_scale = reference_op(w, scale=given)
        np.testing.assert_array_equal(bits(q), bits(want_q))
        np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
        # the tensorwise codes of each expert's weight (or its transpose), bit for bit
        x = jnp.swapaxes(w, 1, 2) if layout == "transposed" else w
        tensor_q, _ = fp8.quantize(x, "tensor", scale=given[:, None, None])
        np.testing.assert_array_equal(bits(q), bits(tensor_q))


@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_quantize_weights_batches(layout):
    op, reference_op = WEIGHT_LAYOUTS[layout]
    w = jax.random.normal(jax.random.key(6), (3, 2, 130, 20), jnp.bfloat16)
    q, scale = jax.vmap(op)(w)
    for i in range(3):
        want_q, want_scale = reference_op(w[i])
        np.testing.assert_array_equal(bits(q[i]), bits(want_q))
        np.testing.assert_array_equal(np.asarray(scale[i]), np.asarray(want_scale))


@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
@pytest.mark.parametrize("args, kwargs, error, message", [
    ((jnp.ones((4, 4), jnp.float32),), {}, ValueError, "w must have rank 3 ([G, K, N])"),
    ((jnp.ones((2, 4, 4), jnp.int32),), {}, TypeError, "w must be"),
    ((jnp.ones((2, 4, 4), jnp.float32),), {"scale": jnp.ones((1,), jnp.float32)}, ValueError,
     "scale must be float32 of shape (2,) (one per expert of w), got float32[1]"),
    ((jnp.ones((2, 4, 4), jnp.float32),), {"scale": jnp.ones((2,), jnp.bfloat16)}, ValueError,
     "got bfloat16[2]"),
    ((jnp.ones((2, 4, 4), jnp.float32),), {"scale": jnp.float32(1)}, ValueError,
     "got float32[]"),
])
def test_quantize_weights_refuses_bad_input(layout, args, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        WEIGHT_LAYOUTS[layout][0](*args, **kwargs)


# --- the engine's FP8 weight gradient ----------------------------------------------------------

# name -> (M, C, group_sizes)
TRANSPOSED_CASES = {
    "unaligned_groups_and_rows_past_them": (330, 200, [130, 0, 100, 50]),
    "all_rows_in_one_group": (300, 24, [0, 300, 0]),
    "empty_groups": (40, 24, [0, 0, 0]),
    "aligned": (256, 8, [128, 128]),
    "negative_and_overlong_sizes": (50, 9, [-3, 40, 100]),
    "no_groups": (6, 4, []),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_quantize_transposed_is_bitwise_the_numpy_derivation(case, dtype):
    m, c, sizes = TRANSPOSED_CASES[case]
    rng = np.random.default_rng(m + c)
    # Magnitudes over 24 binades across the columns: subnormal codes and whole-block zeros.
    x = rng.standard_normal((m, c)) * np.exp2(rng.integers(-12, 12, (1, c)))
    x = jnp.asarray(x, dtype).at[:, 0].set(0)
    if m > 140:  # a NaN and an inf in one block each
        x = x.at[5, 1].set(jnp.nan).at[140, 2].set(-jnp.inf)
    q_t, scale = fp8.quantize_transposed(x, int32(sizes))
    want_q, want_scale = numpy_quantize_transposed(x, sizes)
    blocks = -(-m // 128) + len(sizes)
    assert q_t.dtype == fp8.E4M3 and q_t.shape == (c, 128 * blocks)
    assert scale.dtype == jnp.float32 and scale.shape == (blocks, c)
    np.testing.assert_array_equal(bits(q_t), want_q)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)  # NaN == NaN here
    jitted = jax.jit(fp8.quantize_transposed)(x, int32(sizes))
    np.testing.assert_array_equal(bits(jitted[0]), bits(q_t))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_quantize_transposed_with_a_given_scale_is_bitwise_the_numpy_derivation(case, dtype):
    """The tensorwise recipe's call: one scale for every block, unused ones included; the
    tensor's own (no code saturates), a quarter of it (the largest do) and NaN (every code)."""
    m, c, sizes = TRANSPOSED_CASES[case]
    rng = np.random.default_rng(m + c + 1)
    x = jnp.asarray(rng.standard_normal((m, c)) * np.exp2(rng.integers(-6, 6, (1, c))), dtype)
    _, tensor_scale = fp8.quantize(x, "tensor")
    for given_scale in (tensor_scale, tensor_scale / 4, jnp.float32(jnp.nan)):
        q_t, scale = jax.jit(fp8.quantize_transposed)(x, int32(sizes), scale=given_scale)
        want_q, want_scale = numpy_quantize_transposed(x, sizes, np.float32(given_scale.item()))
        np.testing.assert_array_equal(bits(q_t), want_q)
        np.testing.assert_array_equal(np.asarray(scale), want_scale)


def test_the_tensorwise_weight_gradient_operand_is_the_emulations():
    """The kernel path's tensorwise operand (the rows in the groups quantised at their one
    scale, the forward's, then re-laid by transpose_codes) dequantises to the emulation's
    tensorwise quantisation of those rows, and ignores the rows past the groups."""
    m, c, sizes = TRANSPOSED_CASES["unaligned_groups_and_rows_past_them"]
    x = jax.random.normal(jax.random.key(4), (m, c), jnp.bfloat16) * 3
    x = x.at[m - 1].set(1e4)  # past the groups: no effect on the scale
    q, scale = fp8._tensor_rows(x, int32(sizes))
    q_t = fp8.transpose_codes(q, int32(sizes))
    used = group_offsets(sizes, m)[-1]
    want_q, want_scale = fp8.quantize(x[:used], "tensor")
    assert scale.shape == (1,) and float(scale[0]) == float(want_scale.reshape(()))
    want = np.zeros((m, c))
    want[:used] = as_f64(fp8.dequantize(want_q, want_scale, "tensor"))
    blocks = jnp.broadcast_to(scale, (q_t.shape[1] // fp8.BLOCK, c))
    np.testing.assert_array_equal(untransposed(q_t, blocks, sizes, m), want)


def untransposed(q_t, scale, sizes, m):
    """The rows of quantize_transposed's blocks put back: [M, C] float32, zero past the groups
    (scale None: q_t's bytes as they are, [M, C] uint8)."""
    values = (np.swapaxes(q_t, 0, 1) if scale is None else
              as_f64(fp8.dequantize(jnp.swapaxes(q_t, 0, 1), scale, fp8.WGRAD_BLOCK)))
    out = np.zeros((m, values.shape[1]), values.dtype)
    bounds, b = group_offsets(sizes, m), 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        for first in range(start, end, fp8.BLOCK):
            rows = min(fp8.BLOCK, end - first)
            out[first:first + rows] = values[fp8.BLOCK * b:fp8.BLOCK * b + rows]
            b += 1
    return out


@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_quantize_transposed_holds_the_emulations_blocks(case):
    """Put back in place, the blocks dequantise to what the emulated weight gradient multiplies
    (`_qdq_group_rows`), value for value; with no groups, nothing (zeros)."""
    m, c, sizes = TRANSPOSED_CASES[case]
    x = jax.random.normal(jax.random.key(m), (m, c), jnp.bfloat16) * 100
    q_t, scale = fp8.quantize_transposed(x, int32(sizes))
    want = fp8._qdq_group_rows(fp8._rows_in_groups(x, int32(sizes)), int32(sizes), "blockwise")
    np.testing.assert_array_equal(untransposed(q_t, scale, sizes, m), as_f64(want))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("forward", ["emulated", "kernel"])
def test_no_groups_give_zeros_and_zero_gradients(recipe, forward):
    """G = 0: no row is in a group, so the result and lhs's gradient are zero and rhs's
    gradient is empty, on the emulation and on the kernels alike."""
    lhs = jax.random.normal(jax.random.key(0), (6, 32), jnp.bfloat16)
    rhs = jnp.ones((0, 32, 16), jnp.bfloat16)

    def loss(lhs, rhs):
        out = fp8.fp8_grouped_matmul(lhs, rhs, int32([]), recipe=recipe, forward=forward)
        return jnp.sum(out.astype(jnp.float32) * jnp.arange(16)), out

    (_, out), (dlhs, drhs) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)
    assert out.shape == (6, 16) and not np.any(as_f64(out))
    assert dlhs.shape == lhs.shape and not np.any(as_f64(dlhs))
    assert drhs.shape == rhs.shape


# name -> (M, K, N, group_sizes); N off the kernel's multiple of 8 (padded around the call)
CONTRACT_CASES = {**CASES, "negative_and_overlong_sizes": (50, 144, 24, [-3, 40, 100]),
                  "n_padded_for_the_kernel": (50, 100, 13, [20, 25])}


def contract_operands(m, k, n, sizes, seed=0):
    lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16)
    dout = jax.random.normal(jax.random.key(seed + 1), (m, n), jnp.bfloat16)
    return lhs, dout, (*fp8.quantize_transposed(lhs, int32(sizes)),
                       *fp8.quantize_transposed(dout, int32(sizes)))


@pytest.mark.parametrize("case", CONTRACT_CASES)
def test_the_fp8_contraction_is_the_emulated_weight_gradient(case):
    """Against the reference (the dequantised operands' product per group) and against the
    emulation's weight gradient, qdq(lhs)^T @ qdq(dout) over each group's rows in float32: up
    to float32 summation order and the kernel's bfloat16 output."""
    m, k, n, sizes = CONTRACT_CASES[case]
    lhs, dout, operands = contract_operands(m, k, n, sizes)
    got = nodrop.grouped_matmul_fp8_blockwise_contract(*operands, int32(sizes), num_rows=m)
    assert got.dtype == jnp.bfloat16 and got.shape == (len(sizes), k, n)
    assert_bf16_close(got, reference.grouped_matmul_fp8_blockwise_contract(
        *operands, int32(sizes), num_rows=m), "reference")
    rhs = jnp.zeros((len(sizes), k, n), jnp.bfloat16)  # the weight gradient needs its shape only
    _, emulated = jax.jit(fp8._emulated_backward, static_argnums=(4, 5, 6))(
        (lhs,), rhs, dout, int32(sizes), "blockwise", "fp8", grouped_matmul)
    assert_bf16_close(got, emulated, "emulation")
    for g, size in enumerate(np.diff(group_offsets(sizes, m))):
        if size == 0:
            assert not np.any(as_f64(got[g])), f"empty group {g}'s gradient is not zero"
    jitted = jax.jit(nodrop.grouped_matmul_fp8_blockwise_contract, static_argnames="num_rows")
    np.testing.assert_array_equal(as_f64(jitted(*operands, int32(sizes), num_rows=m)),
                                  as_f64(got))


def kept(lhs, sizes, recipe):
    """What the forward keeps of lhs for an FP8 weight gradient: lhs, or for the tensorwise
    recipe its codes and scale."""
    return fp8._tensor_rows(lhs, sizes) if recipe == "tensorwise" else (lhs,)


@functools.partial(jax.jit, static_argnums=3)
def kernel_and_emulated_weight_gradients(lhs, dout, sizes, recipe):
    rhs = jnp.zeros((sizes.shape[0], lhs.shape[1], dout.shape[1]), lhs.dtype)
    operands = (kept(lhs, sizes, recipe), rhs, dout, sizes, recipe, "fp8")
    return (fp8._kernel_backward(*operands)[1],
            fp8._emulated_backward(*operands, grouped_matmul)[1])


@settings(max_examples=20)
@given(sizes=st.one_of(valid_group_sizes(PROPERTY_SHAPE[0], PROPERTY_SHAPE[3]),
                       invalid_group_sizes(PROPERTY_SHAPE[0], PROPERTY_SHAPE[3])),
       seed=seeds, recipe=st.sampled_from(fp8.RECIPES))
def test_property_the_fp8_weight_gradient_is_the_emulated_one(sizes, seed, recipe):
    """Any group sizes, invalid ones included (clamped alike by both); the tensorwise recipe's
    codes gathered into the kernel's layout by group."""
    m, k, n, _ = PROPERTY_SHAPE
    lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16)
    dout = jax.random.normal(jax.random.key(seed + 1), (m, n), jnp.bfloat16)
    got, emulated = kernel_and_emulated_weight_gradients(lhs, dout, int32(sizes), recipe)
    assert_bf16_close(got, emulated)


def test_the_fp8_contraction_reads_only_the_groups_rows():
    """Codes and scales where no group row is (the short last block's tail, the blocks past
    the groups) change nothing: the contraction is over each group's rows."""
    m, k, n, sizes = 200, 16, 8, [70, 90]
    _, _, (lhs_t, lhs_scales, rhs_t, rhs_scales) = contract_operands(m, k, n, sizes, seed=4)
    got = nodrop.grouped_matmul_fp8_blockwise_contract(lhs_t, lhs_scales, rhs_t, rhs_scales,
                                                       int32(sizes), num_rows=m)
    # Block 0 holds group 0's rows 0-69, block 1 group 1's rows 70-159; blocks 2 and 3 are
    # unused (rows 160-199 are past the groups).
    owned = np.zeros(lhs_t.shape[1], bool)
    owned[0:70] = owned[128:128 + 90] = True
    noisy = [jnp.where(jnp.asarray(owned)[None, :], q, jnp.asarray(3.0, fp8.E4M3))
             for q in (lhs_t, rhs_t)]
    scales = [s.at[2:].set(1e3) for s in (lhs_scales, rhs_scales)]
    again = nodrop.grouped_matmul_fp8_blockwise_contract(noisy[0], scales[0], noisy[1],
                                                         scales[1], int32(sizes), num_rows=m)
    np.testing.assert_array_equal(as_f64(again), as_f64(got))


def test_the_fp8_weight_gradient_ops_under_vmap_and_checked_mode():
    m, k, sizes = 40, 16, int32([10, 30])
    lhs = jax.random.normal(jax.random.key(0), (3, m, k), jnp.bfloat16)
    q_t, scale = jax.vmap(fp8.quantize_transposed, in_axes=(0, None))(lhs, sizes)
    want = [fp8.quantize_transposed(x, sizes) for x in lhs]
    np.testing.assert_array_equal(bits(q_t), np.stack([bits(w[0]) for w in want]))
    np.testing.assert_array_equal(np.asarray(scale), np.stack([np.asarray(w[1]) for w in want]))
    gram = lambda q, s: nodrop.grouped_matmul_fp8_blockwise_contract(  # noqa: E731
        q, s, q, s, sizes, num_rows=m)
    np.testing.assert_array_equal(as_f64(jax.vmap(gram)(q_t, scale)),
                                  np.stack([as_f64(gram(*w)) for w in want]))
    x = jnp.ones((m, k), jnp.float32)
    with nodrop.checks(), pytest.raises(jax.errors.JaxRuntimeError,
                                        match=re.escape("group_sizes sum to 50")):
        jax.block_until_ready(fp8.quantize_transposed(x, int32([10, 40])))
    q, s = fp8.quantize_transposed(x, sizes)
    with nodrop.checks(), pytest.raises(jax.errors.JaxRuntimeError,
                                        match=re.escape("group_sizes[0] = -1 is negative")):
        jax.block_until_ready(nodrop.grouped_matmul_fp8_blockwise_contract(
            q, s, q, s, int32([-1, 30]), num_rows=m))


def _contract_args(**changes):
    _, _, (lhs_t, lhs_scales, rhs_t, rhs_scales) = contract_operands(200, 16, 24, [70, 90])
    args = dict(lhs_t=lhs_t, lhs_scales=lhs_scales, rhs_t=rhs_t, rhs_scales=rhs_scales,
                group_sizes=int32([70, 90]), num_rows=200)
    return {**args, **{name: change(args[name]) for name, change in changes.items()}}


@pytest.mark.parametrize("changes, error, message", [
    (dict(num_rows=lambda r: -1), ValueError, "num_rows must be a non-negative int (M), got -1"),
    (dict(num_rows=lambda r: 200.0), ValueError,
     "num_rows must be a non-negative int (M), got 200.0"),
    (dict(num_rows=lambda r: 300), ValueError,
     "lhs_t has 512 columns along axis 1 (P = 128 * (ceil(num_rows / 128) + G) for num_rows "
     "300 and G 2) but expected 640 (shape (16, 512))"),
    (dict(lhs_t=lambda x: x[0]), ValueError, "lhs_t must have rank 2 ([K, P]), got shape (512,)"),
    (dict(rhs_t=lambda x: x[None]), ValueError, "rhs_t must have rank 2 ([N, P])"),
    (dict(lhs_t=lambda x: x.astype(jnp.bfloat16)), TypeError,
     "lhs_t must be float8_e4m3fn, got bfloat16"),
    (dict(rhs_t=lambda x: x[:, :256]), ValueError,
     "rhs_t has 256 columns along axis 1 (P = 128 * (ceil(num_rows / 128) + G) for num_rows "
     "200 and G 2) but expected 512"),
    (dict(lhs_scales=lambda s: s[:3]), ValueError,
     "lhs_scales must be float32 of shape (4, 16) (one scale per block of 128 rows and column), "
     "got float32 of shape (3, 16)"),
    (dict(rhs_scales=lambda s: s.astype(jnp.bfloat16)), ValueError,
     "rhs_scales must be float32 of shape (4, 24)"),
    (dict(group_sizes=lambda g: g[None]), ValueError,
     "group_sizes must have rank 1 ([G]), got shape (1, 2)"),
    (dict(group_sizes=lambda g: g.astype(jnp.float32)), TypeError,
     "group_sizes must have an integer dtype, got float32"),
])
def test_grouped_matmul_fp8_blockwise_contract_refuses_bad_input(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        nodrop.grouped_matmul_fp8_blockwise_contract(**_contract_args(**changes))


# --- the engine's tensorwise weight gradient ---------------------------------------------------

TENSORWISE_CONTRACT_CASES = {**CONTRACT_CASES, "no_groups": (6, 16, 8, [])}


def tensorwise_contract_operands(m, k, n, sizes, seed=0):
    """lhs [M, K] and dout [M, N] in bfloat16 (dout on a scale of its own), and the tensorwise
    contraction's operands, as the recipe makes them: each one's codes at its one scale over the
    rows in the groups, re-laid by transpose_codes, and that scale [1]."""
    lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16)
    dout = jax.random.normal(jax.random.key(seed + 1), (m, n), jnp.bfloat16) / 1024
    return lhs, dout, (*tensorwise_transposed(lhs, int32(sizes)),
                       *tensorwise_transposed(dout, int32(sizes)))


def tensorwise_transposed(x, sizes):
    """The tensorwise weight gradient's operand of x: its rows' codes re-laid, and their scale."""
    q, scale = fp8._tensor_rows(x, sizes)
    return fp8.transpose_codes(q, sizes), scale


@pytest.mark.parametrize("case", TENSORWISE_CONTRACT_CASES)
def test_grouped_matmul_fp8_tensorwise_contract_matches_the_reference(case):
    """Against the reference (the dequantised operands' product per group) and against the
    emulated tensorwise weight gradient: up to float32 summation order and the kernel's bfloat16
    output. Empty groups give zeros; jitted, the same."""
    m, k, n, sizes = TENSORWISE_CONTRACT_CASES[case]
    lhs, dout, operands = tensorwise_contract_operands(m, k, n, sizes)
    got = nodrop.grouped_matmul_fp8_tensorwise_contract(*operands, int32(sizes), num_rows=m)
    assert got.dtype == jnp.bfloat16 and got.shape == (len(sizes), k, n)
    assert_bf16_close(got, reference.grouped_matmul_fp8_tensorwise_contract(
        *operands, int32(sizes), num_rows=m), "reference")
    rhs = jnp.zeros((len(sizes), k, n), jnp.bfloat16)  # the weight gradient needs its shape only
    _, emulated = jax.jit(fp8._emulated_backward, static_argnums=(4, 5, 6))(
        kept(lhs, int32(sizes), "tensorwise"), rhs, dout, int32(sizes), "tensorwise", "fp8",
        grouped_matmul)
    assert_bf16_close(got, emulated, "emulation")
    for g, size in enumerate(np.diff(group_offsets(sizes, m))):
        if size == 0:
            assert not np.any(as_f64(got[g])), f"empty group {g}'s gradient is not zero"
    jitted = jax.jit(nodrop.grouped_matmul_fp8_tensorwise_contract, static_argnames="num_rows")
    np.testing.assert_array_equal(as_f64(jitted(*operands, int32(sizes), num_rows=m)),
                                  as_f64(got))


@pytest.mark.parametrize("case", ["aligned", "negative_and_overlong_sizes",
                                  "unaligned_groups_and_rows_past_them"])
def test_grouped_matmul_fp8_tensorwise_contract_is_the_blockwise_one_on_repeated_scales(case):
    """The blockwise contraction on the same codes with quantize_transposed's own scales (the
    given one repeated over every block): bitwise the same where no group has more than 128
    rows (one block: the same float32 dot times the same scale product), else up to float32
    summation order."""
    m, k, n, sizes = CONTRACT_CASES[case]
    lhs, dout, (lhs_t, lhs_scale, rhs_t, rhs_scale) = tensorwise_contract_operands(
        m, k, n, sizes, seed=2)
    repeated = [fp8.quantize_transposed(x, int32(sizes), scale=scale)[1]
                for x, scale in ((lhs, lhs_scale), (dout, rhs_scale))]
    blockwise = nodrop.grouped_matmul_fp8_blockwise_contract(
        lhs_t, repeated[0], rhs_t, repeated[1], int32(sizes), num_rows=m)
    got = nodrop.grouped_matmul_fp8_tensorwise_contract(lhs_t, lhs_scale, rhs_t, rhs_scale,
                                                        int32(sizes), num_rows=m)
    if np.all(np.diff(group_offsets(sizes, m)) <= fp8.BLOCK):
        np.testing.assert_array_equal(as_f64(got), as_f64(blockwise))
    else:
        assert_bf16_close(got, blockwise)


def test_grouped_matmul_fp8_tensorwise_contract_under_vmap_scan_and_checked_mode():
    m, k, sizes = 40, 16, int32([10, 30])
    x = jax.random.normal(jax.random.key(0), (2, m, k), jnp.bfloat16) * jnp.asarray(
        [[[1.0]], [[8.0]]], jnp.bfloat16)
    q_t, scale = (jnp.stack(parts) for parts in zip(*(tensorwise_transposed(xi, sizes)
                                                      for xi in x)))
    gram = lambda q, s: nodrop.grouped_matmul_fp8_tensorwise_contract(  # noqa: E731
        q, s, q, s, sizes, num_rows=m)
    one_by_one = np.stack([as_f64(gram(q, s)) for q, s in zip(q_t, scale)])
    np.testing.assert_array_equal(as_f64(jax.vmap(gram)(q_t, scale)), one_by_one)

    def body(total, operand):  # the same call on each element of a scan
        return total, gram(*operand)

    _, scanned = jax.jit(lambda q, s: jax.lax.scan(body, 0, (q, s)))(q_t, scale)
    np.testing.assert_array_equal(as_f64(scanned), one_by_one)
    with nodrop.checks(), pytest.raises(jax.errors.JaxRuntimeError,
                                        match=re.escape("group_sizes[0] = -1 is negative")):
        jax.block_until_ready(nodrop.grouped_matmul_fp8_tensorwise_contract(
            q_t[0], scale[0], q_t[0], scale[0], int32([-1, 30]), num_rows=m))


def _tensorwise_contract_args(**changes):
    _, _, (lhs_t, lhs_scale, rhs_t, rhs_scale) = tensorwise_contract_operands(
        200, 16, 24, [70, 90])
    args = dict(lhs_t=lhs_t, lhs_scale=lhs_scale, rhs_t=rhs_t, rhs_scale=rhs_scale,
                group_sizes=int32([70, 90]), num_rows=200)
    return {**args, **{name: change(args[name]) for name, change in changes.items()}}


@pytest.mark.parametrize("changes, error, message", [
    (dict(num_rows=lambda r: -1), ValueError, "num_rows must be a non-negative int (M), got -1"),
    (dict(num_rows=lambda r: 300), ValueError,
     "lhs_t has 512 columns along axis 1 (P = 128 * (ceil(num_rows / 128) + G) for num_rows "
     "300 and G 2) but expected 640 (shape (16, 512))"),
    (dict(lhs_t=lambda x: x[0]), ValueError, "lhs_t must have rank 2 ([K, P]), got shape (512,)"),
    (dict(rhs_t=lambda x: x.astype(jnp.float32)), TypeError,
     "rhs_t must be float8_e4m3fn, got float32"),
    (dict(rhs_t=lambda x: x[:, :256]), ValueError,
     "rhs_t has 256 columns along axis 1 (P = 128 * (ceil(num_rows / 128) + G) for num_rows "
     "200 and G 2) but expected 512"),
    (dict(lhs_scale=lambda s: s.reshape(1, 1)), ValueError,
     "lhs_scale must be float32 of shape (1,) (one scale for all of lhs_t), got float32 of "
     "shape (1, 1)"),
    (dict(lhs_scale=lambda s: s.astype(jnp.bfloat16)), ValueError,
     "lhs_scale must be float32 of shape (1,) (one scale for all of lhs_t), got bfloat16 of "
     "shape (1,)"),
    (dict(rhs_scale=lambda s: jnp.broadcast_to(s, (4, 24))), ValueError,
     "rhs_scale must be float32 of shape (1,) (one scale for all of rhs_t), got float32 of "
     "shape (4, 24)"),
    (dict(group_sizes=lambda g: g[None]), ValueError,
     "group_sizes must have rank 1 ([G]), got shape (1, 2)"),
    (dict(group_sizes=lambda g: g.astype(jnp.float32)), TypeError,
     "group_sizes must have an integer dtype, got float32"),
])
def test_grouped_matmul_fp8_tensorwise_contract_refuses_bad_input(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        nodrop.grouped_matmul_fp8_tensorwise_contract(**_tensorwise_contract_args(**changes))


@pytest.mark.parametrize("op", ["rows", "contract"])
def test_fast_accumulation_reaches_the_engine_and_changes_nothing_on_the_cpu(op):
    """Both tensorwise ops pass fast_accumulation (default False) to their FFI target as a
    bool attribute; the CPU engine's sums are float32 either way, so the results are the
    same."""
    m, sizes = 40, int32([10, 25])
    if op == "rows":
        operands = tensorwise_operands(m, 200, 16, 2, seed=7)
        run = nodrop.grouped_matmul_fp8_tensorwise
    else:
        operands = tensorwise_contract_operands(m, 24, 16, [10, 25], seed=7)[2]
        run = functools.partial(nodrop.grouped_matmul_fp8_tensorwise_contract, num_rows=m)
    assert "fast_accumulation = false" in jax.jit(run).lower(*operands, sizes).as_text()
    results = {}
    for fast in (False, True):
        f = jax.jit(functools.partial(run, fast_accumulation=fast))
        assert f"fast_accumulation = {str(fast).lower()}" in f.lower(*operands, sizes).as_text()
        results[fast] = f(*operands, sizes)
    np.testing.assert_array_equal(as_f64(results[True]), as_f64(results[False]))


@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_transpose_codes_of_tensorwise_rows_is_the_transposed_quantisation(case):
    """Rows quantised at one scale, then re-laid: bitwise quantize_transposed of the rows at
    that scale (and the numpy derivation's codes), for the tensor's own scale, a quarter of it
    (the largest codes saturate) and NaN; eagerly and under jit, and every byte value moved as
    it is."""
    m, c, sizes = TRANSPOSED_CASES[case]
    rng = np.random.default_rng(m + c + 2)
    x = jnp.asarray(rng.standard_normal((m, c)) * np.exp2(rng.integers(-6, 6, (1, c))),
                    jnp.bfloat16)
    _, tensor_scale = fp8.quantize(x, "tensor")
    for given_scale in (tensor_scale, tensor_scale / 4, jnp.float32(jnp.nan)):
        q, _ = fp8.quantize(x, "tensor", scale=jnp.reshape(given_scale, (1, 1)))
        q_t = fp8.transpose_codes(q, int32(sizes))
        want, _ = fp8.quantize_transposed(x, int32(sizes), scale=given_scale)
        assert q_t.dtype == fp8.E4M3 and q_t.shape == want.shape
        np.testing.assert_array_equal(bits(q_t), bits(want))
        want_q, _ = numpy_quantize_transposed(x, sizes, np.float32(given_scale.item()))
        np.testing.assert_array_equal(bits(q_t), want_q)
        np.testing.assert_array_equal(bits(jax.jit(fp8.transpose_codes)(q, int32(sizes))),
                                      bits(q_t))
    codes = jnp.asarray(rng.integers(0, 256, (m, c), np.uint8)).view(fp8.E4M3)
    q_t = bits(fp8.transpose_codes(codes, int32(sizes)))
    want = np.where(np.arange(m)[:, None] < group_offsets(sizes, m)[-1], bits(codes), 0)
    np.testing.assert_array_equal(untransposed(q_t, None, sizes, m), want)


@pytest.mark.parametrize("args, error, message", [
    ((jnp.ones((4,), fp8.E4M3), int32([4])), ValueError, "q must have rank 2 ([M, C])"),
    ((jnp.ones((4, 4), jnp.bfloat16), int32([4])), TypeError,
     "q must be float8_e4m3fn, got bfloat16"),
    ((jnp.ones((4, 4), fp8.E4M3), int32([[4]])), ValueError,
     "group_sizes must have rank 1 ([G]), got shape (1, 1)"),
    ((jnp.ones((4, 4), fp8.E4M3), jnp.ones((1,), jnp.float32)), TypeError,
     "group_sizes must have an integer dtype, got float32"),
])
def test_transpose_codes_refuses_bad_input(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fp8.transpose_codes(*args)


@pytest.mark.parametrize("args, error, message", [
    ((jnp.ones((4,), jnp.float32), int32([4])), ValueError, "x must have rank 2 ([M, C])"),
    ((jnp.ones((4, 4), jnp.int32), int32([4])), TypeError, "x must be"),
    ((jnp.ones((4, 4), jnp.float32), int32([[4]])), ValueError,
     "group_sizes must have rank 1 ([G]), got shape (1, 1)"),
    ((jnp.ones((4, 4), jnp.float32), jnp.ones((1,), jnp.float32)), TypeError,
     "group_sizes must have an integer dtype, got float32"),
])
def test_quantize_transposed_refuses_bad_input(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fp8.quantize_transposed(*args)


@pytest.mark.parametrize("scale, message", [
    (jnp.ones((2,), jnp.float32), "scale must be one float32 value (any shape of one element), "
     "got float32[2]"),
    (jnp.ones((), jnp.bfloat16), "got bfloat16[]"),
    (jnp.ones((1, 0), jnp.float32), "got float32[1, 0]"),
])
def test_quantize_transposed_refuses_a_bad_given_scale(scale, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fp8.quantize_transposed(jnp.ones((4, 4), jnp.float32), int32([4]), scale=scale)
