"""topk_router against the float64 reference: ids exactly, weights and logit gradients closely.

The chosen ids are piecewise constant in the logits, so inputs are drawn without near-ties: the
selection scores around the k-th choice (and the group scores around the topk_groups-th group)
are separated by a margin far above float32 rounding (and above the finite-difference steps of
check_grads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (DTYPE_IDS, F32_TOL, FLOAT_DTYPES, assert_close, f64, random_normal,
                      ref64, ref64_vjp, seeds, tolerance)
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import nodrop
from nodrop.ops import reference

NUM_EXPERTS = 8
# name -> keyword arguments of topk_router (bias=True adds a random expert_bias)
CONFIGS = {
    "softmax_top1": dict(k=1),
    "softmax_top2": dict(k=2),
    "softmax_k_equals_e": dict(k=NUM_EXPERTS),
    "softmax_renormalize": dict(k=2, renormalize=True),
    "softmax_bias": dict(k=2, bias=True),
    "softmax_scaled": dict(k=3, scaling_factor=0.5),
    "sigmoid_top2": dict(k=2, score_function="sigmoid"),
    "sigmoid_bias_renormalize_scaled": dict(k=3, score_function="sigmoid", bias=True,
                                            renormalize=True, scaling_factor=2.5),
    "group_limited_sigmoid": dict(k=4, score_function="sigmoid", bias=True, num_groups=4,
                                  topk_groups=2, renormalize=True, scaling_factor=2.5),
    "group_limited_softmax": dict(k=2, num_groups=2, topk_groups=1),
    "group_limited_k_above_groups": dict(k=3, num_groups=4, topk_groups=2),
    "group_limited_k_equals_e": dict(k=NUM_EXPERTS, num_groups=2, topk_groups=2),
}

# logit gradients are checked on the configurations that differentiate the weights differently
GRAD_CONFIGS = ["softmax_top2", "softmax_k_equals_e", "softmax_renormalize", "sigmoid_top2",
                "sigmoid_bias_renormalize_scaled", "group_limited_sigmoid"]

# With k=1 and renormalize the weight is constantly 1 and its logit gradient is zero up to
# rounding (~1e-17): relative errors are taken against at least this scale (cotangents are ~1).
GRAD_FLOOR = 1e-3

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
configs = pytest.mark.parametrize("name", list(CONFIGS))
grad_configs = pytest.mark.parametrize("name", GRAD_CONFIGS)


def selection_margin(logits, bias, *, k, score_function="softmax", num_groups=1,
                     topk_groups=1, **_):
    """How far the inputs are from a tie that decides the ids, computed in float64.

    For each pair of consecutive choices (selection scores up to the (k+1)-th allowed expert,
    and group scores around the last kept group) this is gap / (unbiased scores of the pair):
    a perturbation of the logits by d changes a score s by at most about 2*d*s, so a margin
    above 2*d (and far above float32 rounding) keeps the ids fixed.
    """
    logits = np.asarray(logits, np.float64)
    if score_function == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    if bias is None:
        selection = scores
    elif score_function == "softmax":  # the bias is added to the logits
        selection = scores * np.exp(np.asarray(bias, np.float64))
    else:
        selection = scores + np.asarray(bias, np.float64)
    tokens, experts = selection.shape
    margins = [np.inf]
    allowed = np.ones((tokens, experts), bool)
    allowed_count = experts
    if num_groups > 1:
        per_group = experts // num_groups
        best = max(1, k // topk_groups)
        grouped = selection.reshape(tokens, num_groups, per_group)
        top = np.argsort(-grouped, -1, kind="stable")[..., :best]
        group_score = np.take_along_axis(grouped, top, -1).sum(-1)
        group_mass = np.take_along_axis(scores.reshape(grouped.shape), top, -1).sum(-1)
        order = np.argsort(-group_score, -1, kind="stable")
        if topk_groups < num_groups:
            last, first_out = order[:, topk_groups - 1:topk_groups], order[:, topk_groups:
                                                                            topk_groups + 1]
            gap = (np.take_along_axis(group_score, last, -1)
                   - np.take_along_axis(group_score, first_out, -1))
            mass = (np.take_along_axis(group_mass, last, -1)
                    + np.take_along_axis(group_mass, first_out, -1))
            margins.append(float(np.min(gap / mass)))
        kept = np.zeros((tokens, num_groups), bool)
        np.put_along_axis(kept, order[:, :topk_groups], True, axis=-1)
        allowed = np.repeat(kept, per_group, axis=1)
        allowed_count = topk_groups * per_group
    chosen = np.argsort(-np.where(allowed, selection, -np.inf), -1, kind="stable")
    chosen = chosen[:, :min(k + 1, allowed_count)]
    if chosen.shape[1] > 1:
        sel = np.take_along_axis(selection, chosen, -1)
        mass = np.take_along_axis(scores, chosen, -1)
        margins.append(float(np.min((sel[:, :-1] - sel[:, 1:]) / (mass[:, :-1] + mass[:, 1:]))))
    return min(margins)


def spread_logits(rng, tokens, experts, dtype=jnp.float32):
    """Each token's logits are a random permutation of evenly spaced values (spacing 0.5, with
    a little jitter), exactly representable after rounding to `dtype`."""
    base = (np.arange(experts) - (experts - 1) / 2) * 0.5
    logits = np.stack([rng.permutation(base) for _ in range(tokens)])
    logits = logits + rng.uniform(-0.1, 0.1, logits.shape)
    return jnp.asarray(logits.astype(np.float32)).astype(dtype)


def router_inputs(rng, config, tokens, dtype=jnp.float32, min_margin=1e-4):
    """Logits (and an expert bias if the config asks for one) whose ids are decided with a
    margin of at least min_margin; deterministic for a given rng."""
    experts = config.get("experts", NUM_EXPERTS)
    for _ in range(500):
        logits = spread_logits(rng, tokens, experts, dtype)
        bias = random_normal(rng, (experts,), scale=0.1) if config.get("bias") else None
        if selection_margin(logits, bias, **router_kwargs(config)) >= min_margin:
            return logits, bias
    raise AssertionError(f"no router inputs with margin {min_margin} for {config}")


def router_kwargs(config, bias=None):
    """topk_router keyword arguments from a config (dropping the test-only keys)."""
    kwargs = {key: value for key, value in config.items() if key not in ("bias", "experts")}
    if bias is not None:
        kwargs["expert_bias"] = bias
    return kwargs


def _reference_router_with_bias(logits, bias, **static):
    return reference.topk_router(logits, expert_bias=bias, **static)


def ref_router(logits, bias, kwargs):
    """The float64 reference's (weights, ids) for topk_router(logits, **kwargs)."""
    static = {key: v for key, v in kwargs.items() if key != "expert_bias"}
    if bias is None:
        return ref64("topk_router", logits, **static)
    return ref64(_reference_router_with_bias, logits, bias, **static)


