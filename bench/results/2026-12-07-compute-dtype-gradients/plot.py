"""compute-dtype-gradients.png: tokens/s of each preset's 40 training steps with gradients in the
compute dtype over float32 gradients, per round, and the step's tail alone (round 1's
bench/gpu_optimizer.py). Prints the ratios it draws.

    python3 plot.py   (in this folder)
"""
import json
import pathlib
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).parent
PRESETS = ["qwen3", "mixtral", "deepseek", "mixtral-fp8"]


def tokens_per_s(run: pathlib.Path) -> float:
    return json.loads((run / "summary.json").read_text())["tokens_per_s"]


def main():
    fig, (runs_ax, tail_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rounds = sorted(p for p in HERE.glob("round-*") if (p / "runs").is_dir())
    width = 0.8 / len(rounds)
    for i, folder in enumerate(rounds):
        ratios = []
        for preset in PRESETS:
            on, off = folder / "runs" / f"{preset}-on", folder / "runs" / f"{preset}-off"
            ratio = tokens_per_s(on) / tokens_per_s(off) if on.is_dir() and off.is_dir() else 0
            ratios.append(ratio)
            if ratio:
                print(f"{folder.name} {preset}: {tokens_per_s(on):,.0f} / {tokens_per_s(off):,.0f}"
                      f" tokens/s = {ratio:.3f}x")
        runs_ax.bar([j + i * width for j in range(len(PRESETS))], ratios, width,
                    label=folder.name)
    runs_ax.axhline(1.0, color="gray", lw=0.8)
    runs_ax.set_xticks([j + width * (len(rounds) - 1) / 2 for j in range(len(PRESETS))], PRESETS)
    runs_ax.set_ylim(0.98, 1.04)
    runs_ax.set_ylabel("tokens/s, compute-dtype / float32 gradients")
    runs_ax.set_title("40 training steps (H100)")
    runs_ax.legend()

    table = (HERE / "round-1" / "optimizer" / "optimizer.md").read_text()
    rows = re.findall(r"^\| (\w+) \| [\d.]+B \| ([^|]+?) \| ([\d.]+) \|", table, re.M)
    tail = {(preset, version): float(ms) for preset, version, ms in rows}
    versions = ["fused, widened in the step", "fused, compute-dtype gradients"]
    for i, version in enumerate(versions):
        values = [tail[(p, version)] for p in ("qwen3", "mixtral")]
        tail_ax.bar([j + i * 0.4 for j in range(2)], values, 0.4, label=version)
    tail_ax.set_xticks([0.2, 1.2], ["qwen3", "mixtral"])
    tail_ax.set_ylabel("ms (median of 10)")
    tail_ax.set_title("the step's tail: AdamW and its statistics")
    tail_ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(HERE / "compute-dtype-gradients.png", dpi=110)


if __name__ == "__main__":
    main()
