"""Every nodrop op inside `jax.shard_map` with its defaults (check_vma=True), on 8 host devices:
values and gradients against the float64 reference run shard by shard.

Operands split over the mesh vary from device to device; replicated operands (expert weights,
the expert bias) do not, and their gradient is the sum over the devices.
"""

from __future__ import annotations

import devices  # noqa: F401  (first: 8 host devices)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import F32_TOL, assert_close, f64, int32, random_normal, ref64_vjp, tolerance
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nodrop
from nodrop import _ffi
from nodrop.ops import reference

SHARDS = devices.NUM_DEVICES
MESH = jax.make_mesh((SHARDS,), ("x",), axis_types=(AxisType.Auto,))
SPLIT, WHOLE = P("x"), P()


def in_shard_map(fn, in_specs, out_specs):
    """fn on each device's shard, jitted; check_vma is left at its default (on)."""
    return jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_specs))


def shard_by_shard(fn, split, whole=()):
    """fn applied to each device's piece of the `split` arrays (and all of `whole`), the outputs
    concatenated: what `in_shard_map` computes, written as a loop."""
    pieces = [fn(*(a.reshape(SHARDS, -1, *a.shape[1:])[s] for a in split), *whole)
              for s in range(SHARDS)]
    return jax.tree.map(lambda *outs: jnp.concatenate(outs), *pieces)


def group_sizes_per_shard(rng, rows: int, groups: int):
    """[SHARDS * groups] sizes, each shard's own: empty groups and rows past the groups."""
    sizes = [np.diff(np.sort(np.concatenate([[0], rng.integers(0, rows + 1, groups - 1),
                                             [rng.integers(0, rows + 1)]]))) for _ in
             range(SHARDS)]
    sizes[0][:] = 0  # one shard with no rows in any group
    return int32(np.concatenate(sizes))


# --- grouped matmul ------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs_kn", "rhs_nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_matmul_in_shard_map(transpose_rhs, dtype):
    """lhs split over the devices, the weights replicated: rows as on one device, the weight
    gradient summed over the devices."""
    rng = np.random.default_rng(0)
    rows, k, n, groups = 12, 8, 6, 3
    lhs = random_normal(rng, (SHARDS * rows, k), dtype)
    rhs = random_normal(rng, (groups, n, k) if transpose_rhs else (groups, k, n), dtype)
    sizes = group_sizes_per_shard(rng, rows, groups)
    cot = random_normal(rng, (SHARDS * rows, n))

    def op(matmul):
        return lambda lhs, sizes, rhs: matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs)

    run = in_shard_map(op(nodrop.grouped_matmul), (SPLIT, SPLIT, WHOLE), SPLIT)
    out, vjp = jax.vjp(lambda lhs, rhs: run(lhs, sizes, rhs), lhs, rhs)
    grad_lhs, grad_rhs = vjp(cot.astype(out.dtype))
    ref = lambda lhs, rhs: shard_by_shard(op(reference.grouped_matmul), (lhs, sizes), (rhs,))
    assert out.dtype == dtype
    assert_close(out, ref(f64(lhs), f64(rhs)), tolerance(dtype), "output")
    ref_grad_lhs, ref_grad_rhs = ref64_vjp(ref, (lhs, rhs), cot.astype(dtype))
    assert_close(grad_lhs, ref_grad_lhs, tolerance(dtype), "grad lhs")
    assert_close(grad_rhs, ref_grad_rhs, tolerance(dtype), "grad rhs")


