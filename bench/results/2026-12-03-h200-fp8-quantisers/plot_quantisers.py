"""round-4-quantisers.png from round-4-training-bench/: python3 plot_quantisers.py round-4-training-bench round-4-quantisers.png"""
import pathlib
import sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
folder = pathlib.Path(sys.argv[1])
shapes = ["mixtral", "qwen3", "dsv3", "dsv3-down", "mixtral-gate-up", "mixtral-down"]
def ratios(prefix, s):
    for line in (folder / f"training-{prefix}{s}.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == s and len(cells) == 6:
            return float(cells[4]), float(cells[5])
    raise SystemExit(f"no bandwidth row for {s}")
old = np.array([ratios("old-", s) for s in shapes]); new = np.array([ratios("", s) for s in shapes])
x = np.arange(len(shapes)); w = 0.2
fig, ax = plt.subplots(figsize=(10, 4.6))
for i, (data, col, label) in enumerate([(old[:, 0], "#bbbbbb", "rows, 3ca813c"), (new[:, 0], "#1f77b4", "rows, 72c04d9"),
                                         (old[:, 1], "#e0c0a0", "transposed, 3ca813c"), (new[:, 1], "#d62728", "transposed, 72c04d9")]):
    ax.bar(x + (i - 1.5) * w, data, w, color=col, label=label)
ax.axhline(0.8, color="k", ls="--", lw=1, label="issue 18: 0.8")
ax.set_xticks(x, shapes); ax.set_ylabel("bandwidth / device copy"); ax.set_ylim(0, 1.1)
ax.set_title("FP8 quantisers on an H200 (2026-12-03, round 4, one process per shape)")
ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.1)); ax.grid(axis="y", alpha=0.3)
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=120)
