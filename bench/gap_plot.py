"""Plots, per comparison folder, the validation loss of dropless minus that of a capacity factor
at every evaluation (below zero: dropless is ahead), one line per folder and seed.

    python3 bench/gap_plot.py OUT.png CAPACITY COMPARE_DIR...   # CAPACITY e.g. 1.25
"""

import gzip
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def val_losses(run: Path) -> dict[int, float]:
    path = run / "metrics.jsonl"
    opener = open if path.exists() else gzip.open
    with opener(path if path.exists() else run / "metrics.jsonl.gz", "rt") as lines:
        return {r["step"]: r["val_loss"] for r in map(json.loads, lines) if r["kind"] == "eval"}


def main(out: str, capacity: str, folders: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for folder in map(Path, folders):
        # `compare --seeds` keeps a folder per seed; a one-seed comparison the run itself.
        seeds = [p.name for p in sorted((folder / "dropless").glob("seed-*"))] or [""]
        for seed in seeds:
            run = folder / "dropless" / seed
            dropless = val_losses(run)
            dropping = val_losses(folder / f"capacity-{capacity}" / seed)
            train = json.loads((run / "config.json").read_text())["train"]
            steps = sorted(set(dropless) & set(dropping))
            ax.plot(steps, [dropless[s] - dropping[s] for s in steps], marker="o",
                    label=f"{train['preset']}, seed {train['seed']}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"val loss: dropless - capacity {capacity}")
    ax.set_title("below zero: dropless ahead at equal steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
