"""Where a GPU step's time goes: device time per region and kernel class (JAX profiler traces).

    python bench/gpu_profile.py runs RUN_DIR... --out DIR
    python bench/gpu_profile.py layer --out DIR [--shapes Qwen3-30B-A3B] [--fp8 tensorwise]

`runs` reads the traces `nodrop train --profile START:STOP` wrote into each run folder (e.g.
the same preset dropless and at --capacity-factor 1.0) and puts them side by side: milliseconds
per step of each region of the model (attention, router, experts, ...: the named scopes in the
op_name of the HLO op behind each kernel, read from the train_step.hlo.txt saved with the
trace) and of each kernel class (grouped GEMM, cuBLAS GEMM, cuDNN attention, nodrop's permute
kernels, XLA fusions, ...). Writes DIR/profile.md and DIR/profile.png.

`layer` traces a few jitted forward+backward steps of bench/gpu_moe.py's MoE layer
(nodrop.moe.MoEBlock dropless, in each FP8 recipe --fp8 names, and at capacity factor 1.0) and
writes DIR/layer-profile.md (the kernels that take the most time, each with the op_name and
result type of the HLO op behind it) and the raw traces.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re

import jax

from nodrop.ops.fp8 import RECIPES as FP8_RECIPES
from shapes import LAYER_SEED, LAYER_SHAPES, layer_config

# Named scopes of the model and the trainer (nodrop/models/lm.py, nodrop/moe/block.py,
# nodrop/train/trainer.py); a kernel belongs to the innermost one in its op's op_name.
# "moe" alone is the MoE block outside its router and experts: permute and unpermute when
# dropless, dispatch and combine at a capacity factor.
SCOPES = ("embed", "attention", "dense_ffn", "moe", "router", "experts", "shared_experts",
          "lm_head", "loss", "optimizer")
REGION_NAMES = {"moe": "moe: permute/unpermute or dispatch/combine",
                None: "other (norms, residuals, metrics)"}
# Kernel classes by kernel name, first match wins.
KERNEL_CLASSES = (
    ("grouped GEMM (nodrop, CUTLASS)", r"GroupProblemShape"),
    ("attention (cuDNN)", r"cudnn|sdpa|fmha|flash"),
    ("GEMM (cuBLAS / XLA)", r"^nvjet|xmma|gemm|cublas|cutlass"),
    ("nodrop permute/router kernels", r"nodrop::"),
    ("sort", r"sort|cub::"),
    ("copies and memsets", r"[Mm]emcpy|[Mm]emset|^copy|^wrapped_copy"),
    ("XLA reduction/scatter fusions", r"^input_|reduce|scatter"),
    ("XLA elementwise fusions", r"^loop_|^wrapped_|fusion"),
)
TOP = 20


def short_name(kernel: str) -> str:
    """A CUTLASS grouped GEMM's schedule, MMA shape and operand majors (its mangled name runs to
    thousands of characters); any other kernel's name as it is."""
    if "GroupProblemShape" not in kernel:
        return kernel
    schedule = re.search(r"KernelPtrArrayTmaWarpSpecialized(\w+?)E", kernel)
    # GMMA's operand majors: 0 K-major, 1 MN-major (A then B).
    mma = re.search(r"MMA_(\d+x\d+x\d+)_F32(\w+?)_SS\w*?MajorE(\d)E\w+?_(\d)E", kernel)
    return ("CUTLASS grouped GEMM " + (schedule[1] if schedule else "?") + " "
            + (f"{mma[1]} {mma[2]} majors {mma[3]}{mma[4]}" if mma else "?"))


def kernel_class(name: str) -> str:
    return next((label for label, pattern in KERNEL_CLASSES if re.search(pattern, name)),
                "other kernels")


def region(op_name: str | None) -> str | None:
    """The innermost named scope in op_name (None: outside every scope, or unknown)."""
    if not op_name:
        return None
    found = [word for word in re.findall(r"\w+", op_name) if word in SCOPES]
    return found[-1] if found else None


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """{instruction name: metadata op_name} of an optimized HLO module's text."""
    pattern = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="((?:[^"\\]|\\.)*)"',
                         re.MULTILINE)
    return {name: op_name for name, op_name in pattern.findall(hlo_text)}


def hlo_result_types(hlo_text: str) -> dict[str, str]:
    """{instruction name: its result type without layouts ("f8e4m3fn[8,28672,4096]", or a tuple
    of them)} of an optimized HLO module's text: which tensor a fusion kernel writes."""
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^)]*\)|\S+)\s", re.MULTILINE)
    return {name: re.sub(r"\{[^}]*\}", "", type_) for name, type_ in pattern.findall(hlo_text)}