def ref_router_grad(logits, bias, static, cot):
    bias64 = None if bias is None else f64(bias)
    return ref64_vjp(lambda x: reference.topk_router(x, expert_bias=bias64, **static)[0],
                     (logits,), cot)[0]


# --- forward -------------------------------------------------------------------------------------


@dtypes
@configs
@pytest.mark.parametrize("tokens", [1, 16], ids=["T1", "T16"])
def test_topk_router_matches_reference(name, tokens, dtype):
    config = CONFIGS[name]
    logits, bias = router_inputs(np.random.default_rng(0), config, tokens, dtype)
    kwargs = router_kwargs(config, bias)
    weights, ids = nodrop.topk_router(logits, **kwargs)
    assert weights.shape == ids.shape == (tokens, config["k"])
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    ref_weights, ref_ids = ref_router(logits, bias, kwargs)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids), "ids")
    # weights are computed in float32 from the exactly widened logits, whatever their dtype
    assert_close(weights, ref_weights, F32_TOL, "weights")


@pytest.mark.parametrize("name", ["softmax_top2", "softmax_k_equals_e", "sigmoid_top2",
                                  "group_limited_softmax", "group_limited_k_above_groups"])
def test_topk_router_ties_match_reference(name):
    """Equal logits: ties go to the lower expert (and the lower group) index."""
    config = CONFIGS[name]
    logits = jnp.zeros((3, NUM_EXPERTS), jnp.float32)
    weights, ids = nodrop.topk_router(logits, **router_kwargs(config))
    ref_weights, ref_ids = ref_router(logits, None, router_kwargs(config))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    assert_close(weights, ref_weights, F32_TOL)


