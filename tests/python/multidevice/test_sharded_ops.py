"""nodrop's ops under `jit` on sharded arrays (outside shard_map), on 8 host devices: values
against the float64 reference, and the collectives the compiled program holds (none where an op
partitions locally; docs/design.md, "Ops under sharding")."""

from __future__ import annotations

import devices  # noqa: F401  (first: 8 host devices)
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import F32_TOL, assert_close, f64, int32, random_normal
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nodrop
from nodrop import _ffi
from nodrop.ops import reference

MESH = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
M, K, N = 32, 8, 6
# Shards of 8 rows (over x): groups straddle the shards, one is empty, a negative size counts as
# zero and the last one runs past the rows (clamped), as the engine does on one device.
SIZES = int32([-3, 5, 14, 0, 9, 100])


def collectives(compiled_text: str) -> set[str]:
    return {name for name in COLLECTIVES if re.search(rf"\b{name}(-start)?\(", compiled_text)}


def put(x, spec):
    return jax.device_put(x, NamedSharding(MESH, spec))


def compiled(fn, *args):
    jitted = jax.jit(fn)
    return jitted(*args), collectives(jitted.lower(*args).compile().as_text())


# name -> (lhs spec, rhs spec [G, K, N], collectives of the forward, output spec)
RAGGED_DOT = {
    "rows": (P("x"), P(), set(), P("x")),
    "columns": (P(), P(None, None, "y"), set(), P(None, "y")),
    "rows_and_columns": (P("x"), P(None, None, "y"), set(), P("x", "y")),
    "contraction": (P(None, "y"), P(None, "y"), {"all-reduce"}, P()),
    "experts_gathered": (P(), P("y"), {"all-gather"}, P()),
}


@pytest.mark.parametrize("case", list(RAGGED_DOT))
def test_ragged_dot_partitions_locally(case):
    """Rows and N split: no collective, the output keeps the split, as jax.lax.ragged_dot
    does; K split: one all-reduce; experts (G) split: gathered."""
    lhs_spec, rhs_spec, expected, out_spec = RAGGED_DOT[case]
    rng = np.random.default_rng(0)
    lhs, rhs = random_normal(rng, (M, K)), random_normal(rng, (len(SIZES), K, N))
    out, found = compiled(lambda a, b: nodrop.ragged_dot(a, b, SIZES), put(lhs, lhs_spec),
                          put(rhs, rhs_spec))
    assert found == expected
    assert out.sharding.spec == out_spec or tuple(out.sharding.spec) == tuple(out_spec)
    assert_close(out, reference.ragged_dot(f64(lhs), f64(rhs), SIZES), F32_TOL)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs_kn", "rhs_nk"])
def test_grouped_matmul_gradients_under_sharding(transpose_rhs):
    """Rows over x, N over y: the forward is local, the input gradient sums over the split N
    and the weight gradient over the split rows (all-reduces); nothing is gathered."""
    rng = np.random.default_rng(1)
    shape = (len(SIZES), N, K) if transpose_rhs else (len(SIZES), K, N)
    lhs, rhs = random_normal(rng, (M, K)), random_normal(rng, shape)
    n_axis = 1 if transpose_rhs else 2
    rhs_spec = P(*(("y" if axis == n_axis else None) for axis in range(3)))

    def loss(ops):
        return lambda a, b: jnp.sum(jnp.sin(ops.grouped_matmul(
            a, b, SIZES, transpose_rhs=transpose_rhs)))

    (grad_lhs, grad_rhs), found = compiled(jax.grad(loss(nodrop), argnums=(0, 1)),
                                           put(lhs, P("x")), put(rhs, rhs_spec))
    assert found == {"all-reduce"}
    expected = jax.grad(loss(reference), argnums=(0, 1))(f64(lhs), f64(rhs))
    assert_close(grad_lhs, expected[0], F32_TOL, "grad lhs")
    assert_close(grad_rhs, expected[1], F32_TOL, "grad rhs")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_matmul_contract_sums_split_rows(dtype):
    """The weight gradient's mode with its rows split: each shard's part, summed (all-reduce,
    in float32); K and N split stay local."""
    rng = np.random.default_rng(2)
    lhs, rhs = random_normal(rng, (M, K), dtype), random_normal(rng, (M, N), dtype)
    expected = reference.grouped_matmul_contract(f64(lhs), f64(rhs), SIZES)
    out, found = compiled(lambda a, b: nodrop.grouped_matmul_contract(a, b, SIZES),
                          put(lhs, P("x")), put(rhs, P("x")))
    assert found == {"all-reduce"} and out.dtype == dtype
    assert_close(out, expected, F32_TOL if dtype == jnp.float32 else 1e-2)
    out, found = compiled(lambda a, b: nodrop.grouped_matmul_contract(a, b, SIZES),
                          put(lhs, P(None, "x")), put(rhs, P(None, "y")))
    assert found == set() and tuple(out.sharding.spec) == (None, "x", "y")
    assert_close(out, expected, F32_TOL if dtype == jnp.float32 else 1e-2)


