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


# --- forward mode (jvp, linearize, hessian) and the kernels reverse mode runs --------------------
# Both modes are bilinear primitives: the JVP is one primitive call per nonzero tangent, the
# transpose of either operand one call of the other mode.


def _jvp_against_reference(op, ref, primals, tangents, tol):
    out, d_out = jax.jvp(op, primals, tangents)
    ref_out, ref_d_out = jax.jvp(ref, tuple(map(f64, primals)), tuple(map(f64, tangents)))
    assert d_out.dtype == out.dtype
    assert_close(out, ref_out, tol, "primal")
    assert_close(d_out, ref_d_out, tol, "tangent")


@dtypes
@transposes
@pytest.mark.parametrize("sizes", [GRAD_SIZES, [-2, 9, 8]], ids=["rows_past_total", "clamped"])
def test_grouped_matmul_jvp_matches_reference(sizes, transpose_rhs, dtype):
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(40)
    lhs, rhs = gmm_inputs(rng, m, k, n, 3, dtype, transpose_rhs)
    tangents = (random_normal(rng, lhs.shape, dtype), random_normal(rng, rhs.shape, dtype))
    sizes = int32(sizes)
    _jvp_against_reference(
        lambda a, b: nodrop.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs),
        lambda a, b: reference.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs),
        (lhs, rhs), tangents, tolerance(dtype))


@dtypes
def test_grouped_matmul_contract_jvp_matches_reference(dtype):
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(41)
    lhs, rhs = contract_inputs(rng, m, k, n, dtype)
    tangents = (random_normal(rng, lhs.shape, dtype), random_normal(rng, rhs.shape, dtype))
    sizes = int32(GRAD_SIZES)
    _jvp_against_reference(lambda a, b: nodrop.grouped_matmul_contract(a, b, sizes),
                           lambda a, b: reference.grouped_matmul_contract(a, b, sizes),
                           (lhs, rhs), tangents, tolerance(dtype))


def test_ragged_dot_jvp_and_linearize_match_jax_lax_ragged_dot():
    rng = np.random.default_rng(42)
    lhs, rhs = gmm_inputs(rng, 30, 7, 5, 4)
    t_lhs, t_rhs = random_normal(rng, lhs.shape), random_normal(rng, rhs.shape)
    sizes = int32([8, 0, 12, 10])
    ours = lambda a, b: nodrop.ragged_dot(a, b, sizes)  # noqa: E731
    xla = lambda a, b: jax.lax.ragged_dot(  # noqa: E731
        a, b, sizes, precision=jax.lax.Precision.HIGHEST)
    out, d_out = jax.jvp(ours, (lhs, rhs), (t_lhs, t_rhs))
    ref_out, ref_d_out = jax.jvp(xla, (lhs, rhs), (t_lhs, t_rhs))
    assert_close(out, ref_out, 1e-5, "primal")
    assert_close(d_out, ref_d_out, 1e-5, "tangent")
    out, linear = jax.linearize(ours, lhs, rhs)
    ref_out, ref_linear = jax.linearize(xla, lhs, rhs)
    for scale in (1.0, -2.5):
        assert_close(linear(scale * t_lhs, t_rhs), ref_linear(scale * t_lhs, t_rhs), 1e-5,
                     f"linearized at {scale}")


@transposes
def test_grouped_matmul_check_grads_forward_and_reverse(transpose_rhs):
    m, k, n = GRAD_SHAPE
    lhs, rhs = gmm_inputs(np.random.default_rng(43), m, k, n, 3, transpose_rhs=transpose_rhs)
    sizes = int32(GRAD_SIZES)
    check_grads(lambda a, b: nodrop.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs),
                (lhs, rhs), order=2, modes=["fwd", "rev"], atol=1e-3, rtol=1e-3, eps=1e-2)
    check_grads(lambda a, b: nodrop.grouped_matmul_contract(a, b, sizes),
                (lhs, jnp.tanh(lhs[:, :n])), order=2, modes=["fwd", "rev"], atol=1e-3,
                rtol=1e-3, eps=1e-2)


def test_ragged_dot_hessian_matches_reference():
    """jax.hessian (forward over reverse) of a scalar loss in both operands; XLA's own ragged
    dot cannot do this (its batching rule supports only dimension 0)."""
    rng = np.random.default_rng(44)
    lhs, rhs = gmm_inputs(rng, 9, 3, 2, 3)
    sizes = int32([2, 0, 6])  # one row in no group

    def loss(ragged_dot):
        return lambda a, b: jnp.sum(jnp.sin(ragged_dot(a, b, sizes)) * jnp.arange(1.0, 3.0))

    got = jax.hessian(loss(nodrop.ragged_dot), argnums=(0, 1))(lhs, rhs)
    expected = jax.hessian(loss(reference.ragged_dot), argnums=(0, 1))(f64(lhs), f64(rhs))
    for (i, j) in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert_close(got[i][j], expected[i][j], F32_TOL, f"hessian block {i}{j}")