@pytest.mark.parametrize("weight_gradient", ["fp8", "unquantised"])
@pytest.mark.parametrize("forward", ["kernel", "emulated"])
def test_fp8_grouped_matmul_in_shard_map(forward, weight_gradient):
    """The blockwise FP8 recipe with lhs split over the devices and the weights replicated, on
    the engine's FP8 kernels and emulated: each device's rows as the recipe on its shard alone,
    the weight gradient the sum of the shards' (its custom VJP returns each gradient with its
    operand's type: the lhs gradient varying, the weights' summed)."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(5)
    rows, k, n, groups = 40, 256, 136, 3
    lhs = random_normal(rng, (SHARDS * rows, k), jnp.bfloat16)
    rhs = random_normal(rng, (groups, k, n), jnp.bfloat16)
    sizes = group_sizes_per_shard(rng, rows, groups)
    cot = random_normal(rng, (SHARDS * rows, n), jnp.bfloat16)

    def op(lhs, sizes, rhs):
        return fp8.fp8_grouped_matmul(lhs, rhs, sizes, forward=forward,
                                      weight_gradient=weight_gradient)

    run = in_shard_map(op, (SPLIT, SPLIT, WHOLE), SPLIT)
    out, vjp = jax.vjp(lambda lhs, rhs: run(lhs, sizes, rhs), lhs, rhs)
    grad_lhs, grad_rhs = vjp(cot)
    pieces = [jax.vjp(lambda a, b: op(a, s, b), a, rhs) for a, s in
              zip(lhs.reshape(SHARDS, rows, k), sizes.reshape(SHARDS, groups))]
    grads = [vjp_s(c) for (_, vjp_s), c in zip(pieces, cot.reshape(SHARDS, rows, n))]
    assert_close(out, jnp.concatenate([o for o, _ in pieces]), 1e-2, "output")
    assert_close(grad_lhs, jnp.concatenate([g[0] for g in grads]), 1e-2, "grad lhs")
    assert_close(grad_rhs, sum(g[1].astype(jnp.float32) for g in grads), 1e-2, "grad rhs")


def test_grouped_matmul_contract_in_shard_map():
    """Each device's weight gradient of its own rows, stacked [SHARDS, G, K, N]."""
    rng = np.random.default_rng(1)
    rows, k, n, groups = 10, 5, 7, 4
    lhs, rhs = random_normal(rng, (SHARDS * rows, k)), random_normal(rng, (SHARDS * rows, n))
    sizes = group_sizes_per_shard(rng, rows, groups)
    cot = random_normal(rng, (SHARDS * groups, k, n))

    def op(contract):
        return lambda lhs, rhs, sizes: contract(lhs, rhs, sizes)

    run = in_shard_map(op(nodrop.grouped_matmul_contract), (SPLIT,) * 3, SPLIT)
    out, vjp = jax.vjp(lambda lhs, rhs: run(lhs, rhs, sizes), lhs, rhs)
    ref = lambda lhs, rhs: shard_by_shard(op(reference.grouped_matmul_contract),
                                          (lhs, rhs, sizes))
    assert_close(out, ref(f64(lhs), f64(rhs)), F32_TOL, "output")
    for grad, ref_grad, name in zip(vjp(cot), ref64_vjp(ref, (lhs, rhs), cot), ("lhs", "rhs")):
        assert_close(grad, ref_grad, F32_TOL, f"grad {name}")


def test_ragged_dot_and_second_order_gradients_in_shard_map():
    """`nodrop.ragged_dot`, and the gradient of a gradient (each op's backward is made of ops).
    Each device has its own weights here: the gradient of a replicated operand taken inside
    shard_map would be the sum over the devices."""
    rng = np.random.default_rng(2)
    rows, k, n, groups = 9, 4, 6, 2
    lhs, rhs = random_normal(rng, (SHARDS * rows, k)), random_normal(rng, (SHARDS * groups, k, n))
    sizes = group_sizes_per_shard(rng, rows, groups)

    def grad_of_grad(ragged_dot, shard_map, rhs):
        def rhs_grad(lhs, sizes, rhs):  # per device: d/d rhs of sum(out^2)
            return jax.grad(lambda w: jnp.sum(ragged_dot(lhs, w, sizes) ** 2))(rhs)
        per_device = shard_map(rhs_grad)
        return jax.grad(lambda lhs: jnp.sum(jnp.sin(per_device(lhs, sizes, rhs))))

    def op(ragged_dot):
        return lambda lhs, sizes, rhs: ragged_dot(lhs, rhs, sizes)

    on_devices = lambda fn: in_shard_map(fn, (SPLIT,) * 3, SPLIT)
    by_shard = lambda fn: lambda *args: shard_by_shard(fn, args)
    out = on_devices(op(nodrop.ragged_dot))(lhs, sizes, rhs)
    assert_close(out, by_shard(op(reference.ragged_dot))(f64(lhs), sizes, f64(rhs)), F32_TOL,
                 "output")
    second = grad_of_grad(nodrop.ragged_dot, on_devices, rhs)(lhs)
    expected = jax.jit(grad_of_grad(reference.ragged_dot, by_shard, f64(rhs)))(f64(lhs))
    assert_close(second, expected, F32_TOL, "second-order gradient")


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["rhs_kn", "rhs_nk"])
def test_grouped_matmul_forward_mode_in_shard_map(transpose_rhs):
    """jvp and forward-over-reverse (a Hessian-vector product) inside shard_map: lhs split, the
    weights and their tangent replicated (check_vma: the primitives' results vary over the
    axes their operands do)."""
    rng = np.random.default_rng(7)
    rows, k, n, groups = 12, 8, 6, 3
    lhs = random_normal(rng, (SHARDS * rows, k))
    rhs = random_normal(rng, (groups, n, k) if transpose_rhs else (groups, k, n))
    t_lhs, t_rhs = random_normal(rng, lhs.shape), random_normal(rng, rhs.shape)
    sizes = group_sizes_per_shard(rng, rows, groups)

    def op(matmul):
        return lambda lhs, sizes, rhs: matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs)

    run = in_shard_map(op(nodrop.grouped_matmul), (SPLIT, SPLIT, WHOLE), SPLIT)
    ref = lambda lhs, rhs: shard_by_shard(op(reference.grouped_matmul), (lhs, sizes), (rhs,))
    out, d_out = jax.jvp(lambda a, b: run(a, sizes, b), (lhs, rhs), (t_lhs, t_rhs))
    ref_out, ref_d_out = jax.jvp(ref, (f64(lhs), f64(rhs)), (f64(t_lhs), f64(t_rhs)))
    assert_close(out, ref_out, F32_TOL, "output")
    assert_close(d_out, ref_d_out, F32_TOL, "tangent")

    def per_device_hvp(matmul):  # inside shard_map: d/dt of the gradient of a local loss
        def hvp(lhs, sizes, rhs, t_lhs, t_rhs):
            grad = jax.grad(lambda a, b: jnp.sum(jnp.sin(op(matmul)(a, sizes, b))),
                            argnums=(0, 1))
            return jax.jvp(grad, (lhs, rhs), (t_lhs, t_rhs))[1]
        return hvp

    hvp = in_shard_map(per_device_hvp(nodrop.grouped_matmul),
                       (SPLIT, SPLIT, WHOLE, SPLIT, WHOLE), (SPLIT, WHOLE))
    got_lhs, got_rhs = hvp(lhs, sizes, rhs, t_lhs, t_rhs)
    pieces = [per_device_hvp(reference.grouped_matmul)(
        *(f64(a).reshape(SHARDS, rows, -1)[s] if a is not sizes else
          a.reshape(SHARDS, -1)[s] for a in (lhs, sizes)), f64(rhs),
        f64(t_lhs).reshape(SHARDS, rows, -1)[s], f64(t_rhs)) for s in range(SHARDS)]
    assert_close(got_lhs, jnp.concatenate([p[0] for p in pieces]), F32_TOL, "hvp lhs")
    # The weights are replicated: their part is the sum of every device's, as for a gradient.
    assert_close(got_rhs, sum(p[1] for p in pieces), F32_TOL, "hvp rhs")


