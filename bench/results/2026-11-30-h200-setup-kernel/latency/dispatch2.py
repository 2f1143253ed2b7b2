# Is the fixed latency of a jitted call nodrop's or JAX's? Dense jnp.dot against torch.mm, the
# same way as dispatch.py; and nodrop's compiled HLO for the step.
import functools, os, statistics, sys, time
import numpy as np
import jax, jax.numpy as jnp
import gpu_moe
import nodrop
from nodrop.bench import forward_backward
torch, _ = gpu_moe.load_torch()
rows, k, n, g = gpu_moe.GEMM_SHAPES["DeepSeek-V3-EP8"]
keys = jax.random.split(jax.random.key(0), 3)
lhs = jax.random.normal(keys[0], (rows, k), gpu_moe.DTYPE)
rhs = jax.random.normal(keys[1], (g, k, n), gpu_moe.DTYPE)
grad = jax.random.normal(keys[2], (rows, n), gpu_moe.DTYPE)
sizes = jnp.asarray(gpu_moe.group_sizes("uniform", rows, g))
step = jax.jit(forward_backward(nodrop.ragged_dot))
open(os.environ["OUT"] + "/nodrop-step.hlo.txt", "w").write(step.lower(lhs, rhs, sizes, grad).compile().as_text())
w = rhs[0]
def dense_step(x, w, gy):
    out, vjp = jax.vjp(jnp.dot, x, w)
    return out, vjp(gy)
dstep = jax.jit(dense_step)
opts = dict(dtype=torch.bfloat16, device="cuda")
tx = torch.randn(rows, k, **opts, requires_grad=True); tw = torch.randn(k, n, **opts, requires_grad=True)
tgy = torch.randn(rows, n, **opts)
def torch_dense():
    out = tx @ tw
    return out, torch.autograd.grad(out, (tx, tw), grad_outputs=tgy)
tiny = jax.jit(lambda a: a + 1); ta = jnp.ones((8,)); tt = torch.ones(8, device="cuda")
runs = {"jax dense": (functools.partial(dstep, lhs, w, grad), jax.block_until_ready),
        "torch dense": (torch_dense, lambda _: torch.cuda.synchronize()),
        "jax tiny": (functools.partial(tiny, ta), jax.block_until_ready),
        "torch tiny": (lambda: tt + 1, lambda _: torch.cuda.synchronize())}
for nm, (run, sync) in runs.items():
    for _ in range(30):
        sync(run())
for nm, (run, sync) in runs.items():
    ret, done = [], []
    for _ in range(20):
        time.sleep(0.01)
        t0 = time.perf_counter(); r = run(); t1 = time.perf_counter(); sync(r); t2 = time.perf_counter()
        ret.append((t1 - t0) * 1e6); done.append((t2 - t0) * 1e6)
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20): r = run()
        host.append((time.perf_counter() - t0) / 20 * 1e6); sync(r)
    print(f"{nm}: one call after idle returns in {statistics.median(ret):.0f} us, done in {statistics.median(done):.0f} us; host {statistics.median(host):.0f} us/call queued", flush=True)
pair = {"jax": runs["jax dense"], "torch": runs["torch dense"]}
for calls in (1, 2, 5, 10, 20, 50):
    samples = {nm: [] for nm in pair}
    order = list(pair)
    for _ in range(7):
        for nm in order:
            run, sync = pair[nm]
            t0 = time.perf_counter()
            for _ in range(calls): r = run()
            sync(r)
            samples[nm].append(time.perf_counter() - t0)
        order.reverse()
    med = {nm: statistics.median(s) * 1e3 for nm, s in samples.items()}
    print(f"dense {calls:3d} calls: jax {med['jax']:.3f} ms, torch {med['torch']:.3f} ms, "
          f"jax/torch speed {med['torch']/med['jax']:.3f}x, difference {med['jax']-med['torch']:+.3f} ms", flush=True)
