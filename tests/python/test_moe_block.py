"""The MoE block (nodrop.moe.MoEBlock): against a pure-JAX reference built from
nodrop.ops.reference, batch invariance (dropless) against the token-dropping baseline, its
reported statistics, aux-loss-free balancing, config checks, and jit / nnx.jit / remat."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import F32_TOL, as_f64, assert_close, f64, random_normal
from flax import nnx

from nodrop.moe import (MoEBlock, MoEConfig, load_balancing_loss, router_z_loss,
                        updated_expert_bias)
from nodrop.moe.block import _bfloat16_parts, router_logits
from nodrop.ops import reference

SOFTMAX_TOP2 = MoEConfig(num_experts=8, k=2, hidden=16, ffn=32, renormalize=True,
                         dtype=jnp.float32)
DEEPSEEK = MoEConfig(num_experts=8, k=3, hidden=16, ffn=32, score_function="sigmoid",
                     num_groups=4, topk_groups=2, renormalize=True, scaling_factor=2.5,
                     shared_ffn=24, dtype=jnp.float32)
CAPACITY = dataclasses.replace(SOFTMAX_TOP2, capacity_factor=1.0)
CONFIGS = {"softmax_top2": SOFTMAX_TOP2, "sigmoid_groups_shared": DEEPSEEK, "capacity": CAPACITY}


def make_block(config, expert_bias=None):
    block = MoEBlock(config, rngs=nnx.Rngs(0))
    if expert_bias is not None:
        block.expert_bias[...] = jnp.asarray(expert_bias, jnp.float32)
    return block


def skewed_tokens(rng, num_tokens, hidden, offset=4.0):
    """Tokens sharing a constant feature 0; with `skew_router` every token prefers expert 0."""
    return random_normal(rng, (num_tokens, hidden)).at[:, 0].set(offset)


def skew_router(block, strength=2.0):
    block.router[...] = block.router[...].at[0, 0].set(strength)


# --- the reference -----------------------------------------------------------------------------


def reference_block(config, params, expert_bias, x):
    """The block on nodrop.ops.reference, in the dtype of `params` (float64 here), with gate and
    up as two separate grouped matmuls. Returns (y, load-balancing loss, z-loss)."""
    ffn, shared = config.ffn, config.shared_ffn
    tokens = x.reshape(-1, config.hidden)
    logits = tokens @ params["router"]
    weights, ids = reference.topk_router(
        logits, config.k, score_function=config.score_function, expert_bias=expert_bias,
        num_groups=config.num_groups, topk_groups=config.topk_groups,
        renormalize=config.renormalize, scaling_factor=config.scaling_factor)
    rows, group_sizes, row_map = reference.permute(tokens, ids, config.num_experts)
    gate = reference.grouped_matmul(rows, params["gate_up"][..., :ffn], group_sizes)
    up = reference.grouped_matmul(rows, params["gate_up"][..., ffn:], group_sizes)
    out = reference.grouped_matmul(jax.nn.silu(gate) * up, params["down"], group_sizes)
    y = reference.unpermute(out, row_map, weights)
    if shared:
        w = params["shared_gate_up"]
        y = y + (jax.nn.silu(tokens @ w[:, :shared]) * (tokens @ w[:, shared:])) \
            @ params["shared_down"]
    if config.score_function == "softmax":
        probs = jax.nn.softmax(logits)
    else:
        probs = jax.nn.sigmoid(logits) / jax.nn.sigmoid(logits).sum(-1, keepdims=True)
    num_sequences = x.shape[0] if x.ndim == 3 else 1
    per_sequence = [load_balancing_loss(p, i, config.num_experts) for p, i in zip(
        jnp.split(probs, num_sequences), jnp.split(ids, num_sequences))]
    return (y.reshape(x.shape), load_balancing_loss(probs, ids), sum(per_sequence) / num_sequences,
            router_z_loss(logits))


def scalar_loss(y, lb_loss, seq_loss, z_loss, cotangent):
    """Touches the output and the auxiliary losses, so every gradient path is exercised."""
    return jnp.sum(y * cotangent) + 0.1 * lb_loss + 0.05 * seq_loss + 0.01 * z_loss


@pytest.mark.parametrize("config", [SOFTMAX_TOP2, DEEPSEEK], ids=["softmax_top2",
                                                                  "sigmoid_groups_shared"])
def test_block_matches_reference_forward_and_gradients(config):
    rng = np.random.default_rng(0)
    bias = random_normal(rng, (config.num_experts,), scale=0.1)  # moves the selection
    block = make_block(config, expert_bias=bias)
    x = random_normal(rng, (2, 12, config.hidden))
    cotangent = random_normal(rng, x.shape)
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return scalar_loss(y, aux.load_balancing_loss, aux.sequence_balance_loss, aux.z_loss,
                           cotangent), (y, aux)

    (_, (y, aux)), (grad_params, grad_x) = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True))(params, x)

    def ref_loss(params, x):
        y, lb_loss, seq_loss, z_loss = reference_block(config, params, f64(bias), x)
        return (scalar_loss(y, lb_loss, seq_loss, z_loss, f64(cotangent)),
                (y, lb_loss, seq_loss, z_loss))

    params64 = {name: f64(value) for name, value in nnx.to_pure_dict(params).items()}
    (_, (ref_y, ref_lb, ref_seq, ref_z)), (ref_grad_params, ref_grad_x) = jax.jit(jax.value_and_grad(
        ref_loss, argnums=(0, 1), has_aux=True))(params64, f64(x))

    assert y.shape == x.shape and y.dtype == jnp.float32
    assert_close(y, ref_y, F32_TOL, "output")
    assert_close(aux.load_balancing_loss, ref_lb, F32_TOL, "load-balancing loss")
    assert_close(aux.sequence_balance_loss, ref_seq, F32_TOL, "sequence balance loss")
    assert_close(aux.z_loss, ref_z, F32_TOL, "z-loss")
    assert_close(grad_x, ref_grad_x, F32_TOL, "grad x")
    grads = nnx.to_pure_dict(grad_params)
    assert sorted(grads) == sorted(ref_grad_params)
    for name, grad in grads.items():
        assert grad.dtype == jnp.float32
        assert_close(grad, ref_grad_params[name], F32_TOL, f"grad {name}")


def test_bfloat16_compute_keeps_float32_params():
    config = dataclasses.replace(SOFTMAX_TOP2, dtype=jnp.bfloat16)
    x = random_normal(np.random.default_rng(1), (24, config.hidden))
    y16, _ = make_block(config)(x)
    y32, _ = make_block(SOFTMAX_TOP2)(x)
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, y32, 3e-2, "bf16 vs f32 output")
    grads = nnx.grad(lambda block: jnp.sum(block(x)[0].astype(jnp.float32)))(make_block(config))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_default_dtype_computes_in_the_input_dtype(dtype):
    """MoEConfig.dtype defaults to None (Flax's convention): the block computes in x's dtype,
    with the same output as the config that names that dtype."""
    default = dataclasses.replace(SOFTMAX_TOP2, dtype=None)
    assert MoEConfig(num_experts=8, k=2, hidden=16, ffn=32).dtype is None
    x = random_normal(np.random.default_rng(2), (24, default.hidden), dtype)
    y, _ = make_block(default)(x)
    named, _ = make_block(dataclasses.replace(SOFTMAX_TOP2, dtype=dtype))(x)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(named, np.float32))
    with pytest.raises(TypeError, match=r"x must be float32, float16 or bfloat16 where "
                                        r"MoEConfig.dtype is None .* got int32"):
        make_block(default)(jnp.zeros((4, default.hidden), jnp.int32))


def test_models_and_presets_keep_their_compute_dtype():
    """The model names its dtype (bfloat16 by default, float32 for the tiny preset), so the
    block default does not change it; None is not a model dtype."""
    from nodrop.models.config import PRESETS, ModelConfig, preset
    assert all(config.moe_config().dtype == config.dtype is not None
               for config in PRESETS.values())
    assert preset("tiny").moe_config().dtype == jnp.float32
    assert dataclasses.replace(preset("tiny"), dtype=jnp.bfloat16).moe_config().dtype == \
        jnp.bfloat16
    assert ModelConfig.__dataclass_fields__["dtype"].default == jnp.bfloat16
    with pytest.raises(ValueError, match=r"ModelConfig.dtype must be float32, float16 or "
                                         r"bfloat16, got None"):
        dataclasses.replace(preset("tiny"), dtype=None)


# --- batch invariance and dropping -------------------------------------------------------------


def outputs_in_two_batches(config):
    """One token's output when it is first in a batch and when it is last in a batch of other
    tokens, with a router that sends every token to expert 0 first. Returns (the first batch's
    output, the token's two outputs, the first batch's aux)."""
    rng = np.random.default_rng(2)
    block = make_block(config)
    skew_router(block)
    batch_a = skewed_tokens(rng, 32, config.hidden)
    batch_b = skewed_tokens(rng, 32, config.hidden).at[-1].set(batch_a[0])
    (y_a, aux_a), (y_b, _) = block(batch_a), block(batch_b)
    return y_a, y_a[0], y_b[-1], aux_a


def test_dropless_output_of_a_token_does_not_depend_on_its_batch():
    y_all, y_a, y_b, aux = outputs_in_two_batches(SOFTMAX_TOP2)
    assert float(aux.max_over_mean) > 3  # skewed: expert 0 takes every token's first slot
    np.testing.assert_allclose(np.asarray(y_b), np.asarray(y_a), rtol=1e-5,
                               atol=1e-6 * float(jnp.abs(y_all).max()))


def test_capacity_output_of_a_token_depends_on_its_batch():
    """Placed last, the token finds expert 0 full and loses its main contribution."""
    y_all, y_a, y_b, aux = outputs_in_two_batches(CAPACITY)
    assert float(aux.dropped_fraction) > 0
    typical = float(jnp.sqrt(jnp.mean(jnp.square(y_all))))
    assert float(jnp.sqrt(jnp.mean(jnp.square(y_a - y_b)))) > 0.1 * typical


def test_capacity_drops_the_slots_past_each_experts_capacity():
    """k=1 and every token to expert 0: the first C tokens get the dropless output, the rest
    get exactly zero."""
    config = dataclasses.replace(SOFTMAX_TOP2, k=1)
    x = skewed_tokens(np.random.default_rng(3), 32, config.hidden)
    dropless = make_block(config)
    skew_router(dropless)
    capacity_block = make_block(dataclasses.replace(config, capacity_factor=1.0))
    skew_router(capacity_block)
    (y, _), (y_capacity, aux) = dropless(x), capacity_block(x)
    capacity = 32 // config.num_experts
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), [32] + [0] * 7)
    np.testing.assert_allclose(np.asarray(y_capacity[:capacity]), np.asarray(y[:capacity]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(y_capacity[capacity:]), 0)
    assert float(aux.dropped_fraction) == (32 - capacity) / 32


def test_capacity_with_room_for_every_slot_equals_dropless():
    config = dataclasses.replace(DEEPSEEK, capacity_factor=float(DEEPSEEK.num_experts))
    x = random_normal(np.random.default_rng(4), (20, config.hidden))
    (y, aux), (y_capacity, aux_capacity) = make_block(DEEPSEEK)(x), make_block(config)(x)
    assert float(aux_capacity.dropped_fraction) == 0
    np.testing.assert_array_equal(np.asarray(aux_capacity.tokens_per_expert),
                                  np.asarray(aux.tokens_per_expert))
    assert_close(y_capacity, y, F32_TOL, "capacity output")


def test_ragged_dot_experts_equal_nodrop_experts():
    """The `jax.lax.ragged_dot` peer computes the same block, gradients included."""
    config = dataclasses.replace(DEEPSEEK, matmul="ragged_dot")
    x = random_normal(np.random.default_rng(6), (24, config.hidden))
    cotangent = random_normal(np.random.default_rng(7), x.shape)

    def loss_and_grads(block):
        def loss(block, x):
            y, aux = block(x)
            return scalar_loss(y, aux.load_balancing_loss, aux.sequence_balance_loss, aux.z_loss,
                               cotangent)
        return nnx.value_and_grad(loss, argnums=(0, 1))(block, x)

    (value, (block_grads, x_grad)) = loss_and_grads(make_block(DEEPSEEK))
    (value_rd, (block_grads_rd, x_grad_rd)) = loss_and_grads(make_block(config))
    assert_close(value_rd, value, F32_TOL, "loss")
    assert_close(x_grad_rd, x_grad, F32_TOL, "x gradient")
    for name in ("gate_up", "down", "router"):
        assert_close(getattr(block_grads_rd, name)[...], getattr(block_grads, name)[...],
                     F32_TOL, f"{name} gradient")


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_reference_ops_compute_the_same_block(config):
    """MoEConfig(ops="reference") runs the block on nodrop.ops.reference (what `nodrop demo`
    checks nodrop's ops against): the same loss, loads and gradients."""
    reference_config = dataclasses.replace(config, ops="reference")
    x = random_normal(np.random.default_rng(8), (24, config.hidden))

    def run(block):
        def loss(block, x):
            y, aux = block(x)
            return jnp.sum(jnp.square(y)) + aux.load_balancing_loss, aux
        return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(block, x)

    (value, aux), (block_grads, x_grad) = run(make_block(config))
    (value_ref, aux_ref), (block_grads_ref, x_grad_ref) = run(make_block(reference_config))
    assert_close(value_ref, value, F32_TOL, "loss")
    np.testing.assert_array_equal(np.asarray(aux_ref.tokens_per_expert),
                                  np.asarray(aux.tokens_per_expert))
    assert_close(x_grad_ref, x_grad, F32_TOL, "x gradient")
    for name in ("gate_up", "down", "router"):
        assert_close(getattr(block_grads_ref, name)[...], getattr(block_grads, name)[...],
                     F32_TOL, f"{name} gradient")


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_reported_statistics(config):
    rng = np.random.default_rng(5)
    block = make_block(config)
    skew_router(block)
    num_tokens = 40
    _, aux = block(skewed_tokens(rng, num_tokens, config.hidden).reshape(4, 10, -1))
    counts = np.asarray(aux.tokens_per_expert)
    slots = num_tokens * config.k
    assert counts.dtype == np.int32 and counts.sum() == slots
    assert aux.overflow.dtype == bool and not bool(aux.overflow)  # nothing exchanged
    assert float(aux.max_over_mean) == pytest.approx(counts.max() * config.num_experts / slots)
    if config.capacity_factor is None:
        assert float(aux.dropped_fraction) == 0.0  # measured from the group sizes
    else:
        capacity = int(np.ceil(config.capacity_factor * slots / config.num_experts))
        dropped = np.maximum(counts - capacity, 0).sum() / slots
        assert dropped > 0
        assert float(aux.dropped_fraction) == pytest.approx(dropped)


# --- aux-loss-free balancing -------------------------------------------------------------------


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    bias = jnp.asarray([0.5, 0.0, -0.5, 0.0], jnp.float32)
    counts = jnp.asarray([10, 2, 2, 6], jnp.int32)  # mean 5
    np.testing.assert_allclose(np.asarray(updated_expert_bias(bias, counts, 0.01)),
                               [0.49, 0.01, -0.49, -0.01], rtol=1e-6)
    balanced = jnp.full((4,), 5, jnp.int32)
    np.testing.assert_array_equal(np.asarray(updated_expert_bias(bias, balanced, 0.01)), bias)


def test_proportional_bias_update_moves_by_the_relative_load_error_clipped_to_one():
    bias = jnp.asarray([0.5, 0.0, -0.5, 0.0, 0.0], jnp.float32)
    counts = jnp.asarray([20, 0, 4, 6, 0], jnp.int32)  # mean 6
    # errors (6 - load) / 6: -2.33 (clipped to -1), 1, 1/3, 0, 1
    np.testing.assert_allclose(
        np.asarray(updated_expert_bias(bias, counts, 0.3, "proportional")),
        [0.2, 0.3, -0.4, 0.0, 0.3], rtol=1e-6)
    # No tokens at all: no error to correct (the mean is clamped, not divided by).
    np.testing.assert_array_equal(np.asarray(updated_expert_bias(
        bias, jnp.zeros((5,), jnp.int32), 0.3, "proportional")), bias)
    with pytest.raises(ValueError, match="rule must be 'sign' or 'proportional', got 'Sign'"):
        updated_expert_bias(bias, counts, 0.3, "Sign")


@pytest.mark.parametrize("rule, rate", [("sign", 0.05), ("proportional", 0.1)])
def test_bias_updates_balance_the_block(rule, rate):
    """The trainer's loop: forward, then the bias step; the skewed load evens out."""
    config = dataclasses.replace(DEEPSEEK, shared_ffn=0)
    block = make_block(config)
    skew_router(block)
    x = skewed_tokens(np.random.default_rng(6), 64, config.hidden)
    forward = nnx.jit(lambda block, x: block(x)[1])
    first = forward(block, x)
    imbalance = [float(first.max_over_mean)]
    block.expert_bias[...] = updated_expert_bias(block.expert_bias[...],
                                                 first.tokens_per_expert, rate, rule)
    bias = np.asarray(block.expert_bias[...])
    load = np.asarray(first.tokens_per_expert)
    assert (bias[load < load.mean()] > 0).all() and (bias[load > load.mean()] < 0).all()
    for _ in range(20):
        aux = forward(block, x)
        imbalance.append(float(aux.max_over_mean))
        block.expert_bias[...] = updated_expert_bias(block.expert_bias[...],
                                                     aux.tokens_per_expert, rate, rule)
    assert imbalance[0] > 2.5 and max(imbalance[-5:]) < 1.5, imbalance


def test_expert_bias_is_not_trained():
    block = make_block(DEEPSEEK)
    x = random_normal(np.random.default_rng(7), (8, DEEPSEEK.hidden))
    grads = nnx.grad(lambda block: jnp.sum(block(x)[0]))(block)
    assert "expert_bias" not in nnx.to_pure_dict(grads)


# --- the router's matmul ------------------------------------------------------------------------

# float32 values whose significands fill every bit, the extremes of the exponent, signs, zero.
EDGE_WEIGHTS = np.array([0.0, -0.0, 1.0, -1.0, 1 - 2.0 ** -24, -(1 + 2.0 ** -23), 3.0e38,
                         -3.0e38, 2.0 ** -103 * (1 + 2.0 ** -23), 0.1, -1 / 3, np.pi],
                        np.float32)


def test_bfloat16_parts_sum_to_the_float32_value_exactly():
    rng = np.random.default_rng(21)
    values = np.concatenate([EDGE_WEIGHTS, (rng.standard_normal(4096) * np.exp2(
        rng.integers(-60, 60, 4096))).astype(np.float32)])
    for jitted in (False, True):
        fn = jax.jit(_bfloat16_parts) if jitted else _bfloat16_parts
        parts = fn(jnp.asarray(values))
        assert all(part.dtype == jnp.bfloat16 for part in parts)
        total = sum(as_f64(part) for part in parts)
        np.testing.assert_array_equal(total, values.astype(np.float64),
                                      err_msg=f"jit={jitted}")
        # Each part holds the leading bits of what was left: no part larger than the one before.
        sizes = [np.abs(as_f64(part)) for part in parts]
        assert np.all(sizes[1] <= sizes[0]) and np.all(sizes[2] <= sizes[1])
    # Below 2^-103 the last parts are subnormal, which float32 arithmetic may flush to zero: the
    # parts then lose those bits, and no more.
    tiny = np.array([1.2e-38, -3.0e-36, 2.0 ** -105 * (1 + 2.0 ** -23)], np.float32)
    total = sum(as_f64(part) for part in jax.jit(_bfloat16_parts)(jnp.asarray(tiny)))
    assert np.all(np.abs(total - tiny.astype(np.float64)) < 2.0 ** -126)


def _logits_and_gradients(method, x, router, cotangent):
    def loss(x, router):
        return jnp.sum(router_logits(x, router, method) * cotangent)
    logits = jax.jit(router_logits, static_argnums=2)(x, router, method)
    return (logits, *jax.jit(jax.grad(loss, argnums=(0, 1)))(x, router))


@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 96, 8), (256, 512, 64)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_split_router_logits_and_gradients_against_float64(shape):
    tokens, hidden, experts = shape
    rng = np.random.default_rng(22)
    x = random_normal(rng, (tokens, hidden), jnp.bfloat16)
    router = random_normal(rng, (hidden, experts), scale=0.05)
    cotangent = random_normal(rng, (tokens, experts))
    logits, grad_x, grad_router = _logits_and_gradients("split", x, router, cotangent)
    assert (logits.dtype, grad_x.dtype, grad_router.dtype) == (
        jnp.float32, jnp.bfloat16, jnp.float32)
    # Exact products: only the float32 sums round, as in a float32 GEMM.
    assert_close(logits, as_f64(x) @ as_f64(router), 1e-6, "logits")
    assert_close(grad_router, as_f64(x).T @ as_f64(cotangent), 1e-6, "router gradient")
    # x's gradient is bfloat16: one rounding of the float64 value (half an ulp) plus the part
    # products left out, under 3 * 2^-14 of the sum of the terms' magnitudes.
    expected = as_f64(cotangent) @ as_f64(router).T
    half_ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(expected), 1e-30))) - 8)
    left_out = 3 * 2.0 ** -14 * (np.abs(as_f64(cotangent)) @ np.abs(as_f64(router)).T)
    assert np.all(np.abs(as_f64(grad_x) - expected) <= half_ulp + left_out), \
        "x's gradient beyond its bound"


