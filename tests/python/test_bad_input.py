"""Bad input: trace-time errors that name the argument, and checked mode for run-time values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import F32_TOL, assert_close, int32, random_normal, ref64
from jax.errors import JaxRuntimeError

import nodrop


def exactly(message: str) -> str:
    """A pytest.raises pattern that matches the whole message and nothing else."""
    return "^" + re.escape(message) + "$"


def f32(*shape):
    return jnp.ones(shape, jnp.float32)


def i32(*shape):
    return jnp.zeros(shape, jnp.int32)


# (call, exception type, exact message)
GROUPED_MATMUL_CASES = {
    "group_count": (
        lambda: nodrop.grouped_matmul(f32(16, 4), f32(8, 4, 3), i32(7)),
        ValueError, "group_sizes has 7 groups but rhs has 8"),
    "lhs_rank": (
        lambda: nodrop.grouped_matmul(f32(8), f32(2, 4, 3), i32(2)),
        ValueError, "lhs must have rank 2 ([M, K]), got shape (8,)"),
    "rhs_rank": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(4, 3), i32(2)),
        ValueError, "rhs must have rank 3 ([G, K, N]), got shape (4, 3)"),
    "rhs_rank_transposed": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(4, 3), i32(2), transpose_rhs=True),
        ValueError, "rhs must have rank 3 ([G, N, K]), got shape (4, 3)"),
    "contraction_size": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(2, 5, 3), i32(2)),
        ValueError,
        "rhs has contraction size 5 (axis 1 of shape (2, 5, 3)) but lhs has K=4 "
        "(shape (8, 4))"),
    "contraction_size_transposed": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(2, 4, 3), i32(2), transpose_rhs=True),
        ValueError,
        "rhs has contraction size 3 (axis 2 of shape (2, 4, 3)) but lhs has K=4 "
        "(shape (8, 4))"),
    "group_sizes_rank": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(2, 4, 3), i32(2, 1)),
        ValueError, "group_sizes must have rank 1 ([G]), got shape (2, 1)"),
    "group_sizes_dtype": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(2, 4, 3), f32(2)),
        TypeError, "group_sizes must have an integer dtype, got float32"),
    "lhs_dtype": (
        lambda: nodrop.grouped_matmul(i32(8, 4), f32(2, 4, 3), i32(2)),
        TypeError, "lhs must be float32, float16 or bfloat16, got int32"),
    "rhs_float64": (
        lambda: nodrop.grouped_matmul(f32(8, 4), jnp.ones((2, 4, 3), jnp.float64), i32(2)),
        TypeError, "rhs must be float32, float16 or bfloat16, got float64"),
    "out_dtype": (
        lambda: nodrop.grouped_matmul(f32(8, 4), f32(2, 4, 3), i32(2), out_dtype=jnp.int32),
        TypeError, "out_dtype must be float32, float16 or bfloat16, got int32"),
    "ragged_dot_group_count": (
        lambda: nodrop.ragged_dot(f32(16, 4), f32(8, 4, 3), i32(7)),
        ValueError, "group_sizes has 7 groups but rhs has 8"),
    "ragged_dot_preferred_type": (
        lambda: nodrop.ragged_dot(f32(8, 4), f32(2, 4, 3), i32(2),
                                  preferred_element_type=jnp.float64),
        TypeError, "out_dtype must be float32, float16 or bfloat16, got float64"),
    "ragged_dot_group_offset": (
        lambda: nodrop.ragged_dot(f32(8, 4), f32(2, 4, 3), i32(2), group_offset=i32(1)),
        NotImplementedError,
        "nodrop.ragged_dot: group_offset is not supported (got one of shape (1,)); pass the "
        "rows of the local groups as lhs and their sizes as group_sizes (one entry per group "
        "of rhs) instead"),
    "contract_rows": (
        lambda: nodrop.grouped_matmul_contract(f32(8, 4), f32(7, 3), i32(2)),
        ValueError, "rhs has 7 rows but lhs has 8 (shapes (7, 3) and (8, 4))"),
    "contract_rhs_rank": (
        lambda: nodrop.grouped_matmul_contract(f32(8, 4), f32(2, 8, 3), i32(2)),
        ValueError, "rhs must have rank 2 ([M, N]), got shape (2, 8, 3)"),
    "contract_group_sizes_dtype": (
        lambda: nodrop.grouped_matmul_contract(f32(8, 4), f32(8, 3), f32(2)),
        TypeError, "group_sizes must have an integer dtype, got float32"),
    "contract_lhs_dtype": (
        lambda: nodrop.grouped_matmul_contract(f32(8, 4).astype(jnp.float64), f32(8, 3),
                                               i32(2)),
        TypeError, "lhs must be float32, float16 or bfloat16, got float64"),
}

PERMUTE_CASES = {
    "x_rank": (
        lambda: nodrop.permute(f32(4), i32(4, 2), 3),
        ValueError, "x must have rank 2 ([T, H]), got shape (4,)"),
    "ids_rank": (
        lambda: nodrop.permute(f32(4, 3), i32(4), 3),
        ValueError, "ids must have rank 2 ([T, k]), got shape (4,)"),
    "x_dtype": (
        lambda: nodrop.permute(i32(4, 3), i32(4, 2), 3),
        TypeError, "x must be float32, float16 or bfloat16, got int32"),
    "ids_tokens": (
        lambda: nodrop.permute(f32(4, 3), i32(3, 2), 3),
        ValueError, "ids has 3 tokens (rows) as x has but expected 4 (shape (3, 2))"),
    "ids_no_slots": (
        lambda: nodrop.permute(f32(4, 3), i32(4, 0), 3),
        ValueError, "ids must have at least one slot per token, got shape (4, 0)"),
    "num_experts": (
        lambda: nodrop.permute(f32(4, 3), i32(4, 2), 0),
        ValueError, "num_experts must be at least 1, got 0"),
    "ids_dtype": (
        lambda: nodrop.permute(f32(4, 3), f32(4, 2), 3),
        TypeError, "ids must have an integer dtype, got float32"),
    "unpermute_rows_rank": (
        lambda: nodrop.unpermute(f32(8), i32(8), f32(4, 2)),
        ValueError, "rows must have rank 2 ([T*k, H]), got shape (8,)"),
    "unpermute_row_map_rank": (
        lambda: nodrop.unpermute(f32(8, 3), i32(4, 2), f32(4, 2)),
        ValueError, "row_map must have rank 1 ([T*k]), got shape (4, 2)"),
    "unpermute_weights_rank": (
        lambda: nodrop.unpermute(f32(8, 3), i32(8), f32(8)),
        ValueError, "weights must have rank 2 ([T, k]), got shape (8,)"),
    "unpermute_row_map_length": (
        lambda: nodrop.unpermute(f32(8, 3), i32(7), f32(4, 2)),
        ValueError, "row_map has 7 entries (T*k from weights) but expected 8 (shape (7,))"),
    "unpermute_rows_count": (
        lambda: nodrop.unpermute(f32(6, 3), i32(8), f32(4, 2)),
        ValueError, "rows has 6 rows (T*k from weights) but expected 8 (shape (6, 3))"),
    "unpermute_rows_dtype": (
        lambda: nodrop.unpermute(i32(8, 3), i32(8), f32(4, 2)),
        TypeError, "rows must be float32, float16 or bfloat16, got int32"),
    "unpermute_weights_float64": (
        lambda: nodrop.unpermute(f32(8, 3), i32(8), jnp.ones((4, 2), jnp.float64)),
        TypeError, "weights must be float32, float16 or bfloat16, got float64"),
    "unpermute_row_map_dtype": (
        lambda: nodrop.unpermute(f32(8, 3), f32(8), f32(4, 2)),
        TypeError, "row_map must have an integer dtype, got float32"),
}

ROUTER_CASES = {
    "logits_rank": (
        lambda: nodrop.topk_router(f32(8), 2),
        ValueError, "logits must have rank 2 ([T, E]), got shape (8,)"),
    "logits_dtype": (
        lambda: nodrop.topk_router(i32(4, 8), 2),
        TypeError, "logits must be float32, float16 or bfloat16, got int32"),
    "score_function": (
        lambda: nodrop.topk_router(f32(4, 8), 2, score_function="relu"),
        ValueError, "score_function must be one of ('softmax', 'sigmoid'), got 'relu'"),
    "k_above_e": (
        lambda: nodrop.topk_router(f32(4, 8), 9),
        ValueError, "k must be in [1, E=8], got 9"),
    "k_zero": (
        lambda: nodrop.topk_router(f32(4, 8), 0),
        ValueError, "k must be in [1, E=8], got 0"),
    "num_groups_not_dividing": (
        lambda: nodrop.topk_router(f32(4, 8), 2, num_groups=3),
        ValueError, "num_groups must divide the number of experts E=8, got 3"),
    "num_groups_zero": (
        lambda: nodrop.topk_router(f32(4, 8), 2, num_groups=0),
        ValueError, "num_groups must divide the number of experts E=8, got 0"),
    "topk_groups": (
        lambda: nodrop.topk_router(f32(4, 8), 2, num_groups=4, topk_groups=5),
        ValueError, "topk_groups must be in [1, num_groups=4], got 5"),
    "k_above_allowed_groups": (
        lambda: nodrop.topk_router(f32(4, 8), 3, num_groups=4, topk_groups=1),
        ValueError, "k=3 exceeds the 2 experts in the topk_groups=1 groups that may be chosen"),
    "expert_bias_length": (
        lambda: nodrop.topk_router(f32(4, 8), 2, expert_bias=f32(7)),
        ValueError, "expert_bias has 7 entries (E from logits) but expected 8 (shape (7,))"),
    "expert_bias_rank": (
        lambda: nodrop.topk_router(f32(4, 8), 2, expert_bias=f32(1, 8)),
        ValueError, "expert_bias must have rank 1 ([E]), got shape (1, 8)"),
    "expert_bias_dtype": (
        lambda: nodrop.topk_router(f32(4, 8), 2, expert_bias=i32(8)),
        TypeError, "expert_bias must be float32, float16 or bfloat16, got int32"),
}

ALL_CASES = {**GROUPED_MATMUL_CASES, **PERMUTE_CASES, **ROUTER_CASES}


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_bad_input_error_names_the_argument(case):
    call, error, message = ALL_CASES[case]
    with pytest.raises(error, match=exactly(message)):
        call()


def test_bad_input_is_reported_when_tracing_under_jit():
    """The error is raised while tracing, before anything is compiled or run."""
    fn = jax.jit(nodrop.grouped_matmul)
    # JAX appends a note about filtered traceback frames after the message
    with pytest.raises(ValueError,
                       match="^" + re.escape("group_sizes has 7 groups but rhs has 8") + "(\n|$)"):
        fn.trace(jax.ShapeDtypeStruct((16, 4), jnp.float32),
                 jax.ShapeDtypeStruct((8, 4, 3), jnp.float32),
                 jax.ShapeDtypeStruct((7,), jnp.int32))


# --- checked mode --------------------------------------------------------------------------------


def gmm_args(m=10, k=4, n=3, g=3, seed=0):
    rng = np.random.default_rng(seed)
    return random_normal(rng, (m, k)), random_normal(rng, (g, k, n))


INVALID_SIZES = {"negative": [4, -1, 3], "past_rows": [4, 5, 2], "int32_max": [1, 2**31 - 1, 0]}
invalid_sizes = pytest.mark.parametrize("sizes", list(INVALID_SIZES.values()),
                                        ids=list(INVALID_SIZES))


def run(fn, *args):
    return jax.block_until_ready(fn(*args))


def fresh_jit(op, **kwargs):
    """jax.jit of a new function object: JAX caches traces per function, and the checked flag
    is read when tracing, so a test must not reuse a trace made under another setting."""
    return jax.jit(lambda *args: op(*args, **kwargs))


@invalid_sizes
def test_checked_grouped_matmul_rejects_invalid_group_sizes(sizes):
    lhs, rhs = gmm_args()
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match="group_sizes"):
        run(nodrop.grouped_matmul, lhs, rhs, int32(sizes))


@invalid_sizes
def test_checked_grouped_matmul_transposed_rejects_invalid_group_sizes(sizes):
    lhs, rhs = gmm_args()
    rhs = jnp.swapaxes(rhs, 1, 2)
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match="group_sizes"):
        run(lambda a, b, s: nodrop.grouped_matmul(a, b, s, transpose_rhs=True), lhs, rhs,
            int32(sizes))


@invalid_sizes
def test_checked_grouped_matmul_contract_rejects_invalid_group_sizes(sizes):
    lhs, _ = gmm_args()
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match="group_sizes"):
        run(nodrop.grouped_matmul_contract, lhs, lhs, int32(sizes))


@invalid_sizes
def test_checked_ragged_dot_under_jit_rejects_invalid_group_sizes(sizes):
    lhs, rhs = gmm_args()
    with nodrop.checks():
        fn = fresh_jit(nodrop.ragged_dot)  # traced inside the block
        with pytest.raises(JaxRuntimeError, match="group_sizes"):
            run(fn, lhs, rhs, int32(sizes))


def test_checked_grouped_matmul_gradient_rejects_invalid_group_sizes():
    lhs, rhs = gmm_args()
    sizes = int32(INVALID_SIZES["past_rows"])
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match="group_sizes"):
        run(jax.jit(jax.grad(lambda a, b: jnp.sum(nodrop.grouped_matmul(a, b, sizes)))),
            lhs, rhs)


@pytest.mark.parametrize("bad_id", [-1, 4, 2**31 - 1], ids=["negative", "E", "int32_max"])
def test_checked_permute_rejects_out_of_range_ids(bad_id):
    x = random_normal(np.random.default_rng(1), (3, 5))
    ids = int32([[0, 1], [2, bad_id], [3, 3]])
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match="ids"):
        run(lambda v, i: nodrop.permute(v, i, 4), x, ids)


def test_checked_mode_accepts_valid_values():
    """Empty groups and a total short of the rows are valid: no error, the reference result."""
    lhs, rhs = gmm_args()
    sizes = int32([0, 6, 0])
    x = random_normal(np.random.default_rng(2), (3, 5))
    ids = int32([[0, 1], [2, 3], [3, 3]])
    with nodrop.checks():
        out = run(nodrop.grouped_matmul, lhs, rhs, sizes)
        contract = run(nodrop.grouped_matmul_contract, lhs, lhs, sizes)
        rows, group_sizes, _ = run(lambda v, i: nodrop.permute(v, i, 4), x, ids)
        grads = run(jax.grad(lambda a: jnp.sum(nodrop.grouped_matmul(a, rhs, sizes))), lhs)
    assert_close(out, ref64("grouped_matmul", lhs, rhs, sizes), F32_TOL)
    assert_close(contract, ref64("grouped_matmul_contract", lhs, lhs, sizes), F32_TOL)
    np.testing.assert_array_equal(np.asarray(group_sizes), [1, 1, 1, 3])
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(ref64("permute", x, ids,
                                                                     num_experts=4)[0]))
    assert np.all(np.isfinite(np.asarray(grads)))


def test_unchecked_mode_clamps_instead_of_raising():
    lhs, rhs = gmm_args()
    sizes = int32(INVALID_SIZES["past_rows"])
    out = run(fresh_jit(nodrop.grouped_matmul), lhs, rhs, sizes)
    assert_close(out, ref64("grouped_matmul", lhs, rhs, sizes), F32_TOL)
    ids = int32([[0, -1], [7, 1]])
    _, group_sizes, row_map = run(lambda v, i: nodrop.permute(v, i, 4), lhs[:2], ids)
    np.testing.assert_array_equal(np.asarray(group_sizes), [1, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(row_map), [0, -1, -1, 1])


ENV_CHECKS = """
import jax, jax.numpy as jnp, nodrop
lhs, rhs = jnp.ones((10, 4)), jnp.ones((3, 4, 3))
sizes = jnp.asarray([4, -1, 3])
assert nodrop.checks_enabled()
try:
    jax.jit(nodrop.grouped_matmul)(lhs, rhs, sizes).block_until_ready()