def test_topk_router_ties_go_to_lower_expert_index():
    logits = jnp.asarray([[0.0, 1.0, 1.0, 0.0, 1.0]], jnp.float32)
    _, ids = nodrop.topk_router(logits, 4)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 4, 0]])


def test_topk_router_slots_in_descending_score():
    logits = jnp.asarray([[0.1, 2.0, -1.0, 3.0, 0.5]], jnp.float32)
    weights, ids = nodrop.topk_router(logits, 3)
    np.testing.assert_array_equal(np.asarray(ids), [[3, 1, 4]])
    assert np.all(np.diff(np.asarray(weights)[0]) < 0)


def test_topk_router_expert_bias_changes_selection_not_weights():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    bias = jnp.asarray([0.0, 0.0, 0.0, 5.0], jnp.float32)
    weights, ids = nodrop.topk_router(logits, 1, expert_bias=bias)
    assert int(ids[0, 0]) == 3
    softmax = np.exp([2.0, 1.0, 0.0, -1.0]) / np.sum(np.exp([2.0, 1.0, 0.0, -1.0]))
    np.testing.assert_allclose(float(weights[0, 0]), softmax[3], rtol=1e-6)


def test_topk_router_renormalized_weights_sum_to_scaling_factor():
    config = {"k": 3, "score_function": "sigmoid"}
    logits, _ = router_inputs(np.random.default_rng(1), config, 16)
    weights, _ = nodrop.topk_router(logits, 3, score_function="sigmoid", renormalize=True,
                                    scaling_factor=2.5)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 2.5, rtol=1e-6)


@pytest.mark.parametrize("num_groups, topk_groups, expected", [
    (4, 1, [2, 3]),  # groups scored by their best 2 (k // topk_groups): group 1 wins
    (4, 2, [0, 2]),  # groups scored by their best 1: groups 0 and 1 are kept
])
def test_topk_router_group_limited_picks_only_from_best_groups(num_groups, topk_groups,
                                                                expected):
    # sigmoid scores: 0.953, 0.047, 0.924, 0.917, 0.269, 0.269, 0.119, 0.119
    logits = jnp.asarray([[3.0, -3.0, 2.5, 2.4, -1.0, -1.0, -2.0, -2.0]], jnp.float32)
    _, ids = nodrop.topk_router(logits, 2, score_function="sigmoid", num_groups=num_groups,
                                topk_groups=topk_groups)
    np.testing.assert_array_equal(np.asarray(ids), [expected])


def test_topk_router_group_limited_excludes_the_best_expert_of_a_weak_group():
    # 2 groups of 4, scored by their best 2: group 1 (0.924 + 0.917) beats group 0 (0.953 +
    # 0.047) although expert 0 has the best single score.
    logits = jnp.asarray([[3.0, -3.0, -3.0, -3.0, 2.5, 2.4, -3.0, -3.0]], jnp.float32)
    _, ids = nodrop.topk_router(logits, 2, score_function="sigmoid", num_groups=2,
                                topk_groups=1)
    np.testing.assert_array_equal(np.asarray(ids), [[4, 5]])


# --- gradients -----------------------------------------------------------------------------------


@grad_configs
def test_topk_router_check_grads(name):
    config = CONFIGS[name]
    logits, bias = router_inputs(np.random.default_rng(2), config, 6, min_margin=2e-2)
    kwargs = router_kwargs(config, bias)
    check_grads(lambda x: nodrop.topk_router(x, **kwargs)[0], (logits,), order=1,
                modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3)


@dtypes
@grad_configs
def test_topk_router_logit_grads_match_reference(name, dtype):
    config = CONFIGS[name]
    rng = np.random.default_rng(3)
    logits, bias = router_inputs(rng, config, 16, dtype)
    kwargs = router_kwargs(config, bias)
    cot = random_normal(rng, (16, config["k"]))
    _, vjp = jax.vjp(lambda x: nodrop.topk_router(x, **kwargs)[0], logits)
    (grad,) = vjp(cot)
    assert grad.dtype == dtype
    expected = ref_router_grad(logits, bias, router_kwargs(config), cot)
    # the float32 gradient is rounded to the logits' dtype
    assert_close(grad, expected, tolerance(dtype), "grad logits", floor=GRAD_FLOOR)