def test_split_router_matmul_equals_float32_one():
    rng = np.random.default_rng(23)
    router = random_normal(rng, (96, 16), scale=0.05)
    cotangent = random_normal(rng, (64, 16))
    x = random_normal(rng, (64, 96), jnp.bfloat16)
    split = _logits_and_gradients("split", x, router, cotangent)
    full = _logits_and_gradients("float32", x, router, cotangent)
    for name, a, b, tol in zip(("logits", "x gradient", "router gradient"), split, full,
                               (1e-6, 1e-2, 1e-6)):
        assert_close(a, b, tol, name)
    # Inputs not in bfloat16 take the float32 GEMM whatever the method: the same program.
    for dtype in (jnp.float32, jnp.float16):
        x = random_normal(rng, (64, 96), dtype)
        for a, b in zip(_logits_and_gradients("split", x, router, cotangent),
                        _logits_and_gradients("float32", x, router, cotangent)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("config", [SOFTMAX_TOP2, DEEPSEEK], ids=["softmax_top2", "deepseek"])
def test_block_with_the_split_router_matmul(config):
    """In bfloat16 the split router picks the float32 router's experts and gives its outputs
    and gradients, under jit, remat and scan over two layers."""
    rng = np.random.default_rng(24)
    configs = [dataclasses.replace(config, dtype=jnp.bfloat16, router_matmul=method)
               for method in ("float32", "split")]
    x = random_normal(rng, (2, 16, config.hidden), jnp.bfloat16)
    cotangent = random_normal(rng, x.shape)

    def run(config, remat):
        block = make_block(config)
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)

        def apply(params, x):
            return nnx.merge(graphdef, params, rest)(x)

        apply = jax.checkpoint(apply) if remat else apply

        def two_layers(params, x):  # the same block twice, through lax.scan
            def layer(x, _):
                y, aux = apply(params, x)
                return y, aux.tokens_per_expert
            y, counts = jax.lax.scan(layer, x, length=2)
            return jnp.sum(y.astype(jnp.float32) * cotangent), counts

        (_, counts), grads = jax.jit(jax.value_and_grad(two_layers, has_aux=True))(params, x)
        y, aux = jax.jit(apply)(params, x)
        return y, aux, counts, grads

    for remat in (False, True):
        (y0, aux0, counts0, grads0), (y1, aux1, counts1, grads1) = (
            run(c, remat) for c in configs)
        np.testing.assert_array_equal(np.asarray(counts1), np.asarray(counts0))
        np.testing.assert_array_equal(np.asarray(aux1.tokens_per_expert),
                                      np.asarray(aux0.tokens_per_expert))
        assert_close(y1, y0, 1e-2, "output")
        assert_close(aux1.z_loss, aux0.z_loss, 1e-5, "z loss")
        for (path, g1), g0 in zip(jax.tree.leaves_with_path(grads1), jax.tree.leaves(grads0)):
            assert_close(g1, g0, 2e-2, f"gradient {jax.tree_util.keystr(path)}")
            assert float(jnp.abs(g1).max()) > 0


