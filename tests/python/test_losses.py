"""tokens_per_expert, load_balancing_loss, sequence_balance_loss and router_z_loss against
numpy."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DTYPE_IDS, FLOAT_DTYPES, as_f64, int32, random_normal, tolerance

import nodrop


def numpy_softmax(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_load_balancing_loss(probs, ids, num_experts):
    ids = np.asarray(ids).reshape(-1)
    counts = np.bincount(ids[(ids >= 0) & (ids < num_experts)], minlength=num_experts)
    return num_experts * np.sum(counts / ids.size * np.asarray(probs, np.float64).mean(0))


# --- tokens_per_expert ------------------------------------------------------------------------


def test_tokens_per_expert_counts_every_slot():
    ids = np.random.default_rng(0).integers(0, 6, size=(40, 3))
    counts = nodrop.tokens_per_expert(int32(ids), 6)
    assert counts.dtype == jnp.int32 and counts.shape == (6,)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(ids.reshape(-1), minlength=6))


def test_tokens_per_expert_ignores_out_of_range_ids():
    ids = int32([[0, -1], [5, 2], [2, 100], [2**31 - 1, -(2**31)]])
    np.testing.assert_array_equal(np.asarray(nodrop.tokens_per_expert(ids, 5)), [1, 0, 2, 0, 0])


def test_tokens_per_expert_matches_permute_group_sizes():
    ids = int32(np.random.default_rng(1).integers(-1, 5, size=(16, 2)))
    _, group_sizes, _ = nodrop.permute(jnp.zeros((16, 3), jnp.float32), ids, 4)
    np.testing.assert_array_equal(np.asarray(nodrop.tokens_per_expert(ids, 4)),
                                  np.asarray(group_sizes))


# --- load_balancing_loss ----------------------------------------------------------------------


def test_load_balancing_loss_uniform_routing_is_one():
    num_tokens, num_experts, k = 32, 8, 2
    probs = jnp.full((num_tokens, num_experts), 1 / num_experts, jnp.float32)
    ids = int32((np.arange(num_tokens * k) % num_experts).reshape(num_tokens, k))
    loss = nodrop.load_balancing_loss(probs, ids)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)


def test_load_balancing_loss_balanced_counts_give_one_for_any_probs():
    """With every expert chosen equally often the loss is E * (1/E) * sum_e P_e = 1."""
    num_tokens, num_experts = 24, 4
    probs = numpy_softmax(np.random.default_rng(2).standard_normal((num_tokens, num_experts)))
    ids = int32((np.arange(num_tokens) % num_experts)[:, None])
    loss = nodrop.load_balancing_loss(jnp.asarray(probs, jnp.float32), ids)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)


def test_load_balancing_loss_skewed_routing_exceeds_one():
    num_tokens, num_experts = 32, 8
    logits = np.zeros((num_tokens, num_experts))
    logits[:, 0] = 4.0
    probs = jnp.asarray(numpy_softmax(logits), jnp.float32)
    ids = int32(np.zeros((num_tokens, 1)))
    loss = float(nodrop.load_balancing_loss(probs, ids))
    assert loss > 1.5
    np.testing.assert_allclose(loss, num_experts * float(probs[0, 0]), rtol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_load_balancing_loss_matches_numpy(dtype):
    rng = np.random.default_rng(3)
    probs = jnp.asarray(numpy_softmax(rng.standard_normal((50, 6))), jnp.float32).astype(dtype)
    ids = rng.integers(-1, 7, size=(50, 2))  # some out of range: they count nowhere
    loss = nodrop.load_balancing_loss(probs, int32(ids), num_experts=6)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(float(loss), numpy_load_balancing_loss(as_f64(probs), ids, 6),
                               rtol=1e-6)


def test_load_balancing_loss_gradient_flows_through_probs_only():
    rng = np.random.default_rng(4)
    num_tokens, num_experts, k = 20, 5, 2
    probs = jnp.asarray(numpy_softmax(rng.standard_normal((num_tokens, num_experts))),
                        jnp.float32)
    ids = rng.integers(0, num_experts, size=(num_tokens, k))
    grad = jax.grad(nodrop.load_balancing_loss)(probs, int32(ids))
    fraction = np.bincount(ids.reshape(-1), minlength=num_experts) / ids.size
    expected = np.broadcast_to(num_experts * fraction / num_tokens, probs.shape)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6)


def test_load_balancing_loss_under_jit():
    rng = np.random.default_rng(5)
    probs = jnp.asarray(numpy_softmax(rng.standard_normal((12, 4))), jnp.float32)
    ids = rng.integers(0, 4, size=(12, 2))
    loss = jax.jit(nodrop.load_balancing_loss, static_argnames="num_experts")(
        probs, int32(ids), num_experts=4)
    np.testing.assert_allclose(float(loss), numpy_load_balancing_loss(probs, ids, 4), rtol=1e-6)


def test_load_balancing_loss_rejects_mismatched_num_experts():
    probs = jnp.full((4, 8), 1 / 8, jnp.float32)
    with pytest.raises(ValueError, match="^" + re.escape(
            "probs has 8 experts but num_experts is 4") + "$"):
        nodrop.load_balancing_loss(probs, int32(np.zeros((4, 2))), num_experts=4)


# --- sequence_balance_loss --------------------------------------------------------------------


def test_sequence_balance_loss_is_the_mean_of_each_sequences_loss():
    rng = np.random.default_rng(3)
    num_sequences, seq, num_experts, k = 3, 10, 6, 2
    probs = numpy_softmax(rng.normal(size=(num_sequences * seq, num_experts)))
    ids = rng.integers(0, num_experts, size=(num_sequences * seq, k))
    expected = np.mean([numpy_load_balancing_loss(probs[i * seq:(i + 1) * seq],
                                                  ids[i * seq:(i + 1) * seq], num_experts)
                        for i in range(num_sequences)])
    loss = nodrop.moe.sequence_balance_loss(jnp.asarray(probs, jnp.float32), int32(ids),
                                            num_sequences)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_sequence_balance_loss_sees_what_the_batch_loss_does_not():
    """Two sequences, each all on its own expert: balanced over the batch, not per sequence."""
    probs = jnp.asarray(np.repeat(np.eye(2, dtype=np.float32), 4, axis=0))  # [8, 2]
    ids = int32(np.repeat([[0], [1]], 4, axis=0))
    assert float(nodrop.load_balancing_loss(probs, ids)) == pytest.approx(1.0)
    assert float(nodrop.moe.sequence_balance_loss(probs, ids, 2)) == pytest.approx(2.0)
    assert float(nodrop.moe.sequence_balance_loss(probs, ids, 1)) == pytest.approx(1.0)


def test_sequence_balance_loss_refuses_sequences_that_do_not_divide_the_tokens():
    with pytest.raises(ValueError, match="num_sequences must divide the 8 tokens, got 3"):
        nodrop.moe.sequence_balance_loss(jnp.ones((8, 2)) / 2, int32(np.zeros((8, 1))), 3)


# --- router_z_loss ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_router_z_loss_matches_numpy(dtype):
    logits = random_normal(np.random.default_rng(6), (30, 8), dtype, scale=3.0)
    x = as_f64(logits)
    m = x.max(-1, keepdims=True)
    expected = np.mean((np.log(np.exp(x - m).sum(-1)) + m[:, 0]) ** 2)
    loss = nodrop.router_z_loss(logits)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(float(loss), expected, rtol=tolerance(jnp.float32))


def test_router_z_loss_gradient_matches_numpy():
    logits = random_normal(np.random.default_rng(7), (10, 6))
    x = as_f64(logits)
    z = np.log(np.exp(x).sum(-1))
    expected = 2 * z[:, None] * numpy_softmax(x) / x.shape[0]
    grad = jax.grad(nodrop.router_z_loss)(logits)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)


def test_router_z_loss_of_large_logits_is_finite():
    logits = jnp.full((4, 8), 100.0, jnp.float32)
    expected = (100.0 + np.log(8.0)) ** 2
    np.testing.assert_allclose(float(nodrop.router_z_loss(logits)), expected, rtol=1e-6)
