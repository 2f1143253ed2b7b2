"""One MoE layer, forward and backward on random data: nodrop's ops against the pure-JAX references.

The layer is nodrop.moe.MoEBlock (top-k softmax router -> permute -> SwiGLU experts -> unpermute)
with a mean-squared-error loss plus the load-balancing loss. The demo runs it on nodrop's ops and,
with the same weights, on the pure-JAX references (MoEConfig(ops="reference"),
nodrop/ops/reference.py), and compares the output, the loss and every gradient. Then it times the
jitted forward+backward against the same layer as plain JAX would write it: the references'
routing and permutation around jax.lax.ragged_dot. It exits with status 1 if a difference exceeds
the tolerance.

bench/gpu_moe.py and bench/gpu_profile.py time this layer step (`loss_and_grads`) on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nodrop.moe.block import MoEBlock, MoEConfig

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max relative difference to the references
AUX_LOSS_WEIGHT = 0.01
# The layers the demo runs: MoEConfig fields on top of the command line's shape.
LAYERS = {
    "nodrop": dict(ops="nodrop", matmul="nodrop"),
    "reference": dict(ops="reference", matmul="nodrop"),  # the references' grouped matmul
    "jax.lax.ragged_dot": dict(ops="reference", matmul="ragged_dot"),
}


def loss_and_grads(block: MoEBlock):
    """A function (params, x, target) -> ((loss, out), (grad params, grad x)) of `block`.

    params: the block's nnx.Param state, `nnx.state(block, nnx.Param)`, or that of another block
    of the same shape (so that blocks of different configs run on the same weights). x, target:
    [T, H]. The loss: mean squared error of out against target, plus AUX_LOSS_WEIGHT times the
    load-balancing loss.
    """
    graphdef, _, rest = nnx.split(block, nnx.Param, ...)

    def loss(params, x, target):
        out, aux = nnx.merge(graphdef, params, rest)(x)
        mse = jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))
        return mse + AUX_LOSS_WEIGHT * aux.load_balancing_loss, out

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def inputs(key, config: MoEConfig, tokens: int):
    """Random tokens x and regression target, [tokens, H] in config.dtype."""
    keys = jax.random.split(key)
    return tuple(jax.random.normal(k, (tokens, config.hidden)).astype(config.dtype) for k in keys)


def relative_difference(actual, expected) -> float:
    """max |actual - expected| / max |expected|, computed in float32."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def median_ms(step, args, iters: int) -> float:
    """Median wall time of `iters` calls of step(*args) in milliseconds, each waited for, after
    two untimed calls (the first compiles)."""
    for _ in range(2):
        jax.block_until_ready(step(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


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
    config = MoEConfig(num_experts=args.experts, k=args.topk, hidden=args.hidden, ffn=args.ffn,
                       dtype=args.dtype, param_dtype=args.dtype)
    steps = {name: jax.jit(loss_and_grads(MoEBlock(dataclasses.replace(config, **fields),
                                                   rngs=nnx.Rngs(0))))
             for name, fields in LAYERS.items()}
    params = nnx.state(MoEBlock(config, rngs=nnx.Rngs(0)), nnx.Param)  # every layer's weights
    x, target = inputs(jax.random.key(1), config, args.tokens)
    print(f"MoE layer (nodrop.moe.MoEBlock): T={args.tokens} tokens, H={args.hidden}, "
          f"F={args.ffn}, E={args.experts} experts, top-{args.topk}, {args.dtype}, "
          f"on {jax.default_backend()}")

    (loss, out), (grads, grad_x) = steps["nodrop"](params, x, target)
    (ref_loss, ref_out), (ref_grads, ref_grad_x) = steps["reference"](params, x, target)
    differences = {"output": relative_difference(out, ref_out),
                   "loss": relative_difference(loss, ref_loss),
                   "grad x": relative_difference(grad_x, ref_grad_x)}
    ref_grads = nnx.to_pure_dict(ref_grads)
    differences.update({f"grad {name}": relative_difference(grad, ref_grads[name])
                        for name, grad in nnx.to_pure_dict(grads).items()})
    tolerance = TOLERANCE[args.dtype]
    print(f"nodrop vs reference, max |difference| / max |reference| (tolerance {tolerance:g}):")
    for name, difference in differences.items():
        print(f"  {name:12s} {difference:.2e}  {'ok' if difference <= tolerance else 'TOO LARGE'}")

    nodrop_ms = median_ms(steps["nodrop"], (params, x, target), args.iters)
    ragged_dot_ms = median_ms(steps["jax.lax.ragged_dot"], (params, x, target), args.iters)
    print(f"forward+backward, median of {args.iters} jitted steps: nodrop {nodrop_ms:.1f} ms, "
          f"jax.lax.ragged_dot {ragged_dot_ms:.1f} ms, nodrop speedup "
          f"{ragged_dot_ms / nodrop_ms:.2f}x")

    passed = all(difference <= tolerance for difference in differences.values())
    print("PASS" if passed else "FAIL: nodrop differs from the references beyond the tolerance")
    return 0 if passed else 1
