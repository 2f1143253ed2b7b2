# Does the host keep ahead of the GPU in the Mixtral layer step? Host time per call while
# queued, window time per call, for nodrop and capacity 1.0, in turns.
import statistics, time, jax
import nodrop
from nodrop import demo
import gpu_moe
tokens, hidden, ffn, experts, k = gpu_moe.LAYER_SHAPES["Mixtral-8x7B"]
params, x, target = demo.init(jax.random.key(2), tokens, hidden, ffn, experts, gpu_moe.DTYPE)
steps = {impl: jax.jit(demo.loss_and_grads(ops, k))
         for impl, ops in {"nodrop": nodrop, "capacity_1.0": gpu_moe.capacity_ops(1.0)}.items()}
for s in steps.values():
    for _ in range(3): jax.block_until_ready(s(params, x, target))
for turn in range(3):
    for impl, s in steps.items():
        host = []
        t0 = time.perf_counter()
        for _ in range(30):
            t = time.perf_counter(); r = s(params, x, target); host.append(time.perf_counter() - t)
        t1 = time.perf_counter(); jax.block_until_ready(r); t2 = time.perf_counter()
        print(f"{impl} turn {turn}: host per call median {statistics.median(host)*1e3:.3f} ms, max {max(host)*1e3:.3f} ms, "
              f"first {host[0]*1e3:.3f} ms; loop {(t1-t0)*1e3:.1f} ms; window {(t2-t0)/30*1e3:.2f} ms per call", flush=True)
