"""GPU benchmark: nodrop against its peers, grouped matmul and a whole MoE expert layer.

    python bench/gpu_moe.py --out DIR [--iters 10] [--only gemm|layer|all]
                              [--shapes Mixtral-8x7B,Qwen3-30B-A3B] [--router-matmul split]
                              [--fp8-weight-gradient unquantised|fp8]

Everything runs in this one process: bf16 inputs, float32 accumulation, jitted.

1. Grouped matmul at four MoE shapes, uniform and Zipf(1) group sizes, forward and
   forward+backward (the output and the gradients of both inputs: 3 GEMMs): nodrop.ragged_dot,
   jax.lax.ragged_dot, the token-dropping batched einsum at capacity factors 1.0 and 1.25 (useful
   FLOPs only, with the fraction of token slots it would drop), torch._grouped_mm where torch
   imports, tokamax.ragged_dot where tokamax imports (its Mosaic GPU kernels on a GPU: see
   bench/tokamax_peer.py), and a dense jnp.dot of the same FLOPs (the ceiling).
2. An MoE expert layer, nodrop.moe.MoEBlock (top-k softmax router, SwiGLU experts, combine),
   forward+backward: dropless on nodrop's ops against the same block with its expert matmuls on
   tokamax.ragged_dot (the same routing) and against the block dropping tokens
   (MoEConfig(capacity_factor=1.0) and 1.25), and the dropless block with its experts in each
   FP8 recipe (MoEConfig(fp8=...), the trainer's --fp8, its weight gradient as
   --fp8-weight-gradient says; its speed-up over bf16 reported, no target). With each
   variant's activation memory: the compiled step's temporary buffers
   (XLA's memory_analysis) per token. Every variant's router multiplies its logits as
   --router-matmul says (MoEConfig.router_matmul, split by default).

Shapes and group sizes: bench/shapes.py. Timing: bench/timing.py (side_by_side). A case that
fails (tokamax missing, a kernel that does not compile, out of memory) is recorded as failed.

Writes DIR/gpu-moe.json (every number), DIR/gpu-moe.md (the tables) and DIR/gpu-moe.png
(forward+backward TFLOP/s). Exit status 1 if a target (see below) fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import nodrop
from nodrop import demo
from nodrop.demo import positive_int, relative_difference
from nodrop.moe import MoEBlock
from nodrop.moe.block import FP8_WEIGHT_GRADIENTS, ROUTER_MATMULS, MoEConfig
from nodrop.moe.capacity import capacity_rows
from shapes import (GEMM_SHAPES, GROUP_SIZE_KINDS, LAYER_SEED, LAYER_SHAPES, group_sizes,
                    layer_config, shape_list)
from timing import (CASE_BUDGET_S, DEFAULT_ITERS, PASSES, gpu_run_metadata, package_version,
                    side_by_side)
from tokamax_peer import MOE_OPS, load_tokamax, tokamax_ops
from torch_peer import load_torch, share_gpu_with_torch, torch_grouped_mm_steps, torch_sync

CAPACITY_FACTORS = (1.0, 1.25)
BASELINE_CAPACITY = "capacity_1.0"  # the token-dropping peer of the ratios and the layer target
MEMORY_BASELINE = "capacity_1.25"  # the layer's memory target: dropless holds no more than this
DTYPE = jnp.bfloat16
RAGGED_DOT_MAX_FORWARD_S = 2.0  # a slower jax.lax.ragged_dot forward skips its forward+backward
CHECK_TOLERANCE = 1e-2  # nodrop's bf16 output vs a float32 jnp.dot, relative to max |dot|

# Targets (issue 19's where it names one), as minimum ratios nodrop TFLOP/s / peer TFLOP/s:
# forward+backward against every peer below, and the forward against torch too.
MIN_VS_TORCH = 1.0  # every shape and group sizes
MIN_VS_DENSE = {"Mixtral-8x7B": 0.85}
MIN_VS_RAGGED_DOT = {"Mixtral-8x7B": 5.0, "Qwen3-30B-A3B": 50.0}
MIN_LAYER_SPEEDUP = 1.10  # capacity-1.0 layer ms / nodrop layer ms
MIN_LAYER_VS_TOKAMAX = 1.0  # tokamax layer ms / nodrop layer ms (the same routing)
MIN_MEMORY_SAVING = 1.0  # capacity-1.25 temporary bytes / nodrop temporary bytes, layer step
FP8_RECIPES = ("tensorwise", "blockwise")  # the layer's FP8 variants, "fp8_<recipe>"

IMPL_LABELS = {
    "nodrop": "nodrop", "torch": "torch._grouped_mm", "tokamax": "tokamax.ragged_dot",
    "ragged_dot": "jax.lax.ragged_dot",
    **{f"capacity_{cf}": f"capacity {cf}" for cf in CAPACITY_FACTORS}, "dense": "dense jnp.dot",
    **{f"fp8_{recipe}": f"nodrop FP8 {recipe}" for recipe in FP8_RECIPES},
}
PLOTTED_IMPLS = ("nodrop", "torch", "tokamax", "ragged_dot", BASELINE_CAPACITY, "dense")
PASS_LABELS = {"forward": "fwd", "forward+backward": "fwd+bwd"}
NOT_RUN = dict(status="not run", ms=None, tflops=None, iters=0, detail="")
START = time.perf_counter()


# --- timing: bench/timing.py; here, failures recorded as results --------------------------------


def measure(runs: dict, iters: int, flops: float) -> dict:
    """{name: result} for runs {name: (run, sync)}, timed side by side. A failure (out of
    memory, say) is recorded instead of raised. A run whose first call fails is left out of the
    others' windows; where the rest fail together, each is retried alone, so that one failure
    does not cost the others their figures."""
    results, runnable = {}, {}
    for name, (run, sync) in runs.items():
        try:
            sync(run())  # alone, compiling: what cannot compile or run at all fails here
            runnable[name] = run, sync
        except Exception as error:  # XlaRuntimeError, torch.OutOfMemoryError, ...
            results[name] = failure(error)
    try:
        timings = side_by_side(runnable, iters) if runnable else {}
    except Exception as error:
        if len(runnable) == 1:
            results |= {name: failure(error) for name in runnable}
        else:
            results |= {name: measure({name: run}, iters, flops)[name]
                        for name, run in runnable.items()}
    else:
        results |= {name: dict(status="ok", ms=1e3 * seconds, tflops=flops / seconds / 1e12,
                               iters=calls, detail="")
                    for name, (seconds, calls) in timings.items()}
    return {name: results[name] for name in runs}


def failure(error: Exception) -> dict:
    """The result of a case that raised `error`: out of memory, or another error."""
    text = str(error)
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    return dict(status="OOM" if oom else "error", ms=None, tflops=None, iters=0,
                detail=f"{type(error).__name__}: {text[:500]}")


def log(case: dict) -> None:
    if case["status"] == "ok":
        result = f"{case['ms']:9.3f} ms {case['tflops']:7.1f} TFLOP/s"
    else:
        result = f"{case['status']} {case['detail'][:160]}"
    # The layer's memory too: a run cut short by a time limit keeps what its log printed.
    memory = case.get("memory")
    memory = f", {memory['temp_bytes_per_token']:,.0f} temporary B/token" if memory else ""
    print(f"[{time.perf_counter() - START:6.1f} s] {case['section']} {case['shape']} "
          f"{case['group_sizes']} {PASS_LABELS[case['passes']]} {IMPL_LABELS[case['impl']]}: "
          f"{result}{dropped_text(case.get('dropped'))}{memory}", flush=True)


def dropped_text(dropped) -> str:
    """', dropped 1.2%' (layer), ', dropped uniform 0.0%, zipf 31.6%' (GEMM) or ''."""
    if dropped is None:
        return ""
    if isinstance(dropped, dict):
        return ", dropped " + ", ".join(f"{kind} {share:.1%}" for kind, share in dropped.items())
    return f", dropped {dropped:.1%}"


def add_case(cases: list, **case) -> None:
    log(case)
    cases.append(case)


# --- grouped matmul ---------------------------------------------------------------------------


def dropped_fraction(sizes, capacity: int) -> float:
    """The fraction of the slots past their group's C rows: those a capacity factor drops."""
    sizes = np.asarray(sizes)
    return float(np.maximum(sizes - capacity, 0).sum() / sizes.sum())


