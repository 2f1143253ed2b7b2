"""`nodrop compare`: one model trained dropless and with capacity factors (token dropping),
optionally with jax.lax.ragged_dot as the dropless matmul or dropless on FP8 recipes, for one
seed or several; a markdown
table with the spread across seeds, and plots of the whole validation curves against steps and
against training time, with the dropped fraction over time.

Every run is a full `nodrop train` run in `<out>/<variant>/seed-<seed>/`. The runs of one seed
read the same batches from the same initial weights: they differ only in how the MoE layers
dispatch tokens (or, with FP8 recipes, in the precision of the experts' matmuls). So a difference is judged seed by seed (paired), against the seed-to-seed spread.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from nodrop.moe.block import DEFAULT_FP8_WEIGHT_GRADIENT
from nodrop.train import data, plots, trainer
from nodrop.train.config import ConfigError, build
from nodrop.train.metrics import read_jsonl

DEFAULT_CAPACITY_FACTORS = (1.0, 1.25)
# Evaluations per run when --eval-every is not given: enough points for whole curves.
DEFAULT_EVALUATIONS = 20
# Said in compare.md, on compare.png and on the console when a comparison has one seed.
ONE_SEED_CAVEAT = ("one seed: a difference between the variants may be seed noise (on short "
                   "runs it often is); give --seeds 0 1 2 for the spread")


# How a variant's name and folder say its weight gradient, where it is not the default.
WEIGHT_GRADIENT_LABELS = {"fp8": ("FP8 weight gradients", "fp8-wgrad"),
                          "unquantised": ("unquantised weight gradients", "unquantised-wgrad")}


def variants(capacity_factors, with_ragged_dot: bool, fp8_recipes=(),
             fp8_weight_gradients=(DEFAULT_FP8_WEIGHT_GRADIENT,)) -> list[tuple[str, str, dict]]:
    """(name, sub-folder, model overrides) of each run, dropless first; each FP8 recipe once per
    weight gradient."""
    out = [("dropless (nodrop)", "dropless", {"capacity_factor": None, "moe_matmul": "nodrop"})]
    for recipe in fp8_recipes:
        for weight_gradient in fp8_weight_gradients:
            name, folder = f"dropless (nodrop, FP8 {recipe}", f"dropless-fp8-{recipe}"
            if weight_gradient != DEFAULT_FP8_WEIGHT_GRADIENT:
                label, suffix = WEIGHT_GRADIENT_LABELS[weight_gradient]
                name, folder = f"{name}, {label}", f"{folder}-{suffix}"
            out.append((name + ")", folder,
                        {"capacity_factor": None, "moe_matmul": "nodrop", "fp8": recipe,
                         "fp8_weight_gradient": weight_gradient}))
    if with_ragged_dot:
        out.append(("dropless (jax.lax.ragged_dot)", "dropless-ragged-dot",
                    {"capacity_factor": None, "moe_matmul": "ragged_dot"}))
    out += [(f"capacity factor {float(cf)}", f"capacity-{float(cf)}",
             {"capacity_factor": float(cf)}) for cf in capacity_factors]
    return out


def run(overrides: dict, out: str | os.PathLike, *,
        capacity_factors=DEFAULT_CAPACITY_FACTORS, with_ragged_dot: bool = False,
        fp8_recipes=(), fp8_weight_gradients=(DEFAULT_FP8_WEIGHT_GRADIENT,), seeds=None,
        progress: bool | None = None, echo=print) -> dict[str, dict[int, trainer.Summary]]:
    """Trains every variant for every seed (default: the `seed` of `overrides`, else 0) into
    `out`/<variant>/seed-<seed>/ and writes compare.md, compare.json and compare.png there.
    Returns {variant name: {seed: Summary}}. Every configuration is validated before the first
    run starts."""
    out = Path(out)
    if seeds is None:
        seeds = [overrides.get("seed", 0)]
    seeds = list(seeds)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must not repeat a seed, got {seeds}")
    base = dict(overrides)
    if "eval_every" not in base:
        base["eval_every"] = max(1, build(base)[0].steps // DEFAULT_EVALUATIONS)
    chosen = variants(capacity_factors, with_ragged_dot, fp8_recipes, fp8_weight_gradients)
    if len(chosen) == 1:
        raise ConfigError("nothing to compare dropless with: give capacity factors, "
                          "--fp8-recipes or --with-ragged-dot")
    runs = []
    for name, folder, model in chosen:
        for seed in seeds:
            fields = {**base, "seed": seed, "model_overrides": {
                **base.get("model_overrides", {}), **model}}
            build(fields)  # validated now, not after hours of other runs
            runs.append((name, seed, out / folder / f"seed-{seed}", fields))
    first = build(runs[0][3])
    dataset = data.load(first[0].data, None, echo=echo)
    tokens, _, resolved, _ = trainer.load_data(*first, dataset=dataset, echo=echo)
    data.check_length(tokens, resolved.seq_len)
    if "vocab_size" in resolved.model_overrides:  # every run the same vocabulary, recorded
        vocabulary = {"vocab_size": resolved.model_overrides["vocab_size"]}
        runs = [(name, seed, run_dir, {**fields, "model_overrides": {
            **fields.get("model_overrides", {}), **vocabulary}})
            for name, seed, run_dir, fields in runs]

    results: dict[str, dict[int, trainer.Summary]] = {}
    for name, seed, run_dir, fields in runs:
        summary = finished_run(run_dir, fields)
        if summary is None:
            echo(f"nodrop compare: {name}, seed {seed} -> {run_dir}")
            # A folder a stopped comparison left half-trained continues (or restarts).
            resume = (run_dir / trainer.CONFIG_FILE).exists()
            summary = trainer.run(fields, out=run_dir, resume=resume, progress=progress,
                                  dataset=dataset)
        else:
            echo(f"nodrop compare: {name}, seed {seed}: finished before in {run_dir}")
        echo(f"  validation loss {summary.val_loss:.4f}, {summary.tokens_per_s:,.0f} tokens/s, "
             f"dropped {summary.dropped_fraction:.2%}")
        results.setdefault(name, {})[seed] = summary

    records = {name: {seed: read_jsonl(Path(s.run_dir) / "metrics.jsonl")
                      for seed, s in by_seed.items()} for name, by_seed in results.items()}
    config = first[0]
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"
    title = (f"{config.preset}: {config.steps} steps of {config.batch_size} x {config.seq_len} "
             f"tokens, {seed_text}")
    plots.plot_compare(records, out / "compare.png", title,
                       caveat=ONE_SEED_CAVEAT if len(seeds) == 1 else None)
    if len(seeds) == 1:
        echo(f"nodrop compare: caveat: {ONE_SEED_CAVEAT}")
    stats = statistics(results, records)
    (out / "compare.md").write_text(table(results, stats, title))
    (out / "compare.json").write_text(json.dumps(
        {name: {"seeds": {str(seed): s.to_dict() for seed, s in by_seed.items()},
                **stats[name]} for name, by_seed in results.items()}, indent=2) + "\n")
    return results


def finished_run(run_dir: Path, fields: dict) -> trainer.Summary | None:
    """The Summary of the run in `run_dir` if it finished with exactly these settings (the
    comparison was stopped and started again with the same --out); None if it did not finish.
    A finished run of other settings is refused: it is not this comparison's."""
    summary = run_dir / trainer.SUMMARY_FILE
    if not summary.exists():
        return None
    config, model = build(fields)
    try:
        saved = json.loads((run_dir / trainer.CONFIG_FILE).read_text())
        values = json.loads(summary.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{run_dir}: cannot read the finished run ({error})") from None
    wanted = json.loads(json.dumps({"train": config.to_dict(), "model": model.to_dict()}))
    if {key: saved.get(key) for key in wanted} != wanted:
        raise ConfigError(f"{run_dir} holds a finished run of other settings; give another --out")
    return trainer.Summary(**{**values, "run_dir": str(run_dir.absolute())})


def val_loss_at_time(records: list[dict], seconds: float) -> float | None:
    """The validation loss a run had reached after `seconds` of training time, interpolated
    linearly between its evaluations (None before its first one)."""
    evals = [(r["elapsed_s"], r["val_loss"]) for r in records
             if r.get("kind") == "eval" and r.get("val_loss") is not None]
    if not evals or seconds < evals[0][0]:
        return None
    times, losses = zip(*evals)
    return float(np.interp(seconds, times, losses))


def run_mfu(records: list[dict], summary: trainer.Summary) -> float | None:
    """The run's model FLOPs utilisation over all its steps, against the device's bf16 peak
    (FP8 runs too): its timing records' FLOPs per token over the peak, times the Summary's
    tokens/s. None where the trainer knows no peak for the device (the CPU)."""
    timing = next((r for r in records if r.get("kind") == "timing" and r.get("mfu")), None)
    if timing is None:
        return None
    return timing["mfu"] / timing["tokens_per_s"] * summary.tokens_per_s


def statistics(results, records) -> dict[str, dict]:
    """Per variant: final validation loss (mean and half-range over seeds), the validation
    loss at equal training time (the time the quickest variant took for all its steps), and,
    for every variant but the first, the per-seed difference to the first and a verdict."""
    names = list(results)
    seeds = list(results[names[0]])
    equal_time = min(s.train_time_s for by_seed in results.values() for s in by_seed.values())
    stats = {}
    for name in names:
        finals = np.asarray([results[name][seed].val_loss for seed in seeds])
        at_time = [val_loss_at_time(records[name][seed], equal_time) for seed in seeds]
        mfu = [run_mfu(records[name][seed], results[name][seed]) for seed in seeds]
        stats[name] = {
            "val_loss_mean": float(finals.mean()),
            "val_loss_half_range": float((finals.max() - finals.min()) / 2),
            "equal_time_s": equal_time,
            "val_loss_at_equal_time": at_time,
            "mfu": None if None in mfu else _mean(mfu),
        }
    reference = names[0]
    for name in names[1:]:
        diffs = [results[name][seed].val_loss - results[reference][seed].val_loss
                 for seed in seeds]
        stats[name]["difference_to_" + _key(reference)] = diffs
        stats[name]["verdict"] = verdict(diffs, stats[name]["val_loss_half_range"],
                                         stats[reference]["val_loss_half_range"])
    return stats


def verdict(diffs: list[float], *half_ranges: float) -> str:
    """Whether paired differences (this run minus the reference, one per seed) are outside the
    noise: every seed must agree on the sign and the mean difference must exceed the
    seed-to-seed half-range of both runs. One seed gives no estimate of the noise."""
    mean = float(np.mean(diffs))
    if len(diffs) < 2:
        return "one seed: no estimate of the noise"
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    noise = max(half_ranges)
    if same_sign and abs(mean) > noise:
        return f"{'higher' if mean > 0 else 'lower'} on every seed, beyond the seed spread ({noise:.4f})"
    return f"inside the noise (seed spread {noise:.4f})"


def _key(name: str) -> str:
    return name.split(" (")[0].replace(" ", "_")


def _mean(values) -> float:
    return float(np.mean(values))


def table(results, stats, title: str) -> str:
    names = list(results)
    seeds = list(results[names[0]])
    equal_time = stats[names[0]]["equal_time_s"]
    with_mfu = all(stats[name]["mfu"] is not None for name in names)
    lines = [f"# nodrop compare: {title}", "",
             "| run | final val loss | per seed | val loss at "
             f"{equal_time:.0f} s | vs {names[0]} | final train loss | tokens/s | "
             + ("MFU (bf16 peak) | " if with_mfu else "")
             + "dropped fraction | training time (s) | compile (s) | wall time (s) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | " + ("---: | " if with_mfu else "")
             + "---: | ---: | ---: | ---: |"]
    for name in names:
        runs, s = [results[name][seed] for seed in seeds], stats[name]
        spread = f" ± {s['val_loss_half_range']:.4f}" if len(seeds) > 1 else ""
        at_time = [v for v in s["val_loss_at_equal_time"] if v is not None]
        diffs = s.get("difference_to_" + _key(names[0]))
        cells = [name, f"{s['val_loss_mean']:.4f}{spread}",
                 ", ".join(f"{r.val_loss:.4f}" for r in runs),
                 f"{_mean(at_time):.4f}" if at_time else "—",
                 f"{_mean(diffs):+.4f}" if diffs else "—",
                 f"{_mean([r.train_loss for r in runs]):.4f}",
                 f"{_mean([r.tokens_per_s for r in runs]):,.0f}",
                 *([f"{s['mfu']:.1%}"] if with_mfu else []),
                 f"{_mean([r.dropped_fraction for r in runs]):.2%}",
                 f"{_mean([r.train_time_s for r in runs]):.1f}",
                 f"{_mean([r.compile_s for r in runs]):.1f}",
                 f"{_mean([r.wall_s for r in runs]):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if len(seeds) == 1:
        lines += ["", f"**Caveat: {ONE_SEED_CAVEAT}.**"]
    lines += ["", f"Against {names[0]}, seed by seed (same weights and batches):"]
    for name in names[1:]:
        diffs = stats[name]["difference_to_" + _key(names[0])]
        lines.append(f"- {name}: {', '.join(f'{d:+.4f}' for d in diffs)} "
                     f"(mean {_mean(diffs):+.4f}); {stats[name]['verdict']}.")
    unigram = results[names[0]][seeds[0]].unigram_loss
    lines += ["", "Final val loss: mean over the seeds ± half their range. Val loss at "
              f"{equal_time:.0f} s: at equal training time, the time the quickest run took for "
              "all its steps, interpolated between evaluations. A difference is called outside "
              "the noise only when every seed agrees on its sign and its mean exceeds the "
              f"seed-to-seed half-range of both runs. Unigram baseline (entropy of the training "
              f"split's token frequencies): {unigram:.4f} nats. Dropped fraction: the share of "
              "(token, expert) slots that reached no expert, averaged over layers and steps. "
              "Tokens/s and training time count the steps only (no compile, evaluation or "
              "checkpoints), over all of a run's steps"
              + ("; MFU counts the model's FLOPs against the device's bf16 peak, for FP8 runs "
                 "too" if with_mfu else "")
              + "; compile and wall time are those of the "
              "process that finished the run (of its last part, for a run resumed after a "
              "stop). Curves: compare.png.", ""]
    return "\n".join(lines)
