"""One MoE layer, forward and backward on random data, through nodrop's ops.

The layer: top-k softmax router -> permute -> SwiGLU experts (one gate/up grouped matmul against
[E, H, 2F], silu(gate) * up, down grouped matmul) -> unpermute, with a mean-squared-error loss plus the
load-balancing loss. The demo computes it with nodrop's ops and with the pure-JAX references
(nodrop.ops.reference) and compares the output and every gradient; then it times the jitted
forward+backward against the same layer written with jax.lax.ragged_dot. It exits with status 1
if a difference exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import types

import jax
import jax.numpy as jnp

import nodrop
from nodrop.bench import median_ms, positive_int, relative_difference
from nodrop.moe.block import swiglu
from nodrop.moe.losses import load_balancing_loss
from nodrop.ops import reference

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max relative difference to the references
AUX_LOSS_WEIGHT = 0.01

# The layer as plain JAX would write it: the references' routing and permutation (top_k,
# argsort, gather) around XLA's jax.lax.ragged_dot.
JAX_RAGGED_DOT_OPS = types.SimpleNamespace(
    topk_router=reference.topk_router, permute=reference.permute,
    grouped_matmul=jax.lax.ragged_dot, unpermute=reference.unpermute)


def init(key, tokens: int, hidden: int, ffn: int, experts: int, dtype):
    """Random expert weights (scaled by 1/sqrt(fan_in)), tokens x and a regression target."""
    keys = jax.random.split(key, 5)

    def normal(key, shape, fan_in=1):
        return (jax.random.normal(key, shape) / fan_in**0.5).astype(dtype)

    params = {
        "router": normal(keys[0], (hidden, experts), hidden),
        # Each expert's gate in [..., :F] and up in [..., F:]: one grouped matmul for both.
        "gate_up": normal(keys[1], (experts, hidden, 2 * ffn), hidden),
        "down": normal(keys[2], (experts, ffn, hidden), ffn),
    }
    return params, normal(keys[3], (tokens, hidden)), normal(keys[4], (tokens, hidden))


def moe_layer(ops, params, x, k: int):
    """x [T, H] -> out [T, H], router probabilities [T, E], expert ids [T, k]."""
    num_experts = params["router"].shape[1]
    logits = jnp.dot(x, params["router"], preferred_element_type=jnp.float32)
    weights, ids = ops.topk_router(logits, k)
    rows, group_sizes, row_map = ops.permute(x, ids, num_experts)
    out_rows = swiglu(lambda a, w: ops.grouped_matmul(a, w, group_sizes), rows,
                      params["gate_up"], params["down"])
    return ops.unpermute(out_rows, row_map, weights), jax.nn.softmax(logits), ids


def loss_and_grads(ops, k: int):
    """(params, x, target) -> ((loss, out), (grad params, grad x))."""
    def loss(params, x, target):
        out, probs, ids = moe_layer(ops, params, x, k)
        mse = jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))
        return mse + AUX_LOSS_WEIGHT * load_balancing_loss(probs, ids), out
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=positive_int, default=2048, help="T (default: 2048)")
    parser.add_argument("--hidden", type=positive_int, default=512, help="H (default: 512)")
    parser.add_argument("--ffn", type=positive_int, default=1024,
                        help="expert FFN size F (default: 1024)")
    parser.add_argument("--experts", type=positive_int, default=8, help="E (default: 8)")
    parser.add_argument("--topk", type=positive_int, default=2,
                        help="experts per token, at most E (default: 2)")
    parser.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32",
                        help="dtype of the tokens and weights (default: float32)")
    parser.add_argument("--iters", type=positive_int, default=5,
                        help="timed steps per layer, after warm-up (default: 5)")


def run(args: argparse.Namespace) -> int:
    params, x, target = init(jax.random.key(0), args.tokens, args.hidden, args.ffn,
                             args.experts, jnp.dtype(args.dtype))
    inputs = (params, x, target)
    print(f"MoE layer: T={args.tokens} tokens, H={args.hidden}, F={args.ffn}, "
          f"E={args.experts} experts, top-{args.topk}, {args.dtype}, on {jax.default_backend()}")

    nodrop_step = loss_and_grads(nodrop, args.topk)
    (loss, out), (grads, grad_x) = jax.jit(nodrop_step)(*inputs)
    (ref_loss, ref_out), (ref_grads, ref_grad_x) = jax.jit(
        loss_and_grads(reference, args.topk))(*inputs)
    differences = {"output": relative_difference(out, ref_out),
                   "loss": relative_difference(loss, ref_loss),
                   "grad x": relative_difference(grad_x, ref_grad_x)}
    differences.update({f"grad {name}": relative_difference(grads[name], ref_grads[name])
                        for name in params})
    tolerance = TOLERANCE[args.dtype]
    print(f"nodrop vs reference, max |difference| / max |reference| (tolerance {tolerance:g}):")
    for name, difference in differences.items():
        print(f"  {name:12s} {difference:.2e}  {'ok' if difference <= tolerance else 'TOO LARGE'}")

    nodrop_ms = median_ms(nodrop_step, inputs, args.iters)
    ragged_dot_ms = median_ms(loss_and_grads(JAX_RAGGED_DOT_OPS, args.topk), inputs, args.iters)
    print(f"forward+backward, median of {args.iters} jitted steps: nodrop {nodrop_ms:.1f} ms, "
          f"jax.lax.ragged_dot {ragged_dot_ms:.1f} ms, nodrop speedup "
          f"{ragged_dot_ms / nodrop_ms:.2f}x")

    passed = all(difference <= tolerance for difference in differences.values())
    print("PASS" if passed else "FAIL: nodrop differs from the references beyond the tolerance")
    return 0 if passed else 1
