"""Draws fused-adamw.png and prints the table of the README: the optimizer benchmark per
version (round-1/optimizer/optimizer.md) and the training step's tokens/s, fused over optax,
per round (round-*/runs/PRESET-VERSION/metrics.jsonl, the intervals after the compile's and
outside the traced steps).

    python3 plot.py
"""
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PRESETS = ("qwen3", "mixtral", "deepseek")
VERSIONS = ("optax", "fused", "optax, update only")


def optimizer_times():
    rows = [line.split("|")[1:-1]
            for line in (HERE / "round-1" / "optimizer" / "optimizer.md").read_text().splitlines()
            if line.startswith("| ") and "ms (median)" not in line and "---" not in line]
    return {(r[0].strip(), r[2].strip()): float(r[3]) for r in rows}


def steady_tokens_per_s(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timing = [r for r in records if r["kind"] == "timing" and r["first_step"] > 1
              and r["steps"] > 3]  # not the compile's interval, not a traced one (round 2)
    return sum(r["tokens_per_s"] * r["steps"] for r in timing) / sum(r["steps"] for r in timing)


def speedups():
    """{(round, preset): (optax tokens/s, fused tokens/s)} for every pair that ran."""
    found = {}
    for folder in sorted(HERE.glob("round-*/runs")):
        for preset in PRESETS:
            runs = [folder / f"{preset}-{v}" for v in ("optax", "fused")]
            if all((run / "metrics.jsonl").exists() for run in runs):
                found[(folder.parent.name, preset)] = tuple(map(steady_tokens_per_s, runs))
    return found


def main():
    times, pairs = optimizer_times(), speedups()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    presets = [p for p in PRESETS if (p, "fused") in times]
    width = 0.27
    for i, version in enumerate(VERSIONS):
        left.bar([j + i * width for j in range(len(presets))],
                 [times[(p, version)] for p in presets], width, label=version)
    left.set_xticks([j + width for j in range(len(presets))], presets)
    left.set_ylabel("ms per step")
    left.set_title("AdamW step + its statistics, alone")
    left.legend(fontsize=8, loc="lower center")
    labels = [f"{preset}\n{name}" for name, preset in pairs]
    ratios = [fused / optax for optax, fused in pairs.values()]
    right.bar(labels, ratios, color="tab:green")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_ylim(0.95, max(ratios, default=1.0) + 0.03)
    for x, value in enumerate(ratios):
        right.text(x, value + 0.004, f"{value:.3f}x", ha="center")
    right.set_title("training step, tokens/s fused / optax")
    figure.suptitle("The AdamW step in one engine call per parameter, 2026-12-06")
    figure.tight_layout()
    figure.savefig(HERE / "fused-adamw.png", dpi=110)
    for (name, preset), (optax, fused) in pairs.items():
        print(f"{name} {preset}: optax {optax:,.0f}, fused {fused:,.0f} tokens/s, "
              f"{fused / optax:.4f}x")


if __name__ == "__main__":
    main()
