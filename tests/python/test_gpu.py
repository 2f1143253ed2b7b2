"""Every op on the GPU (the CUDA engine) against its pure-JAX reference, run on the same GPU.

Skipped unless JAX sees a GPU and nodrop was built with its CUDA engine. `make gpu-check` runs
this file with XLA's command buffers (CUDA graphs) on for custom calls, so the jitted cases also
check that a captured call reads new group sizes on every replay.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nodrop
from conftest import numpy_quantize_transposed
from nodrop.ops import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (nodrop.backends()["cuda"] and jax.default_backend() == "gpu"),
                       reason="needs an NVIDIA GPU and nodrop's CUDA engine"),
]

TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3, jnp.float32: 2e-5}


def rel_error(actual, expected):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def group_sizes(kind, rows, groups, rng):
    """int32 [groups]: the group-size patterns the issue names (some sum to less than rows)."""
    if kind == "uniform":
        sizes = np.full(groups, rows // groups)
    elif kind == "zipf":
        share = 1.0 / np.arange(1, groups + 1)
        sizes = np.floor(rows * share / share.sum())
    elif kind == "empty_groups":  # every group but each third one is empty
        sizes = np.zeros(groups)
        sizes[::3] = rows // len(sizes[::3])
    elif kind == "all_in_one":
        sizes = np.zeros(groups)
        sizes[groups // 2] = rows
    elif kind == "random_short":  # sums to less than rows: the tail rows must come out zero
        sizes = rng.multinomial(rows - 37, np.ones(groups) / groups)
    else:
        raise ValueError(kind)
    return jnp.asarray(sizes, jnp.int32)


SIZE_KINDS = ["uniform", "zipf", "empty_groups", "all_in_one", "random_short"]
# (M rows, K, N, G): rows not a multiple of any tile; K and N multiples of 8 (TMA alignment).
GEMM_SHAPES = [(1000, 64, 136, 8), (777, 256, 64, 1), (2048, 512, 384, 33)]


def inputs(shape, dtype, seed=0):
    """lhs [M, K], rhs [G, K, N] and an output-shaped grad [M, N]."""
    m, k, n, g = shape
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (m, k), dtype), jax.random.normal(keys[1], (g, k, n), dtype),
            jax.random.normal(keys[2], (m, n), dtype))


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("kind", SIZE_KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_grouped_matmul_modes_match_reference(shape, kind, dtype, out_dtype):
    lhs, rhs, grad = inputs(shape, dtype)
    sizes = group_sizes(kind, shape[0], shape[3], np.random.default_rng(0))
    tol = TOLERANCE[out_dtype or dtype]
    cases = [
        (nodrop.grouped_matmul(lhs, rhs, sizes, out_dtype=out_dtype),
         reference.grouped_matmul(lhs, rhs, sizes, out_dtype=out_dtype)),
        (nodrop.grouped_matmul(grad, rhs, sizes, transpose_rhs=True, out_dtype=out_dtype),
         reference.grouped_matmul(grad, rhs, sizes, transpose_rhs=True, out_dtype=out_dtype)),
        (nodrop.grouped_matmul_contract(lhs, grad, sizes, out_dtype=out_dtype),
         reference.grouped_matmul_contract(lhs, grad, sizes, out_dtype=out_dtype)),
    ]
    for got, want in cases:
        assert got.dtype == want.dtype
        assert rel_error(got, want) <= tol
    used = int(jnp.clip(sizes, 0).sum())
    assert not np.asarray(cases[0][0][used:]).any(), "rows past the groups must be zero"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["zipf", "random_short"])
def test_unaligned_k_and_n_and_float32_run_on_the_gpu(dtype, kind):
    """K and N not multiples of 8 are padded for the TMA; float32 runs on XLA's ragged dot."""
    shape = (300, 36, 70, 5)
    lhs, rhs, grad = inputs(shape, dtype, seed=7)
    sizes = group_sizes(kind, shape[0], shape[3], np.random.default_rng(1))

    def vjp(fn):
        out, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return (out, *pullback(grad))

    got = jax.jit(lambda: vjp(nodrop.ragged_dot))()
    want = jax.jit(lambda: vjp(reference.ragged_dot))()
    for name, g, w in zip(["out", "lhs grad", "rhs grad"], got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel_error(g, w) <= TOLERANCE[dtype], name
    used = int(jnp.clip(sizes, 0).sum())
    assert not np.asarray(got[0][used:]).any(), "rows past the groups must be zero"


def test_grouped_matmul_gradients_match_reference():
    lhs, rhs, grad = inputs(GEMM_SHAPES[0], jnp.bfloat16, seed=1)
    sizes = group_sizes("zipf", lhs.shape[0], rhs.shape[0], None)

    def vjp(fn):
        out, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return (out, *pullback(grad))

    for got, want in zip(jax.jit(lambda: vjp(nodrop.ragged_dot))(),
                         jax.jit(lambda: vjp(reference.ragged_dot))()):
        assert rel_error(got, want) <= TOLERANCE[jnp.bfloat16]


def test_jitted_call_reads_new_group_sizes_on_every_replay():
    lhs, rhs, _ = inputs(GEMM_SHAPES[2], jnp.bfloat16, seed=2)
    step = jax.jit(lambda sizes: nodrop.ragged_dot(lhs, rhs, sizes))
    rng = np.random.default_rng(3)
    for kind in ["uniform", "all_in_one", "random_short", "zipf", "empty_groups"]:
        sizes = group_sizes(kind, lhs.shape[0], rhs.shape[0], rng)
        assert rel_error(step(sizes), reference.ragged_dot(lhs, rhs, sizes)) <= 2e-2, kind


def test_invalid_group_sizes_are_clamped_on_the_device():
    lhs, rhs, _ = inputs(GEMM_SHAPES[0], jnp.bfloat16, seed=4)
    for sizes in ([-5, 300, 2000, 7, -1, 0, 10**9, 3], [2**31 - 1] * 8):
        sizes = jnp.asarray(sizes, jnp.int32)
        assert rel_error(nodrop.ragged_dot(lhs, rhs, sizes),
                         reference.ragged_dot(lhs, rhs, sizes)) <= 2e-2


def test_results_are_bitwise_deterministic():
    lhs, rhs, grad = inputs(GEMM_SHAPES[2], jnp.bfloat16, seed=5)
    sizes = group_sizes("zipf", lhs.shape[0], rhs.shape[0], None)
    logits = jax.random.normal(jax.random.key(6), (lhs.shape[0], 32), jnp.float32)

    @jax.jit
    def layer(lhs, rhs, grad, logits):
        weights, ids = nodrop.topk_router(logits, 4)
        rows, routed_sizes, row_map = nodrop.permute(lhs, ids, 32)
        out = nodrop.unpermute(rows * 2, row_map, weights)
        return (nodrop.ragged_dot(lhs, rhs, sizes), nodrop.grouped_matmul_contract(lhs, grad, sizes),
                out, routed_sizes)

    first, second = layer(lhs, rhs, grad, logits), layer(lhs, rhs, grad, logits)
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def distinct_logits(tokens, experts, seed):
    """Logits whose scores are far from ties, so float32 GPU and reference pick the same ids."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([rng.permutation(experts) for _ in range(tokens)]) * 0.25,
                       jnp.float32)


@pytest.mark.parametrize("config", [
    dict(k=2),
    dict(k=8, renormalize=True),
    dict(k=8, score_function="sigmoid", num_groups=8, topk_groups=4, renormalize=True,
         scaling_factor=2.5),
])
@pytest.mark.parametrize("experts", [8, 64, 256])
def test_router_matches_reference_with_gradients(config, experts):
    groups = config.get("num_groups", 1)
    if config["k"] > config.get("topk_groups", 1) * experts // groups:
        pytest.skip("config does not fit the experts")
    logits = distinct_logits(300, experts, seed=experts)
    bias = jnp.linspace(-0.01, 0.01, experts, dtype=jnp.float32)
    config = dict(config, expert_bias=bias)
    weights, ids = nodrop.topk_router(logits, **config)
    ref_weights, ref_ids = reference.topk_router(logits, **config)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))
    assert rel_error(weights, ref_weights) <= 1e-5
    probe = jnp.arange(config["k"], dtype=jnp.float32) + 1
    grad = jax.grad(lambda l: (nodrop.topk_router(l, **config)[0] * probe).sum())(logits)
    ref_grad = jax.grad(lambda l: (reference.topk_router(l, **config)[0] * probe).sum())(logits)
    assert float(jnp.abs(grad - ref_grad).max()) <= 1e-5 * max(float(jnp.abs(ref_grad).max()), 1)


@pytest.mark.parametrize("ids_kind", ["uniform", "zipf", "one_expert", "all_to_one", "k_equals_e",
                                      "dropped"])
@pytest.mark.parametrize("hidden", [4096, 100])  # 100: rows not a multiple of 16 bytes
def test_permute_unpermute_match_reference(ids_kind, hidden):
    tokens, experts, k = 513, 16, 2
    rng = np.random.default_rng(7)
    if ids_kind == "uniform":
        ids = rng.integers(0, experts, (tokens, k))
    elif ids_kind == "zipf":
        ids = np.minimum(rng.zipf(1.5, (tokens, k)) - 1, experts - 1)
    elif ids_kind == "one_expert":
        experts, ids = 1, np.zeros((tokens, k))
    elif ids_kind == "all_to_one":
        ids = np.full((tokens, k), 5)
    elif ids_kind == "k_equals_e":
        k, ids = experts, np.tile(rng.permutation(experts), (tokens, 1))
    else:  # out-of-range ids drop their slot
        ids = rng.integers(-2, experts + 2, (tokens, k))
    ids = jnp.asarray(ids, jnp.int32)
    x = jax.random.normal(jax.random.key(8), (tokens, hidden), jnp.bfloat16)
    weights = jax.random.uniform(jax.random.key(9), (tokens, k), jnp.float32)
    got, want = nodrop.permute(x, ids, experts), reference.permute(x, ids, experts)
    for a, b in zip(got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    rows, _, row_map = got
    assert rel_error(nodrop.unpermute(rows, row_map, weights),
                     reference.unpermute(rows, row_map, weights)) <= 1e-2

    def loss(op_module, x, weights):
        rows, _, row_map = op_module.permute(x, ids, experts)
        return (op_module.unpermute(rows * 3, row_map, weights).astype(jnp.float32) ** 2).sum()

    grads = jax.grad(lambda x, w: loss(nodrop, x, w), argnums=(0, 1))(x, weights)
    ref_grads = jax.grad(lambda x, w: loss(reference, x, w), argnums=(0, 1))(x, weights)
    for a, b in zip(grads, ref_grads):
        assert rel_error(a, b) <= 2e-2


@pytest.mark.parametrize("name", ["small", "mixtral", "deepseek", "qwen3"])
def test_preset_moe_layer_matches_capacity_without_drops(name):
    """Each GPU preset's MoE layer at its real shapes and 4096 tokens: dropless (nodrop's CUDA
    engine) against the capacity path with buffers of T * k rows, which drops nothing and runs
    on XLA's einsum. The output and every gradient must agree to bf16 rounding, so a dropless
    run that trains differently from a capacity one is not a kernel defect at these shapes."""
    from flax import nnx

    from nodrop.models import preset
    from nodrop.moe import MoEBlock

    config = preset(name).moe_config()
    no_drop = config.__class__(**{**config.__dict__, "capacity_factor": float(config.num_experts)})
    x = jax.random.normal(jax.random.key(0), (4096, config.hidden), jnp.bfloat16)
    grad_out = jax.random.normal(jax.random.key(1), (4096, config.hidden), jnp.bfloat16)

    def layer_and_grads(moe_config):
        block = MoEBlock(moe_config, rngs=nnx.Rngs(0))
        graph, params, rest = nnx.split(block, nnx.Param, ...)

        def loss(params, x):
            y, aux = nnx.merge(graph, params, rest)(x)
            return jnp.sum(y.astype(jnp.float32) * grad_out) + aux.load_balancing_loss, y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return y, grads

    y, grads = layer_and_grads(config)
    y_capacity, grads_capacity = layer_and_grads(no_drop)
    assert rel_error(y, y_capacity) <= 2e-2, "output"
    for (path, g), g_capacity in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree.leaves(grads_capacity)):
        assert rel_error(g, g_capacity) <= 2e-2, jax.tree_util.keystr(path)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_fp8_quantize_rows_is_bitwise_the_emulation_on_the_gpu(dtype):
    """The CUDA quantisation kernel against nodrop.ops.fp8.quantize, the emulation, run on the
    CPU: the same codes and scales, NaN, all-zero blocks and float16 subnormals included; jitted
    twice (a replay). The emulation runs on the CPU because XLA's GPU code for it rounds
    differently from the CPU's on float16 inputs (seen on an H200, 2026-12-02), and the CPU's is
    the one the CPU engine is tested against bitwise."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(8)
    x = rng.standard_normal((257, 300)) * np.exp2(rng.integers(-12, 12, (257, 1)))
    x = jnp.asarray(x, dtype).at[3, :128].set(0).at[5, 200].set(jnp.nan)
    quantize = jax.jit(fp8.quantize_rows)
    emulate = jax.jit(lambda x: fp8.quantize(x, fp8.ACTIVATION_BLOCK))
    for x in (x, x * 3):
        q, scale = quantize(x)
        want_q, want_scale = emulate(jax.device_put(x, jax.devices("cpu")[0]))
        np.testing.assert_array_equal(np.asarray(q.view(jnp.uint8)),
                                      np.asarray(want_q.view(jnp.uint8)))
        np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("ids_kind", ["uniform", "all_to_one", "dropped"])
