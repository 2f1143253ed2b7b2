"""CPU grouped-matmul benchmark: nodrop.ragged_dot against jax.lax.ragged_dot and a dense jnp.dot.

    python bench/cpu_grouped_matmul.py [--iters 20] [--out DIR]    (`make bench`)

One grouped matmul of M=4096 rows, K=N=512 and 8 groups (uniform and Zipf-skewed group sizes), in
float32 and bfloat16, forward and forward+backward (gradients of lhs and rhs: 3 GEMMs). Every
implementation is jitted and timed in this process: warm-up, then the median of --iters runs. The
dense jnp.dot ([M, K] @ [K, N]) does the same FLOPs with no grouping, the speed a grouped matmul
aims for. Acceptance targets, forward: nodrop >= 0.5x dense, and nodrop faster than
jax.lax.ragged_dot. Results go to OUT/YYYY-MM-DD-cpu-grouped-matmul.{json,md} (default OUT: the
results/ folder beside this program, wherever it is run from; a relative --out is relative to
the working folder); exit status 1 if a target or the output check fails.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib

import jax
import jax.numpy as jnp

import nodrop
from nodrop.demo import positive_int, relative_difference
from shapes import CPU_GEMM_SHAPE, GROUP_SIZE_KINDS, group_sizes
from timing import PASSES, median_ms

M, K, N, GROUPS = CPU_GEMM_SHAPE
DTYPES = ("float32", "bfloat16")
MIN_VS_DENSE = 0.5  # target: nodrop forward runs at >= 0.5x the dense jnp.dot
CHECK_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}  # nodrop vs jax.lax.ragged_dot output

MATMULS = {
    "nodrop": nodrop.ragged_dot,
    "ragged_dot": jax.lax.ragged_dot,
    "dense": lambda lhs, rhs, sizes: jnp.dot(lhs, rhs),  # rhs [K, N]: one group
}


def cpu_device() -> dict:
    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                  if line.startswith("model name")), "unknown CPU")
    return {"cpu": model, "cores": len(os.sched_getaffinity(0))}


def run_cases(iters: int) -> list[dict]:
    """Times every (dtype, group sizes, pass, matmul); prints a line per case as it runs."""
    keys = jax.random.split(jax.random.key(0), 3)
    total = len(DTYPES) * len(GROUP_SIZE_KINDS) * len(PASSES) * len(MATMULS)
    cases = []
    for dtype in DTYPES:
        lhs = jax.random.normal(keys[0], (M, K), dtype)
        rhs = jax.random.normal(keys[1], (GROUPS, K, N), dtype)
        grad_out = jax.random.normal(keys[2], (M, N), dtype)
        for kind in GROUP_SIZE_KINDS:
            sizes = jnp.asarray(group_sizes(kind, M, GROUPS))
            check = relative_difference(jax.jit(nodrop.ragged_dot)(lhs, rhs, sizes),
                                        jax.jit(jax.lax.ragged_dot)(lhs, rhs, sizes))
            print(f"{dtype} {kind} {sizes.tolist()}: nodrop vs jax.lax.ragged_dot output, "
                  f"max rel diff {check:.1e}", flush=True)
            for pass_name, (make_step, gemms) in PASSES.items():
                for name, matmul in MATMULS.items():
                    operands = (lhs, rhs[0] if name == "dense" else rhs, sizes, grad_out)
                    ms = median_ms(make_step(matmul), operands, iters)
                    gflops = gemms * 2 * M * K * N / ms / 1e6
                    cases.append(dict(dtype=dtype, group_sizes=kind, sizes=sizes.tolist(),
                                      passes=pass_name, matmul=name, ms=ms, gflops=gflops,
                                      check=check))
                    print(f"[{len(cases):2d}/{total}] {dtype:8s} {kind:7s} {pass_name:16s} "
                          f"{name:10s} {ms:8.2f} ms {gflops:8.1f} GFLOP/s", flush=True)
    return cases


def summarize(cases: list[dict]) -> list[dict]:
    """One row per (dtype, group sizes, pass): GFLOP/s of each matmul, nodrop's ratios, verdicts."""
    rows = {}
    for case in cases:
        row = rows.setdefault((case["dtype"], case["group_sizes"], case["passes"]), dict(
            dtype=case["dtype"], group_sizes=case["group_sizes"], passes=case["passes"],
            check=case["check"]))
        row[f"{case['matmul']}_gflops"] = case["gflops"]
    for row in rows.values():
        row["nodrop_vs_dense"] = row["nodrop_gflops"] / row["dense_gflops"]
        row["nodrop_vs_ragged_dot"] = row["nodrop_gflops"] / row["ragged_dot_gflops"]
        if row["passes"] == "forward":
            row["check_ok"] = row["check"] <= CHECK_TOLERANCE[row["dtype"]]
            row["vs_dense_pass"] = row["nodrop_vs_dense"] >= MIN_VS_DENSE
            row["vs_ragged_dot_pass"] = row["nodrop_vs_ragged_dot"] > 1
    return list(rows.values())


