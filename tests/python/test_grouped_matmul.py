"""grouped_matmul, grouped_matmul_contract and ragged_dot against the float64 reference."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (DTYPE_IDS, F32_TOL, FLOAT_DTYPES, assert_close, f64, group_offsets, int32,
                      invalid_group_sizes, random_normal, ref64, ref64_vjp, seeds, tolerance,
                      valid_group_sizes)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import nodrop
from nodrop.ops import reference

from nodrop.ops import grouped_matmul as gmm_module

# name -> (M, K, N, group_sizes)
EDGE_CASES = {
    "random": (40, 12, 10, [5, 0, 17, 8]),
    "empty_groups": (24, 8, 6, [0, 10, 0, 0, 6, 0]),
    "all_rows_in_one_group": (24, 8, 6, [0, 0, 24, 0]),
    "one_group": (24, 8, 6, [24]),
    "odd_k_and_n": (21, 7, 3, [4, 9, 8]),
    "one_row": (1, 8, 6, [0, 1, 0]),
    "rows_past_group_total": (32, 8, 6, [3, 0, 5]),
    "no_rows_in_any_group": (16, 8, 6, [0, 0, 0]),
    "k_and_n_one": (9, 1, 1, [2, 3, 4]),
}

# (M, K, N, G) for the property tests: a few fixed shapes so compiled calls are reused.
PROPERTY_SHAPES = [(1, 1, 1, 1), (7, 3, 5, 2), (16, 8, 16, 4), (33, 5, 3, 8), (64, 16, 16, 8),
                   (64, 15, 7, 1), (48, 16, 9, 3)]

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
out_dtypes = pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
transposes = pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs_kn", "rhs_nk"])
edge_cases = pytest.mark.parametrize("case", list(EDGE_CASES))


def gmm_inputs(rng, m, k, n, g, dtype=jnp.float32, transpose_rhs=False):
    lhs = random_normal(rng, (m, k), dtype)
    rhs = random_normal(rng, (g, n, k) if transpose_rhs else (g, k, n), dtype)
    return lhs, rhs


def contract_inputs(rng, m, k, n, dtype=jnp.float32):
    return random_normal(rng, (m, k), dtype), random_normal(rng, (m, n), dtype)


def assert_rows_past_groups_zero(out, group_sizes):
    total = group_offsets(group_sizes, out.shape[0])[-1]
    tail = np.asarray(out[total:]).astype(np.float64)
    assert np.all(tail == 0), f"rows {total}.. past the groups are not zero: {tail}"


# --- grouped_matmul: forward ------------------------------------------------------------------


@dtypes
@transposes
@edge_cases
def test_grouped_matmul_matches_reference(case, transpose_rhs, dtype):
    m, k, n, sizes = EDGE_CASES[case]
    lhs, rhs = gmm_inputs(np.random.default_rng(0), m, k, n, len(sizes), dtype, transpose_rhs)
    out = nodrop.grouped_matmul(lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    assert out.shape == (m, n) and out.dtype == dtype
    expected = ref64("grouped_matmul", lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    assert_close(out, expected, tolerance(dtype))
    assert_rows_past_groups_zero(out, sizes)


@dtypes
@out_dtypes
def test_grouped_matmul_out_dtype(dtype, out_dtype):
    m, k, n, sizes = EDGE_CASES["random"]
    lhs, rhs = gmm_inputs(np.random.default_rng(1), m, k, n, len(sizes), dtype)
    out = nodrop.grouped_matmul(lhs, rhs, int32(sizes), out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_close(out, ref64("grouped_matmul", lhs, rhs, int32(sizes)), tolerance(dtype, out_dtype))


@transposes
def test_grouped_matmul_rows_past_group_total_are_exactly_zero(transpose_rhs):
    lhs, rhs = gmm_inputs(np.random.default_rng(2), 32, 8, 6, 3, transpose_rhs=transpose_rhs)
    out = nodrop.grouped_matmul(lhs, rhs, int32([3, 0, 5]), transpose_rhs=transpose_rhs)
    assert np.any(np.asarray(out[:8]) != 0)
    assert np.all(np.asarray(out[8:]) == 0)


@dtypes
def test_grouped_matmul_ignores_nan_in_rows_past_group_total(dtype):
    """The reference masks rows outside every group, whatever lhs holds there."""
    lhs, rhs = gmm_inputs(np.random.default_rng(3), 16, 8, 6, 2, dtype)
    lhs = lhs.at[10:].set(jnp.nan)
    out = nodrop.grouped_matmul(lhs, rhs, int32([4, 6]))
    assert np.all(np.asarray(out[10:]).astype(np.float64) == 0)
    assert_close(out, ref64("grouped_matmul", lhs, rhs, int32([4, 6])), tolerance(dtype))


def test_grouped_matmul_promotes_mixed_input_dtypes():
    lhs, rhs = gmm_inputs(np.random.default_rng(4), 12, 4, 5, 2)
    out = nodrop.grouped_matmul(lhs.astype(jnp.bfloat16), rhs, int32([5, 7]))
    assert out.dtype == jnp.float32
    assert_close(out, ref64("grouped_matmul", lhs.astype(jnp.bfloat16), rhs, int32([5, 7])),
                 F32_TOL)


def test_grouped_matmul_accepts_int64_group_sizes():
    lhs, rhs = gmm_inputs(np.random.default_rng(5), 12, 4, 5, 2)
    sizes = jnp.asarray([5, 6], dtype=jnp.int64)
    out = nodrop.grouped_matmul(lhs, rhs, sizes)
    assert_close(out, ref64("grouped_matmul", lhs, rhs, sizes), F32_TOL)


# --- the CUDA lowering's operand adaptation, run on the CPU engine -------------------------------
# On the GPU, K and N are padded to multiples of 8 around the engine call and float32 runs on
# XLA's ragged dot; both adaptations are plain JAX around the engine, so they are exercised here
# around the CPU engine (engine="cpu").

CUDA_ADAPTED = {  # name -> (M, K, N, group_sizes)
    "unaligned_k_and_n": (40, 12, 10, [5, 0, 17, 8]),
    "k_and_n_one": (9, 1, 1, [2, 3, 4]),
    "invalid_sizes": (24, 9, 6, [-3, 30, 4]),
    "rows_past_group_total": (32, 8, 6, [3, 0, 5]),
}
cuda_adapted = pytest.mark.parametrize("case", list(CUDA_ADAPTED))
adapted_dtypes = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])


@adapted_dtypes
@transposes
@cuda_adapted
def test_cuda_lowering_of_grouped_matmul_matches_reference(case, transpose_rhs, dtype):
    m, k, n, sizes = CUDA_ADAPTED[case]
    lhs, rhs = gmm_inputs(np.random.default_rng(30), m, k, n, len(sizes), dtype, transpose_rhs)
    out = gmm_module._cuda_rows(lhs, rhs, int32(sizes), transpose_rhs, jnp.dtype(dtype),
                                engine="cpu")
    assert out.shape == (m, n) and out.dtype == dtype
    expected = ref64("grouped_matmul", lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    assert_close(out, expected, tolerance(dtype))
    assert_rows_past_groups_zero(out, sizes)


@adapted_dtypes
@cuda_adapted
def test_cuda_lowering_of_grouped_matmul_contract_matches_reference(case, dtype):
    m, k, n, sizes = CUDA_ADAPTED[case]
    lhs, rhs = contract_inputs(np.random.default_rng(31), m, k, n, dtype)
    out = gmm_module._cuda_contract(lhs, rhs, int32(sizes), jnp.dtype(dtype), engine="cpu")
    assert out.shape == (len(sizes), k, n) and out.dtype == dtype
    assert_close(out, ref64("grouped_matmul_contract", lhs, rhs, int32(sizes)), tolerance(dtype))


# --- grouped_matmul_contract: forward ---------------------------------------------------------


@dtypes
@edge_cases
def test_grouped_matmul_contract_matches_reference(case, dtype):
    m, k, n, sizes = EDGE_CASES[case]
    lhs, rhs = contract_inputs(np.random.default_rng(6), m, k, n, dtype)
    out = nodrop.grouped_matmul_contract(lhs, rhs, int32(sizes))
    assert out.shape == (len(sizes), k, n) and out.dtype == dtype
    assert_close(out, ref64("grouped_matmul_contract", lhs, rhs, int32(sizes)), tolerance(dtype))


@dtypes
@out_dtypes
def test_grouped_matmul_contract_out_dtype(dtype, out_dtype):
    m, k, n, sizes = EDGE_CASES["random"]
    lhs, rhs = contract_inputs(np.random.default_rng(7), m, k, n, dtype)
    out = nodrop.grouped_matmul_contract(lhs, rhs, int32(sizes), out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_close(out, ref64("grouped_matmul_contract", lhs, rhs, int32(sizes)),
                 tolerance(dtype, out_dtype))


def test_grouped_matmul_contract_empty_groups_are_exactly_zero():
    lhs, rhs = contract_inputs(np.random.default_rng(8), 24, 8, 6)
    sizes = [0, 10, 0, 0, 6, 0]
    out = np.asarray(nodrop.grouped_matmul_contract(lhs, rhs, int32(sizes)))
    for g in (0, 2, 3, 5):
        assert np.all(out[g] == 0), f"empty group {g} is not zero"
    assert np.any(out[1] != 0) and np.any(out[4] != 0)


def test_grouped_matmul_contract_ignores_rows_past_group_total():
    lhs, rhs = contract_inputs(np.random.default_rng(9), 16, 4, 3)
    sizes = int32([5, 3])
    out = nodrop.grouped_matmul_contract(lhs, rhs, sizes)
    changed = nodrop.grouped_matmul_contract(lhs.at[8:].set(100.0), rhs.at[8:].set(-100.0), sizes)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(changed))


# --- ragged_dot --------------------------------------------------------------------------------


@dtypes
@pytest.mark.parametrize("preferred", [None, jnp.float32], ids=["default", "f32"])
def test_ragged_dot_matches_reference(dtype, preferred):
    m, k, n, sizes = EDGE_CASES["random"]
    lhs, rhs = gmm_inputs(np.random.default_rng(10), m, k, n, len(sizes), dtype)
    out = nodrop.ragged_dot(lhs, rhs, int32(sizes), preferred_element_type=preferred)
    assert out.dtype == (preferred or dtype)
    assert_close(out, ref64("ragged_dot", lhs, rhs, int32(sizes)), tolerance(dtype, preferred))


def test_ragged_dot_matches_jax_lax_ragged_dot():
    lhs, rhs = gmm_inputs(np.random.default_rng(11), 30, 7, 5, 4)
    sizes = int32([8, 0, 12, 10])
    out = nodrop.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    expected = jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)
    assert_close(out, expected, 1e-5)


# --- gradients ----------------------------------------------------------------------------------

GRAD_SHAPE = (12, 5, 3)  # M, K, N
GRAD_SIZES = [3, 0, 7]  # rows 10, 11 are in no group


@transposes
def test_grouped_matmul_check_grads(transpose_rhs):
    m, k, n = GRAD_SHAPE
    lhs, rhs = gmm_inputs(np.random.default_rng(12), m, k, n, 3, transpose_rhs=transpose_rhs)
    sizes = int32(GRAD_SIZES)
    check_grads(lambda a, b: nodrop.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs),
                (lhs, rhs), order=1, modes=["rev"], atol=1e-3, rtol=1e-3, eps=1e-2)


@transposes
def test_grouped_matmul_second_order_check_grads(transpose_rhs):
    m, k, n = GRAD_SHAPE
    lhs, rhs = gmm_inputs(np.random.default_rng(13), m, k, n, 3, transpose_rhs=transpose_rhs)
    sizes = int32(GRAD_SIZES)
    check_grads(lambda a, b: nodrop.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs),
                (lhs, rhs), order=2, modes=["rev"], atol=1e-3, rtol=1e-3, eps=1e-2)


def test_grouped_matmul_contract_check_grads():
    m, k, n = GRAD_SHAPE
    lhs, rhs = contract_inputs(np.random.default_rng(14), m, k, n)
    sizes = int32(GRAD_SIZES)
    check_grads(lambda a, b: nodrop.grouped_matmul_contract(a, b, sizes),
                (lhs, rhs), order=2, modes=["rev"], atol=1e-3, rtol=1e-3, eps=1e-2)


def _gmm_vjp_against_reference(lhs, rhs, sizes, transpose_rhs, cotangent, tol):
    out, vjp = jax.vjp(
        lambda a, b: nodrop.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs), lhs, rhs)
    grad_lhs, grad_rhs = vjp(cotangent.astype(out.dtype))
    assert grad_lhs.dtype == lhs.dtype and grad_rhs.dtype == rhs.dtype
    expected = ref64_vjp(
        lambda a, b: reference.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs),
        (lhs, rhs), cotangent)
    assert_close(grad_lhs, expected[0], tol, "grad lhs")
    assert_close(grad_rhs, expected[1], tol, "grad rhs")


@dtypes
@transposes
@pytest.mark.parametrize("sizes", [GRAD_SIZES, [0, 12, 0], [-2, 9, 8]],
                         ids=["rows_past_total", "one_group", "invalid_clamped"])
def test_grouped_matmul_grads_match_reference(sizes, transpose_rhs, dtype):
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(15)
    lhs, rhs = gmm_inputs(rng, m, k, n, 3, dtype, transpose_rhs)
    _gmm_vjp_against_reference(lhs, rhs, int32(sizes), transpose_rhs,
                               random_normal(rng, (m, n), dtype), tolerance(dtype))


@dtypes
def test_grouped_matmul_contract_grads_match_reference(dtype):
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(16)
    lhs, rhs = contract_inputs(rng, m, k, n, dtype)
    sizes = int32(GRAD_SIZES)
    cotangent = random_normal(rng, (3, k, n), dtype)
    _, vjp = jax.vjp(lambda a, b: nodrop.grouped_matmul_contract(a, b, sizes), lhs, rhs)
    grads = vjp(cotangent)
    expected = ref64_vjp(lambda a, b: reference.grouped_matmul_contract(a, b, sizes),
                         (lhs, rhs), cotangent)
    assert_close(grads[0], expected[0], tolerance(dtype), "grad lhs")
    assert_close(grads[1], expected[1], tolerance(dtype), "grad rhs")


@transposes
def test_grouped_matmul_hessian_vector_product_matches_reference(transpose_rhs):
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(17)
    lhs, rhs = gmm_inputs(rng, m, k, n, 3, transpose_rhs=transpose_rhs)
    cot = random_normal(rng, (m, n))
    v_lhs, v_rhs = random_normal(rng, lhs.shape), random_normal(rng, rhs.shape)
    sizes = int32(GRAD_SIZES)

    def hvp(gmm, dtype):
        def loss(a, b):
            return jnp.sum(gmm(a, b, sizes, transpose_rhs=transpose_rhs) * cot.astype(dtype))

        def directional(a, b):
            g_a, g_b = jax.grad(loss, argnums=(0, 1))(a, b)
            return jnp.vdot(g_a, v_lhs.astype(dtype)) + jnp.vdot(g_b, v_rhs.astype(dtype))

        return jax.grad(directional, argnums=(0, 1))

    got = hvp(nodrop.grouped_matmul, jnp.float32)(lhs, rhs)
    expected = hvp(reference.grouped_matmul, jnp.float64)(f64(lhs), f64(rhs))
    assert_close(got[0], expected[0], F32_TOL, "hvp lhs")
    assert_close(got[1], expected[1], F32_TOL, "hvp rhs")


# --- transformations -------------------------------------------------------------------------


def test_grouped_matmul_under_jit():
    m, k, n, sizes = EDGE_CASES["random"]
    lhs, rhs = gmm_inputs(np.random.default_rng(18), m, k, n, len(sizes))
    out = jax.jit(nodrop.grouped_matmul, static_argnames=("transpose_rhs", "out_dtype"))(
        lhs, rhs, int32(sizes))
    assert_close(out, ref64("grouped_matmul", lhs, rhs, int32(sizes)), F32_TOL)


def test_grouped_matmul_group_sizes_are_traced_under_jit():
    """One compiled function serves different group sizes (they are run-time values)."""
    lhs, rhs = gmm_inputs(np.random.default_rng(19), 16, 4, 3, 3)
    fn = jax.jit(nodrop.grouped_matmul)
    for sizes in ([16, 0, 0], [1, 2, 3], [0, 0, 5], [-1, 20, 3]):
        assert_close(fn(lhs, rhs, int32(sizes)),
                     ref64("grouped_matmul", lhs, rhs, int32(sizes)), F32_TOL, str(sizes))


def _gmm_loss(gmm, a, b, sizes, cot):
    return jnp.sum(gmm(a, b, sizes) * cot)


@pytest.mark.parametrize("transform", ["jit_grad", "checkpoint"])
def test_grouped_matmul_grad_under_transform(transform):
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(20)
    lhs, rhs = gmm_inputs(rng, m, k, n, 3)
    cot = random_normal(rng, (m, n))
    sizes = int32(GRAD_SIZES)

    def grads(gmm, dtype):
        loss = lambda a, b: _gmm_loss(gmm, a, b, sizes, cot.astype(dtype))  # noqa: E731
        if transform == "checkpoint":
            loss = jax.checkpoint(loss)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    got = grads(nodrop.grouped_matmul, jnp.float32)(lhs, rhs)
    expected = grads(reference.grouped_matmul, jnp.float64)(f64(lhs), f64(rhs))
    assert_close(got[0], expected[0], F32_TOL, "grad lhs")
    assert_close(got[1], expected[1], F32_TOL, "grad rhs")


def test_grouped_matmul_under_scan_and_remat():
    """A scan over layers x <- tanh(grouped_matmul(x, W_l)), each layer rematerialised."""
    rng = np.random.default_rng(21)
    layers, m, h, g = 3, 20, 6, 4
    x = random_normal(rng, (m, h))
    weights = random_normal(rng, (layers, g, h, h), scale=h**-0.5)
    sizes = int32([6, 0, 9, 3])  # two rows in no group

    def model(gmm):
        @jax.checkpoint
        def layer(carry, w):
            return jnp.tanh(gmm(carry, w, sizes)) + carry, None

        def loss(x, ws):
            out, _ = jax.lax.scan(layer, x, ws)
            return jnp.sum(out**2), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    (_, out), grads = model(nodrop.grouped_matmul)(x, weights)
    (_, out64), grads64 = model(reference.grouped_matmul)(f64(x), f64(weights))
    assert_close(out, out64, F32_TOL, "output")
    assert_close(grads[0], grads64[0], F32_TOL, "grad x")
    assert_close(grads[1], grads64[1], F32_TOL, "grad weights")


def test_grouped_matmul_under_vmap():
    rng = np.random.default_rng(22)
    lhs = random_normal(rng, (3, 10, 4))
    rhs = random_normal(rng, (3, 2, 4, 5))
    sizes = int32([[4, 6], [0, 7], [10, 0]])
    out = jax.vmap(nodrop.grouped_matmul)(lhs, rhs, sizes)
    for b in range(3):
        assert_close(out[b], ref64("grouped_matmul", lhs[b], rhs[b], sizes[b]), F32_TOL, f"{b}")


# --- property tests ------------------------------------------------------------------------------


@st.composite
def gmm_case(draw, valid=True):
    m, k, n, g = draw(st.sampled_from(PROPERTY_SHAPES))
    sizes = draw(valid_group_sizes(m, g) if valid else invalid_group_sizes(m, g))
    return m, k, n, sizes


@settings(max_examples=200)
@given(case=gmm_case(), dtype=st.sampled_from(FLOAT_DTYPES), transpose_rhs=st.booleans(),
       seed=seeds)
def test_grouped_matmul_property_matches_reference(case, dtype, transpose_rhs, seed):
    m, k, n, sizes = case
    lhs, rhs = gmm_inputs(np.random.default_rng(seed), m, k, n, len(sizes), dtype, transpose_rhs)
    out = nodrop.grouped_matmul(lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    expected = ref64("grouped_matmul", lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    assert_close(out, expected, tolerance(dtype))
    assert_rows_past_groups_zero(out, sizes)


@settings(max_examples=100)
@given(case=gmm_case(valid=False), dtype=st.sampled_from(FLOAT_DTYPES),
       transpose_rhs=st.booleans(), seed=seeds)
def test_grouped_matmul_property_clamps_invalid_group_sizes(case, dtype, transpose_rhs, seed):
    m, k, n, sizes = case
    lhs, rhs = gmm_inputs(np.random.default_rng(seed), m, k, n, len(sizes), dtype, transpose_rhs)
    out = nodrop.grouped_matmul(lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    expected = ref64("grouped_matmul", lhs, rhs, int32(sizes), transpose_rhs=transpose_rhs)
    assert_close(out, expected, tolerance(dtype))
    assert_rows_past_groups_zero(out, sizes)


@settings(max_examples=200)
@given(case=gmm_case(), dtype=st.sampled_from(FLOAT_DTYPES),
       out_dtype=st.sampled_from((None, *FLOAT_DTYPES)), seed=seeds)
def test_grouped_matmul_contract_property_matches_reference(case, dtype, out_dtype, seed):
    m, k, n, sizes = case
    lhs, rhs = contract_inputs(np.random.default_rng(seed), m, k, n, dtype)
    out = nodrop.grouped_matmul_contract(lhs, rhs, int32(sizes), out_dtype=out_dtype)
    assert out.dtype == (out_dtype or dtype)
    assert_close(out, ref64("grouped_matmul_contract", lhs, rhs, int32(sizes)),
                 tolerance(dtype, out_dtype))


@settings(max_examples=100)
@given(case=gmm_case(valid=False), dtype=st.sampled_from(FLOAT_DTYPES), seed=seeds)
def test_grouped_matmul_contract_property_clamps_invalid_group_sizes(case, dtype, seed):
    m, k, n, sizes = case
    lhs, rhs = contract_inputs(np.random.default_rng(seed), m, k, n, dtype)
    out = nodrop.grouped_matmul_contract(lhs, rhs, int32(sizes))
    assert_close(out, ref64("grouped_matmul_contract", lhs, rhs, int32(sizes)), tolerance(dtype))


@settings(max_examples=100)
@given(case=gmm_case(), dtype=st.sampled_from(FLOAT_DTYPES),
       preferred=st.sampled_from((None, *FLOAT_DTYPES)), seed=seeds)
def test_ragged_dot_property_matches_reference(case, dtype, preferred, seed):
    m, k, n, sizes = case
    lhs, rhs = gmm_inputs(np.random.default_rng(seed), m, k, n, len(sizes), dtype)
    out = nodrop.ragged_dot(lhs, rhs, int32(sizes), preferred_element_type=preferred)
    assert out.dtype == (preferred or dtype)
    assert_close(out, ref64("ragged_dot", lhs, rhs, int32(sizes)), tolerance(dtype, preferred))
    assert_rows_past_groups_zero(out, sizes)


@settings(max_examples=60)
@given(case=st.one_of(gmm_case(), gmm_case(valid=False)), transpose_rhs=st.booleans(),
       seed=seeds)
def test_grouped_matmul_property_grads_match_reference(case, transpose_rhs, seed):
    m, k, n, sizes = case
    rng = np.random.default_rng(seed)
    lhs, rhs = gmm_inputs(rng, m, k, n, len(sizes), jnp.float32, transpose_rhs)
    _gmm_vjp_against_reference(lhs, rhs, int32(sizes), transpose_rhs,
                               random_normal(rng, (m, n)), F32_TOL)