def device_kernels(trace_path: pathlib.Path) -> tuple[list[tuple[str, float, dict]], list[str]]:
    """[(kernel name, microseconds, event args)] of the kernels on the trace's GPU stream lines,
    and the names of the GPU lines."""
    events = json.loads(gzip.open(trace_path).read())["traceEvents"]
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
    kernels = [(event["name"], event.get("dur", 0.0), event.get("args", {}))
               for event in events
               if event.get("ph") == "X" and (event.get("pid"), event.get("tid")) in stream_lines]
    lines = sorted({f"{process_names.get(pid, pid)} / {name}"
                    for (pid, _), name in thread_names.items() if pid in gpu_pids})
    return kernels, lines


# --- runs: nodrop train --profile --------------------------------------------------------------


def run_profile(run_dir: pathlib.Path) -> dict:
    """The newest --profile trace of a run folder, summed per region and kernel class (ms per
    traced step), with the run's name and its tokens/s outside the traced steps."""
    traces = sorted((run_dir / "tensorboard" / "plugins" / "profile").iterdir())
    if not traces:
        raise SystemExit(f"{run_dir}: no trace; train with --profile START:STOP")
    trace_dir = traces[-1]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    profile = [r for r in records if r["kind"] == "profile"][-1]
    steps = profile["step"] - profile["first_step"] + 1
    traced = range(profile["first_step"], profile["step"] + 1)
    untimed = [r for r in records if r["kind"] == "timing" and r["first_step"] not in traced
               and r["first_step"] > 1]  # the first interval holds the first step's warm-up
    seconds = sum(r["mean_step_time_s"] * r["steps"] for r in untimed)
    tokens_per_s = (sum(r["tokens_per_s"] * r["mean_step_time_s"] * r["steps"] for r in untimed)
                    / seconds if seconds else None)
    op_names = hlo_op_names((trace_dir / "train_step.hlo.txt").read_text())
    op_names_by_kernel = {name.replace(".", "_"): name for name in op_names}
    kernels, lines = device_kernels(next(trace_dir.glob("perfetto_trace.json.gz")))
    by_region, by_class, by_pair = (collections.Counter() for _ in range(3))
    by_kernel, resolved = collections.Counter(), 0
    for name, micros, args in kernels:
        # Under CUDA graphs (XLA's command buffers) every kernel's hlo_op is the graph's; XLA's
        # own fusions are still named after their HLO instruction, "." made "_".
        op = args.get("hlo_op", "")
        if op not in op_names:
            op = op_names_by_kernel.get(name, name)
        resolved += op in op_names
        key = (REGION_NAMES.get(region(op_names.get(op)), region(op_names.get(op))),
               kernel_class(name))
        ms = micros / 1e3 / steps
        by_region[key[0]] += ms
        by_class[key[1]] += ms
        by_pair[key] += ms
        by_kernel[short_name(name)] += ms
    arg_keys = sorted({key for _, _, args in kernels for key in args})
    return {"name": run_dir.name if run_dir.name not in ("seed-0", "") else run_dir.parent.name,
            "steps": steps, "tokens_per_s": tokens_per_s,
            "total_ms": sum(by_region.values()), "regions": by_region, "classes": by_class,
            "pairs": by_pair, "kernels": by_kernel, "lines": lines, "arg_keys": arg_keys,
            "resolved": resolved / max(len(kernels), 1)}


def side_by_side_table(profiles: list[dict], field: str, title: str, limit: int | None = None):
    keys = sorted({key for p in profiles for key in p[field]},
                  key=lambda key: -max(p[field].get(key, 0.0) for p in profiles))[:limit]
    head = f"| {title} | " + " | ".join(p["name"] for p in profiles) + " |"
    difference = len(profiles) == 2
    if difference:
        head += f" {profiles[0]['name']} - {profiles[1]['name']} |"
    rows = [head, "| --- |" + " ---: |" * (len(profiles) + difference)]
    for key in keys:
        label = " / ".join(key) if isinstance(key, tuple) else key
        values = [p[field].get(key, 0.0) for p in profiles]
        rows.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |"
                    + (f" {values[0] - values[1]:+.2f} |" if difference else ""))
    totals = [p["total_ms"] for p in profiles]
    rows.append("| **all kernels** | " + " | ".join(f"**{v:.2f}**" for v in totals) + " |"
                + (f" **{totals[0] - totals[1]:+.2f}** |" if difference else ""))
    return "\n".join(rows)


