"""`nodrop compare`: one model and seed trained dropless and with capacity factors (token
dropping), optionally with jax.lax.ragged_dot as the dropless matmul; a markdown table and a plot
of validation loss against steps and against training time.

Every variant is a full `nodrop train` run in its own sub-folder of the output folder, reading
the same batches (same seed, same data) from the same initial weights: the runs differ only in
how the MoE layers dispatch tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nodrop.train import data, plots, trainer
from nodrop.train.config import build
from nodrop.train.metrics import read_jsonl

DEFAULT_CAPACITY_FACTORS = (1.0, 1.25)


def variants(capacity_factors, with_ragged_dot: bool) -> list[tuple[str, str, dict]]:
    """(name, sub-folder, model overrides) of each run, dropless first."""
    out = [("dropless (nodrop)", "dropless", {"capacity_factor": None, "moe_matmul": "nodrop"})]
    if with_ragged_dot:
        out.append(("dropless (jax.lax.ragged_dot)", "dropless-ragged-dot",
                    {"capacity_factor": None, "moe_matmul": "ragged_dot"}))
    out += [(f"capacity factor {float(cf)}", f"capacity-{float(cf)}",
             {"capacity_factor": float(cf)}) for cf in capacity_factors]
    return out


def run(overrides: dict, out: str | os.PathLike, *,
        capacity_factors=DEFAULT_CAPACITY_FACTORS, with_ragged_dot: bool = False,
        progress: bool | None = None, echo=print) -> list[tuple[str, trainer.Summary]]:
    """Trains every variant into `out`/<variant>/ and writes compare.md, compare.json and
    compare.png there. Each configuration is validated before the first run starts."""
    out = Path(out)
    runs = variants(capacity_factors, with_ragged_dot)
    configs = []
    for name, folder, model in runs:
        fields = {**overrides, "model_overrides": {**overrides.get("model_overrides", {}),
                                                   **model}}
        configs.append((name, folder, fields, build(fields)))
    model_config = configs[0][3][1]
    dataset = data.load(configs[0][3][0].data, model_config.vocab_size)
    data.check_length(dataset, configs[0][3][0].seq_len)

    results = []
    for name, folder, fields, _ in configs:
        echo(f"nodrop compare: {name} -> {out / folder}")
        summary = trainer.run(fields, out=out / folder, progress=progress, dataset=dataset)
        echo(f"  validation loss {summary.val_loss:.4f}, {summary.tokens_per_s:,.0f} tokens/s, "
             f"dropped {summary.dropped_fraction:.2%}")
        results.append((name, summary))

    records = {name: read_jsonl(Path(summary.run_dir) / "metrics.jsonl")
               for name, summary in results}
    config = configs[0][3][0]
    title = (f"{config.preset}: {config.steps} steps of {config.batch_size} x {config.seq_len} "
             f"tokens, seed {config.seed}")
    plots.plot_compare(records, out / "compare.png", title)
    (out / "compare.md").write_text(table(results, title))
    (out / "compare.json").write_text(json.dumps(
        {name: summary.to_dict() for name, summary in results}, indent=2) + "\n")
    return results


def table(results: list[tuple[str, trainer.Summary]], title: str) -> str:
    lines = [f"# nodrop compare: {title}", "",
             "| run | final val loss | final train loss | tokens/s | dropped fraction | "
             "training time (s) | compile (s) | wall time (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in results:
        lines.append(f"| {name} | {s.val_loss:.4f} | {s.train_loss:.4f} | "
                     f"{s.tokens_per_s:,.0f} | {s.dropped_fraction:.2%} | "
                     f"{s.train_time_s:.1f} | {s.compile_s:.1f} | {s.wall_s:.1f} |")
    unigram = results[0][1].unigram_loss
    lines += ["", f"Unigram baseline (entropy of the training split's token frequencies): "
              f"{unigram:.4f} nats. Dropped fraction: the share of (token, expert) slots that "
              "reached no expert, averaged over layers and steps. Training time counts the "
              "steps only (no compile, evaluation or checkpoints); wall time is the whole run. "
              "Validation loss against steps and against training time: compare.png.", ""]
    return "\n".join(lines)
