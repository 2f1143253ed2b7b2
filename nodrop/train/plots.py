"""PNG plots of a run (loss curves, expert load) and of a comparison, from metrics records."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _ema(values: np.ndarray, weight: float = 0.9) -> np.ndarray:
    """Exponential moving average, debiased as TensorBoard's smoothing is (no pull towards the
    first value)."""
    out, acc = np.empty_like(values), 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        out[i] = acc / (1 - weight ** (i + 1))
    return out


def _series(records, kind: str, key: str):
    rows = [(r["step"], r[key]) for r in records
            if r.get("kind") == kind and r.get(key) is not None]
    if not rows:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*rows)
    return np.asarray(steps), np.asarray(values, dtype=np.float64)


def plot_losses(records: list[dict], path: str | os.PathLike, unigram: float | None,
                title: str) -> None:
    """Training cross-entropy (raw and smoothed), validation loss, the unigram baseline."""
    fig, ax = plt.subplots(figsize=(8, 5))
    steps, ce = _series(records, "train", "ce")
    if steps.size:
        ax.plot(steps, ce, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(steps, _ema(ce), color="tab:blue", label="train cross-entropy (EMA 0.9)")
    val_steps, val = _series(records, "eval", "val_loss")
    if val_steps.size:
        ax.plot(val_steps, val, "o-", color="tab:orange", label="validation loss")
    if unigram is not None:
        ax.axhline(unigram, color="gray", linestyle="--",
                   label=f"unigram baseline {unigram:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_expert_load(records: list[dict], path: str | os.PathLike, title: str) -> None:
    """Per MoE layer, the busiest expert's load over the mean load, over time: a heat map and
    one line per layer (1 is perfectly balanced)."""
    rows = [(r["step"], r["max_over_mean"]) for r in records
            if r.get("kind") == "train" and r.get("max_over_mean")]
    fig, (heat, lines) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    if rows:
        steps = np.asarray([s for s, _ in rows])
        load = np.asarray([[np.nan if v is None else v for v in values] for _, values in rows],
                          dtype=np.float64).T  # [layers, steps]
        image = heat.imshow(load, aspect="auto", interpolation="nearest", cmap="magma",
                            extent=(steps[0] - 0.5, steps[-1] + 0.5, load.shape[0] - 0.5, -0.5))
        fig.colorbar(image, ax=heat, label="max / mean load")
        heat.set_yticks(range(load.shape[0]))
        for layer, series in enumerate(load):
            lines.plot(steps, series, label=f"MoE layer {layer}", linewidth=1)
        lines.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        lines.legend(fontsize="small", ncol=2)
    heat.set_ylabel("MoE layer")
    heat.set_title(title)
    lines.set_xlabel("step")
    lines.set_ylabel("max / mean load")
    lines.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(runs: dict[str, dict[int, list[dict]]], path: str | os.PathLike,
                 title: str, caveat: str | None = None) -> None:
    """Each variant's curves, as the mean over its seeds with the min-max band shaded:
    validation loss against steps and against training time, training cross-entropy (EMA)
    and the dropped fraction (mean over the MoE layers, EMA) against steps. caveat: a line
    under the title (one seed: the differences may be noise)."""
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (by_step, by_time), (train, dropped) = axes
    for index, (name, by_seed) in enumerate(runs.items()):
        color = f"C{index}"

        def band(ax, xs, ys, style="-", smooth=False):
            """Mean and min-max over seeds of series cut to their common length."""
            length = min(len(y) for y in ys)
            if length == 0:
                return
            ys = np.asarray([_ema(y[:length]) if smooth else y[:length] for y in ys])
            x = np.mean([x[:length] for x in xs], axis=0)
            ax.plot(x, ys.mean(axis=0), style, color=color, label=name, markersize=3)
            if len(ys) > 1:
                ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.2)

        evals = [_series(records, "eval", "val_loss") for records in by_seed.values()]
        times = [_series(records, "eval", "elapsed_s")[1] for records in by_seed.values()]
        band(by_step, [s for s, _ in evals], [v for _, v in evals], "o-")
        band(by_time, times, [v for _, v in evals], "o-")
        ces = [_series(records, "train", "ce") for records in by_seed.values()]
        band(train, [s for s, _ in ces], [v for _, v in ces], smooth=True)
        drops = [[(r["step"], float(np.mean(r["dropped_fraction"]))) for r in records
                  if r.get("kind") == "train" and r.get("dropped_fraction")]
                 for records in by_seed.values()]
        band(dropped, [np.asarray([s for s, _ in d]) for d in drops],
             [np.asarray([v for _, v in d]) for d in drops], smooth=True)
    by_step.set_xlabel("step")
    by_step.set_ylabel("validation loss (nats / token)")
    by_time.set_xlabel("training time (s, without compile and evaluation)")
    by_time.set_ylabel("validation loss (nats / token)")
    train.set_xlabel("step")
    train.set_ylabel("training cross-entropy (EMA 0.9)")
    train.set_yscale("log")  # the first steps' 5.5 nats would flatten the rest
    dropped.set_xlabel("step")
    dropped.set_ylabel("dropped fraction of slots (EMA 0.9)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title + ("" if all(len(s) == 1 for s in runs.values())
                          else "  (mean over seeds; band: min to max)")
                 + ("" if caveat is None else f"\nCaveat: {caveat}"),
                 color="black" if caveat is None else "firebrick")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
