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


def plot_compare(runs: dict[str, list[dict]], path: str | os.PathLike, title: str) -> None:
    """Validation loss of each run against steps and against training wall time."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, records in runs.items():
        evals = [r for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
        steps = [r["step"] for r in evals]
        seconds = [r["elapsed_s"] for r in evals]
        losses = [r["val_loss"] for r in evals]
        by_step.plot(steps, losses, "o-", label=name)
        by_time.plot(seconds, losses, "o-", label=name)
    by_step.set_xlabel("step")
    by_step.set_ylabel("validation loss (nats / token)")
    by_time.set_xlabel("training time (s, without compile and evaluation)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