except jax.errors.JaxRuntimeError as error:
    print("checked:", str(error).splitlines()[0])
with nodrop.checks(False):
    assert not nodrop.checks_enabled()
    jax.jit(nodrop.grouped_matmul)(lhs, rhs, sizes).block_until_ready()
    print("unchecked inside checks(False)")
try:
    nodrop.permute(lhs[:2], jnp.asarray([[0], [3]]), 3).block_until_ready()
except jax.errors.JaxRuntimeError as error:
    print("checked again:", str(error).splitlines()[0])
"""


def test_nodrop_checks_env_var_enables_checked_mode_and_checks_false_overrides_it():
    """NODROP_CHECKS is read when nodrop is imported: a process of its own."""
    result = subprocess.run([sys.executable, "-c", ENV_CHECKS], capture_output=True, text=True,
                            env={**os.environ, "NODROP_CHECKS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "checked: INVALID_ARGUMENT: group_sizes[1] = -1 is negative",
        "unchecked inside checks(False)",
        "checked again: INVALID_ARGUMENT: ids[1, 0] = 3 is not an expert in [0, 3)"]


def test_checked_mode_is_part_of_the_jit_cache_key():
    """A function jitted before the block is traced again inside it, and the other way round;
    both pass the same function object to jax.jit, whose traces are cached per function."""
    lhs, rhs = gmm_args()
    sizes = int32(INVALID_SIZES["negative"])
    unchecked_first = jax.jit(nodrop.grouped_matmul)
    run(unchecked_first, lhs, rhs, sizes)
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match=r"group_sizes\[1\] = -1"):
        run(unchecked_first, lhs, rhs, sizes)
    run(unchecked_first, lhs, rhs, sizes)  # unchecked again, from its first trace
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match="group_sizes"):
        run(jax.jit(nodrop.grouped_matmul_contract), lhs, lhs, sizes)
    run(jax.jit(nodrop.grouped_matmul_contract), lhs, lhs, sizes)


def test_checked_mode_is_the_same_on_every_thread():
    lhs, rhs = gmm_args()
    sizes = int32(INVALID_SIZES["past_rows"])
    errors = []

    def trace_and_run():
        try:
            run(jax.jit(lambda a, b, s: 2 * nodrop.grouped_matmul(a, b, s)), lhs, rhs, sizes)
        except JaxRuntimeError as error:
            errors.append(str(error).splitlines()[0])

    with nodrop.checks():
        worker = threading.Thread(target=trace_and_run)
        worker.start()
        worker.join()
    assert errors == ["INVALID_ARGUMENT: group_sizes sum to 11 but there are only 10 rows"]


def test_checks_context_restores_previous_state():
    assert not nodrop.checks_enabled()
    with nodrop.checks():
        assert nodrop.checks_enabled()
        with nodrop.checks(False):
            assert not nodrop.checks_enabled()
        assert nodrop.checks_enabled()
    assert not nodrop.checks_enabled()


# --- integer widths, lists, dtypes eagerly and under jit --------------------------------------


WIDE_SIZES = {  # (sizes, what they mean for 10 rows): never wrapped
    "uint32_3e9": (np.array([3_000_000_000, 8, 0], np.uint32), [10, 0, 0]),
    "int64_2**32+3": (np.array([2**32 + 3, 0, 0], np.int64), [10, 0, 0]),
    "int64_below_int32": (np.array([4, -(2**32) + 1, 6], np.int64), [4, 0, 6]),
    "uint64": (np.array([2, 2**64 - 1, 0], np.uint64), [2, 8, 0]),
    "uint8": (np.array([3, 255, 0], np.uint8), [3, 7, 0]),
}


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "jax"])
@pytest.mark.parametrize("case", list(WIDE_SIZES))
def test_group_sizes_of_any_integer_dtype_keep_their_meaning(case, on_device):
    """Sizes past int32 saturate instead of wrapping: the same groups as their true values."""
    lhs, rhs = gmm_args()
    sizes, meaning = WIDE_SIZES[case]
    if on_device:  # x64 is on in the tests: jax keeps the 64-bit dtypes
        sizes = jnp.asarray(sizes)
    want = ref64("grouped_matmul", lhs, rhs, int32(meaning))
    assert_close(run(nodrop.grouped_matmul, lhs, rhs, sizes), want, F32_TOL)
    assert_close(run(jax.jit(nodrop.grouped_matmul), lhs, rhs, sizes), want, F32_TOL)
    assert_close(run(nodrop.grouped_matmul_contract, lhs, lhs, sizes),
                 ref64("grouped_matmul_contract", lhs, lhs, int32(meaning)), F32_TOL)


def test_checked_mode_reports_wide_group_sizes_without_wrapping_them():
    """uint32 3e9 wrapped to -1294967296 (a negative size the caller never passed)."""
    lhs, rhs = gmm_args()
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match=(
            "^INVALID_ARGUMENT: group_sizes sum to 2147483655 but there are only 10 rows")):
        run(nodrop.grouped_matmul, lhs, rhs, np.array([3_000_000_000, 8, 0], np.uint32))


@pytest.mark.parametrize("bad_id", [2**32 + 1, -(2**32) + 1, 2**40])
def test_int64_expert_ids_past_int32_are_dropped_not_wrapped(bad_id):
    x = random_normal(np.random.default_rng(1), (2, 5))
    ids = jnp.asarray([[0, 1], [bad_id, 3]], jnp.int64)
    rows, group_sizes, row_map = run(lambda v, i: nodrop.permute(v, i, 4), x, ids)
    np.testing.assert_array_equal(np.asarray(group_sizes), [1, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(row_map), [0, 1, -1, 2])
    with nodrop.checks(), pytest.raises(JaxRuntimeError, match=r"ids\[1, 0\] = -?2147483\d+ is "
                                                                r"not an expert in \[0, 4\)"):
        run(lambda v, i: nodrop.permute(v, i, 4), x, ids)


def test_lists_and_tuples_are_accepted_as_arrays():
    lhs, rhs = gmm_args()
    want = run(nodrop.grouped_matmul, lhs, rhs, int32([4, 3, 3]))
    np.testing.assert_array_equal(run(nodrop.grouped_matmul, lhs, rhs, [4, 3, 3]), want)
    np.testing.assert_array_equal(run(nodrop.ragged_dot, lhs, rhs, (4, 3, 3)), want)
    np.testing.assert_array_equal(
        run(nodrop.grouped_matmul_contract, lhs, lhs, [4, 3, 3]),
        run(nodrop.grouped_matmul_contract, lhs, lhs, int32([4, 3, 3])))
    x = random_normal(np.random.default_rng(2), (2, 5))
    for got, expected in zip(run(nodrop.permute, x, [[0, 1], [1, 2]], 3),
                             run(nodrop.permute, x, int32([[0, 1], [1, 2]]), 3)):
        np.testing.assert_array_equal(got, expected)
    with pytest.raises(TypeError, match=exactly(
            "group_sizes must have an integer dtype, got float64")):
        nodrop.grouped_matmul(lhs, rhs, [4.0, 3.0, 3.0])


def test_dtype_checks_are_the_same_eagerly_and_under_jit():
    """jit traces a float64 numpy array as float32 with x64 off, and as float64 with it on."""
    lhs64 = np.ones((10, 4), np.float64)
    _, rhs = gmm_args()
    sizes = int32([4, 3, 3])
    with jax.enable_x64(False):
        eager = run(nodrop.grouped_matmul, lhs64, rhs, sizes)
        jitted = run(jax.jit(nodrop.grouped_matmul), lhs64, rhs, sizes)
        assert eager.dtype == jitted.dtype == jnp.float32
        np.testing.assert_array_equal(eager, jitted)
        x = run(lambda v: nodrop.permute(v, int32([[0], [1]]), 2)[0], lhs64[:2])
        assert x.dtype == jnp.float32
    message = exactly("lhs must be float32, float16 or bfloat16, got float64")
    with pytest.raises(TypeError, match=message):
        nodrop.grouped_matmul(lhs64, rhs, sizes)
    with pytest.raises(TypeError, match=message + "|" + message[:-1] + "\n"):
        jax.jit(nodrop.grouped_matmul)(lhs64, rhs, sizes)
