# DeepSeek-V3 EP8 uniform, forward+backward: the spread of 10-call windows within one process,
# nodrop and torch in turns (30 windows each).
import functools, statistics, sys, time
import numpy as np
import jax, jax.numpy as jnp
import gpu_moe, nodrop
from nodrop.bench import forward_backward
torch, _ = gpu_moe.load_torch()
dims = gpu_moe.GEMM_SHAPES["DeepSeek-V3-EP8"]; rows, k, n, g = dims
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
for run, sync in runs.values():
    for _ in range(5): sync(run())
samples = {nm: [] for nm in runs}
order = list(runs)
for _ in range(30):
    for nm in order:
        run, sync = runs[nm]
        t0 = time.perf_counter()
        for _ in range(10): r = run()
        sync(r)
        samples[nm].append((time.perf_counter() - t0) / 10 * 1e3)
    order.reverse()
for nm, s in samples.items():
    q = np.percentile(s, [0, 10, 50, 90, 100])
    print(f"process {sys.argv[1]} {nm}: ms per call min/p10/median/p90/max " + " / ".join(f"{v:.3f}" for v in q)
          + "; windows in order: " + " ".join(f"{v:.2f}" for v in s), flush=True)