def verdict(row: dict, key: str) -> str:
    """' PASS' or ' FAIL' where the row has the target `key`, else ''."""
    return (" PASS" if row[key] else " FAIL") if key in row else ""


def check(row: dict) -> str:
    """nodrop's output vs jax.lax.ragged_dot's (forward rows only)."""
    if "check_ok" not in row:
        return ""
    return f"{row['check']:.0e} {'ok' if row['check_ok'] else 'FAIL'}"


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [
        f"# CPU grouped matmul, {meta['date']}",
        "",
        f"{meta['device']['cpu']}, {meta['device']['cores']} cores; jax {meta['jax']}, "
        f"jaxlib {meta['jaxlib']}, nodrop {meta['nodrop']}.",
        f"M={M}, K={K}, N={N}, {GROUPS} groups; median of {meta['iters']} jitted runs. "
        "Forward+backward counts 3 GEMMs. Targets (forward): nodrop >= "
        f"{MIN_VS_DENSE}x dense jnp.dot, nodrop > jax.lax.ragged_dot.",
        "",
        "| dtype | group sizes | pass | nodrop GFLOP/s | dense GFLOP/s | ragged_dot GFLOP/s "
        "| nodrop/dense | nodrop/ragged_dot | output vs ragged_dot |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for row in summary:
        lines.append(
            f"| {row['dtype']} | {row['group_sizes']} | {row['passes']} "
            f"| {row['nodrop_gflops']:.1f} | {row['dense_gflops']:.1f} "
            f"| {row['ragged_dot_gflops']:.1f} "
            f"| {row['nodrop_vs_dense']:.2f}x{verdict(row, 'vs_dense_pass')} "
            f"| {row['nodrop_vs_ragged_dot']:.2f}x{verdict(row, 'vs_ragged_dot_pass')} "
            f"| {check(row)} |")
    return "\n".join(lines) + "\n"


# Beside the program, not bench/results under whatever folder it is run from.
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=positive_int, default=20,
                        help="timed runs per case, after warm-up (default: 20)")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help="folder for the JSON and markdown results (default: the results/ "
                             f"folder beside this program, {DEFAULT_OUT})")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark, writes the results; exit status 1 if a target or a check fails."""
    meta = dict(date=datetime.date.today().isoformat(), device=cpu_device(),
                jax=jax.__version__, jaxlib=importlib.metadata.version("jaxlib"),
                nodrop=nodrop.__version__, iters=args.iters,
                shape=dict(M=M, K=K, N=N, groups=GROUPS))
    print(f"{meta['device']['cpu']}, {meta['device']['cores']} cores, jax {meta['jax']}; results "
          f"to {args.out.absolute()}", flush=True)
    cases = run_cases(args.iters)
    summary = summarize(cases)
    table = markdown(summary, meta)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{meta['date']}-cpu-grouped-matmul"
    stem.with_suffix(".json").write_text(
        json.dumps(dict(meta, summary=summary, cases=cases), indent=2) + "\n")
    stem.with_suffix(".md").write_text(table)
    print(f"wrote {stem.absolute()}.json and {stem.absolute()}.md")
    verdicts = [row[key] for row in summary
                for key in ("check_ok", "vs_dense_pass", "vs_ragged_dot_pass") if key in row]
    return 0 if all(verdicts) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