@pytest.mark.parametrize("transform", ["jit", "checkpoint", "scan"])
def test_grouped_matmul_jvp_under_transform(transform):
    rng = np.random.default_rng(45)
    layers, m, h, g = 3, 20, 6, 4
    x = random_normal(rng, (m, h))
    weights = random_normal(rng, (layers, g, h, h), scale=h**-0.5)
    t_x, t_w = random_normal(rng, x.shape), random_normal(rng, weights.shape)
    sizes = int32([6, 0, 9, 3])

    def model(gmm):
        def layer(carry, w):
            return jnp.tanh(gmm(carry, w, sizes)) + carry, None

        if transform == "scan":
            return lambda x, ws: jax.lax.scan(jax.checkpoint(layer), x, ws)[0]
        wrap = jax.jit if transform == "jit" else jax.checkpoint
        return wrap(lambda x, ws: layer(layer(x, ws[0])[0], ws[1])[0])

    out, d_out = jax.jit(lambda *a: jax.jvp(model(nodrop.grouped_matmul), a[:2], a[2:]))(
        x, weights, t_x, t_w)
    ref_out, ref_d_out = jax.jvp(model(reference.grouped_matmul), (f64(x), f64(weights)),
                                 (f64(t_x), f64(t_w)))
    assert_close(out, ref_out, F32_TOL, "primal")
    assert_close(d_out, ref_d_out, F32_TOL, "tangent")


def _engine_calls(fn, *args) -> dict:
    """How many times the compiled function calls each grouped matmul handler."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return {target: hlo.count(f'custom_call_target="{target}"')
            for target in ("nodrop_grouped_matmul", "nodrop_grouped_matmul_contract")}


@transposes
def test_grad_runs_three_kernels_per_grouped_matmul(transpose_rhs):
    """Reverse mode through the JVP's transpose is as lean as a hand-written VJP: the forward,
    the input gradient and the weight gradient; forward mode in one operand is two calls."""
    m, k, n = GRAD_SHAPE
    rng = np.random.default_rng(46)
    lhs, rhs = gmm_inputs(rng, m, k, n, 3, transpose_rhs=transpose_rhs)
    sizes = int32(GRAD_SIZES)
    loss = lambda a, b: jnp.sum(jnp.sin(  # noqa: E731
        nodrop.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs)))
    both = _engine_calls(jax.grad(loss, argnums=(0, 1)), lhs, rhs)
    assert both == {"nodrop_grouped_matmul": 2, "nodrop_grouped_matmul_contract": 1}
    weights_only = _engine_calls(jax.grad(loss, argnums=1), lhs, rhs)
    assert weights_only == {"nodrop_grouped_matmul": 1, "nodrop_grouped_matmul_contract": 1}
    tangent_lhs = _engine_calls(lambda a, b, t: jax.jvp(lambda a: loss(a, b), (a,), (t,)),
                                lhs, rhs, lhs)
    assert tangent_lhs == {"nodrop_grouped_matmul": 2, "nodrop_grouped_matmul_contract": 0}


# --- batching rules: a batch folded into the columns or rows of one call, or one call each ------


@pytest.mark.parametrize("batched", ["lhs", "rhs", "both"])
@transposes
def test_grouped_matmul_vmap_over_one_operand(batched, transpose_rhs):
    rng = np.random.default_rng(47)
    m, k, n, batch = 10, 4, 3, 3
    lhs, rhs = gmm_inputs(rng, m, k, n, 3, transpose_rhs=transpose_rhs)
    lhs_b = random_normal(rng, (batch, *lhs.shape))
    rhs_b = random_normal(rng, (batch, *rhs.shape))
    sizes = int32([3, -1, 9])  # clamped: the batched rows keep the engine's rule
    args, axes = {"lhs": ((lhs_b, rhs), (0, None)), "rhs": ((lhs, rhs_b), (None, 0)),
                  "both": ((lhs_b, rhs_b), (0, 0))}[batched]
    gmm = lambda ops: lambda a, b: ops.grouped_matmul(  # noqa: E731
        a, b, sizes, transpose_rhs=transpose_rhs)
    out = jax.vmap(gmm(nodrop), in_axes=axes)(*args)
    expected = jax.vmap(gmm(reference), in_axes=axes)(*map(f64, args))
    assert_close(out, expected, F32_TOL)


@pytest.mark.parametrize("batched", ["lhs", "rhs", "both"])
def test_grouped_matmul_contract_vmap_over_one_operand(batched):
    rng = np.random.default_rng(48)
    m, k, n, batch = 10, 4, 3, 3
    lhs, rhs = contract_inputs(rng, m, k, n)
    lhs_b, rhs_b = random_normal(rng, (m, batch, k)), random_normal(rng, (batch, m, n))
    sizes = int32([3, 0, 6])
    args, axes = {"lhs": ((lhs_b, rhs), (1, None)), "rhs": ((lhs, rhs_b), (None, 0)),
                  "both": ((lhs_b, rhs_b), (1, 0))}[batched]
    op = lambda ops: lambda a, b: ops.grouped_matmul_contract(a, b, sizes)  # noqa: E731
    out = jax.vmap(op(nodrop), in_axes=axes)(*args)
    expected = jax.vmap(op(reference), in_axes=axes)(*map(f64, args))
    assert_close(out, expected, F32_TOL)
