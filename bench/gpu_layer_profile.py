"""Where the MoE expert layer's time goes: GPU kernel time per step, nodrop against capacity 1.0.

    python bench/gpu_layer_profile.py --out DIR [--shapes Qwen3-30B-A3B]

Traces a few jitted forward+backward steps of bench/gpu_moe.py's layer (nodrop.moe.MoEBlock,
dropless on nodrop's ops, and dropping tokens at capacity factor 1.0) with the JAX profiler and
sums the device time of each kernel. Prints, per shape, a table of the kernels that take the
most time per step for each variant, and writes DIR/layer-profile.md plus the raw traces.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib

import jax
from flax import nnx

from nodrop import demo
from nodrop.moe import MoEBlock
from shapes import LAYER_SEED, LAYER_SHAPES, layer_config
from timing import seconds_per_call

STEPS = 5
TOP = 14


def device_kernel_ms(trace_dir: pathlib.Path, steps: int) -> tuple[dict[str, float], list[str]]:
    """{kernel name: ms per step} over the GPU stream lines of the trace, and the line names."""
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    events = json.loads(gzip.open(path).read())["traceEvents"]
    process_names, thread_names = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            process_names[event["pid"]] = event["args"]["name"]
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            thread_names[(event["pid"], event["tid"])] = event["args"]["name"]
    gpu_pids = {pid for pid, name in process_names.items() if "GPU" in name}
    # Kernels sit on the "Stream #n" lines; other device lines (XLA ops, modules) overlap them.
    stream_lines = {key for key, name in thread_names.items()
                    if key[0] in gpu_pids and name.startswith("Stream")}
    totals = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and (event.get("pid"), event.get("tid")) in stream_lines:
            totals[event["name"]] += event.get("dur", 0) / 1e3 / steps
    lines = sorted({f"{process_names.get(pid, pid)} / {name}"
                    for (pid, _), name in thread_names.items() if pid in gpu_pids})
    return dict(totals), lines


def profile(step, args, trace_dir: pathlib.Path) -> tuple[float, dict[str, float], list[str]]:
    for _ in range(3):
        jax.block_until_ready(step(*args))
    wall_ms = seconds_per_call(lambda: step(*args), jax.block_until_ready, 10)[0] * 1e3
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(STEPS):
            result = step(*args)
        jax.block_until_ready(result)
    kernels, lines = device_kernel_ms(trace_dir, STEPS)
    return wall_ms, kernels, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", default=",".join(LAYER_SHAPES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for name in args.shapes.split(","):
        tokens, hidden, ffn, experts, k = LAYER_SHAPES[name]
        configs = {"nodrop": layer_config(name),
                   "capacity_1.0": layer_config(name, capacity_factor=1.0)}
        params = nnx.state(MoEBlock(configs["nodrop"], rngs=nnx.Rngs(LAYER_SEED)), nnx.Param)
        x, target = demo.inputs(jax.random.key(LAYER_SEED), configs["nodrop"], tokens)
        report.append(f"## {name} (T={tokens}, H={hidden}, F={ffn}, E={experts}, k={k})\n")
        for impl, config in configs.items():
            step = jax.jit(demo.loss_and_grads(MoEBlock(config, rngs=nnx.Rngs(LAYER_SEED))))
            wall_ms, kernels, lines = profile(step, (params, x, target),
                                              args.out / f"trace-{name}-{impl}")
            busy = sum(kernels.values())
            report.append(f"### {impl}: {wall_ms:.2f} ms per step, kernels {busy:.2f} ms\n")
            report.append("device lines: " + "; ".join(lines) + "\n")
            report.append("| kernel | ms per step | share |\n| --- | ---: | ---: |")
            for kernel, ms in sorted(kernels.items(), key=lambda item: -item[1])[:TOP]:
                report.append(f"| `{kernel[:90]}` | {ms:.3f} | {ms / busy:.1%} |")
            report.append("")
            print("\n".join(report[-TOP - 4:]), flush=True)
    (args.out / "layer-profile.md").write_text("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