def test_jvp_under_sharding_is_local():
    rng = np.random.default_rng(3)
    lhs, rhs = random_normal(rng, (M, K)), random_normal(rng, (len(SIZES), K, N))
    t_lhs, t_rhs = random_normal(rng, lhs.shape), random_normal(rng, rhs.shape)
    args = (put(lhs, P("x")), put(rhs, P(None, None, "y")), put(t_lhs, P("x")),
            put(t_rhs, P(None, None, "y")))
    jvp = lambda ops: lambda a, b, ta, tb: jax.jvp(  # noqa: E731
        lambda a, b: ops.ragged_dot(a, b, SIZES), (a, b), (ta, tb))
    (out, tangent), found = compiled(jvp(nodrop), *args)
    assert found == set()
    ref_out, ref_tangent = jvp(reference)(*map(f64, (lhs, rhs, t_lhs, t_rhs)))
    assert_close(out, ref_out, F32_TOL, "primal")
    assert_close(tangent, ref_tangent, F32_TOL, "tangent")


def test_checked_mode_gathers_split_rows():
    """Checked mode must see the global group sizes to refuse invalid ones: the rows are
    gathered, and invalid sizes raise as on one device."""
    rng = np.random.default_rng(4)
    lhs, rhs = random_normal(rng, (M, K)), random_normal(rng, (3, K, N))
    sizes = int32([8, 16, 8])
    with nodrop.checks():
        out, found = compiled(lambda a, b, s: nodrop.ragged_dot(a, b, s), put(lhs, P("x")),
                              rhs, sizes)
        assert "all-gather" in found
        assert_close(out, reference.ragged_dot(f64(lhs), f64(rhs), sizes), F32_TOL)
        with pytest.raises(jax.errors.JaxRuntimeError, match="group_sizes"):
            jax.block_until_ready(jax.jit(lambda a, b, s: nodrop.ragged_dot(a, b, s))(
                put(lhs, P("x")), rhs, int32([8, 30, 8])))