def capacity_einsum(tokens, rhs, group_sizes):
    """Tokens already dispatched into [G, C, K] buffers times [G, K, N]: the dropping way."""
    del group_sizes  # every group has C rows
    return jnp.einsum("gck,gkn->gcn", tokens, rhs)


def dense_dot(lhs, rhs, group_sizes):
    """[M, K] @ [K, N]: the same FLOPs as the grouped matmul, with no groups."""
    del group_sizes
    return jnp.dot(lhs, rhs)


GROUPED_MATMULS = {"nodrop": nodrop.ragged_dot, "ragged_dot": jax.lax.ragged_dot}
CHECKED_IMPLS = ("nodrop", "tokamax")  # outputs compared with jnp.dot (nodrop's is a target)


def check_output(impl: str, forward, operands, sizes) -> float | None:
    """`forward`'s output on its first, middle and last groups vs jnp.dot in float32:
    max |difference| / max |dot|, None where it fails. Catches rows written wrongly, or not at
    all."""
    lhs, rhs = operands[:2]
    try:
        out = forward(*operands)
    except Exception as error:  # recorded as a failed check; the timing says more
        print(f"{IMPL_LABELS[impl]} output check failed: {type(error).__name__}: {error}",
              flush=True)
        return None
    ends = np.cumsum(sizes)
    worst = 0.0
    for group in sorted({0, len(sizes) // 2, len(sizes) - 1}):
        start, end = int(ends[group] - sizes[group]), int(ends[group])
        expected = jnp.dot(lhs[start:end], rhs[group], preferred_element_type=jnp.float32)
        worst = max(worst, relative_difference(out[start:end], expected))
    return worst


def gemm_cases_of(name: str, dims, iters: int, torch, tokamax) -> list[dict]:
    """Per group sizes and pass: nodrop.ragged_dot, torch._grouped_mm (where torch imports) and
    tokamax.ragged_dot (`tokamax`: tokamax_peer.load_tokamax) timed side by side, then
    jax.lax.ragged_dot; then dense and capacity."""
    rows, k, n, groups = dims
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k), DTYPE)
    rhs = jax.random.normal(keys[1], (groups, k, n), DTYPE)
    grad_out = jax.random.normal(keys[2], (rows, n), DTYPE)
    flops = 2 * rows * k * n
    # Jitted once per shape: group sizes are a run-time argument, so both kinds share a compile.
    steps = {(impl, passes): jax.jit(make_step(matmul))
             for impl, matmul in (GROUPED_MATMULS | {"tokamax": tokamax}).items()
             for passes, (make_step, _) in PASSES.items()}
    torch_steps = torch_grouped_mm_steps(torch, dims) if torch is not None else None
    common = dict(section="gemm", shape=name, dims=list(dims))
    cases = []
    for kind in GROUP_SIZE_KINDS:
        sizes = group_sizes(kind, rows, groups)
        operands = (lhs, rhs, jnp.asarray(sizes), grad_out)
        checks = {impl: check_output(impl, steps[impl, "forward"], operands, sizes)
                  for impl in CHECKED_IMPLS}
        if torch_steps is not None:
            offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")

        def run(impl, passes):
            return functools.partial(steps[impl, passes], *operands), jax.block_until_ready

        ragged_forward_ms = 0.0
        for passes, (_, gemms) in PASSES.items():
            runs = {"nodrop": run("nodrop", passes)}
            if torch_steps is not None:
                runs["torch"] = (functools.partial(torch_steps[passes], offs), torch_sync(torch))
            runs["tokamax"] = run("tokamax", passes)
            results = measure(runs, iters, gemms * flops)
            if ragged_forward_ms > 1e3 * RAGGED_DOT_MAX_FORWARD_S:
                detail = f"forward took {ragged_forward_ms:.0f} ms per call"
                results["ragged_dot"] = dict(NOT_RUN, status="skipped", detail=detail)
            else:  # alone: it is far slower than the others, and its verdicts have wide margins
                results |= measure({"ragged_dot": run("ragged_dot", passes)}, iters,
                                   gemms * flops)
            if passes == "forward" and results["ragged_dot"]["status"] == "ok":
                ragged_forward_ms = results["ragged_dot"]["ms"]
            for impl, result in results.items():
                extra = dict(check=checks[impl]) if impl in checks else {}
                if impl == "nodrop":
                    extra["sizes"] = sizes.tolist()
                add_case(cases, **common, group_sizes=kind, passes=passes, impl=impl, **result,
                         **extra)
    return cases + padded_gemm_cases(common, lhs, rhs, grad_out, iters)