def test_topk_router_expert_bias_gets_no_gradient():
    logits, bias = router_inputs(np.random.default_rng(4), CONFIGS["softmax_bias"], 4)
    grad = jax.grad(lambda b: jnp.sum(nodrop.topk_router(logits, 2, expert_bias=b)[0]))(bias)
    np.testing.assert_array_equal(np.asarray(grad), 0)


# --- transformations -------------------------------------------------------------------------


@pytest.mark.parametrize("transform", ["jit", "checkpoint"])
def test_topk_router_grad_under_transform(transform):
    config = CONFIGS["group_limited_sigmoid"]
    rng = np.random.default_rng(5)
    logits, bias = router_inputs(rng, config, 16)
    cot = random_normal(rng, (16, config["k"]))
    static = router_kwargs(config)

    def value_and_grad(router, b):
        def loss(x):
            return jnp.sum(router(x, expert_bias=b, **static)[0] * cot.astype(x.dtype))
        if transform == "checkpoint":
            loss = jax.checkpoint(loss)
        return jax.jit(jax.value_and_grad(loss))

    value, grad = value_and_grad(nodrop.topk_router, bias)(logits)
    value64, grad64 = value_and_grad(reference.topk_router, f64(bias))(f64(logits))
    assert_close(value, value64, F32_TOL, "loss")
    assert_close(grad, grad64, F32_TOL, "grad logits", floor=GRAD_FLOOR)


def test_topk_router_under_jit_with_traced_bias():
    config = CONFIGS["sigmoid_bias_renormalize_scaled"]
    logits, bias = router_inputs(np.random.default_rng(6), config, 16)
    static = router_kwargs(config)
    weights, ids = jax.jit(lambda x, b: nodrop.topk_router(x, expert_bias=b, **static))(
        logits, bias)
    ref_weights, ref_ids = ref_router(logits, bias, static)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    assert_close(weights, ref_weights, F32_TOL)


# --- property tests ------------------------------------------------------------------------------


@st.composite
def router_config(draw):
    experts = draw(st.sampled_from([1, 2, 4, 6, 8, 16]))
    num_groups = draw(st.sampled_from([g for g in (1, 2, 3, 4) if experts % g == 0]))
    topk_groups = draw(st.integers(1, num_groups))
    k = draw(st.integers(1, topk_groups * (experts // num_groups)))
    return dict(experts=experts, k=k, num_groups=num_groups, topk_groups=topk_groups,
                score_function=draw(st.sampled_from(["softmax", "sigmoid"])),
                bias=draw(st.booleans()), renormalize=draw(st.booleans()),
                scaling_factor=draw(st.sampled_from([1.0, 2.5])))


@settings(max_examples=300)
@given(config=router_config(), tokens=st.sampled_from([1, 5, 16]),
       dtype=st.sampled_from(FLOAT_DTYPES), seed=seeds)
def test_topk_router_property_matches_reference(config, tokens, dtype, seed):
    rng = np.random.default_rng(seed)
    logits = spread_logits(rng, tokens, config["experts"], dtype)
    bias = random_normal(rng, (config["experts"],), scale=0.1) if config["bias"] else None
    assume(selection_margin(logits, bias, **router_kwargs(config)) >= 1e-4)
    kwargs = router_kwargs(config, bias)
    weights, ids = nodrop.topk_router(logits, **kwargs)
    ref_weights, ref_ids = ref_router(logits, bias, kwargs)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids), "ids")
    assert_close(weights, ref_weights, F32_TOL, "weights")


@settings(max_examples=60)
@given(config=router_config(), seed=seeds)
def test_topk_router_property_grads_match_reference(config, seed):
    rng = np.random.default_rng(seed)
    logits = spread_logits(rng, 5, config["experts"])
    bias = random_normal(rng, (config["experts"],), scale=0.1) if config["bias"] else None
    assume(selection_margin(logits, bias, **router_kwargs(config)) >= 1e-4)
    static = router_kwargs(config)
    cot = random_normal(rng, (5, config["k"]))
    _, vjp = jax.vjp(lambda x: nodrop.topk_router(x, expert_bias=bias, **static)[0], logits)
    assert_close(vjp(cot)[0], ref_router_grad(logits, bias, static, cot), F32_TOL,
                 "grad logits", floor=GRAD_FLOOR)
