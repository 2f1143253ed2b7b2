"""Grouped-GEMM kernel time, cool and sustained: nodrop against torch._grouped_mm, step by step.

    python bench/gpu_gemm_sustained.py --out DIR [--shapes Mixtral-8x7B] [--steps 40]
                                       [--repeats 2]

bench/gpu_moe.py times short windows of wall time. This records, for each implementation, the
GPU kernel time of every forward+backward step of a longer run (CUPTI through the torch
profiler, the same tracer for both): the first steps (a cool card) against the last ones (at the
H200's power limit, which it reaches within a second), each GEMM of the step apart, plus the
span from the first kernel to the last, which adds the gaps and small kernels between them. The
two implementations alternate run by run. Writes DIR/gemm-sustained.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

import nodrop
from nodrop.demo import positive_int
from shapes import GEMM_SHAPES, GROUP_SIZE_KINDS, group_sizes
from timing import forward_backward
from torch_peer import load_torch, share_gpu_with_torch

DTYPE = jnp.bfloat16
COOL_STEPS = 5


def kernel_events(torch, run, steps: int) -> list[tuple[str, float, float]]:
    """(name, start ms, end ms) of every GPU kernel of `steps` calls of run(), in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            result = run()
        wait(torch, result)
    events = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda event: event[1])


def wait(torch, result) -> None:
    jax.block_until_ready(result)
    torch.cuda.synchronize()


def kernel_schedule(name: str) -> str:
    """A CUTLASS kernel's schedule, from its mangled name (tile sizes do not survive mangling's
    back-references reliably)."""
    return "cooperative" if "Cooperative" in name else "ping-pong"


STEP_GEMMS = ("forward", "input grad", "weight grad")
# The order in which each implementation launches a step's GEMMs. XLA keeps the program order
# for nodrop (its kernels' schedules confirm it). PyTorch's backward runs the weight gradient
# first: the setup kernel before each of its GEMMs names the operand strides in its template
# arguments, and the second one's A is column-major (x transposed), the third one's B is
# K-major (the weights transposed), at both the Mixtral and DeepSeek-V3-EP8 shapes
# (bench/results/2026-11-30-h200-sustained-tiles/torch-launch-order; the probe that printed
# them is in git history, commit 5231b42).
LAUNCH_ORDER = {"nodrop": ("forward", "input grad", "weight grad"),
                "torch": ("forward", "weight grad", "input grad")}


def window(events, impl: str, steps: int, last: bool) -> dict:
    """Kernel ms per step over the first or last `steps` steps, each GEMM's share, the span
    from the first GEMM's start to the last one's end (which adds the gaps and small kernels
    between them), and the kernels between one step's last GEMM and the next step's first (by
    name, ms per step)."""
    gemms = [e for e in events if "GemmUniversal" in e[0]]
    per_step = len(STEP_GEMMS)
    chosen = gemms[-per_step * steps:] if last else gemms[:per_step * steps]
    start, end = chosen[0][1], chosen[-1][2]
    inside = [e for e in events if e[1] >= start and e[2] <= end]
    each = {gemm: sum(e[2] - e[1] for e in chosen[i::per_step]) / steps
            for i, gemm in enumerate(LAUNCH_ORDER[impl])}
    between = {}
    for i in range(1, steps):
        gap_start, gap_end = chosen[per_step * i - 1][2], chosen[per_step * i][1]
        for name, kernel_start, kernel_end in events:
            if gap_start <= kernel_start < gap_end:
                between[name] = between.get(name, 0.0) + (kernel_end - kernel_start) / steps
    return dict(gemm_ms=sum(e[2] - e[1] for e in chosen) / steps, each_gemm_ms=each,
                all_kernels_ms=sum(e[2] - e[1] for e in inside) / steps,
                span_ms=(end - start) / steps, between_steps_ms=between)