def padded_gemm_cases(common: dict, lhs, rhs, grad_out, iters: int) -> list[dict]:
    """Dense and capacity-factor GEMMs: their time does not depend on the group sizes."""
    rows, k, n, groups = common["dims"]
    flops = 2 * rows * k * n
    dense_rhs = rhs[0]
    cases = []
    for passes, (make_step, gemms) in PASSES.items():
        run = functools.partial(jax.jit(make_step(dense_dot)), lhs, dense_rhs, None, grad_out)
        result = measure({"dense": (run, jax.block_until_ready)}, iters, gemms * flops)
        add_case(cases, **common, group_sizes="any", passes=passes, impl="dense",
                 **result["dense"])
    for cf in CAPACITY_FACTORS:
        capacity = capacity_rows(rows, groups, cf)
        keys = jax.random.split(jax.random.key(1), 2)
        tokens = jax.random.normal(keys[0], (groups, capacity, k), DTYPE)
        grad_buffers = jax.random.normal(keys[1], (groups, capacity, n), DTYPE)
        dropped = {kind: dropped_fraction(group_sizes(kind, rows, groups), capacity)
                   for kind in GROUP_SIZE_KINDS}
        for passes, (make_step, gemms) in PASSES.items():
            run = functools.partial(jax.jit(make_step(capacity_einsum)), tokens, rhs, None,
                                    grad_buffers)
            result = measure({"capacity": (run, jax.block_until_ready)}, iters, gemms * flops)
            add_case(cases, **common, group_sizes="any", passes=passes, impl=f"capacity_{cf}",
                     **result["capacity"], capacity=capacity, dropped=dropped)
    return cases


# --- MoE expert layer -------------------------------------------------------------------------


