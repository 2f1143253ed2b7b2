"""AdamW's step on one parameter, with the statistics of the step, in one engine call.

The training step's optimizer (nodrop.train.trainer) writes each parameter and both of Adam's
moments in place and sums the squares of the update in the same pass: XLA, running optax, keeps
the update in memory and reads it back to sum it (bench/results/2026-12-06-optimizer-pass). The
arithmetic is optax.adamw's after optax.clip_by_global_norm, operation for operation
(engine.h, AdamWConfig); `reference.adamw_update` is the same in jax.numpy. The step is not
differentiable.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nodrop import _ffi
from nodrop.ops import _partition, _primitives

# The update's five sums (nodrop.train.trainer.tree_stats'): squares, squares scaled by 2^-70
# and by 2^70, values of the update or the new parameter that are not finite, squares that are
# not.
NUM_SUMS = 5
# The gradient's dtypes the engine reads.
GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Elements per engine chunk, at least (one thread block's work on the GPU), and chunks at most.
_CHUNK_ELEMENTS = 16384
_MAX_CHUNKS = 8192


class AdamWStep(NamedTuple):
    param: jax.Array
    mu: jax.Array
    nu: jax.Array
    sums: jax.Array  # [NUM_SUMS] float32, over the whole parameter (every shard's)


def adamw_update(param: jax.Array, grad: jax.Array, mu: jax.Array, nu: jax.Array, *,
                 step_size, count, b1: float, b2: float, eps: float,
                 weight_decay: float = 0.0, update_scale: float = 1.0,
                 max_grad_norm: float = 0.0, grad_norm=None) -> AdamWStep:
    """One AdamW step of a float32 parameter.

    Args:
      param, grad, mu, nu: arrays of one shape: the float32 parameter, its gradient and Adam's
        float32 first and second moments. The gradient may be bfloat16 or float16, as it comes
        for a weight the model computes in that dtype: the engine widens it (exactly) as it
        reads it, so the step is the float32 one on its values, and no float32 copy of the
        gradient is written and read.
      step_size: scalar, the signed step (optax.scale_by_learning_rate's: minus the learning
        rate).
      count: int32 scalar, the step's number from 1 (optax.scale_by_adam's incremented count):
        the bias corrections are 1 - b1**count and 1 - b2**count.
      b1, b2, eps, weight_decay: optax.adamw's (weight_decay applied to this parameter, 0 for
        one the decay mask leaves out).
      update_scale: multiplies the step after the learning rate (optax.scale).
      max_grad_norm, grad_norm: with max_grad_norm > 0 the gradient is clipped as
        optax.clip_by_global_norm clips it, given the global norm grad_norm.

    Returns:
      AdamWStep: the new param, mu and nu (written into the given buffers where XLA can give
      them up, as under jit with the state donated) and the update's NUM_SUMS sums.
    """
    for name, x in (("param", param), ("mu", mu), ("nu", nu)):
        _require_f32(name, x)
    if jnp.result_type(grad) not in GRAD_DTYPES:
        raise ValueError(f"grad must be float32, bfloat16 or float16, got {jnp.result_type(grad)}")
    for name, x in (("grad", grad), ("mu", mu), ("nu", nu)):
        if x.shape != param.shape:
            raise ValueError(f"{name} must have param's shape {param.shape}, got {x.shape}")
    for name, value, low, high in (("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0)):
        if not low <= value < high:
            raise ValueError(f"{name} must be in [{low}, {high}), got {value}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if not math.isfinite(update_scale):
        raise ValueError(f"update_scale must be finite, got {update_scale}")
    if math.isnan(max_grad_norm):
        raise ValueError("max_grad_norm must not be NaN")
    if max_grad_norm > 0 and grad_norm is None:
        raise ValueError(f"max_grad_norm={max_grad_norm} clips: grad_norm must be given")
    count = jnp.asarray(count)
    if count.shape or not jnp.issubdtype(count.dtype, jnp.integer):
        raise ValueError(f"count must be an integer scalar, got {count.dtype}{list(count.shape)}")
    # As optax: 1 - decay**count, a weakly typed float32 power of an int32 count.
    count = count.astype(jnp.int32)
    scalars = jnp.stack([jnp.asarray(step_size, jnp.float32).reshape(()),
                         jnp.asarray(0.0 if grad_norm is None else grad_norm,
                                     jnp.float32).reshape(()),
                         1 - b1 ** count, 1 - b2 ** count]).astype(jnp.float32)
    attrs = (float(b1), float(b2), float(eps), float(weight_decay), float(update_scale),
             float(max_grad_norm))
    shape = param.shape
    flat = [x.reshape(1) for x in (param, grad, mu, nu)] if not shape else [param, grad, mu, nu]
    new_param, new_mu, new_nu, sums = _adamw_p.bind(*flat, scalars, attrs=attrs)
    return AdamWStep(new_param.reshape(shape), new_mu.reshape(shape), new_nu.reshape(shape),
                     sums)


def _require_f32(name, x):
    dtype = jnp.result_type(x)
    if dtype != jnp.float32:
        raise ValueError(f"{name} must be float32 (the optimizer state's dtype), got {dtype}")


def num_chunks(num_elements: int) -> int:
    """The engine chunks (partial sums) a parameter of num_elements is summed in."""
    return max(1, min(_MAX_CHUNKS, -(-num_elements // _CHUNK_ELEMENTS)))


def _lowering(param, grad, mu, nu, scalars, *, attrs, partition):
    b1, b2, eps, weight_decay, update_scale, max_grad_norm = attrs

    def run(param, grad, mu, nu, scalars):
        like = jax.ShapeDtypeStruct(param.shape, jnp.float32)
        partials = jax.ShapeDtypeStruct((num_chunks(math.prod(param.shape)), NUM_SUMS),
                                        jnp.float32)
        new_param, new_mu, new_nu, partials = _ffi.call(
            "nodrop_adamw_update", (like, like, like, partials), param, grad, mu, nu, scalars,
            aliases={0: 0, 2: 1, 3: 2}, b1=np.float32(b1), b2=np.float32(b2),
            eps=np.float32(eps), weight_decay=np.float32(weight_decay),
            update_scale=np.float32(update_scale), max_grad_norm=np.float32(max_grad_norm))
        return new_param, new_mu, new_nu, partials.sum(axis=0)

    if not partition:
        return run(param, grad, mu, nu, scalars)
    # Elementwise: every dimension stays split; the sums add up over the shards.
    factors = tuple(f"d{i}" for i in range(param.ndim))
    tensor = " ".join(factors)
    rule = f"{tensor}, {tensor}, {tensor}, {tensor}, s -> {tensor}, {tensor}, {tensor}, f"

    def local(axes_of, *operands):
        new_param, new_mu, new_nu, sums = run(*operands)
        axes = tuple(axis for factor in factors for axis in axes_of.get(factor, ()))
        return new_param, new_mu, new_nu, jax.lax.psum(sums, axes) if axes else sums

    return _partition.partitioned(
        run, rule, (factors,) * 4 + (("s",),), (factors,) * 3 + (("f",),), local, factors,
        need_replication_factors=("s", "f"))(param, grad, mu, nu, scalars)


_adamw_p = _primitives.define(
    "nodrop_adamw_update",
    abstract_eval=lambda param, grad, mu, nu, scalars, *, attrs: (
        *(_primitives.result_aval((param, grad, mu, nu), param.shape, jnp.float32)
          for _ in range(3)),
        _primitives.result_aval((param, grad, mu, nu), (NUM_SUMS,), jnp.float32)),
    lower=_lowering, multiple_results=True)
