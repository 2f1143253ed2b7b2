"""The folder's figure: FP8 blockwise against bf16 with each weight gradient, in training (the
compare runs' tokens/s) and in the layer benchmark (three GEMMs with their quantisation).

    .venv/bin/python bench/results/2026-12-06-h200-h100-fp8-recipes/plot.py

Reads the committed runs and benchmark tables beside this file; writes fp8-recipes.png here.
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).parent
# (label, compare folder, variant folder of the unquantised and of the FP8 weight gradient)
TRAINING = [
    ("mixtral, H200", "round-1/compare", "dropless-fp8-blockwise-unquantised-wgrad",
     "dropless-fp8-blockwise"),
    ("mixtral, H100\n(60 steps)", "round-3/compare-mixtral", "dropless-fp8-blockwise",
     "dropless-fp8-blockwise-fp8-wgrad"),
    ("qwen3, H100", "round-2/compare-qwen3", "dropless-fp8-blockwise",
     "dropless-fp8-blockwise-fp8-wgrad"),
    ("deepseek, H100", "round-2/compare-deepseek", "dropless-fp8-blockwise",
     "dropless-fp8-blockwise-fp8-wgrad"),
]
LAYER_SHAPES = ["mixtral", "qwen3", "dsv3", "mixtral-gate-up", "mixtral-down", "qwen3-gate-up",
                "qwen3-down"]


def tokens_per_s(folder, variant):
    return json.loads((HERE / folder / variant / "seed-0" / "summary.json").read_text())[
        "tokens_per_s"]


def layer_ratios(table):
    """{shape: (FP8 / bf16, FP8 with the bf16 weight gradient / bf16)} from a benchmark table;
    round 1's table has no column for the latter, so it is computed from its bandwidth table
    as in the README."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in (HERE / table).read_text().splitlines() if line.startswith("| ")]
    layer = {cells[0]: cells for cells in rows if len(cells) in (17, 20)}
    rows_gbs = {cells[0]: cells[1] for cells in rows if len(cells) == 9}
    out = {}
    for shape in LAYER_SHAPES:
        cells = layer[shape]
        bf16 = float(cells[8])
        if len(cells) == 20:  # round 2 prints both totals
            out[shape] = (bf16 / float(cells[15]), bf16 / float(cells[18]))
        else:
            m, k, n = (int(v) for v in cells[1:4])
            rows_ms = (2 * m * (k + n) + m * (k + n) * (1 + 4 / 128)) / (
                float(rows_gbs[shape]) * 1e6)
            fwd, dgrad, bf16_wgrad = float(cells[10]), float(cells[11]), float(cells[7])
            out[shape] = (bf16 / float(cells[14]), bf16 / (rows_ms + fwd + dgrad + bf16_wgrad))
    return out


def main():
    fig, (train_ax, layer_ax) = plt.subplots(1, 2, figsize=(14, 5),
                                             gridspec_kw={"width_ratios": [1, 1.6]})
    width = 0.38
    for i, (label, folder, unquantised, fp8) in enumerate(TRAINING):
        bf16 = tokens_per_s(folder, "dropless")
        for offset, variant, color, name in ((-width / 2, unquantised, "tab:blue",
                                              "bf16 weight gradient (default)"),
                                             (width / 2, fp8, "tab:orange",
                                              "FP8 weight gradient")):
            ratio = tokens_per_s(folder, variant) / bf16
            train_ax.bar(i + offset, ratio, width, color=color, label=name if i == 0 else None)
            train_ax.text(i + offset, ratio + 0.003, f"{ratio:.3f}", ha="center", fontsize=8)
    train_ax.set_xticks(range(len(TRAINING)), [t[0] for t in TRAINING], fontsize=9)
    train_ax.set_ylim(0.95, 1.12)
    train_ax.axhline(1.0, color="black", linewidth=0.8)
    train_ax.set_ylabel("tokens/s, FP8 blockwise / bf16")
    train_ax.set_title("Training step (nodrop compare, same batches)")
    train_ax.legend(fontsize=8, loc="upper right")

    for j, (table, card, hatch) in enumerate((("round-1/fp8-training-bench.md", "H200", None),
                                              ("round-2/fp8-training-bench.md", "H100", "//"))):
        ratios = layer_ratios(table)
        for i, shape in enumerate(LAYER_SHAPES):
            base = i + (j - 0.5) * 0.4
            layer_ax.bar(base - 0.1, ratios[shape][1], 0.2, color="tab:blue", hatch=hatch,
                         edgecolor="white")
            layer_ax.bar(base + 0.1, ratios[shape][0], 0.2, color="tab:orange", hatch=hatch,
                         edgecolor="white")
    layer_ax.set_xticks(range(len(LAYER_SHAPES)), LAYER_SHAPES, fontsize=8, rotation=20)
    layer_ax.set_ylim(0.7, 1.35)
    layer_ax.axhline(1.0, color="black", linewidth=0.8)
    layer_ax.set_ylabel("time, bf16 / FP8 (three GEMMs with quantisation)")
    layer_ax.set_title("Layer benchmark: left pair of each shape H200, right (hatched) H100\n"
                       "blue: bf16 weight gradient (default); orange: FP8 weight gradient",
                       fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "fp8-recipes.png", dpi=110)


if __name__ == "__main__":
    main()