def layer_cases(name: str, iters: int, tokamax, router_matmul: str = MoEConfig.router_matmul,
                fp8_weight_gradient: str = MoEConfig.fp8_weight_gradient) -> list[dict]:
    """nodrop.demo's loss and gradients of nodrop.moe.MoEBlock at LAYER_SHAPES[name]: dropless,
    dropless in each FP8 recipe, dropless with the expert matmuls on `tokamax`
    (tokamax_peer.load_tokamax), and at each capacity factor, on the same weights and data,
    every router by `router_matmul`, the FP8 variants' weight gradient by
    `fp8_weight_gradient`, timed side by side; with the memory of each compiled step."""
    tokens, hidden, ffn, experts, k = dims = LAYER_SHAPES[name]
    flops = 3 * 6 * tokens * k * hidden * ffn  # 3 GEMMs of 2*T*k*H*F forward, twice that backward
    results, runs, extra = {}, {}, {}
    with tokamax_ops(tokamax):
        config = functools.partial(layer_config, name, router_matmul=router_matmul)
        configs = {"nodrop": config(),
                   **{f"fp8_{recipe}": config(fp8=recipe, fp8_weight_gradient=fp8_weight_gradient)
                      for recipe in FP8_RECIPES},
                   "tokamax": config(ops=MOE_OPS)}
        configs |= {f"capacity_{cf}": config(capacity_factor=cf) for cf in CAPACITY_FACTORS}
        params = nnx.state(MoEBlock(configs["nodrop"], rngs=nnx.Rngs(LAYER_SEED)), nnx.Param)
        x, target = demo.inputs(jax.random.key(LAYER_SEED), configs["nodrop"], tokens)
        for impl, config in configs.items():
            block = MoEBlock(config, rngs=nnx.Rngs(LAYER_SEED))  # the weights of `params`
            try:  # compiled here, for its memory; the timing runs this executable
                step = jax.jit(demo.loss_and_grads(block)).lower(params, x, target).compile()
            except Exception as error:  # tokamax's kernels on this device, say
                results[impl] = failure(error)
                continue
            runs[impl] = (functools.partial(step, params, x, target), jax.block_until_ready)
            extra[impl] = dict(memory=step_memory(step, tokens))
            if config.capacity_factor is not None:
                aux = nnx.jit(lambda block, x: block(x)[1])(block, x)
                extra[impl] |= dict(
                    capacity=capacity_rows(tokens * k, experts, config.capacity_factor),
                    dropped=float(aux.dropped_fraction))
    results |= measure(runs, iters, flops)
    cases = []
    for impl in configs:
        add_case(cases, section="layer", shape=name, dims=list(dims), group_sizes="router",
                 passes="forward+backward", impl=impl, **results[impl], **extra.get(impl, {}))
    return cases


def step_memory(compiled, tokens: int) -> dict:
    """XLA's memory plan of a compiled layer step (memory_analysis()), in bytes: its arguments
    (weights, tokens), outputs (gradients, output) and temporary buffers, the activations kept
    from the forward for the backward among them; and those temporaries per token of the layer."""
    stats = compiled.memory_analysis()
    return dict(argument_bytes=stats.argument_size_in_bytes,
                output_bytes=stats.output_size_in_bytes, temp_bytes=stats.temp_size_in_bytes,
                temp_bytes_per_token=stats.temp_size_in_bytes / tokens)


# --- summary and targets ----------------------------------------------------------------------


def ratio(case: dict, peer: dict) -> float | None:
    """nodrop TFLOP/s / peer TFLOP/s, where both ran."""
    if case["status"] != "ok" or peer["status"] != "ok":
        return None
    return case["tflops"] / peer["tflops"]


def verdict(value: float | None, minimum: float, nodrop_case: dict, peer: str,
            peer_case: dict) -> str:
    if nodrop_case["status"] != "ok":
        return f"FAIL (nodrop {nodrop_case['status']})"
    if value is not None:
        return "PASS" if value >= minimum else "FAIL"
    if peer == "ragged_dot" and peer_case["status"] in ("OOM", "skipped"):
        return f"PASS (ragged_dot {peer_case['status']})"  # nodrop ran, ragged_dot could not
    return f"n/a ({IMPL_LABELS[peer]} {peer_case['status']})"


