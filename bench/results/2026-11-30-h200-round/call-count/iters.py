# Does the per-repeat call count move the nodrop / torch ratio? Same process, side by side.
import functools, sys
import numpy as np
import jax, jax.numpy as jnp
import gpu_moe
import nodrop
from nodrop.bench import forward_backward
torch, _ = gpu_moe.load_torch()
for name in sys.argv[1].split(","):
    dims = gpu_moe.GEMM_SHAPES[name]; rows, k, n, g = dims
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k), gpu_moe.DTYPE)
    rhs = jax.random.normal(keys[1], (g, k, n), gpu_moe.DTYPE)
    grad = jax.random.normal(keys[2], (rows, n), gpu_moe.DTYPE)
    step = jax.jit(forward_backward(nodrop.ragged_dot))
    tsteps = gpu_moe.torch_grouped_mm_steps(torch, dims)
    for kind in gpu_moe.GROUP_SIZE_KINDS:
        sizes = gpu_moe.group_sizes(kind, rows, g)
        offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
        runs = {"nodrop": (functools.partial(step, lhs, rhs, jnp.asarray(sizes), grad), jax.block_until_ready),
                "torch": (functools.partial(tsteps["forward+backward"], offs), gpu_moe.torch_sync(torch))}
        for iters in (10, 100, 1000):
            r = gpu_moe.side_by_side(runs, iters)
            print(f"{name} {kind} iters<={iters}: nodrop {r['nodrop'][0]*1e3:.3f} ms ({r['nodrop'][1]} calls), "
                  f"torch {r['torch'][0]*1e3:.3f} ms ({r['torch'][1]} calls), nodrop/torch speed {r['torch'][0]/r['nodrop'][0]:.3f}x", flush=True)