# --- permute and unpermute -----------------------------------------------------------------------


def moe_round_trip(ops, num_experts):
    """permute -> a per-expert scale -> unpermute: the rows' path through an MoE layer."""
    def fn(x, ids, weights):
        rows, group_sizes, row_map = ops.permute(x, ids, num_experts)
        scale = 1.0 + jnp.repeat(jnp.arange(num_experts, dtype=rows.dtype), group_sizes,
                                 total_repeat_length=rows.shape[0])
        return ops.unpermute(rows * scale[:, None], row_map, weights), group_sizes, row_map
    return fn


def test_permute_and_unpermute_in_shard_map():
    """Each device permutes its own tokens: the same rows, group sizes and row map as the
    reference on that device's tokens, and the same gradients."""
    rng = np.random.default_rng(3)
    tokens, hidden, k, num_experts = 6, 5, 2, 4
    x = random_normal(rng, (SHARDS * tokens, hidden))
    ids = int32(rng.integers(0, num_experts, (SHARDS * tokens, k)))
    ids = ids.at[:tokens].set(2)  # one device sends everything to one expert
    weights = random_normal(rng, (SHARDS * tokens, k))
    cot = random_normal(rng, x.shape)

    run = in_shard_map(moe_round_trip(nodrop, num_experts), (SPLIT,) * 3, SPLIT)
    y, group_sizes, row_map = run(x, ids, weights)
    ref = moe_round_trip(reference, num_experts)
    ref_y, ref_sizes, ref_map = shard_by_shard(ref, (f64(x), ids, f64(weights)))
    np.testing.assert_array_equal(np.asarray(group_sizes), np.asarray(ref_sizes))
    np.testing.assert_array_equal(np.asarray(row_map), np.asarray(ref_map))
    assert_close(y, ref_y, F32_TOL, "output")

    rows = in_shard_map(lambda x, ids: nodrop.permute(x, ids, num_experts)[0],
                        (SPLIT, SPLIT), SPLIT)(x, ids)
    ref_rows = shard_by_shard(lambda x, ids: reference.permute(x, ids, num_experts)[0],
                              (f64(x), ids))
    np.testing.assert_array_equal(np.asarray(rows, np.float64), np.asarray(ref_rows))

    _, vjp = jax.vjp(lambda x, w: run(x, ids, w)[0], x, weights)
    _, ref_vjp = jax.vjp(lambda x, w: shard_by_shard(ref, (x, ids, w))[0], f64(x), f64(weights))
    for grad, ref_grad, name in zip(vjp(cot), ref_vjp(f64(cot)), ("x", "weights")):
        assert_close(grad, ref_grad, F32_TOL, f"grad {name}")