@pytest.mark.parametrize("hidden", [4096, 300])  # 300: a short last block, element accesses
@pytest.mark.parametrize("given_scale", [None, 0.01, float("nan")])
def test_fp8_permute_is_permute_then_quantize_rows_on_the_gpu(dtype, ids_kind, hidden,
                                                              given_scale):
    """The CUDA permute_fp8 (one kernel: each token quantised once, written to its k rows)
    bitwise the CPU engine's permute and the emulation's quantisation of the rows, in 1 x 128
    blocks or under a given scale (the tensorwise recipe's; 0.01: the largest values saturate);
    jitted and replayed with new ids."""
    from nodrop.ops import fp8

    tokens, experts, k = 513, 16, 2
    rng = np.random.default_rng(13)
    x = rng.standard_normal((tokens, hidden)) * np.exp2(rng.integers(-12, 12, (tokens, 1)))
    x = jnp.asarray(x, dtype).at[3, :128].set(0).at[5, 200].set(jnp.nan)
    scale = None if given_scale is None else jnp.float32(given_scale)
    run = jax.jit(functools.partial(fp8.permute_fp8, scale=scale), static_argnums=2)
    cpu = jax.devices("cpu")[0]
    for seed in (0, 1):
        ids = {"uniform": rng.integers(0, experts, (tokens, k)),
               "all_to_one": np.full((tokens, k), 5),
               "dropped": rng.integers(-2, experts + 2, (tokens, k))}[ids_kind]
        ids = jnp.asarray(ids, jnp.int32)
        got = run(x, ids, experts)
        want = jax.jit(functools.partial(reference.permute_fp8, scale=scale), static_argnums=2)(
            *jax.device_put((x, ids), cpu), experts)
        for name, a, b in zip(("rows", "group_sizes", "row_map", "rows_q", "rows_scale"), got,
                              want):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8),
                                          err_msg=f"{name}, seed {seed}")


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_moe_block_reads_the_permutes_codes_on_the_gpu(monkeypatch, recipe):
    """The FP8 MoE block on the GPU permutes with permute_fp8 (the tensorwise one with the
    tokens' scale given) and its first expert matmul reads those codes: output and gradients
    bitwise those of permute followed by the matmul's own quantisation of the rows (the path
    before the fusion)."""
    from flax import nnx

    from nodrop.moe import MoEBlock, MoEConfig
    from nodrop.moe import block as block_module

    config = MoEConfig(num_experts=8, k=2, hidden=512, ffn=384, fp8=recipe, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(3), (4, 256, config.hidden), jnp.bfloat16)
    model = MoEBlock(config, rngs=nnx.Rngs(0))

    def run():
        text = jax.jit(lambda: model(x)[0]).lower().as_text()
        out = nnx.jit(lambda b: b(x)[0])(model)
        grads = nnx.jit(nnx.grad(lambda b: jnp.sum(b(x)[0].astype(jnp.float32) ** 2)))(model)
        return out, grads, text.count("custom_call @nodrop_permute_fp8(")

    fused = run()
    monkeypatch.setattr(block_module, "_permute", lambda cfg, tokens, ids, experts: (
        *nodrop.permute(tokens, ids, experts), None))
    unfused = run()
    assert (fused[2], unfused[2]) == (1, 0)
    np.testing.assert_array_equal(np.asarray(fused[0], np.float32),
                                  np.asarray(unfused[0], np.float32))
    for name in ("gate_up", "down", "router"):
        np.testing.assert_array_equal(np.asarray(fused[1][name][...], np.float32),
                                      np.asarray(unfused[1][name][...], np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("kind", SIZE_KINDS)
def test_fp8_blockwise_grouped_matmul_matches_the_reference_on_the_gpu(kind):
    """The CUTLASS FP8 kernel behind its FFI handler against the dequantised reference (on the
    CPU), K and N off the kernel's multiples (padded around the call); jitted, replayed with new
    group sizes."""
    from nodrop.ops import fp8

    m, k, n, g = 1000, 200, 136, 8
    rng = np.random.default_rng(11)
    lhs, rhs, _ = inputs((m, k, n, g), jnp.bfloat16, seed=11)
    operands = (*fp8.quantize_rows(lhs), *fp8.quantize(jnp.swapaxes(rhs, 1, 2), fp8.WEIGHT_BLOCK))
    run = jax.jit(nodrop.grouped_matmul_fp8_blockwise)
    cpu = jax.devices("cpu")[0]
    for sizes in (group_sizes(kind, m, g, rng), group_sizes("random_short", m, g, rng)):
        got = run(*operands, sizes)
        want = reference.grouped_matmul_fp8_blockwise(*jax.device_put((*operands, sizes), cpu))
        assert rel_error(got, want) <= 2 ** -7, kind
        used = int(np.minimum(np.cumsum(np.asarray(sizes)), m)[-1])
        assert not np.any(np.asarray(got[used:], np.float32)), "rows past the groups"


# The tensorwise kernels' fast accumulation: the tensor cores' own sums over all of K, which
# keep fewer bits than float32 (DeepSeek-V3 measured about 14 on the H800), so its error is
# counted against the dot's magnitude (the sum of its terms' magnitudes), on top of bfloat16's
# rounding of the result. Promoted accumulation keeps those sums over 128-deep blocks only, so
# the same bound holds for it.
FAST_ACCUMULATION = 1e-3


@pytest.mark.parametrize("fast_accumulation", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("kind", SIZE_KINDS)
def test_fp8_tensorwise_grouped_matmul_matches_the_reference_on_the_gpu(kind,
                                                                        fast_accumulation):
    """The CUTLASS FP8 tensorwise kernel behind its FFI handler, either accumulation, against
    the dequantised reference (on the CPU), K and N off the kernel's multiples (padded around
    the call), each expert with a scale of its own; jitted, replayed with new group sizes. Each
    element within one bfloat16 rounding of the reference plus FAST_ACCUMULATION of its dot's
    magnitude."""
    from nodrop.ops import fp8

    m, k, n, g = 1000, 200, 136, 8
    rng = np.random.default_rng(13)
    lhs, rhs, _ = inputs((m, k, n, g), jnp.bfloat16, seed=13)
    rhs = rhs * jnp.asarray(np.exp2(np.arange(g) - 3), jnp.bfloat16)[:, None, None]
    (lhs_q, lhs_scale), (rhs_q_t, rhs_scales) = (fp8.quantize(lhs, "tensor"),
                                                 fp8.quantize(jnp.swapaxes(rhs, 1, 2), "tensor"))
    operands = (lhs_q, lhs_scale.reshape(1), rhs_q_t, rhs_scales.reshape(g))
    run = jax.jit(functools.partial(nodrop.grouped_matmul_fp8_tensorwise,
                                    fast_accumulation=fast_accumulation))
    cpu = jax.devices("cpu")[0]
    lhs_abs = jnp.abs(fp8.dequantize(*jax.device_put((lhs_q, lhs_scale), cpu), "tensor"))
    rhs_abs = jnp.abs(fp8.dequantize(*jax.device_put((rhs_q_t, rhs_scales), cpu), "tensor"))
    for sizes in (group_sizes(kind, m, g, rng), group_sizes("random_short", m, g, rng)):
        got = np.asarray(run(*operands, sizes), np.float64)
        on_cpu = jax.device_put((*operands, sizes), cpu)
        want = np.asarray(reference.grouped_matmul_fp8_tensorwise(*on_cpu), np.float64)
        magnitude = np.asarray(reference.grouped_matmul(lhs_abs, rhs_abs, on_cpu[-1],
                                                        transpose_rhs=True), np.float64)
        bound = 2.0 ** -7 * np.abs(want) + FAST_ACCUMULATION * magnitude
        assert np.all(np.abs(got - want) <= bound), (kind, np.max(np.abs(got - want) - bound))
        used = int(np.minimum(np.cumsum(np.asarray(sizes)), m)[-1])
        assert not np.any(got[used:]), "rows past the groups"


@pytest.mark.parametrize("block", [(1, 128), (128, 128), "tensor"])
def test_fp8_round_trip_under_jit_is_the_eager_one_on_the_gpu(block):
    """quantize then dequantize in one jit rounds to E4M3 as the two ops run apart do: XLA must
    not drop the round trip."""
    from nodrop.ops import fp8

    x = jax.random.normal(jax.random.key(1), (8, 256, 384), jnp.bfloat16)
    eager = fp8.dequantize(*fp8.quantize(x, block), block)
    jitted = jax.jit(lambda x: fp8.dequantize(*fp8.quantize(x, block), block))(x)
    assert rel_error(eager, x) > 1e-3  # E4M3 rounding shows
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))


@pytest.mark.parametrize("weight_gradient", ["fp8", "unquantised"])
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_recipe_runs_the_kernels_forward_and_both_gradients_on_the_gpu(recipe,
                                                                            weight_gradient):
    """fp8_grouped_matmul's "auto" mode runs the FP8 kernels on the GPU for bfloat16: the
    recipe's GEMM for the forward and the input gradient (the tensorwise one's with fast
    accumulation in the forward, promoted in the input gradient), the recipe's FP8 contraction
    for the weight gradient (one; with weight_gradient="unquantised" nodrop's bf16 contraction
    instead), each within bfloat16 rounding of the emulated result, relative to its largest
    element (fast accumulation's error, 1e-3 of a dot's magnitude at most, is well inside that
    here)."""
    from nodrop.ops import fp8

    m, k, n, g = 777, 256, 384, 8
    lhs, rhs, dout = inputs((m, k, n, g), jnp.bfloat16, seed=12)
    sizes = group_sizes("zipf", m, g, np.random.default_rng(12))
    results = {}
    fp8_contractions = 1 if weight_gradient == "fp8" else 0
    for forward in ("auto", "emulated"):
        def forward_and_grads(a, b, forward=forward):
            out, vjp = jax.vjp(lambda a, b: fp8.fp8_grouped_matmul(
                a, b, sizes, recipe=recipe, forward=forward, weight_gradient=weight_gradient),
                a, b)
            return out, vjp(dout)

        f = jax.jit(forward_and_grads)
        text = f.lower(lhs, rhs).as_text()
        calls = (text.count("custom_call @nodrop_grouped_matmul_fp8_blockwise("),
                 text.count("custom_call @nodrop_grouped_matmul_fp8_tensorwise("),
                 text.count("custom_call @nodrop_grouped_matmul_fp8_blockwise_contract("),
                 text.count("custom_call @nodrop_grouped_matmul_fp8_tensorwise_contract("),
                 text.count("custom_call @nodrop_grouped_matmul_contract("))
        blockwise = int(recipe == "blockwise")
        if forward == "auto":
            assert calls == (2 * blockwise, 2 * (1 - blockwise), fp8_contractions * blockwise,
                             fp8_contractions * (1 - blockwise), 1 - fp8_contractions), calls
        else:
            assert calls[:4] == (0, 0, 0, 0), calls
        results[forward] = f(lhs, rhs)
    assert rel_error(results["auto"][0], results["emulated"][0]) <= 2 ** -7
    (dlhs, drhs), (dlhs_emulated, drhs_emulated) = results["auto"][1], results["emulated"][1]
    assert rel_error(dlhs, dlhs_emulated) <= 2 ** -7
    assert rel_error(drhs, drhs_emulated) <= 2 ** -7


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(8, 512, 768), (3, 300, 260)])  # [G, K, N]; unaligned
@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_quantize_weights_is_bitwise_the_reference_on_the_gpu(transposed, shape, dtype):
    """The CUDA quantisations of the weights, in place (the input gradient's) and transposed
    (the forward's), against the reference run on the CPU (as quantize_rows' test, for the same
    reason): the same codes and scales, each 128 x 128 block's own scale (a NaN, an all-zero
    block and subnormal codes included) and each expert's given one (saturating, and NaN for one
    expert); jitted once and replayed."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(14)
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, (1, 1, shape[2])))
    w = jnp.asarray(w, dtype).at[0, :128, :128].set(0).at[1, 5, 200].set(jnp.nan)
    cpu = jax.devices("cpu")[0]
    if transposed:
        op, reference_op = fp8.quantize_weights_transposed, reference.quantize_weights_transposed
    else:
        op, reference_op = fp8.quantize_weights, reference.quantize_weights
    quantize, reference_on_cpu = jax.jit(op), jax.jit(reference_op)
    given = jnp.asarray(rng.uniform(1e-3, 1e-2, shape[0]), jnp.float32).at[2].set(jnp.nan)
    for scale in (None, given):
        q, scales = quantize(w, scale=scale)
        want_q, want_scales = reference_on_cpu(
            jax.device_put(w, cpu), scale=None if scale is None else jax.device_put(scale, cpu))
        where = f"given scales {scale is not None}"
        np.testing.assert_array_equal(np.asarray(q.view(jnp.uint8)),
                                      np.asarray(want_q.view(jnp.uint8)), err_msg=where)
        np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales), err_msg=where)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_fp8_quantize_transposed_is_bitwise_the_numpy_derivation_on_the_gpu(dtype):
    """The CUDA transposed quantisation against its numpy derivation (test_fp8.py checks the CPU
    engine against the same): the same codes and scales (NaN, all-zero blocks, groups not
    multiples of 128, empty groups, rows past the groups and the unused blocks included), each
    block's own scale and a given one (the tensorwise recipe's); jitted once and replayed with
    new group sizes."""
    from nodrop.ops import fp8

    m, c, g = 1000, 200, 8
    rng = np.random.default_rng(13)
    x = rng.standard_normal((m, c)) * np.exp2(rng.integers(-12, 12, (1, c)))
    x = jnp.asarray(x, dtype).at[:, 3].set(0).at[5, 7].set(jnp.nan)
    quantize = jax.jit(fp8.quantize_transposed)
    for kind in SIZE_KINDS:
        sizes = group_sizes(kind, m, g, rng)
        for given_scale in (None, np.float32(0.01)):
            q_t, scale = quantize(x, sizes, scale=given_scale)
            want_q, want_scale = numpy_quantize_transposed(x, np.asarray(sizes).tolist(),
                                                           given_scale)
            where = f"{kind}, given scale {given_scale}"
            np.testing.assert_array_equal(np.asarray(q_t.view(jnp.uint8)), want_q, err_msg=where)
            np.testing.assert_array_equal(np.asarray(scale), want_scale, err_msg=where)


def test_fp8_transpose_codes_is_the_transposed_quantisation_on_the_gpu():
    """The CUDA re-layout of codes made at one scale is bitwise the CUDA transposed quantisation
    at that scale and the numpy derivation (NaN, groups not multiples of 128, empty groups,
    rows past the groups), for a column count off 8 too (element by element); jitted once and
    replayed with new group sizes."""
    from nodrop.ops import fp8

    rng = np.random.default_rng(17)
    relay, quantize = jax.jit(fp8.transpose_codes), jax.jit(fp8.quantize_transposed)
    for m, c in ((1000, 200), (300, 13)):
        x = jnp.asarray(rng.standard_normal((m, c)), jnp.bfloat16).at[5, 7].set(jnp.nan)
        for kind in SIZE_KINDS:
            sizes = group_sizes(kind, m, 8, rng)
            for scale in (fp8._tensor_rows(x, sizes)[1], jnp.float32(0.001)):
                q, _ = fp8.quantize(x, "tensor", scale=jnp.reshape(scale, (1, 1)))
                got = np.asarray(relay(q, sizes).view(jnp.uint8))
                want = np.asarray(quantize(x, sizes, scale=scale)[0].view(jnp.uint8))
                where = f"{m}x{c}, {kind}, scale {float(np.asarray(scale).reshape(()))}"
                np.testing.assert_array_equal(got, want, err_msg=where)
                want_q, _ = numpy_quantize_transposed(x, np.asarray(sizes).tolist(),
                                                      np.float32(np.asarray(scale).reshape(())))
                np.testing.assert_array_equal(got, want_q, err_msg=where)


@pytest.mark.parametrize("kind", SIZE_KINDS)
def test_fp8_blockwise_contract_matches_the_reference_on_the_gpu(kind):
    """The FP8 weight gradient on the GPU against the dequantised reference on the CPU, from the
    numpy derivation of its operands, N off the kernel's multiple of 8 (padded around the call);
    jitted, replayed with new group sizes. An empty group's gradient is zero."""
    from nodrop.ops import fp8

    m, k, n, g = 1000, 200, 132, 8
    rng = np.random.default_rng(14)
    lhs, _, dout = inputs((m, k, n, g), jnp.bfloat16, seed=14)
    run = jax.jit(lambda a, d, sizes: nodrop.grouped_matmul_fp8_blockwise_contract(
        *fp8.quantize_transposed(a, sizes), *fp8.quantize_transposed(d, sizes), sizes,
        num_rows=m))
    cpu = jax.devices("cpu")[0]
    for sizes in (group_sizes(kind, m, g, rng), group_sizes("random_short", m, g, rng)):
        got = run(lhs, dout, sizes)
        operands = []
        for x in (lhs, dout):
            codes, scale = numpy_quantize_transposed(x, np.asarray(sizes).tolist())
            operands += [codes.view(fp8.E4M3), scale]
        want = reference.grouped_matmul_fp8_blockwise_contract(
            *jax.device_put((*operands, np.asarray(sizes)), cpu), num_rows=m)
        assert rel_error(got, want) <= 2 ** -7, kind
        empty = np.asarray(sizes) == 0
        assert not np.any(np.asarray(got, np.float32)[empty]), "empty groups"