def gemm_summary(cases: list[dict]) -> list[dict]:
    """One row per (shape, group sizes, pass): each implementation, nodrop's ratios, targets."""
    index = {(c["shape"], c["group_sizes"], c["passes"], c["impl"]): c for c in cases}
    rows = []
    for case in (c for c in cases if c["impl"] == "nodrop"):
        shape, kind, passes = case["shape"], case["group_sizes"], case["passes"]
        impls = {impl: index.get((shape, kind, passes, impl))
                 or index.get((shape, "any", passes, impl)) or NOT_RUN for impl in IMPL_LABELS}
        ratios = {peer: ratio(case, impls[peer])
                  for peer in ("torch", "tokamax", "dense", "ragged_dot", BASELINE_CAPACITY)}
        forward_only = passes != "forward+backward"
        minimums = {"torch": MIN_VS_TORCH} if forward_only else {
            "torch": MIN_VS_TORCH, "dense": MIN_VS_DENSE.get(shape),
            "ragged_dot": MIN_VS_RAGGED_DOT.get(shape)}
        targets = {peer: dict(minimum=minimum, verdict=verdict(
            ratios[peer], minimum, case, peer, impls[peer]))
            for peer, minimum in minimums.items() if minimum is not None}
        if forward_only:
            passed = case["check"] is not None and case["check"] <= CHECK_TOLERANCE
            targets["check"] = dict(minimum=None, verdict="PASS" if passed else "FAIL")
        rows.append(dict(
            shape=shape, dims=case["dims"], group_sizes=kind, passes=passes, check=case["check"],
            tokamax_check=impls["tokamax"].get("check"),
            results={impl: {key: c[key] for key in ("status", "ms", "tflops")}
                     for impl, c in impls.items()},
            ratios=ratios, targets=targets,
            dropped={impl: c["dropped"][kind] for impl, c in impls.items()
                     if isinstance(c.get("dropped"), dict)}))
    return rows


def layer_summary(cases: list[dict]) -> list[dict]:
    """One row per shape: ms, TFLOP/s, dropped fraction and memory of each variant; nodrop's
    speed-ups (peer ms / nodrop ms) and memory saving (peer temporary bytes / nodrop's); the
    speed-up and memory targets; each FP8 recipe's speed-up over nodrop in bf16 (nodrop ms /
    its ms)."""
    rows = {}
    for case in cases:
        row = rows.setdefault(case["shape"], dict(shape=case["shape"], dims=case["dims"],
                                                  results={}))
        row["results"][case["impl"]] = {key: case.get(key) for key in (
            "status", "ms", "tflops", "capacity", "dropped", "memory")}
    for row in rows.values():
        results = row["results"]
        nodrop_case = results["nodrop"]
        row["speedups"] = {peer: results[peer]["ms"] / nodrop_case["ms"]
                           for peer in ("tokamax", BASELINE_CAPACITY)
                           if nodrop_case["status"] == "ok" and results[peer]["status"] == "ok"}
        row["fp8_speedups"] = {recipe: nodrop_case["ms"] / results[f"fp8_{recipe}"]["ms"]
                               for recipe in FP8_RECIPES if nodrop_case["status"] == "ok"
                               and results[f"fp8_{recipe}"]["status"] == "ok"}
        row["memory_saving"] = None
        if nodrop_case["memory"] and results[MEMORY_BASELINE]["memory"]:
            row["memory_saving"] = (results[MEMORY_BASELINE]["memory"]["temp_bytes"]
                                    / nodrop_case["memory"]["temp_bytes"])
        row["targets"] = {
            peer: dict(minimum=minimum, verdict=verdict(
                row["speedups"].get(peer), minimum, nodrop_case, peer, results[peer]))
            for peer, minimum in ((BASELINE_CAPACITY, MIN_LAYER_SPEEDUP),
                                  ("tokamax", MIN_LAYER_VS_TOKAMAX))}
        row["targets"] |= {
            "memory": dict(minimum=MIN_MEMORY_SAVING, verdict=verdict(
                row["memory_saving"], MIN_MEMORY_SAVING, nodrop_case, MEMORY_BASELINE,
                results[MEMORY_BASELINE]))}
    return list(rows.values())


def target_lines(gemm_rows: list[dict], layer_rows: list[dict]) -> list[str]:
    """One line per target: what, the measured ratio, the verdict."""
    lines = []
    for row in gemm_rows:
        where = f"{row['shape']} {row['group_sizes']} {PASS_LABELS[row['passes']]}"
        for peer, target in row["targets"].items():
            if peer == "check":
                measured = "error" if row["check"] is None else f"{row['check']:.1e}"
                lines.append(f"{where}: nodrop output vs jnp.dot <= {CHECK_TOLERANCE:g}: "
                             f"{measured} {target['verdict']}")
                continue
            lines.append(f"{where}: nodrop / {IMPL_LABELS[peer]} >= {target['minimum']:g}x: "
                         f"{ratio_text(row['ratios'][peer], target)}")
    for row in layer_rows:
        for peer in (BASELINE_CAPACITY, "tokamax"):
            target = row["targets"][peer]
            lines.append(f"layer {row['shape']}: {IMPL_LABELS[peer]} ms / nodrop ms >= "
                         f"{target['minimum']:g}x: "
                         f"{ratio_text(row['speedups'].get(peer), target)}")
        target = row["targets"]["memory"]
        lines.append(f"layer {row['shape']}: {IMPL_LABELS[MEMORY_BASELINE]} temporary bytes / "
                     f"nodrop temporary bytes >= {target['minimum']:g}x: "
                     f"{ratio_text(row['memory_saving'], target)}")
    return lines