def test_permute_of_replicated_tokens_sums_their_gradient():
    """The same tokens on every device, routed differently on each: the tokens' gradient is the
    sum of every device's."""
    rng = np.random.default_rng(4)
    tokens, hidden, k, num_experts = 5, 3, 2, 3
    x = random_normal(rng, (tokens, hidden))
    ids = int32(rng.integers(0, num_experts, (SHARDS * tokens, k)))
    weights = random_normal(rng, (SHARDS * tokens, k))

    def loss(ops, shard_map):
        fn = shard_map(lambda ids, weights, x: moe_round_trip(ops, num_experts)(x, ids, weights)[0])
        return lambda x: jnp.sum(jnp.sin(fn(ids, weights, x)))

    grad = jax.grad(loss(nodrop, lambda fn: in_shard_map(fn, (SPLIT, SPLIT, WHOLE), SPLIT)))(x)
    ref_grad = jax.grad(loss(reference, lambda fn: lambda ids, weights, x: shard_by_shard(
        fn, (ids, weights), (x,))))(f64(x))
    assert_close(grad, ref_grad, F32_TOL, "grad x")


# --- router --------------------------------------------------------------------------------------

ROUTERS = {
    "softmax_top2_bias": dict(k=2),
    "group_limited_sigmoid": dict(k=4, score_function="sigmoid", num_groups=4, topk_groups=2,
                                  renormalize=True, scaling_factor=2.5),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_topk_router_in_shard_map(name):
    """Logits split over the devices, the expert bias replicated."""
    rng = np.random.default_rng(5)
    tokens, num_experts = 6, 8
    logits = random_normal(rng, (SHARDS * tokens, num_experts))
    bias = random_normal(rng, (num_experts,), scale=0.1)
    cot = random_normal(rng, (SHARDS * tokens, ROUTERS[name]["k"]))

    def op(router):
        return lambda logits, bias: router(logits, expert_bias=bias, **ROUTERS[name])

    run = in_shard_map(op(nodrop.topk_router), (SPLIT, WHOLE), (SPLIT, SPLIT))
    (weights, ids), vjp = jax.vjp(lambda logits: run(logits, bias), logits)
    ref = lambda logits: shard_by_shard(op(reference.topk_router), (logits,), (f64(bias),))
    ref_weights, ref_ids = ref(f64(logits))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    assert_close(weights, ref_weights, F32_TOL, "weights")
    (grad,) = vjp((cot, np.zeros(ids.shape, jax.dtypes.float0)))
    _, ref_vjp = jax.vjp(lambda logits: ref(logits)[0], f64(logits))
    assert_close(grad, ref_vjp(f64(cot))[0], F32_TOL, "grad logits", floor=1e-3)


# --- the GPU build's platform switch -------------------------------------------------------------


class _CudaLibraryStub:
    """Stands in for libnodrop_ffi_cuda.so: the ops then trace both platforms' branches of
    `jax.lax.platform_dependent` (and lower the CPU one)."""

    def NodropGroupedMatmulWorkspaceBytes(self, num_groups):  # noqa: N802 (the C symbol)
        return 0

    def NodropSortByExpertWorkspaceBytes(self, num_tokens, k, num_experts):  # noqa: N802
        return 0


def test_platform_branches_have_the_same_type_in_shard_map(monkeypatch):
    """With the CUDA engine built, each op is a `platform_dependent` switch whose branches must
    have equal types, varying axes included (the CUDA branch of a float32 grouped matmul is
    XLA's ragged dot)."""
    rng = np.random.default_rng(6)
    tokens, hidden, k, num_experts = 4, 8, 2, 4
    x = random_normal(rng, (SHARDS * tokens, hidden))
    router = random_normal(rng, (hidden, num_experts))
    w = random_normal(rng, (num_experts, hidden, hidden), scale=hidden ** -0.5)

    def layer(x, router, w):
        weights, ids = nodrop.topk_router(x @ router, k)
        rows, group_sizes, row_map = nodrop.permute(x, ids, num_experts)
        return nodrop.unpermute(nodrop.grouped_matmul(rows, w, group_sizes), row_map, weights)

    def value_and_grads():
        run = in_shard_map(layer, (SPLIT, WHOLE, WHOLE), SPLIT)
        return jax.value_and_grad(lambda *args: jnp.sum(jnp.sin(run(*args))),
                                  argnums=(0, 1, 2))(x, router, w)

    expected = value_and_grads()
    monkeypatch.setattr(_ffi, "_cuda_lib", _CudaLibraryStub())
    switched = value_and_grads()
    for got, want in zip(jax.tree.leaves(switched), jax.tree.leaves(expected)):
        assert_close(got, want, F32_TOL)
