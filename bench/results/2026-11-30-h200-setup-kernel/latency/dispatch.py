# Where does nodrop lose at DeepSeek-V3 EP8 with 10-call windows? Host time per call against
# device time per call, and the window time as a function of the number of calls.
import functools, os, statistics, sys, time
import numpy as np
import jax, jax.numpy as jnp
import gpu_moe
import nodrop
from nodrop.bench import forward_backward
torch, _ = gpu_moe.load_torch()
print("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), flush=True)
name = sys.argv[1] if len(sys.argv) > 1 else "DeepSeek-V3-EP8"
dims = gpu_moe.GEMM_SHAPES[name]; rows, k, n, g = dims
keys = jax.random.split(jax.random.key(0), 3)
lhs = jax.random.normal(keys[0], (rows, k), gpu_moe.DTYPE)
rhs = jax.random.normal(keys[1], (g, k, n), gpu_moe.DTYPE)
grad = jax.random.normal(keys[2], (rows, n), gpu_moe.DTYPE)
step = jax.jit(forward_backward(nodrop.ragged_dot))
tsteps = gpu_moe.torch_grouped_mm_steps(torch, dims)
sizes = gpu_moe.group_sizes("uniform", rows, g)
offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
js = jnp.asarray(sizes)
runs = {"nodrop": (functools.partial(step, lhs, rhs, js, grad), jax.block_until_ready),
        "torch": (functools.partial(tsteps["forward+backward"], offs), lambda _: torch.cuda.synchronize())}
for nm, (run, sync) in runs.items():
    for _ in range(30):
        sync(run())
# 1) host time per call while the queue is deep (the host runs ahead), and device time
for nm, (run, sync) in runs.items():
    host, total = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            r = run()
        t1 = time.perf_counter(); sync(r); t2 = time.perf_counter()
        host.append((t1 - t0) / 20 * 1e6); total.append((t2 - t0) / 20 * 1e6)
    print(f"{nm}: host {statistics.median(host):.0f} us/call while queued, window {statistics.median(total):.0f} us/call", flush=True)
# 2) a single call after an idle device: host time to return, and time to sync
for nm, (run, sync) in runs.items():
    ret, done = [], []
    for _ in range(20):
        time.sleep(0.01)
        t0 = time.perf_counter(); r = run(); t1 = time.perf_counter(); sync(r); t2 = time.perf_counter()
        ret.append((t1 - t0) * 1e6); done.append((t2 - t0) * 1e6)
    print(f"{nm}: one call after idle: returns in {statistics.median(ret):.0f} us, done in {statistics.median(done):.0f} us", flush=True)
# 3) window time against calls, side by side in turns
for calls in (1, 2, 5, 10, 20, 50):
    samples = {nm: [] for nm in runs}
    order = list(runs)
    for _ in range(7):
        for nm in order:
            run, sync = runs[nm]
            t0 = time.perf_counter()
            for _ in range(calls):
                r = run()
            sync(r)
            samples[nm].append(time.perf_counter() - t0)
        order.reverse()
    med = {nm: statistics.median(s) * 1e3 for nm, s in samples.items()}
    print(f"{calls:3d} calls: nodrop {med['nodrop']:.3f} ms, torch {med['torch']:.3f} ms, "
          f"speed {med['torch']/med['nodrop']:.3f}x, difference {med['nodrop']-med['torch']:+.3f} ms", flush=True)