# --- output -----------------------------------------------------------------------------------


def tflops_cell(result: dict) -> str:
    return f"{result['tflops']:.1f}" if result["status"] == "ok" else result["status"]


def ratio_text(value: float | None, target: dict | None) -> str:
    """'1.05x', '1.05x PASS', 'PASS (ragged_dot OOM)' or '-'."""
    parts = [f"{value:.2f}x"] if value is not None else []
    if target is not None:
        parts.append(target["verdict"])
    return " ".join(parts) or "-"


def gemm_table(rows: list[dict]) -> list[str]:
    impls = ("nodrop", "torch", "tokamax", "ragged_dot",
             *(f"capacity_{cf}" for cf in CAPACITY_FACTORS), "dense")
    peers = ("torch", "tokamax", "dense", "ragged_dot", BASELINE_CAPACITY)
    lines = [
        "| shape | group sizes | pass | " + " | ".join(IMPL_LABELS[i] for i in impls)
        + " | " + " | ".join(f"nodrop / {IMPL_LABELS[p]}" for p in peers)
        + " | dropped at capacity " + " / ".join(f"{cf}" for cf in CAPACITY_FACTORS)
        + " | nodrop check | tokamax check |",
        "| --- | --- | --- | " + "---: | " * len(impls) + "--- | " * len(peers)
        + "--- | --- | --- |",
    ]
    for row in rows:
        dropped = " / ".join(f"{fraction:.1%}" for fraction in row["dropped"].values())
        check = tokamax_check = ""
        if "check" in row["targets"]:  # forward rows
            check = "error" if row["check"] is None else f"{row['check']:.0e}"
            check += f" {row['targets']['check']['verdict']}"
            tokamax_check = ("error" if row["tokamax_check"] is None
                             else f"{row['tokamax_check']:.0e}")
        lines.append(
            f"| {row['shape']} | {row['group_sizes']} | {PASS_LABELS[row['passes']]} | "
            + " | ".join(tflops_cell(row["results"][i]) for i in impls) + " | "
            + " | ".join(ratio_text(row["ratios"][p], row["targets"].get(p)) for p in peers)
            + f" | {dropped} | {check} | {tokamax_check} |")
    return lines


LAYER_VARIANTS = ("nodrop", *(f"fp8_{recipe}" for recipe in FP8_RECIPES), "tokamax",
                  *(f"capacity_{cf}" for cf in CAPACITY_FACTORS))


