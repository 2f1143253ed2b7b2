# The Mixtral MoE layer at the power limit: nodrop against capacity 1.0, in turns; each turn
# runs 60 back-to-back steps, the last of them traced with the JAX profiler. Per step: span
# (first kernel start to last kernel end over the traced steps), kernel time, idle, and the
# kernels by name.
import collections, gzip, json, pathlib, sys, time, statistics, os
import jax
import nodrop
from nodrop import demo
import gpu_moe
out = pathlib.Path(os.environ["OUT"]) / "layer"
name = "Mixtral-8x7B"
tokens, hidden, ffn, experts, k = gpu_moe.LAYER_SHAPES[name]
params, x, target = demo.init(jax.random.key(2), tokens, hidden, ffn, experts, gpu_moe.DTYPE)
steps = {"nodrop": jax.jit(demo.loss_and_grads(nodrop, k)),
         "capacity_1.0": jax.jit(demo.loss_and_grads(gpu_moe.capacity_ops(1.0), k))}
for s in steps.values():
    jax.block_until_ready(s(params, x, target))
TRACED = 10
def events_of(trace_dir):
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    ev = json.loads(gzip.open(path).read())["traceEvents"]
    pn = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tn = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lines = {key for key, n in tn.items() if "GPU" in pn.get(key[0], "") and n.startswith("Stream")}
    return [e for e in ev if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in lines]
for turn in range(2):
    order = list(steps) if turn == 0 else list(reversed(steps))
    for impl in order:
        step = steps[impl]
        t0 = time.perf_counter()
        for _ in range(50):
            r = step(params, x, target)
        jax.block_until_ready(r)
        warm_ms = (time.perf_counter() - t0) / 50 * 1e3
        d = out / f"{impl}-{turn}"
        with jax.profiler.trace(str(d), create_perfetto_trace=True):
            for _ in range(TRACED):
                r = step(params, x, target)
            jax.block_until_ready(r)
        ev = events_of(d)
        start = min(e["ts"] for e in ev); end = max(e["ts"] + e["dur"] for e in ev)
        busy = sum(e["dur"] for e in ev)
        by = collections.Counter()
        for e in ev:
            by[e["name"][:70]] += e["dur"] / 1e3 / TRACED
        gemm = sum(v for kname, v in by.items() if "cutlass" in kname or "nvjet" in kname or "gemm" in kname)
        print(f"{impl} turn {turn}: wall {warm_ms:.2f} ms/step over 50 untraced; traced span {(end-start)/1e3/TRACED:.2f} ms/step, "
              f"kernels {busy/1e3/TRACED:.2f}, idle {(end-start-busy)/1e3/TRACED:.2f}, GEMM-like {gemm:.2f}", flush=True)
        for kname, v in by.most_common(12):
            print(f"    {v:7.3f}  {kname}", flush=True)
        import shutil; shutil.rmtree(d)