@pytest.mark.parametrize("fast_accumulation", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("kind", SIZE_KINDS)
def test_fp8_tensorwise_contract_matches_the_reference_on_the_gpu(kind, fast_accumulation):
    """The tensorwise recipe's FP8 weight gradient on the GPU, either accumulation, against the
    dequantised reference on the CPU, from the numpy derivation of its operands (one scale per
    operand, given), N off the kernel's multiple of 8 (padded around the call); jitted,
    replayed with new group sizes. An empty group's gradient is zero."""
    from nodrop.ops import fp8

    m, k, n, g = 1000, 200, 132, 8
    rng = np.random.default_rng(16)
    lhs, _, dout = inputs((m, k, n, g), jnp.bfloat16, seed=16)
    def operand(x, sizes):  # the recipe's: the rows' codes at their tensor scale, re-laid
        q, scale = fp8._tensor_rows(x, sizes)
        return fp8.transpose_codes(q, sizes), scale

    run = jax.jit(lambda a, d, sizes: nodrop.grouped_matmul_fp8_tensorwise_contract(
        *operand(a, sizes), *operand(d, sizes), sizes, num_rows=m,
        fast_accumulation=fast_accumulation))
    cpu = jax.devices("cpu")[0]
    for sizes in (group_sizes(kind, m, g, rng), group_sizes("random_short", m, g, rng)):
        got = run(lhs, dout, sizes)
        operands = []
        for x in jax.device_put((lhs, dout), cpu):
            scale = fp8._tensor_rows(x, jax.device_put(sizes, cpu))[1]
            codes, _ = numpy_quantize_transposed(x, np.asarray(sizes).tolist(),
                                                 np.float32(scale[0]))
            operands += [codes.view(fp8.E4M3), scale]
        want = reference.grouped_matmul_fp8_tensorwise_contract(
            *jax.device_put((*operands, np.asarray(sizes)), cpu), num_rows=m)
        assert rel_error(got, want) <= 2 ** -7, kind
        empty = np.asarray(sizes) == 0
        assert not np.any(np.asarray(got, np.float32)[empty]), "empty groups"


def test_split_router_logits_keep_the_float32_products_on_the_gpu():
    """MoEConfig.router_matmul="split" on the GPU: bfloat16 GEMMs whose logits and router
    gradient match float64 to float32 sums (1e-5, for the tensor cores' float32 accumulation),
    which a split XLA had optimised away (the weights rounded to bfloat16 once, about 2^-9)
    would not; x's gradient to bfloat16."""
    from nodrop.moe.block import router_logits

    rng = np.random.default_rng(15)
    t, h, e = 4096, 1024, 128
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((h, e)) * 0.05, jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    logits = jax.jit(router_logits, static_argnums=2)(x, router, "split")
    grad_x, grad_router = jax.jit(jax.grad(
        lambda x, r: jnp.sum(router_logits(x, r, "split") * cotangent), argnums=(0, 1)))(
        x, router)
    x64, r64, c64 = (np.asarray(v, np.float64) for v in (x.astype(jnp.float32), router,
                                                          cotangent))
    assert rel_error(logits, x64 @ r64) <= 1e-5
    assert rel_error(grad_router, x64.T @ c64) <= 1e-5
    assert grad_x.dtype == jnp.bfloat16 and rel_error(grad_x, c64 @ r64.T) <= 2 ** -8


@pytest.mark.parametrize("shape", [(5,), (1003,), (7, 129), (8, 1024, 96)], ids=str)
@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "clip"])
def test_adamw_update(shape, clip):
    """The CUDA AdamW step, written in place (donated state), against the reference on the
    GPU; the C++ GPU tests check it bit for bit against the CPU engine."""
    rng = np.random.default_rng(0)
    param, grad, mu, nu = (jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))
                           for scale in (1.0, 1e-3, 1e-3, 1e-3))
    nu = jnp.abs(nu)
    kwargs = dict(step_size=jnp.float32(-0.05), count=jnp.int32(3), b1=0.9, b2=0.95, eps=1e-8,
                  weight_decay=0.1, update_scale=0.5)
    if clip:
        kwargs.update(max_grad_norm=1.0, grad_norm=jnp.float32(4.0))
    step = jax.jit(lambda *a: nodrop.adamw_update(*a, **kwargs), donate_argnums=(0, 2, 3))
    got = step(jnp.array(param), grad, jnp.array(mu), jnp.array(nu))
    want = jax.jit(lambda *a: reference.adamw_update(*a, **kwargs))(param, grad, mu, nu)
    for name, actual, expected in zip(("param", "mu", "nu"), got[:3], want[:3]):
        assert rel_error(actual, expected) < 1e-6, name
    assert rel_error(got.sums[0], want[3][0]) < 1e-5
    np.testing.assert_array_equal(got.sums[3:], [0, 0])