# --- config and input checks -------------------------------------------------------------------

BAD_CONFIGS = [
    ("num_experts", 0), ("k", 9), ("k", 0), ("hidden", -1), ("ffn", 2.5),
    ("score_function", "relu"), ("num_groups", 3), ("topk_groups", 5), ("renormalize", 1),
    ("scaling_factor", 0.0), ("shared_ffn", -4), ("capacity_factor", 0.0),
    ("capacity_factor", float("inf")), ("matmul", "einsum"), ("ops", "cuda"),
    ("dtype", jnp.int32), ("param_dtype", "float64"), ("expert_parallel", 1),
    ("ep_buffer_factor", 0.0), ("ep_buffer_factor", float("nan")),
    ("router_matmul", "tf32"),
]


@pytest.mark.parametrize("field, value", BAD_CONFIGS,
                         ids=[f"{f}={v!r}" for f, v in BAD_CONFIGS])
def test_config_errors_name_the_field_and_value(field, value):
    kwargs = dict(num_experts=8, k=2, hidden=16, ffn=32, num_groups=4, topk_groups=2)
    kwargs[field] = value
    with pytest.raises(ValueError, match=rf"^MoEConfig\.{field} must be .*, got "
                                         + re.escape(repr(value)) + "$"):
        MoEConfig(**kwargs)