def test_unpermute_partitions_the_hidden_axis_locally():
    """unpermute's and permute_rows' rows split over H stay split with no collective; the
    weights' gradient (gather_row_dots) sums over the split H: one all-reduce."""
    rng = np.random.default_rng(5)
    tokens, hidden, k, num_experts = 8, 8, 2, 4
    x = random_normal(rng, (tokens, hidden))
    ids = int32(rng.integers(0, num_experts, (tokens, k)))
    weights = random_normal(rng, (tokens, k))
    rows, _, row_map = reference.permute(x, ids, num_experts)
    out, found = compiled(nodrop.unpermute, put(rows, P(None, "y")), row_map, weights)
    assert found == set() and tuple(out.sharding.spec) == (None, "y")
    assert_close(out, reference.unpermute(f64(rows), row_map, f64(weights)), F32_TOL)

    loss = lambda ops: lambda r, w: jnp.sum(jnp.sin(ops.unpermute(r, row_map, w)))  # noqa: E731
    (grad_rows, grad_w), found = compiled(jax.grad(loss(nodrop), argnums=(0, 1)),
                                          put(rows, P(None, "y")), weights)
    assert found == {"all-reduce"}
    expected = jax.grad(loss(reference), argnums=(0, 1))(f64(rows), f64(weights))
    assert_close(grad_rows, expected[0], F32_TOL, "grad rows")
    assert_close(grad_w, expected[1], F32_TOL, "grad weights")


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_topk_router_partitions_tokens_locally(score_function):
    """Routing is per token: logits split over the tokens give weights and ids split the same
    way, and the logits' gradient too, with no collective."""
    rng = np.random.default_rng(6)
    logits, bias = random_normal(rng, (M, 8)), random_normal(rng, (8,), scale=0.1)
    route = lambda ops: lambda l: ops.topk_router(  # noqa: E731
        l, 2, score_function=score_function, expert_bias=bias, renormalize=True)
    (weights, ids), found = compiled(route(nodrop), put(logits, P(("x", "y"))))
    assert found == set() and tuple(weights.sharding.spec) == (("x", "y"),)
    ref_weights, ref_ids = route(reference)(f64(logits))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    assert_close(weights, ref_weights, F32_TOL, "weights")
    loss = lambda ops: lambda l: jnp.sum(jnp.sin(route(ops)(l)[0]))  # noqa: E731
    grad, found = compiled(jax.grad(loss(nodrop)), put(logits, P(("x", "y"))))
    assert found == set()
    assert_close(grad, jax.grad(loss(reference))(f64(logits)), F32_TOL, "grad logits",
                 floor=1e-3)


class _CudaLibraryStub:
    """Stands in for libnodrop_ffi_cuda.so: the ops then trace both platforms' branches of
    `jax.lax.platform_dependent`, here inside the partitioned per-device functions."""

    def NodropGroupedMatmulWorkspaceBytes(self, num_groups):  # noqa: N802 (the C symbol)
        return 0

    def NodropSortByExpertWorkspaceBytes(self, num_tokens, k, num_experts):  # noqa: N802
        return 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_partitioned_calls_keep_the_platform_switch(monkeypatch, dtype):
    """With the CUDA engine built, the per-device functions hold the platform switch too."""
    rng = np.random.default_rng(7)
    lhs, rhs = random_normal(rng, (M, K), dtype), random_normal(rng, (len(SIZES), K, N), dtype)
    args = (put(lhs, P("x")), put(rhs, P(None, None, "y")))
    def value_and_grads():  # a new function each time: traced and lowered again
        loss = lambda a, b: jnp.sum(jnp.sin(  # noqa: E731
            nodrop.ragged_dot(a, b, SIZES).astype(jnp.float32)))
        return compiled(jax.value_and_grad(loss, argnums=(0, 1)), *args)

    expected, _ = value_and_grads()
    monkeypatch.setattr(_ffi, "_cuda_lib", _CudaLibraryStub())
    switched, found = value_and_grads()
    assert found == {"all-reduce"}
    for got, want in zip(jax.tree.leaves(switched), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_permute_partitions_the_hidden_axis_locally():
    """Every shard sorts the same ids and moves its columns of the tokens: rows split over H,
    group sizes and row map replicated, no collective."""
    rng = np.random.default_rng(8)
    tokens, hidden, k, num_experts = 8, 8, 2, 4
    x = random_normal(rng, (tokens, hidden))
    ids = int32(rng.integers(-1, num_experts, (tokens, k)))
    (rows, sizes, row_map), found = compiled(lambda x, ids: nodrop.permute(x, ids, num_experts),
                                             put(x, P(None, "y")), ids)
    assert found == set() and tuple(rows.sharding.spec) == (None, "y")
    ref_rows, ref_sizes, ref_map = reference.permute(f64(x), ids, num_experts)
    np.testing.assert_array_equal(np.asarray(rows, np.float64), np.asarray(ref_rows))
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(ref_sizes))
    np.testing.assert_array_equal(np.asarray(row_map), np.asarray(ref_map))