def layer_table(rows: list[dict]) -> list[str]:
    peers = (BASELINE_CAPACITY, "tokamax")

    def cell(result):
        if result["status"] != "ok":
            return result["status"]
        dropped = f", {result['dropped']:.1%} dropped" if result["dropped"] is not None else ""
        return f"{result['ms']:.2f} ms ({result['tflops']:.0f} TFLOP/s{dropped})"

    lines = ["| shape (T, H, F, E, k) | " + " | ".join(IMPL_LABELS[v] for v in LAYER_VARIANTS)
             + " | " + " | ".join(f"{IMPL_LABELS[p]} ms / nodrop ms" for p in peers)
             + " | " + " | ".join(f"nodrop ms / FP8 {recipe} ms" for recipe in FP8_RECIPES)
             + " |",
             "|" + " --- |" * (1 + len(LAYER_VARIANTS) + len(peers) + len(FP8_RECIPES))]
    for row in rows:
        speedups = " | ".join(ratio_text(row["speedups"].get(p), row["targets"].get(p))
                              for p in peers)
        fp8 = " | ".join(ratio_text(row["fp8_speedups"].get(recipe), None)
                         for recipe in FP8_RECIPES)
        lines.append(f"| {row['shape']} {tuple(row['dims'])} | "
                     + " | ".join(cell(row["results"][v]) for v in LAYER_VARIANTS)
                     + f" | {speedups} | {fp8} |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    def cell(result):
        memory = result["memory"]
        if memory is None:  # it did not compile
            return result["status"]
        return (f"{memory['temp_bytes_per_token']:,.0f} B/token "
                f"({memory['temp_bytes'] / 2**20:,.1f} MiB)")

    lines = ["| shape (T, H, F, E, k) | " + " | ".join(IMPL_LABELS[v] for v in LAYER_VARIANTS)
             + f" | {IMPL_LABELS[MEMORY_BASELINE]} / nodrop |",
             "| --- | " + "---: | " * len(LAYER_VARIANTS) + "--- |"]
    for row in rows:
        saving = ratio_text(row["memory_saving"], row["targets"]["memory"])
        lines.append(f"| {row['shape']} {tuple(row['dims'])} | "
                     + " | ".join(cell(row["results"][v]) for v in LAYER_VARIANTS)
                     + f" | {saving} |")
    return lines


def markdown(meta: dict, gemm_rows: list[dict], layer_rows: list[dict]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items()
                         if version)
    timing = meta["timing"]
    lines = [
        f"# nodrop on {meta['device']['jax']}: grouped matmul and MoE layer, {meta['date']}",
        "",
        f"Device: {meta['device']['jax']} (torch: {meta['device']['torch'] or meta['torch']}). "
        f"{versions}. tokamax.ragged_dot: {meta['tokamax']}.",
        f"bf16 inputs, float32 accumulation, jitted; median over {timing['repeats']} repeats of "
        f"the mean of {timing['iters']} back-to-back calls (fewer where those would take over "
        f"{CASE_BUDGET_S:g} s), after {timing['warmup']} warm-up calls and {timing['heat_s']:g} s "
        "of untimed calls that bring the card to its power limit, where training runs. nodrop, "
        "torch._grouped_mm and tokamax.ragged_dot, and the layer's variants, take turns "
        "repeat by repeat, in an order reversed every other repeat, so that each meets the card "
        "in the same state; a case whose first call fails is left out of the turns and shown "
        "as its status (error, OOM; the json has the message).",
    ]
    if gemm_rows:
        shapes = "; ".join(f"{name} {tuple(dims)}" for name, dims in dict(
            (row["shape"], row["dims"]) for row in gemm_rows).items())
        lines += [
            "", "## Grouped matmul, TFLOP/s", "",
            f"Shapes (M, K, N, G): {shapes}. Forward+backward counts 3 GEMMs (output, lhs "
            "gradient, rhs gradient). Capacity counts useful FLOPs only (2*M*K*N per GEMM); its "
            "time does not depend on the group sizes, which only set the share of token slots "
            "it drops. Dense: [M, K] @ [K, N] of the same FLOPs. The check compares nodrop's "
            "first, middle and last group with jnp.dot in float32 (max |difference| / max "
            f"|dot|, tolerance {CHECK_TOLERANCE:g}); tokamax check: the same for "
            "tokamax.ragged_dot (no target; a large one makes its TFLOP/s meaningless).",
            "", *gemm_table(gemm_rows)]
    if layer_rows:
        lines += [
            "", "## MoE expert layer, forward+backward", "",
            "nodrop.moe.MoEBlock in bf16, weights too: top-k softmax router, SwiGLU experts "
            "(gate and up as one grouped GEMM against [E, H, 2F], then down), combine; MSE plus "
            "load-balancing loss (nodrop.demo.loss_and_grads); gradients of every weight and "
            "the tokens. nodrop: dropless, topk_router, permute, grouped_matmul x2 forward (x4 "
            "backward), unpermute. Capacity: MoEConfig(capacity_factor=...), the same router, "
            "slot positions by a cumsum over a one-hot mask, scatter into [E, C, H] buffers, "
            "batched einsums, gather back. tokamax.ragged_dot: the dropless block with its two "
            "grouped matmuls on tokamax.ragged_dot (forward and backward), the rest nodrop's "
            "(the same routing). nodrop FP8: the dropless block with its expert matmuls in "
            "that recipe (MoEConfig(fp8=...), fp8_weight_gradient="
            f"{meta['fp8_weight_gradient']!r}), TFLOP/s counted as "
            "for bf16. Every variant's router logits: MoEConfig(router_matmul="
            f"{meta['router_matmul']!r}). TFLOP/s counts the useful 18*T*k*H*F FLOPs.",
            "", *layer_table(layer_rows),
            "", "## MoE expert layer, activation memory", "",
            "The compiled forward+backward step's temporary buffers (XLA's memory_analysis(): "
            "temp_size_in_bytes; the activations kept for the backward, the dispatch buffers, "
            "the kernels' workspaces) in bytes per token of the layer, and in all. Weights, "
            "tokens and gradients (arguments and outputs) are the same for every variant: the "
            "json has them.",
            "", *memory_table(layer_rows)]
    targets = target_lines(gemm_rows, layer_rows)
    failed = [line for line in targets if "FAIL" in line]
    lines += ["", "## Targets", "",
              f"{len(targets) - len(failed)} of {len(targets)} pass or do not apply.", ""]
    lines += [f"- {line}" for line in targets]
    return "\n".join(lines) + "\n"


def plot(meta: dict, gemm_rows: list[dict], path: pathlib.Path) -> None:
    """Grouped bars: forward+backward TFLOP/s per shape and group sizes; failures labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in gemm_rows if row["passes"] == "forward+backward"]
    width = 0.8 / len(PLOTTED_IMPLS)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(rows)), 5.0))
    for i, impl in enumerate(PLOTTED_IMPLS):
        xs = [j + (i - (len(PLOTTED_IMPLS) - 1) / 2) * width for j in range(len(rows))]
        results = [row["results"][impl] for row in rows]
        ax.bar(xs, [r["tflops"] or 0.0 for r in results], width, label=IMPL_LABELS[impl])
        for x, result in zip(xs, results, strict=True):
            if result["status"] != "ok":
                ax.text(x, 0.01, result["status"], rotation=90, ha="center", va="bottom",
                        fontsize=7, transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(rows)), [f"{row['shape']}\n{row['group_sizes']}" for row in rows],
                  fontsize=8)
    ax.set_ylabel("TFLOP/s (useful FLOPs)")
    ax.set_title(f"Grouped matmul forward+backward, bf16, {meta['device']['jax']}, "
                 f"{meta['date']}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def metadata(torch, torch_status: str, tokamax_status: str, iters: int,
             router_matmul: str, fp8_weight_gradient: str) -> dict:
    meta = gpu_run_metadata(torch, iters, ragged_dot_max_forward_s=RAGGED_DOT_MAX_FORWARD_S)
    meta["versions"]["tokamax"] = package_version("tokamax")
    return dict(
        meta, torch=torch_status or "torch._grouped_mm available", tokamax=tokamax_status,
        router_matmul=router_matmul, fp8_weight_gradient=fp8_weight_gradient,
        targets=dict(min_vs_torch=MIN_VS_TORCH, min_vs_dense=MIN_VS_DENSE,
                     min_vs_ragged_dot=MIN_VS_RAGGED_DOT, min_layer_speedup=MIN_LAYER_SPEEDUP,
                     min_memory_saving=MIN_MEMORY_SAVING, check_tolerance=CHECK_TOLERANCE))


# --- command line -----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True,
                        help="folder for gpu-moe.json, gpu-moe.md and gpu-moe.png")
    parser.add_argument("--iters", type=positive_int, default=DEFAULT_ITERS,
                        help=f"timed calls per repeat (default: {DEFAULT_ITERS})")
    parser.add_argument("--only", choices=("gemm", "layer", "all"), default="all",
                        help="run the grouped-matmul cases, the layer cases or both (default)")
    parser.add_argument("--shapes", type=shape_list((*GEMM_SHAPES, *LAYER_SHAPES)), default=None,
                        help="comma list of shape names to run (default: all of "
                             f"{', '.join(GEMM_SHAPES)})")
    parser.add_argument("--router-matmul", choices=ROUTER_MATMULS,
                        default=MoEConfig.router_matmul,
                        help="every layer variant's MoEConfig.router_matmul (default: "
                             f"{MoEConfig.router_matmul}, as MoEConfig's)")
    parser.add_argument("--fp8-weight-gradient", choices=FP8_WEIGHT_GRADIENTS,
                        default=MoEConfig.fp8_weight_gradient,
                        help="the FP8 layer variants' MoEConfig.fp8_weight_gradient (default: "
                             f"{MoEConfig.fp8_weight_gradient}, as MoEConfig's)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    share_gpu_with_torch()  # before JAX's first use of the GPU, just below
    if jax.default_backend() == "gpu" and not nodrop.backends()["cuda"]:
        raise SystemExit("nodrop has no CUDA engine (nodrop/libnodrop_ffi_cuda.so): build it")
    torch, torch_status = load_torch()
    tokamax, tokamax_status = load_tokamax()
    meta = metadata(torch, torch_status, tokamax_status, args.iters, args.router_matmul,
                    args.fp8_weight_gradient)
    print(f"{meta['device']['jax']}; {meta['torch']}; {meta['tokamax']}; "
          + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v), flush=True)

    def chosen(shapes):
        return {name: dims for name, dims in shapes.items()
                if args.shapes is None or name in args.shapes}

    gemm_cases, layer_results = [], []
    if args.only in ("gemm", "all"):
        for name, dims in chosen(GEMM_SHAPES).items():
            gemm_cases += gemm_cases_of(name, dims, args.iters, torch, tokamax)
            if torch is not None:  # this shape's torch tensors are freed now
                torch.cuda.empty_cache()
    if args.only in ("layer", "all"):
        for name in chosen(LAYER_SHAPES):
            layer_results += layer_cases(name, args.iters, tokamax, args.router_matmul,
                                         args.fp8_weight_gradient)

    gemm_rows, layer_rows = gemm_summary(gemm_cases), layer_summary(layer_results)
    table = markdown(meta, gemm_rows, layer_rows)
    print("\n" + table, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-moe.json").write_text(json.dumps(dict(
        meta, gemm=dict(summary=gemm_rows, cases=gemm_cases),
        layer=dict(summary=layer_rows, cases=layer_results)), indent=2) + "\n")
    (args.out / "gpu-moe.md").write_text(table)
    written = ["gpu-moe.json", "gpu-moe.md"]
    if gemm_rows:
        plot(meta, gemm_rows, args.out / "gpu-moe.png")
        written.append("gpu-moe.png")
    print(f"wrote {', '.join(str(args.out / name) for name in written)}", flush=True)
    return 1 if any("FAIL" in line for line in target_lines(gemm_rows, layer_rows)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