def plot(profiles: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    regions = sorted({r for p in profiles for r in p["regions"]},
                     key=lambda r: -max(p["regions"].get(r, 0.0) for p in profiles))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(profiles)))
    left = [0.0] * len(profiles)
    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(regions):
        widths = [p["regions"].get(name, 0.0) for p in profiles]
        ax.barh([p["name"] for p in profiles], widths, left=left, label=name,
                color=colors[i % len(colors)])
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("GPU kernel time per training step (ms)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def runs_main(args) -> int:
    profiles = [run_profile(pathlib.Path(run)) for run in args.runs]
    report = [f"# Training step, kernel time per step (ms, {profiles[0]['steps']} traced steps)\n",
              "| run | kernels ms/step | tokens/s (untraced steps) | kernels named by HLO op |",
              "| --- | ---: | ---: | ---: |"]
    for p in profiles:
        rate = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] else "-"
        report.append(f"| {p['name']} | {p['total_ms']:.2f} | {rate} | {p['resolved']:.0%} |")
    report += ["", "## By region (named scope)\n",
               side_by_side_table(profiles, "regions", "region"),
               "", "## By kernel class\n", side_by_side_table(profiles, "classes", "kernel class"),
               "", "## By region and kernel class (largest)\n",
               side_by_side_table(profiles, "pairs", "region / kernel class", 24),
               "", "## Kernels (largest)\n",
               side_by_side_table(profiles, "kernels", "kernel", 30).replace("| `", "| "),
               "", "GPU lines: " + "; ".join(sorted({l for p in profiles for l in p["lines"]})),
               "", "Kernel event fields: " + ", ".join(profiles[0]["arg_keys"]), ""]
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(report)
    (args.out / "profile.md").write_text(text)
    plot(profiles, args.out / "profile.png")
    print(text)
    return 0


# --- layer: the MoE layer alone ----------------------------------------------------------------

LAYER_STEPS = 5


def layer_main(args) -> int:
    from flax import nnx

    from nodrop import demo
    from nodrop.moe import MoEBlock
    from timing import seconds_per_call

    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for name in args.shapes.split(","):
        tokens, hidden, ffn, experts, k = LAYER_SHAPES[name]
        configs = {"nodrop": layer_config(name),
                   **{f"fp8_{recipe}": layer_config(name, fp8=recipe) for recipe in args.fp8},
                   "capacity_1.0": layer_config(name, capacity_factor=1.0)}
        params = nnx.state(MoEBlock(configs["nodrop"], rngs=nnx.Rngs(LAYER_SEED)), nnx.Param)
        x, target = demo.inputs(jax.random.key(LAYER_SEED), configs["nodrop"], tokens)
        report.append(f"## {name} (T={tokens}, H={hidden}, F={ffn}, E={experts}, k={k})\n")
        for impl, config in configs.items():
            step = jax.jit(demo.loss_and_grads(MoEBlock(config, rngs=nnx.Rngs(LAYER_SEED)))
                           ).lower(params, x, target).compile()
            op_names = hlo_op_names(step.as_text())
            result_types = hlo_result_types(step.as_text())
            op_names_by_kernel = {op.replace(".", "_"): op for op in op_names}
            for _ in range(3):
                jax.block_until_ready(step(params, x, target))
            wall_ms = seconds_per_call(lambda: step(params, x, target),
                                       jax.block_until_ready, 10)[0] * 1e3
            trace_dir = args.out / f"trace-{name}-{impl}"
            with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                for _ in range(LAYER_STEPS):
                    result = step(params, x, target)
                jax.block_until_ready(result)
            kernels_us, lines = device_kernels(next(trace_dir.rglob("perfetto_trace.json.gz")))
            kernels = collections.Counter()
            for kernel, micros, event_args in kernels_us:
                op = event_args.get("hlo_op", "")  # as in run_profile
                op = op if op in op_names else op_names_by_kernel.get(kernel, kernel)
                # The op_name's last three scopes: enough to tell the ops apart.
                where = "/".join(op_names.get(op, "").split("/")[-3:])
                where += f" {result_types[op]}" if op in result_types else ""
                kernels[(short_name(kernel), where)] += micros / 1e3 / LAYER_STEPS
            busy = sum(kernels.values())
            report.append(f"### {impl}: {wall_ms:.2f} ms per step, kernels {busy:.2f} ms\n")
            report.append("device lines: " + "; ".join(lines) + "\n")
            report.append("| kernel | HLO op_name (last scopes), result | ms per step | share |\n"
                          "| --- | --- | ---: | ---: |")
            for (kernel, where), ms in kernels.most_common(TOP):
                report.append(f"| `{kernel[:90]}` | `{where[:120]}` | {ms:.3f} | {ms / busy:.1%} |")
            report.append("")
            print("\n".join(report[-TOP - 4:]), flush=True)
    (args.out / "layer-profile.md").write_text("\n".join(report) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="side by side: traces of nodrop train --profile")
    runs.add_argument("runs", nargs="+", help="run folders")
    runs.add_argument("--out", type=pathlib.Path, required=True)
    layer = commands.add_parser("layer", help="the MoE layer alone, dropless and capacity 1.0")
    layer.add_argument("--out", type=pathlib.Path, required=True)
    layer.add_argument("--shapes", default=",".join(LAYER_SHAPES))
    layer.add_argument("--fp8", nargs="*", default=[], choices=FP8_RECIPES,
                       help="also the dropless layer in these FP8 recipes")
    args = parser.parse_args()
    return runs_main(args) if args.command == "runs" else layer_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