@pytest.mark.parametrize("recipe, given_scale", [("blockwise", None), ("blockwise", 0.05),
                                                 ("tensorwise", 0.05)])
def test_fp8_weight_gradient_partitions_its_columns_locally(recipe, given_scale):
    """quantize_transposed (each block's scale, or one given), or for the tensorwise recipe
    transpose_codes of the rows' codes at one scale, and the FP8 contraction (blockwise, or
    tensorwise on the codes and the one scale) with their operands' columns split (K over x, N
    over y): no collective, the output keeps both splits, and the values are the one device's,
    bit for bit (the rows, summed over, stay whole)."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(5)
    lhs = random_normal(rng, (M, 16), jnp.bfloat16)
    dout = random_normal(rng, (M, 12), jnp.bfloat16)
    scale = None if given_scale is None else jnp.float32(given_scale)

    def weight_gradient(a, d):
        if recipe == "tensorwise":
            a_t, d_t = (fp8.transpose_codes(
                fp8.quantize(x, "tensor", scale=scale.reshape(1, 1))[0], SIZES) for x in (a, d))
            return nodrop.grouped_matmul_fp8_tensorwise_contract(
                a_t, scale.reshape(1), d_t, scale.reshape(1), SIZES, num_rows=M)
        (a_t, a_scales), (d_t, d_scales) = (fp8.quantize_transposed(x, SIZES, scale=scale)
                                            for x in (a, d))
        return nodrop.grouped_matmul_fp8_blockwise_contract(a_t, a_scales, d_t, d_scales, SIZES,
                                                            num_rows=M)

    out, found = compiled(weight_gradient, put(lhs, P(None, "x")), put(dout, P(None, "y")))
    assert found == set() and tuple(out.sharding.spec) == (None, "x", "y")
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(jax.jit(weight_gradient)(lhs, dout), np.float32))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_forward_partitions_its_rows_locally(recipe):
    """grouped_matmul_fp8_blockwise and grouped_matmul_fp8_tensorwise with the rows split over
    x (the blockwise row scales with them, the tensorwise one replicated): no collective, the
    output keeps the split, and the values are the one device's, bit for bit (each shard runs
    its rows with its part of each group)."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(9)
    lhs = random_normal(rng, (M, 16), jnp.bfloat16)
    rhs_t = random_normal(rng, (len(SIZES), 12, 16), jnp.bfloat16)  # [G, N, K]
    if recipe == "blockwise":
        op, lhs_scale_spec = nodrop.grouped_matmul_fp8_blockwise, P("x")
        (lhs_q, lhs_scale), (rhs_q_t, rhs_scales) = (fp8.quantize_rows(lhs),
                                                     fp8.quantize(rhs_t, fp8.WEIGHT_BLOCK))
    else:
        op, lhs_scale_spec = nodrop.grouped_matmul_fp8_tensorwise, P()
        (lhs_q, lhs_scale), (rhs_q_t, rhs_scales) = (fp8.quantize(lhs, "tensor"),
                                                     fp8.quantize(rhs_t, "tensor"))
        lhs_scale, rhs_scales = lhs_scale.reshape(1), rhs_scales.reshape(len(SIZES))

    def forward(q, scale):
        return op(q, scale, rhs_q_t, rhs_scales, SIZES)

    out, found = compiled(forward, put(lhs_q, P("x")), put(lhs_scale, lhs_scale_spec))
    assert found == set() and out.sharding.spec[0] == "x"
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(jax.jit(forward)(lhs_q, lhs_scale), np.float32))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_recipes_on_the_kernels_give_the_one_device_values_under_sharding(recipe):
    """The FP8 kernels' forward and both gradients (forward="kernel") with the rows split over
    x and the weight's N over y: the one device's gradients, bit for bit (the loss, a sum over
    shards, to float32 rounding): the tensorwise recipe's one scale per tensor is the amax
    over every shard's rows, which its transposed quantisations are then given."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(6)
    lhs = random_normal(rng, (M, 16), jnp.bfloat16)
    rhs = random_normal(rng, (len(SIZES), 16, 12), jnp.bfloat16)

    def value_and_grads(a, b):
        loss = lambda a, b: jnp.sum(jnp.sin(fp8.fp8_grouped_matmul(  # noqa: E731
            a, b, SIZES, recipe=recipe, forward="kernel").astype(jnp.float32)))
        return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

    (value, grads), _ = compiled(value_and_grads, put(lhs, P("x")), put(rhs, P(None, None, "y")))
    one_device_value, one_device_grads = jax.jit(value_and_grads)(lhs, rhs)
    np.testing.assert_allclose(float(value), float(one_device_value), rtol=1e-6)
    for got, want in zip(grads, one_device_grads):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("spec", [P("x", "y"), P(None, "y"), P()], ids=str)
def test_adamw_update_partitions_locally_and_sums_the_shards(spec):
    """The AdamW step is elementwise: each device updates its shard, and the update's sums are
    added over the shards (one all-reduce of five numbers); the parameters as on one device."""
    rng = np.random.default_rng(0)
    param, grad, mu, nu = (random_normal(rng, (16, 12), scale=scale)
                           for scale in (1.0, 1e-3, 1e-3, 1e-3))
    nu = jnp.abs(nu)
    kwargs = dict(step_size=jnp.float32(-0.05), count=jnp.int32(2), b1=0.9, b2=0.95, eps=1e-8,
                  weight_decay=0.1, max_grad_norm=1.0, grad_norm=jnp.float32(3.0))
    want = nodrop.adamw_update(param, grad, mu, nu, **kwargs)
    got, found = compiled(lambda *a: nodrop.adamw_update(*a, **kwargs),
                          *(put(x, spec) for x in (param, grad, mu, nu)))
    assert found == ({"all-reduce"} if spec != P() else set())
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(a, b)
        assert a.sharding.spec == spec or spec == P()
    np.testing.assert_allclose(got.sums, want.sums, rtol=1e-6)


@pytest.mark.parametrize("given_scales", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_weights_quantisations_partition_their_experts_locally(transposed, given_scales):
    """quantize_weights and quantize_weights_transposed (each block's scale, or each expert's
    given, as the tensorwise recipe's) with the experts split over x (their given scales with
    them) and the rows over y: the codes and scales keep x's split, with no collective but the
    gather of each weight's y-split rows, and the values are the one device's, bit for bit."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(11)
    w = random_normal(rng, (4, 130, 12), jnp.bfloat16)  # [G, K, N]
    scales = jnp.asarray(rng.uniform(0.001, 0.01, 4), jnp.float32) if given_scales else None
    op = fp8.quantize_weights_transposed if transposed else fp8.quantize_weights

    def quantise(w, scales):
        return op(w, scale=scales)

    args = (put(w, P("x", "y")),) + ((put(scales, P("x")),) if given_scales else (None,))
    (q, scale), found = compiled(quantise, *args)
    assert found <= {"all-gather"}
    assert tuple(q.sharding.spec)[:1] == ("x",) and tuple(scale.sharding.spec)[:1] == ("x",)
    want_q, want_scale = jax.jit(quantise)(w, scales)
    np.testing.assert_array_equal(np.asarray(q.view(jnp.uint8)),
                                  np.asarray(want_q.view(jnp.uint8)))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
