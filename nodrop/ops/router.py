"""Top-k routing: router logits -> (weights, expert ids), fused in one engine call each way."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from nodrop import _ffi
from nodrop.ops import _checks, _partition, _primitives

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def topk_router(logits: jax.Array, k: int, *, score_function: str = "softmax",
                expert_bias: ArrayLike | None = None, num_groups: int = 1,
                topk_groups: int = 1, renormalize: bool = False,
                scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Chooses k experts per token.

    Args:
      logits: [T, E] router logits (computed in float32; other float dtypes are cast).
      k: experts per token, 1 <= k <= E.
      score_function: "softmax" over the E experts (Mixtral, Qwen) or elementwise "sigmoid"
        (DeepSeek-V3).
      expert_bias: optional [E] float32 that moves the scores for selection only (aux-loss-free
        balancing): added to the sigmoid scores (DeepSeek-V3), added to the logits for softmax
        (the probabilities times exp(bias): one bias step moves an expert by the same factor
        whatever E is). It never changes the weights and gets no gradient.
      num_groups, topk_groups: group-limited routing. The E experts form num_groups equal
        groups; each group is scored by the sum of its best max(1, k // topk_groups) selection
        scores, and only experts of the topk_groups best groups may be chosen.
      renormalize: divide the k selected scores by their sum.
      scaling_factor: multiplies the final weights.

    Returns:
      weights [T, k] float32 and ids [T, k] int32, slots in descending selection score, ties to
      the lower expert index. Differentiable in logits.
    """
    _checks.require_rank("logits", logits, 2, "[T, E]")
    _checks.require_float("logits", logits)
    num_experts = logits.shape[1]
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, E={num_experts}], got {k}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_groups must divide the number of experts E={num_experts}, got {num_groups}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got {topk_groups}")
    if k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"k={k} exceeds the {topk_groups * (num_experts // num_groups)} experts in the "
            f"topk_groups={topk_groups} groups that may be chosen")
    if expert_bias is None:
        expert_bias = jnp.zeros((num_experts,), jnp.float32)
    else:
        _checks.require_rank("expert_bias", expert_bias, 1, "[E]")
        _checks.require_float("expert_bias", expert_bias)
        _checks.require_dim("expert_bias", expert_bias, 0, num_experts, "entries (E from logits)")
    config = (int(k), score_function, int(num_groups), int(topk_groups), bool(renormalize),
              float(scaling_factor))
    logits, expert_bias = _ffi.match_vma(logits.astype(jnp.float32),
                                         jax.lax.stop_gradient(expert_bias.astype(jnp.float32)))
    weights, ids = _topk_router(logits, expert_bias, config)
    return weights, ids


def _attrs(config):
    k, score_function, num_groups, topk_groups, renormalize, scaling_factor = config
    return dict(k=np.int64(k), score_function=score_function, num_groups=np.int64(num_groups),
                topk_groups=np.int64(topk_groups), renormalize=np.bool_(renormalize),
                scaling_factor=np.float32(scaling_factor))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _topk_router(logits, expert_bias, config):
    return tuple(_router_p.bind(logits, expert_bias, config=config))


def _topk_router_fwd(logits, expert_bias, config):
    weights, ids = _topk_router(logits, expert_bias, config)
    return (weights, ids), (logits, ids, expert_bias)


def _topk_router_bwd(config, residuals, grads):
    logits, ids, expert_bias = residuals
    grad_logits = _router_grad_p.bind(*_ffi.match_vma(logits, ids, grads[0]), config=config)
    return grad_logits, jnp.zeros_like(expert_bias)


_topk_router.defvjp(_topk_router_fwd, _topk_router_bwd)


# --- the two engine calls: primitives, so that under jit on sharded arrays the tokens (T)
# partition locally (routing is per token); the expert axis E is gathered. Differentiated by
# the custom_vjp above, not by JAX.


def _router_lowering(logits, expert_bias, *, config, partition):
    def run(logits, expert_bias):
        num_tokens, k = logits.shape[0], config[0]
        return _ffi.call(
            "nodrop_topk_router",
            (jax.ShapeDtypeStruct((num_tokens, k), jnp.float32),
             jax.ShapeDtypeStruct((num_tokens, k), jnp.int32)),
            logits, expert_bias, **_attrs(config))

    if not partition:
        return run(logits, expert_bias)
    return _partition.partitioned(
        run, "t e, e -> t k, t k", (("t", "e"), ("e",)), (("t", "k"), ("t", "k")),
        lambda axes_of, *operands: run(*operands), ("t",),
        need_replication_factors=("e", "k"))(logits, expert_bias)


def _router_grad_lowering(logits, ids, grad, *, config, partition):
    def run(logits, ids, grad):
        return _ffi.call("nodrop_topk_router_grad",
                         jax.ShapeDtypeStruct(logits.shape, jnp.float32), logits, ids, grad,
                         **_attrs(config))

    if not partition:
        return run(logits, ids, grad)
    return _partition.partitioned(
        run, "t e, t k, t k -> t e", (("t", "e"), ("t", "k"), ("t", "k")), (("t", "e"),),
        lambda axes_of, *operands: run(*operands), ("t",),
        need_replication_factors=("e", "k"))(logits, ids, grad)


_router_p = _primitives.define(
    "nodrop_topk_router",
    abstract_eval=lambda logits, bias, *, config: (
        _primitives.result_aval((logits, bias), (logits.shape[0], config[0]), jnp.float32),
        _primitives.result_aval((logits, bias), (logits.shape[0], config[0]), jnp.int32)),
    lower=_router_lowering, multiple_results=True)

_router_grad_p = _primitives.define(
    "nodrop_topk_router_grad",
    abstract_eval=lambda logits, ids, grad, *, config: _primitives.result_aval(
        (logits, ids, grad), logits.shape, jnp.float32),
    lower=_router_grad_lowering)
