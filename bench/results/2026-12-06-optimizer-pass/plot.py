"""Draws optimizer-pass.png from round 2's files: the step's tail per version (tail.md) and the
training step's tokens/s before and after (runs/*/metrics.jsonl, the intervals after the first
and outside the traced steps).

    python3 plot.py
"""
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PRESETS = ("qwen3", "mixtral", "deepseek")


def tail_times():
    rows = [line.split("|")[1:-1] for line in (HERE / "round-2" / "tail.md").read_text().splitlines()
            if line.startswith("| ") and "ms (median)" not in line
            and "---" not in line]
    return {(r[0].strip(), r[2].strip()): float(r[3]) for r in rows}


def steady_tokens_per_s(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timing = [r for r in records if r["kind"] == "timing" and r["first_step"] > 1
              and r["steps"] > 3]  # not the compile's interval, not the traced one
    return sum(r["tokens_per_s"] * r["steps"] for r in timing) / sum(r["steps"] for r in timing)


def main():
    tails = tail_times()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    versions = ("before", "after", "after, no update stats", "update only")
    presets = sorted({p for p, _ in tails})
    width = 0.2
    for i, version in enumerate(versions):
        left.bar([j + i * width for j in range(len(presets))],
                 [tails[(p, version)] for p in presets], width, label=version)
    left.set_xticks([j + 1.5 * width for j in range(len(presets))], presets)
    left.set_ylabel("ms per step")
    left.set_title("AdamW update + the step's metrics (1.8-1.9B parameters)")
    left.legend(fontsize=8, loc="lower center")
    speedups = [steady_tokens_per_s(HERE / "round-2" / "runs" / f"{p}-after")
                / steady_tokens_per_s(HERE / "round-2" / "runs" / f"{p}-before") for p in PRESETS]
    right.bar(PRESETS, speedups, color="tab:green")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_ylim(0.95, max(speedups) + 0.03)
    for x, value in enumerate(speedups):
        right.text(x, value + 0.004, f"{value:.3f}x", ha="center")
    right.set_title("training step, tokens/s after / before")
    figure.suptitle("One pass for the step's metrics, NVIDIA H100 80GB HBM3, 2026-12-06")
    figure.tight_layout()
    figure.savefig(HERE / "optimizer-pass.png", dpi=110)
    for preset, value in zip(PRESETS, speedups):
        print(f"{preset}: {value:.4f}x")


if __name__ == "__main__":
    main()
