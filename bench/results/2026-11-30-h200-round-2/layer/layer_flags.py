# The Mixtral MoE layer, nodrop against capacity 1.0 side by side, under the XLA_FLAGS given.
import os, jax
import nodrop
from nodrop import demo
import gpu_moe
tokens, hidden, ffn, experts, k = gpu_moe.LAYER_SHAPES["Mixtral-8x7B"]
params, x, target = demo.init(jax.random.key(2), tokens, hidden, ffn, experts, gpu_moe.DTYPE)
runs = {impl: ((lambda s: (lambda: s(params, x, target)))(jax.jit(demo.loss_and_grads(ops, k))), jax.block_until_ready)
        for impl, ops in {"nodrop": nodrop, "capacity_1.0": gpu_moe.capacity_ops(1.0)}.items()}
for iters in (10, 50, 10):
    r = gpu_moe.side_by_side(runs, iters)
    n, c = r["nodrop"][0] * 1e3, r["capacity_1.0"][0] * 1e3
    print(f"XLA_FLAGS='{os.environ.get('XLA_FLAGS', '')}' {iters} calls: nodrop {n:.2f} ms, capacity 1.0 {c:.2f} ms, "
          f"capacity/nodrop {c/n:.3f}x", flush=True)
