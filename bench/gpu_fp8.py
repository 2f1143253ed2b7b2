"""GPU benchmark: nodrop's FP8 grouped GEMM forward against torch._scaled_grouped_mm.

    python bench/gpu_fp8.py --out DIR [--iters 10] [--shapes Mixtral-8x7B,DeepGEMM-N4096-K7168]
                            [--row-multiple 16] [--dry-run]

Issue 18's FP8 forward targets, measured in this one process: nodrop's blockwise-scaled FP8
GEMM (nodrop.grouped_matmul_fp8_blockwise: activations in 1 x 128 blocks, each expert's weight
in 128 x 128 blocks, DeepSeek-V3's recipe) at least as fast as PyTorch's FP8 grouped GEMM
(torch._scaled_grouped_mm: CUTLASS, row-wise scales, one per activation row and one per output
column of each expert) on every shape and group sizes of the bf16 benchmark (bench/gpu_moe.py),
and at least 1200 TFLOP/s on DeepGEMM's two grouped shapes (4 equal groups of 8192 rows). The
same two targets are checked apart for nodrop's tensorwise GEMM (the tensorwise recipe's
forward: one scale for the activations and one per expert, fast accumulation, as torch's
use_fast_accum).

Timed side by side (bench/timing.py), in turns:
- nodrop FP8 GEMM: grouped_matmul_fp8_blockwise on operands quantised beforehand;
- nodrop tensorwise FP8 GEMM: grouped_matmul_fp8_tensorwise on operands quantised beforehand
  (one scale over the activations, one per expert's weight);
- nodrop quantize_rows + GEMM: the forward from bf16 activations, their quantisation included
  (the weights quantised beforehand, as for the GEMM);
- torch._scaled_grouped_mm with use_fast_accum False and True, on operands quantised
  beforehand: no quantisation, so the targets compare it with nodrop's GEMM alone.

Each output is checked on its first, middle and last non-empty groups against a float32
(torch: float64) product of its own dequantised operands (relative Frobenius error, tolerance
CHECK_TOLERANCE), which a wrong layout, scale or offset fails; its error against the product of
the unquantised bf16 operands is reported too (the recipe's quantisation error). A torch case
that fails, or a torch without a GPU, is recorded with the reason. `--dry-run`: one tiny shape,
in seconds, on the CPU too (nodrop's CPU engine; torch then reports why it did not run).

Writes DIR/gpu-fp8.json (every number), DIR/gpu-fp8.md (the tables) and DIR/gpu-fp8.png
(TFLOP/s). Exit status 1 if a target fails.
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

import nodrop
from gpu_moe import failure, measure
from nodrop.demo import positive_int
from nodrop.ops.fp8 import (ACTIVATION_BLOCK, E4M3_MAX, WEIGHT_BLOCK, dequantize, quantize,
                            quantize_rows)
from shapes import DEEPGEMM_SHAPES, GEMM_SHAPES, GROUP_SIZE_KINDS, group_sizes, shape_list
from timing import CASE_BUDGET_S, DEFAULT_ITERS, gpu_run_metadata
from torch_peer import load_torch, share_gpu_with_torch, torch_sync

DTYPE = jnp.bfloat16
DRY_RUN_SHAPES = {"tiny": (256, 256, 256, 4)}  # two K and N blocks; Zipf's groups unaligned
CHECK_TOLERANCE = 2e-2  # relative Frobenius error against the dequantised operands' product
MIN_VS_TORCH = 1.0  # nodrop FP8 GEMM / the faster torch._scaled_grouped_mm, GEMM_SHAPES
MIN_TFLOPS = 1200.0  # nodrop FP8 GEMM, DEEPGEMM_SHAPES

TORCH_IMPLS = {"torch": False, "torch_fast_accum": True}  # impl -> use_fast_accum
GEMM_IMPLS = ("nodrop_gemm", "nodrop_tensorwise")  # nodrop's GEMMs alone, each held to the targets
NODROP_IMPLS = (*GEMM_IMPLS, "nodrop_forward")
IMPL_LABELS = {
    "nodrop_gemm": "nodrop FP8 GEMM",
    "nodrop_tensorwise": "nodrop tensorwise FP8 GEMM",
    "nodrop_forward": "nodrop quantize_rows + FP8 GEMM",
    "torch": "torch._scaled_grouped_mm",
    "torch_fast_accum": "torch._scaled_grouped_mm use_fast_accum",
}
START = time.perf_counter()


def log(case: dict) -> None:
    if case["status"] == "ok":
        result = f"{case['ms']:9.3f} ms {case['tflops']:7.1f} TFLOP/s"
    else:
        result = f"{case['status']} {case['detail'][:160]}"
    if case["check"] is not None:
        result += (f", error {case['check']:.1e} vs dequantised operands, "
                   f"{case['error_vs_bf16']:.1e} vs bf16 operands")
    print(f"[{time.perf_counter() - START:6.1f} s] {case['shape']} {case['group_sizes']} "
          f"{IMPL_LABELS[case['impl']]}: {result}", flush=True)


# --- group sizes and the check ------------------------------------------------------------------


def rounded_sizes(sizes: np.ndarray, multiple: int) -> np.ndarray:
    """sizes rounded down to multiples of `multiple`, the rows that frees going to group 0: the
    same sum, and a multiple in every group where the sum is one."""
    out = sizes // multiple * multiple
    out[0] += sizes.sum() - out.sum()
    return out


def sampled_groups(sizes: np.ndarray) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of the first, middle and last non-empty groups."""
    ends = np.cumsum(sizes)
    nonempty = np.flatnonzero(sizes)
    picks = sorted({nonempty[0], nonempty[len(nonempty) // 2], nonempty[-1]})
    return [(int(g), int(ends[g] - sizes[g]), int(ends[g])) for g in picks]


def relative_errors(squares) -> tuple[float, float]:
    """(error against the dequantised operands' product, against the bf16 operands' product),
    relative Frobenius, from each group's (|out - dequantised|^2, |dequantised|^2,
    |out - bf16|^2, |bf16|^2)."""
    totals = np.sum(np.asarray(squares, np.float64), axis=0)
    return float(np.sqrt(totals[0] / totals[1])), float(np.sqrt(totals[2] / totals[3]))


def sum_squares(*pairs) -> list[float]:
    """[|a - b|^2, |b|^2] for each (a, b): jax arrays or torch tensors."""
    return [float(x) for a, b in pairs for x in (((a - b) ** 2).sum(), (b ** 2).sum())]


# --- the two implementations --------------------------------------------------------------------


def nodrop_fp8(dims):
    """{impl: run(group sizes)} and {impl: errors(out, sizes)} of nodrop's FP8 forwards at dims,
    on random normal bf16 operands quantised as fp8_grouped_matmul's kernel forward does for
    each recipe."""
    rows, k, n, groups = dims
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], (rows, k), DTYPE)
    rhs = jax.random.normal(keys[1], (groups, k, n), DTYPE)
    lhs_q, lhs_scales = jax.jit(quantize_rows)(lhs)
    rhs_q_t, rhs_scales = jax.jit(lambda w: quantize(jnp.swapaxes(w, 1, 2), WEIGHT_BLOCK))(rhs)
    gemm = jax.jit(nodrop.grouped_matmul_fp8_blockwise)
    forward = jax.jit(lambda lhs, *weights: nodrop.grouped_matmul_fp8_blockwise(
        *quantize_rows(lhs), *weights))
    # The tensorwise recipe's operands: one scale over lhs, one per expert's weight.
    tensor_q, tensor_scale = jax.jit(lambda x: quantize(x, "tensor"))(lhs)
    tensor_rhs_q_t, tensor_rhs_scales = jax.jit(
        lambda w: quantize(jnp.swapaxes(w, 1, 2), "tensor"))(rhs)
    tensorwise = jax.jit(functools.partial(nodrop.grouped_matmul_fp8_tensorwise,
                                           fast_accumulation=True))
    runs = {"nodrop_gemm": lambda gs: functools.partial(gemm, lhs_q, lhs_scales, rhs_q_t,
                                                        rhs_scales, gs),
            "nodrop_tensorwise": lambda gs: functools.partial(
                tensorwise, tensor_q, tensor_scale.reshape(1), tensor_rhs_q_t,
                tensor_rhs_scales.reshape(groups), gs),
            "nodrop_forward": lambda gs: functools.partial(forward, lhs, rhs_q_t, rhs_scales, gs)}

    def errors_of(dequantised_lhs, dequantised_rhs_t):
        """errors(out, sizes) against the product of the dequantised operands' groups."""
        def errors(out, sizes):
            squares = []
            for g, start, end in sampled_groups(sizes):
                got = out[start:end].astype(jnp.float32)
                dequantised = jnp.dot(dequantised_lhs(start, end), dequantised_rhs_t(g).T,
                                      precision=jax.lax.Precision.HIGHEST)
                exact = jnp.dot(lhs[start:end], rhs[g], precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
                squares.append(sum_squares((got, dequantised), (got, exact)))
            return relative_errors(squares)
        return errors

    blockwise_errors = errors_of(
        lambda start, end: dequantize(lhs_q[start:end], lhs_scales[start:end], ACTIVATION_BLOCK),
        lambda g: dequantize(rhs_q_t[g], rhs_scales[g], WEIGHT_BLOCK))
    tensorwise_errors = errors_of(
        lambda start, end: dequantize(tensor_q[start:end], tensor_scale, "tensor"),
        lambda g: dequantize(tensor_rhs_q_t[g], tensor_rhs_scales[g], "tensor"))
    return runs, {"nodrop_gemm": blockwise_errors, "nodrop_tensorwise": tensorwise_errors,
                  "nodrop_forward": blockwise_errors}


def rowwise(torch, x):
    """x [..., R, K] bf16 -> (q float8_e4m3fn, scale float32 [..., R]): one scale per row,
    amax / 448 (1 for a row of zeros), torch's row-wise recipe."""
    amax = x.abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def torch_fp8(torch, dims):
    """{impl: run(offs)} and errors(out, sizes) of torch._scaled_grouped_mm at dims, on random
    normal bf16 operands quantised row-wise.

    Its 2d x 3d form (aten/src/ATen/native/cuda/GroupedBlas.cpp, ScaledGroupMM.cu): mat_a [M, K]
    float8_e4m3fn row-major; mat_b [G, K, N] float8_e4m3fn column-major in each group (a
    contiguous [G, N, K] transposed); K and N multiples of 16; scale_a float32 [M], contiguous;
    scale_b float32 [G, N]; offs int32 [G], the groups' cumulative ends (no alignment asked of
    the group sizes when the rows are grouped); bf16 output; fewer than 1024 groups."""
    rows, k, n, groups = dims
    generator = torch.Generator(device="cuda").manual_seed(0)
    lhs = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda", generator=generator)
    rhs_t = torch.randn(groups, n, k, dtype=torch.bfloat16, device="cuda", generator=generator)
    lhs_q, lhs_scale = rowwise(torch, lhs)
    rhs_q_t, rhs_scale = rowwise(torch, rhs_t)  # a scale per output column of each expert
    mat_b = rhs_q_t.transpose(-2, -1)

    def run(fast_accum):
        return lambda offs: lambda: torch._scaled_grouped_mm(
            lhs_q, mat_b, lhs_scale, rhs_scale, offs=offs, out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum)

    def errors(out, sizes):
        squares = []
        for g, start, end in sampled_groups(sizes):
            got = out[start:end].double()
            dequantised = ((lhs_q[start:end].double() * lhs_scale[start:end, None].double())
                           @ (rhs_q_t[g].double() * rhs_scale[g][:, None].double()).T)
            exact = lhs[start:end].double() @ rhs_t[g].double().T
            squares.append(sum_squares((got, dequantised), (got, exact)))
        return relative_errors(squares)

    return {impl: run(fast) for impl, fast in TORCH_IMPLS.items()}, errors


# --- the cases ----------------------------------------------------------------------------------


def shape_cases(name: str, dims, kinds, iters: int, torch, torch_status: str,
                row_multiple: int) -> list[dict]:
    """Per group sizes: nodrop's GEMM and forward and torch's two variants (where `torch` is
    not None; else n/a for `torch_status`), checked, then timed side by side."""
    rows, k, n, groups = dims
    flops = 2 * rows * k * n
    nodrop_runs, nodrop_errors = nodrop_fp8(dims)
    torch_runs, torch_errors = {}, None
    not_run = dict(status="n/a", ms=None, tflops=None, iters=0, detail=torch_status)
    if torch is not None:
        try:
            torch_runs, torch_errors = torch_fp8(torch, dims)
        except Exception as error:  # out of memory, say: each case records it
            not_run = failure(error)
    cases = []
    for kind in kinds:
        sizes = rounded_sizes(group_sizes(kind, rows, groups), row_multiple)
        group_sizes_jax = jnp.asarray(sizes)
        runs, errors, results = {}, {}, {}
        for impl, make in nodrop_runs.items():
            runs[impl] = make(group_sizes_jax), jax.block_until_ready
            errors[impl] = nodrop_errors[impl]
        if torch_runs:
            offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
            for impl, make in torch_runs.items():
                runs[impl] = make(offs), torch_sync(torch)
                errors[impl] = torch_errors
        checks = {}
        for impl, (run, _) in list(runs.items()):
            try:  # alone first: what cannot run at all fails here, with its reason
                checks[impl] = errors[impl](run(), sizes)
            except Exception as error:
                results[impl] = failure(error)
                del runs[impl]
        if runs:
            results |= measure(runs, iters, flops)
        for impl in IMPL_LABELS:
            result = results.get(impl, not_run)
            check, error_vs_bf16 = checks.get(impl, (None, None))
            case = dict(shape=name, dims=list(dims), group_sizes=kind, impl=impl, **result,
                        check=check, error_vs_bf16=error_vs_bf16)
            if impl == "nodrop_gemm":
                case["sizes"] = sizes.tolist()
            log(case)
            cases.append(case)
    return cases


# --- summary and targets ------------------------------------------------------------------------


def checked(result: dict) -> bool:
    return result["check"] is not None and result["check"] <= CHECK_TOLERANCE


def verdict(passed: bool, nodrop_result: dict) -> str:
    if nodrop_result["status"] != "ok":
        return f"FAIL (nodrop {nodrop_result['status']})"
    return "PASS" if passed else "FAIL"


def summary(cases: list[dict]) -> list[dict]:
    """One row per (shape, group sizes): each implementation, the faster torch variant whose
    output passed its check, nodrop's ratios to it, the targets."""
    rows = {}
    for case in cases:
        row = rows.setdefault((case["shape"], case["group_sizes"]), dict(
            shape=case["shape"], dims=case["dims"], group_sizes=case["group_sizes"],
            results={}))
        row["results"][case["impl"]] = {key: case[key] for key in (
            "status", "ms", "tflops", "check", "error_vs_bf16", "detail")}
        if "sizes" in case:
            row["sizes"] = case["sizes"]
    for row in rows.values():
        results = row["results"]
        peers = [impl for impl in TORCH_IMPLS
                 if results[impl]["status"] == "ok" and checked(results[impl])]
        best = max(peers, key=lambda impl: results[impl]["tflops"]) if peers else None
        row["torch_best"] = best
        row["ratios"] = {impl: (results[impl]["tflops"] / results[best]["tflops"]
                                if best and results[impl]["status"] == "ok" else None)
                         for impl in NODROP_IMPLS}
        targets = {f"check {impl}": dict(minimum=None, verdict=verdict(
            checked(results[impl]), results[impl])) for impl in NODROP_IMPLS}
        for impl in GEMM_IMPLS:  # each GEMM against the targets, apart
            gemm = results[impl]
            if row["shape"] in GEMM_SHAPES:
                if gemm["status"] == "ok" and best is None:  # no torch variant ran and checked
                    text = "n/a (torch: " + ", ".join(
                        results[peer]["status"] if results[peer]["status"] != "ok"
                        else "check failed" for peer in TORCH_IMPLS) + ")"
                else:
                    text = verdict(best is not None
                                   and row["ratios"][impl] >= MIN_VS_TORCH, gemm)
                targets[f"vs torch {impl}"] = dict(minimum=MIN_VS_TORCH, verdict=text)
            if row["shape"] in DEEPGEMM_SHAPES:
                targets[f"TFLOP/s {impl}"] = dict(minimum=MIN_TFLOPS, verdict=verdict(
                    gemm["status"] == "ok" and gemm["tflops"] >= MIN_TFLOPS, gemm))
        row["targets"] = targets
    return list(rows.values())


def torch_best_text(row: dict) -> str:
    best = row["torch_best"]
    return "" if best is None else f" (use_fast_accum={TORCH_IMPLS[best]})"


def target_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        where = f"{row['shape']} {row['group_sizes']}"
        for name, target in row["targets"].items():
            kind, impl = name.rsplit(" ", 1)
            label = IMPL_LABELS[impl]
            if kind == "check":
                check = row["results"][impl]["check"]
                measured = "error" if check is None else f"{check:.1e}"
                lines.append(f"{where}: {label} output vs the dequantised operands' "
                             f"product <= {CHECK_TOLERANCE:g}: {measured} {target['verdict']}")
            elif kind == "vs torch":
                ratio = row["ratios"][impl]
                measured = f"{ratio:.2f}x " if ratio is not None else ""
                lines.append(f"{where}: {label} / torch._scaled_grouped_mm"
                             f"{torch_best_text(row)} >= {target['minimum']:g}x: {measured}"
                             f"{target['verdict']}")
            else:
                gemm = row["results"][impl]
                measured = f"{gemm['tflops']:.1f} " if gemm["status"] == "ok" else ""
                lines.append(f"{where}: {label} >= {target['minimum']:g} TFLOP/s: "
                             f"{measured}{target['verdict']}")
    return lines


# --- output -------------------------------------------------------------------------------------


def tflops_cell(result: dict) -> str:
    if result["status"] != "ok":
        return result["status"]
    return f"{result['tflops']:.1f}" + ("" if checked(result) else " (check failed)")


def error_cell(result: dict) -> str:
    if result["check"] is None:
        return result["status"]
    return f"{result['check']:.1e} / {result['error_vs_bf16']:.1e}"


def markdown(meta: dict, rows: list[dict]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items()
                         if version)
    timing = meta["timing"]
    shapes = "; ".join(f"{name} {tuple(dims)}" for name, dims in dict(
        (row["shape"], row["dims"]) for row in rows).items())
    multiple = meta["row_multiple"]
    sizes_text = ("as they are" if multiple == 1 else
                  f"rounded down to multiples of {multiple} rows, the rest to group 0")
    lines = [
        f"# nodrop's FP8 grouped GEMM against torch._scaled_grouped_mm on "
        f"{meta['device']['jax']}, {meta['date']}",
        "",
        f"Device: {meta['device']['jax']} (torch: {meta['device']['torch'] or meta['torch']}). "
        f"{versions}.",
        "",
        "Forward only, bf16 output. nodrop: grouped_matmul_fp8_blockwise, activations in 1 x "
        "128 blocks and each expert's weight in 128 x 128 blocks, float32 scales, each block's "
        "product scaled as it is accumulated; nodrop tensorwise: grouped_matmul_fp8_tensorwise, "
        "one scale for the activations and one per expert, fast accumulation, scaled in the "
        "epilogue; torch._scaled_grouped_mm: row-wise float32 scales "
        "(one per activation row, one per output column of each expert) applied in the "
        "epilogue, with use_fast_accum False and True. nodrop's two GEMM columns and both torch "
        "columns time the GEMM alone on operands quantised beforehand; \"nodrop quantize_rows "
        "+ FP8 GEMM\" includes the activations' quantisation (weights quantised beforehand). "
        f"Median over {timing['repeats']} repeats of the mean of {timing['iters']} "
        f"back-to-back calls (fewer where those would take over {CASE_BUDGET_S:g} s), after "
        f"{timing['warmup']} warm-up calls and {timing['heat_s']:g} s of untimed calls that "
        "bring the card to its power limit; the five take turns repeat by repeat, in an order "
        "reversed every other repeat. A case that fails shows its status (the json has the "
        "message).",
        "",
        f"Shapes (M, K, N, G): {shapes}. Group sizes: bench/shapes.py's, {sizes_text}, the same "
        "for both implementations (the json has them); DeepGEMM's shapes: 4 equal groups. "
        "TFLOP/s counts 2*M*K*N. Both sides multiply random normal bf16 operands of their own "
        "(same distribution, not the same values).",
        "",
        "## TFLOP/s",
        "",
        "| shape | group sizes | " + " | ".join(IMPL_LABELS.values())
        + " | " + " | ".join(f"{IMPL_LABELS[impl]} / torch (the faster)"
                             for impl in NODROP_IMPLS) + " |",
        "| --- | --- | " + "---: | " * len(IMPL_LABELS) + "--- | " * len(NODROP_IMPLS),
    ]
    for row in rows:
        ratios = [f"{value:.2f}x{torch_best_text(row)}" if value is not None else "-"
                  for value in row["ratios"].values()]
        lines.append(f"| {row['shape']} | {row['group_sizes']} | "
                     + " | ".join(tflops_cell(row["results"][i]) for i in IMPL_LABELS)
                     + " | " + " | ".join(ratios) + " |")
    lines += [
        "", "## Accuracy", "",
        "Relative Frobenius error of each output on its first, middle and last non-empty "
        "groups: against the product of its own dequantised operands (float32 for nodrop, "
        f"float64 for torch; tolerance {CHECK_TOLERANCE:g}: a wrong layout, scale or offset "
        "shows here) / against the product of the bf16 operands before quantisation (the "
        "recipe's error).",
        "",
        "| shape | group sizes | " + " | ".join(IMPL_LABELS.values()) + " |",
        "| --- | --- | " + "---: | " * len(IMPL_LABELS),
    ]
    lines += [f"| {row['shape']} | {row['group_sizes']} | "
              + " | ".join(error_cell(row["results"][i]) for i in IMPL_LABELS) + " |"
              for row in rows]
    targets = target_lines(rows)
    failed = [line for line in targets if "FAIL" in line]
    lines += ["", "## Targets", "",
              f"{len(targets) - len(failed)} of {len(targets)} pass or do not apply.", ""]
    lines += [f"- {line}" for line in targets]
    return "\n".join(lines) + "\n"


def plot(meta: dict, rows: list[dict], path: pathlib.Path) -> None:
    """Grouped bars: TFLOP/s per shape and group sizes; failures labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(IMPL_LABELS)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.4 * len(rows)), 5.0))
    for i, (impl, label) in enumerate(IMPL_LABELS.items()):
        xs = [j + (i - (len(IMPL_LABELS) - 1) / 2) * width for j in range(len(rows))]
        results = [row["results"][impl] for row in rows]
        ax.bar(xs, [r["tflops"] or 0.0 for r in results], width, label=label)
        for x, result in zip(xs, results, strict=True):
            if result["status"] != "ok":
                ax.text(x, 0.01, result["status"], rotation=90, ha="center", va="bottom",
                        fontsize=7, transform=ax.get_xaxis_transform())
    if any(row["shape"] in DEEPGEMM_SHAPES for row in rows):
        ax.axhline(MIN_TFLOPS, color="gray", linestyle="--", linewidth=1,
                   label=f"{MIN_TFLOPS:g} TFLOP/s (issue 18, DeepGEMM's shapes)")
    ax.set_xticks(range(len(rows)), [f"{row['shape']}\n{row['group_sizes']}" for row in rows],
                  fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"FP8 grouped GEMM forward, {meta['device']['jax']}, {meta['date']}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def metadata(torch, torch_status: str, iters: int, row_multiple: int) -> dict:
    return dict(gpu_run_metadata(torch, iters),
                torch=torch_status or "torch._scaled_grouped_mm available",
                row_multiple=row_multiple,
                targets=dict(min_vs_torch=MIN_VS_TORCH, min_tflops=MIN_TFLOPS,
                             check_tolerance=CHECK_TOLERANCE))


def load_scaled_grouped_mm():
    """(torch, "") where torch imports, sees a GPU and has _scaled_grouped_mm; else (None, why)."""
    torch, status = load_torch()
    if torch is not None and not hasattr(torch, "_scaled_grouped_mm"):
        return None, f"torch {torch.__version__} has no _scaled_grouped_mm"
    return torch, status


# --- command line -------------------------------------------------------------------------------

SHAPES = GEMM_SHAPES | DEEPGEMM_SHAPES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True,
                        help="folder for gpu-fp8.json, gpu-fp8.md and gpu-fp8.png")
    parser.add_argument("--iters", type=positive_int, default=DEFAULT_ITERS,
                        help=f"timed calls per repeat (default: {DEFAULT_ITERS})")
    parser.add_argument("--shapes", type=shape_list(SHAPES), default=None,
                        help=f"comma list of shapes to run (default: all of {', '.join(SHAPES)})")
    parser.add_argument("--row-multiple", type=positive_int, default=1,
                        help="round every group's rows down to a multiple of this, the rest to "
                             "group 0, for both implementations (default 1: the sizes as they "
                             "are; torch's grouped rows need no alignment)")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"only the tiny shape {DRY_RUN_SHAPES['tiny']}, in seconds, on the "
                             "CPU too")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    share_gpu_with_torch()  # before JAX's first use of the GPU, just below
    if jax.default_backend() == "gpu" and not nodrop.backends()["cuda"]:
        raise SystemExit("nodrop has no CUDA engine (nodrop/libnodrop_ffi_cuda.so): build it")
    shapes = DRY_RUN_SHAPES if args.dry_run else {
        name: dims for name, dims in SHAPES.items() if args.shapes is None or name in args.shapes}
    uneven = [name for name, dims in shapes.items() if dims[0] % args.row_multiple]
    if uneven:
        raise SystemExit(f"--row-multiple {args.row_multiple} does not divide the rows of "
                         f"{', '.join(uneven)}")
    torch, torch_status = load_scaled_grouped_mm()
    meta = metadata(torch, torch_status, args.iters, args.row_multiple)
    print(f"{meta['device']['jax']}; {meta['torch']}; "
          + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v), flush=True)

    cases = []
    for name, dims in shapes.items():
        kinds = ("uniform",) if name in DEEPGEMM_SHAPES else GROUP_SIZE_KINDS
        cases += shape_cases(name, dims, kinds, args.iters, torch, torch_status,
                             args.row_multiple)
        if torch is not None:  # this shape's torch tensors are freed now
            torch.cuda.empty_cache()

    rows = summary(cases)
    table = markdown(meta, rows)
    print("\n" + table, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-fp8.json").write_text(json.dumps(dict(meta, summary=rows, cases=cases),
                                                      indent=2) + "\n")
    (args.out / "gpu-fp8.md").write_text(table)
    plot(meta, rows, args.out / "gpu-fp8.png")
    written = ("gpu-fp8.json", "gpu-fp8.md", "gpu-fp8.png")
    print(f"wrote {', '.join(str(args.out / name) for name in written)}", flush=True)
    return 1 if any("FAIL" in line for line in target_lines(rows)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