def test_config_rejects_expert_parallelism_with_a_capacity_factor():
    with pytest.raises(ValueError, match=re.escape(
            "MoEConfig.capacity_factor must be None (dropless) with expert_parallel, got 1.0")):
        MoEConfig(num_experts=8, k=2, hidden=16, ffn=32, capacity_factor=1.0,
                  expert_parallel=True)


def test_config_rejects_k_beyond_the_selectable_groups():
    with pytest.raises(ValueError, match=r"^MoEConfig\.k must be at most the 4 experts"):
        MoEConfig(num_experts=8, k=5, hidden=16, ffn=32, num_groups=4, topk_groups=2)


def test_input_of_the_wrong_shape_is_rejected():
    block = make_block(SOFTMAX_TOP2)
    with pytest.raises(ValueError, match=re.escape(
            "x must be [B, S, H] or [T, H] with H = hidden = 16, got shape (4, 8)")):
        block(jnp.zeros((4, 8), jnp.float32))


# --- transformations ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_jit_nnx_jit_and_remat(config):
    rng = np.random.default_rng(8)
    block = make_block(config)
    x = random_normal(rng, (2, 8, config.hidden))
    cotangent = random_normal(rng, x.shape)
    y, aux = block(x)
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def apply(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    for y_jit, aux_jit in (jax.jit(apply)(params, x), nnx.jit(lambda b, x: b(x))(block, x)):
        assert_close(y_jit, y, 1e-6, "jitted output")
        for name, value in dataclasses.asdict(aux).items():
            assert_close(getattr(aux_jit, name), value, 1e-6, f"jitted aux {name}")

    def loss(apply_fn):
        def fn(params, x):
            y, aux = apply_fn(params, x)
            return scalar_loss(y, aux.load_balancing_loss, aux.sequence_balance_loss, aux.z_loss,
                               cotangent)
        return jax.jit(jax.grad(fn, argnums=(0, 1)))

    grads, grads_remat = loss(apply)(params, x), loss(jax.checkpoint(apply))(params, x)
    for grad, grad_remat in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        assert_close(grad_remat, grad, 1e-6, "remat gradient")
        assert float(jnp.abs(grad).max()) > 0
