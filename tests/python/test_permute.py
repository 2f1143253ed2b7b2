"""permute / unpermute against the reference, and a full MoE stack under jit, grad, remat, scan."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (DTYPE_IDS, F32_TOL, FLOAT_DTYPES, INT32_MAX, INT32_MIN, as_f64,
                      assert_close, f64, int32, moe_layer, moe_params, random_normal, ref64,
                      ref64_vjp, seeds, tolerance)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import nodrop
from nodrop.ops import reference

# name -> (H, E, ids [T, k])
EDGE_CASES = {
    "random": (6, 4, [[0, 3], [2, 2], [1, 0], [3, 1], [0, 0], [2, 1], [1, 3], [3, 2]]),
    "k_equals_e": (5, 4, [[3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0]]),
    "one_token": (8, 4, [[3, 1]]),
    "one_expert": (4, 1, [[0], [0], [0]]),
    "all_tokens_to_one_expert": (4, 4, [[2], [2], [2], [2], [2]]),
    "empty_experts": (3, 8, [[5, 1], [1, 5], [5, 1]]),
    "dropped_ids": (5, 4, [[-1, 2], [4, 0], [1, 100], [INT32_MIN, INT32_MAX], [3, 3]]),
    "every_id_dropped": (3, 2, [[-1, 2], [5, -7]]),
    "odd_hidden": (7, 3, [[2, 0], [1, 2], [0, 1]]),
}

# (T, k, E, H) for the property tests.
PROPERTY_SHAPES = [(1, 1, 1, 1), (1, 2, 4, 3), (5, 2, 3, 7), (16, 4, 8, 16), (33, 1, 8, 5),
                   (16, 8, 8, 4)]

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
edge_cases = pytest.mark.parametrize("case", list(EDGE_CASES))


def edge_case(case, dtype=jnp.float32, seed=0):
    hidden, num_experts, ids = EDGE_CASES[case]
    x = random_normal(np.random.default_rng(seed), (len(ids), hidden), dtype)
    return x, int32(ids), num_experts


def assert_permute_matches_reference(x, ids, num_experts):
    rows, group_sizes, row_map = nodrop.permute(x, ids, num_experts)
    assert rows.dtype == x.dtype and group_sizes.dtype == jnp.int32 and row_map.dtype == jnp.int32
    assert rows.shape == (ids.size, x.shape[1])
    assert group_sizes.shape == (num_experts,) and row_map.shape == (ids.size,)
    ref_rows, ref_sizes, ref_map = ref64("permute", x, ids, num_experts=num_experts)
    np.testing.assert_array_equal(np.asarray(group_sizes), np.asarray(ref_sizes), "group_sizes")
    np.testing.assert_array_equal(np.asarray(row_map), np.asarray(ref_map), "row_map")
    np.testing.assert_array_equal(as_f64(rows), as_f64(ref_rows), "rows (exact copies)")
    total = int(np.sum(np.asarray(group_sizes)))
    assert np.all(as_f64(rows[total:]) == 0), "rows past the last group are not zero"
    return rows, group_sizes, row_map


# --- permute -------------------------------------------------------------------------------------


@dtypes
@edge_cases
def test_permute_matches_reference(case, dtype):
    assert_permute_matches_reference(*edge_case(case, dtype))


def test_permute_orders_rows_by_expert_then_token_then_slot():
    x = jnp.asarray([[1.0], [2.0]], dtype=jnp.float32)
    rows, group_sizes, row_map = nodrop.permute(x, int32([[1, 0], [0, 1]]), 2)
    # expert 0: (t0, s1), (t1, s0); expert 1: (t0, s0), (t1, s1)
    np.testing.assert_array_equal(np.asarray(row_map), [2, 0, 1, 3])
    np.testing.assert_array_equal(np.asarray(group_sizes), [2, 2])
    np.testing.assert_array_equal(np.asarray(rows)[:, 0], [1.0, 2.0, 1.0, 2.0])


def test_permute_drops_out_of_range_ids():
    x, ids, num_experts = edge_case("dropped_ids")
    rows, group_sizes, row_map = nodrop.permute(x, ids, num_experts)
    flat = np.asarray(ids).reshape(-1)
    dropped = (flat < 0) | (flat >= num_experts)
    assert np.all(np.asarray(row_map)[dropped] == -1)
    assert int(np.sum(np.asarray(group_sizes))) == int(np.sum(~dropped))
    assert np.all(np.asarray(rows)[int(np.sum(~dropped)):] == 0)


def test_permute_accepts_int64_ids():
    x, ids, num_experts = edge_case("random")
    assert_permute_matches_reference(x, ids.astype(jnp.int64), num_experts)


# --- unpermute -----------------------------------------------------------------------------------


def unpermute_inputs(case, dtype=jnp.float32, seed=0):
    x, ids, num_experts = edge_case(case, jnp.float32, seed)
    _, _, row_map = ref64("permute", x, ids, num_experts=num_experts)
    rng = np.random.default_rng(seed + 1)
    rows = random_normal(rng, (ids.size, x.shape[1]), dtype)
    weights = random_normal(rng, ids.shape)
    return rows, row_map, weights


@dtypes
@edge_cases
def test_unpermute_matches_reference(case, dtype):
    rows, row_map, weights = unpermute_inputs(case, dtype)
    out = nodrop.unpermute(rows, row_map, weights)
    assert out.dtype == dtype and out.shape == (weights.shape[0], rows.shape[1])
    assert_close(out, ref64("unpermute", rows, row_map, weights), tolerance(dtype))


@pytest.mark.parametrize("weights_dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_unpermute_casts_low_precision_weights(weights_dtype):
    rows, row_map, weights = unpermute_inputs("random")
    weights = weights.astype(weights_dtype)
    out = nodrop.unpermute(rows, row_map, weights)
    assert out.dtype == jnp.float32
    assert_close(out, ref64("unpermute", rows, row_map, weights), F32_TOL)


def test_unpermute_ignores_out_of_range_row_map_entries():
    rows, _, weights = unpermute_inputs("random")
    row_map = int32([3, -1, 16, 0, 5, INT32_MAX, 7, 7, INT32_MIN, 1, 2, 15, 4, 6, 8, 9])
    out = nodrop.unpermute(rows, row_map, weights)
    assert_close(out, ref64("unpermute", rows, row_map, weights), F32_TOL)


@dtypes
@edge_cases
def test_unpermute_inverts_permute(case, dtype):
    """unpermute(permute(x)) with weights w is sum_s w[t, s] * x[t] over the kept slots."""
    x, ids, num_experts = edge_case(case, dtype)
    rows, _, row_map = nodrop.permute(x, ids, num_experts)
    weights = random_normal(np.random.default_rng(1), ids.shape)
    out = nodrop.unpermute(rows, row_map, weights)
    flat = np.asarray(ids)
    kept = (flat >= 0) & (flat < num_experts)
    expected = np.sum(np.where(kept, as_f64(weights), 0), axis=1)[:, None] * as_f64(x)
    assert_close(out, expected, tolerance(dtype))


# --- gradients -----------------------------------------------------------------------------------


def test_permute_check_grads():
    x, ids, num_experts = edge_case("dropped_ids")
    check_grads(lambda v: nodrop.permute(v, ids, num_experts)[0], (x,), order=2, modes=["rev"],
                atol=1e-3, rtol=1e-3, eps=1e-2)


@pytest.mark.parametrize("case", ["random", "dropped_ids", "k_equals_e"])
def test_unpermute_check_grads(case):
    rows, row_map, weights = unpermute_inputs(case)
    check_grads(lambda r, w: nodrop.unpermute(r, row_map, w), (rows, weights), order=2,
                modes=["rev"], atol=1e-3, rtol=1e-3, eps=1e-2)


@dtypes
@pytest.mark.parametrize("case", ["random", "dropped_ids", "one_token"])
def test_permute_grads_match_reference(case, dtype):
    x, ids, num_experts = edge_case(case, dtype)
    cot = random_normal(np.random.default_rng(2), (ids.size, x.shape[1]), dtype)
    _, vjp = jax.vjp(lambda v: nodrop.permute(v, ids, num_experts)[0], x)
    (grad,) = vjp(cot)
    assert grad.dtype == dtype
    expected = ref64_vjp(lambda v: reference.permute(v, ids, num_experts)[0], (x,), cot)
    assert_close(grad, expected[0], tolerance(dtype))


@dtypes
@pytest.mark.parametrize("case", ["random", "dropped_ids", "k_equals_e"])
def test_unpermute_grads_match_reference(case, dtype):
    rows, row_map, weights = unpermute_inputs(case, dtype)
    cot = random_normal(np.random.default_rng(3), (weights.shape[0], rows.shape[1]), dtype)
    _, vjp = jax.vjp(lambda r, w: nodrop.unpermute(r, row_map, w), rows, weights)
    grad_rows, grad_weights = vjp(cot)
    assert grad_rows.dtype == dtype and grad_weights.dtype == jnp.float32
    expected = ref64_vjp(lambda r, w: reference.unpermute(r, row_map, w), (rows, weights), cot)
    assert_close(grad_rows, expected[0], tolerance(dtype), "grad rows")
    assert_close(grad_weights, expected[1], tolerance(dtype), "grad weights")


def test_permute_unpermute_second_order_grads_match_reference():
    x, ids, num_experts = edge_case("dropped_ids")
    rng = np.random.default_rng(4)
    weights, cot = random_normal(rng, ids.shape), random_normal(rng, x.shape)
    v_x, v_w = random_normal(rng, x.shape), random_normal(rng, ids.shape)

    def hvp(ops, dtype):
        def loss(x, w):
            rows, _, row_map = ops.permute(x, ids, num_experts)
            return jnp.sum(ops.unpermute(rows * rows, row_map, w) * cot.astype(dtype))

        def directional(x, w):
            g_x, g_w = jax.grad(loss, argnums=(0, 1))(x, w)
            return jnp.vdot(g_x, v_x.astype(dtype)) + jnp.vdot(g_w, v_w.astype(dtype))

        return jax.grad(directional, argnums=(0, 1))

    got = hvp(nodrop, jnp.float32)(x, weights)
    expected = hvp(reference, jnp.float64)(f64(x), f64(weights))
    assert_close(got[0], expected[0], F32_TOL, "hvp x")
    assert_close(got[1], expected[1], F32_TOL, "hvp weights")


# --- transformations and the MoE stack -------------------------------------------------------


def test_permute_and_unpermute_under_jit():
    x, ids, num_experts = edge_case("dropped_ids")
    weights = random_normal(np.random.default_rng(5), ids.shape)

    @jax.jit
    def roundtrip(x, ids, weights):
        rows, sizes, row_map = nodrop.permute(x, ids, num_experts)
        return nodrop.unpermute(rows * 2.0, row_map, weights), sizes

    out, sizes = roundtrip(x, ids, weights)
    ref_rows, ref_sizes, ref_map = ref64("permute", x, ids, num_experts=num_experts)
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(ref_sizes))
    assert_close(out, ref64("unpermute", ref_rows * 2.0, ref_map, weights), F32_TOL)


MOE = dict(layers=3, hidden=8, ffn=6, experts=4)
MOE_TOKENS, MOE_K = 24, 2


def moe_loss(ops, remat: bool):
    layer = lambda x, p: (moe_layer(ops, x, p, k=MOE_K), None)  # noqa: E731
    if remat:
        layer = jax.checkpoint(layer)

    def loss(x, params):
        out, _ = jax.lax.scan(layer, x, params)
        return jnp.sum(jnp.sin(out)), out

    return loss


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_remat"])
def test_moe_stack_under_scan_matches_reference(remat):
    """jit(grad(scan over layers of route -> permute -> grouped_matmul -> unpermute))."""
    rng = np.random.default_rng(6)
    x = random_normal(rng, (MOE_TOKENS, MOE["hidden"]))
    params = moe_params(rng, **MOE)
    grad_fn = lambda ops: jax.jit(jax.value_and_grad(  # noqa: E731
        moe_loss(ops, remat), argnums=(0, 1), has_aux=True))
    (_, out), (grad_x, grad_params) = grad_fn(nodrop)(x, params)
    (_, out64), (grad_x64, grad_params64) = grad_fn(reference)(
        f64(x), tuple(f64(p) for p in params))
    assert_close(out, out64, F32_TOL, "output")
    assert_close(grad_x, grad_x64, F32_TOL, "grad x")
    for name, got, expected in zip(("router", "w_in", "w_out"), grad_params, grad_params64):
        assert_close(got, expected, F32_TOL, f"grad {name}")


def test_moe_layer_bf16_matches_reference():
    rng = np.random.default_rng(7)
    x = random_normal(rng, (MOE_TOKENS, MOE["hidden"]), jnp.bfloat16)
    params = tuple(p[0] for p in moe_params(rng, **MOE, dtype=jnp.bfloat16))
    out = jax.jit(lambda x, p: moe_layer(nodrop, x, p, k=MOE_K))(x, params)
    assert out.dtype == jnp.bfloat16
    expected = moe_layer(reference, f64(x), tuple(f64(p) for p in params), k=MOE_K)
    assert_close(out, expected, tolerance(jnp.bfloat16))


# --- property tests ------------------------------------------------------------------------------


@st.composite
def permute_case(draw, allow_dropped=True):
    t, k, e, h = draw(st.sampled_from(PROPERTY_SHAPES))
    valid = st.integers(0, e - 1)
    if allow_dropped and draw(st.booleans()):
        entry = st.one_of(valid, valid, st.integers(-3, -1), st.integers(e, e + 3),
                          st.sampled_from([INT32_MIN, INT32_MAX]))
    else:
        entry = valid
    ids = draw(st.lists(entry, min_size=t * k, max_size=t * k))
    return np.asarray(ids, np.int64).reshape(t, k), e, h


@settings(max_examples=200)
@given(case=permute_case(), dtype=st.sampled_from(FLOAT_DTYPES), seed=seeds)
def test_permute_property_matches_reference(case, dtype, seed):
    ids, num_experts, hidden = case
    x = random_normal(np.random.default_rng(seed), (ids.shape[0], hidden), dtype)
    assert_permute_matches_reference(x, int32(ids), num_experts)


@settings(max_examples=200)
@given(case=permute_case(), dtype=st.sampled_from(FLOAT_DTYPES), arbitrary_map=st.booleans(),
       seed=seeds)
def test_unpermute_property_matches_reference(case, dtype, arbitrary_map, seed):
    ids, num_experts, hidden = case
    rng = np.random.default_rng(seed)
    slots = ids.size
    if arbitrary_map:  # repeats and out-of-range entries
        row_map = int32(rng.integers(-2, slots + 2, size=slots))
    else:
        row_map = ref64("permute", jnp.zeros((ids.shape[0], 1), jnp.float32), int32(ids),
                        num_experts=num_experts)[2]
    rows = random_normal(rng, (slots, hidden), dtype)
    weights = random_normal(rng, ids.shape)
    out = nodrop.unpermute(rows, row_map, weights)
    assert_close(out, ref64("unpermute", rows, row_map, weights), tolerance(dtype))


@settings(max_examples=60)
@given(case=permute_case(), seed=seeds)
def test_permute_unpermute_property_grads_match_reference(case, seed):
    ids, num_experts, hidden = case
    ids = int32(ids)
    rng = np.random.default_rng(seed)
    x = random_normal(rng, (ids.shape[0], hidden))
    weights, cot = random_normal(rng, ids.shape), random_normal(rng, x.shape)
    row_scale = random_normal(rng, (ids.size, hidden))

    def model(ops):
        def f(x, w):
            rows, _, row_map = ops.permute(x, ids, num_experts)
            return ops.unpermute(rows * row_scale.astype(x.dtype), row_map, w)
        return f

    _, vjp = jax.vjp(model(nodrop), x, weights)
    grads = vjp(cot)
    expected = ref64_vjp(model(reference), (x, weights), cot)
    assert_close(grads[0], expected[0], F32_TOL, "grad x")
    assert_close(grads[1], expected[1], F32_TOL, "grad weights")


# --- forward mode: the row movers are bilinear primitives, permute's rows linear in x ------------


def _round_trip(ops, num_experts, ids):
    def fn(x, weights):
        rows, _, row_map = ops.permute(x, ids, num_experts)
        return ops.unpermute(jnp.sin(rows), row_map, weights)
    return fn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_permute_and_unpermute_jvp_match_reference(dtype):
    rng = np.random.default_rng(60)
    tokens, hidden, k, num_experts = 7, 5, 2, 4
    x = random_normal(rng, (tokens, hidden), dtype)
    ids = int32(rng.integers(-1, num_experts + 1, (tokens, k)))  # some slots dropped
    weights = random_normal(rng, (tokens, k))
    t_x, t_w = random_normal(rng, x.shape, dtype), random_normal(rng, weights.shape)
    out, d_out = jax.jvp(_round_trip(nodrop, num_experts, ids), (x, weights), (t_x, t_w))
    ref_out, ref_d_out = jax.jvp(_round_trip(reference, num_experts, ids),
                                 (f64(x), f64(weights)), (f64(t_x), f64(t_w)))
    tol = F32_TOL if dtype == jnp.float32 else 2e-2
    assert d_out.dtype == dtype
    assert_close(out, ref_out, tol, "primal")
    assert_close(d_out, ref_d_out, tol, "tangent")


def test_permute_and_unpermute_hessian_and_linearize_match_reference():
    rng = np.random.default_rng(61)
    tokens, hidden, k, num_experts = 5, 3, 2, 3
    x = random_normal(rng, (tokens, hidden))
    ids = int32(rng.integers(0, num_experts, (tokens, k)))
    weights = random_normal(rng, (tokens, k))
    loss = lambda ops: lambda x, w: jnp.sum(  # noqa: E731
        _round_trip(ops, num_experts, ids)(x, w) ** 2)
    got = jax.hessian(loss(nodrop), argnums=(0, 1))(x, weights)
    expected = jax.hessian(loss(reference), argnums=(0, 1))(f64(x), f64(weights))
    for i in range(2):
        for j in range(2):
            assert_close(got[i][j], expected[i][j], F32_TOL, f"hessian block {i}{j}")
    _, linear = jax.linearize(_round_trip(nodrop, num_experts, ids), x, weights)
    _, ref_linear = jax.linearize(_round_trip(reference, num_experts, ids), f64(x), f64(weights))
    assert_close(linear(x, weights), ref_linear(f64(x), f64(weights)), F32_TOL, "linearized")


def test_grad_of_permute_and_unpermute_runs_the_same_kernels():
    """Reverse mode is the transpose of the JVP: permute and unpermute forward, then
    permute_rows (rows), gather_row_dots (weights) and unpermute (x): one call each."""
    rng = np.random.default_rng(62)
    x, weights = random_normal(rng, (6, 4)), random_normal(rng, (6, 2))
    ids = int32(rng.integers(0, 3, (6, 2)))
    grad = jax.grad(lambda x, w: jnp.sum(_round_trip(nodrop, 3, ids)(x, w) ** 2), argnums=(0, 1))
    hlo = jax.jit(grad).lower(x, weights).compile().as_text()
    calls = sorted(re.findall(r'custom_call_target="(nodrop_\w+)"', hlo))
    assert calls == ["nodrop_gather_row_dots", "nodrop_permute", "nodrop_permute_rows",
                     "nodrop_unpermute", "nodrop_unpermute"]