def gpu_state() -> str:
    """SM clock and power as nvidia-smi reads them now."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi: {error}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", default="Mixtral-8x7B")
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--repeats", type=positive_int, default=2)
    args = parser.parse_args()
    share_gpu_with_torch()  # before JAX's first use of the GPU
    torch, torch_status = load_torch()
    if torch is None:
        raise SystemExit(f"gpu_gemm_sustained.py compares against torch._grouped_mm: "
                         f"{torch_status}")
    sustained_steps = max(1, args.steps // 2)

    rows = []
    for name in args.shapes.split(","):
        rows_m, k, n, groups = GEMM_SHAPES[name]
        keys = jax.random.split(jax.random.key(0), 3)
        lhs = jax.random.normal(keys[0], (rows_m, k), DTYPE)
        rhs = jax.random.normal(keys[1], (groups, k, n), DTYPE)
        grad_out = jax.random.normal(keys[2], (rows_m, n), DTYPE)
        step = jax.jit(forward_backward(nodrop.ragged_dot))
        options = dict(dtype=torch.bfloat16, device="cuda")
        t_lhs = torch.randn(rows_m, k, **options, requires_grad=True)
        t_rhs = torch.randn(groups, k, n, **options, requires_grad=True)
        t_grad = torch.randn(rows_m, n, **options)
        flops = 3 * 2 * rows_m * k * n
        for repeat in range(args.repeats):
            for kind in GROUP_SIZE_KINDS:
                sizes = group_sizes(kind, rows_m, groups)
                offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
                jax_sizes = jnp.asarray(sizes)

                def torch_step(offs=offs):
                    out = torch._grouped_mm(t_lhs, t_rhs, offs=offs)
                    return torch.autograd.grad(out, (t_lhs, t_rhs), grad_outputs=t_grad)

                runs = {"torch": torch_step,
                        "nodrop": lambda s=jax_sizes: step(lhs, rhs, s, grad_out)}
                for impl, run in runs.items():
                    for _ in range(3):  # compile, then warm up
                        wait(torch, run())
                    events = kernel_events(torch, run, args.steps)
                    state = gpu_state()
                    gemms = [e for e in events if "GemmUniversal" in e[0]]
                    kernels = dict(zip(LAUNCH_ORDER[impl],
                                       (kernel_schedule(e[0]) for e in gemms[-len(STEP_GEMMS):])))
                    row = dict(shape=name, group_sizes=kind, repeat=repeat, impl=impl,
                               cool=window(events, impl, COOL_STEPS, last=False),
                               sustained=window(events, impl, sustained_steps, last=True),
                               kernels=kernels, gpu_after=state)
                    row["sustained_tflops"] = flops / row["sustained"]["span_ms"] / 1e9
                    rows.append(row)
                    print(f"{name} {kind} repeat {repeat} {impl}: cool {row['cool']['gemm_ms']:.3f}"
                          f" ms, sustained {row['sustained']['gemm_ms']:.3f} ms GEMM, "
                          f"{row['sustained']['span_ms']:.3f} ms span per step ({state})",
                          flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm-sustained.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "gemm-sustained.md").write_text(markdown(rows, args.steps, sustained_steps))
    print(markdown(rows, args.steps, sustained_steps))
    return 0


def markdown(rows: list[dict], steps: int, sustained_steps: int) -> str:
    lines = [
        f"# Grouped GEMM forward+backward, cool and sustained ({jax.devices()[0].device_kind})\n",
        f"{steps} steps per run, kernels traced with CUPTI (torch profiler) for both. Cool: GPU "
        f"kernel ms per step over the first {COOL_STEPS} steps. Sustained: over the last "
        f"{sustained_steps}; span runs from the first GEMM's start to the last one's end, so it "
        "adds the gaps and the small kernels between them. nvidia-smi's SM clock and power are "
        "read right after each run.\n",
        "| shape | group sizes | repeat | impl | schedules (" + ", ".join(STEP_GEMMS) + ") "
        "| cool GEMM ms | sustained GEMM ms | sustained span ms | sustained TFLOP/s "
        "| SM clock, power after |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['group_sizes']} | {r['repeat']} | {r['impl']} | "
            f"{', '.join(r['kernels'][g] for g in STEP_GEMMS)} | {r['cool']['gemm_ms']:.3f} | "
            f"{r['sustained']['gemm_ms']:.3f} | {r['sustained']['span_ms']:.3f} | "
            f"{r['sustained_tflops']:.1f} | {r['gpu_after']} |")
    lines += [
        "\nSustained, per step: the span, the time in it that no kernel ran (span minus all "
        "kernels), and the kernels between a step's last GEMM and the next step's first.\n",
        "| shape | group sizes | repeat | impl | span ms | GPU idle ms | kernels between steps "
        "(ms per step) |",
        "| --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        w = r["sustained"]
        between = "; ".join(f"`{name[:60]}` {ms:.4f}" for name, ms in
                            sorted(w["between_steps_ms"].items(), key=lambda item: -item[1]))
        lines.append(f"| {r['shape']} | {r['group_sizes']} | {r['repeat']} | {r['impl']} | "
                     f"{w['span_ms']:.3f} | {w['span_ms'] - w['all_kernels_ms']:.3f} | "
                     f"{between or 'none'} |")
    lines += [
        "\nEach GEMM, ms per step: cool / sustained.\n",
        "| shape | group sizes | repeat | impl | " + " | ".join(STEP_GEMMS) + " |",
        "| --- | --- | ---: | --- |" + " ---: |" * len(STEP_GEMMS),
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['group_sizes']} | {r['repeat']} | {r['impl']} | "
            + " | ".join(f"{r['cool']['each_gemm_ms'][g]:.3f} / "
                         f"{r['sustained']['each_gemm_ms'][g]:.3f}" for g in STEP_GEMMS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
