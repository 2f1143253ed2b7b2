"""Expert parallelism on the GPUs of one host: scaling, exchange bandwidth, dropless under skew.

    python bench/ep_scaling.py --out DIR [--presets deepseek,qwen3] [--data PATH]
    python bench/ep_scaling.py --out DIR --dry-run     # the tiny preset on 8 host CPU devices

On N devices (every GPU of the host), four sections, each written to DIR/ep-scaling.{json,md}
as it finishes (DIR/ep-scaling.png: tokens/s per GPU against the EP degree):

1. scaling: `nodrop train` of each preset with the per-device batch fixed, on one device and on
   the meshes data=N/d,expert=d for d = 1 (pure data parallelism), 2, 4, ..., N: tokens/s per
   device (the timing records after the first interval), against the one-device run. Target: at
   EP=N at least 90% of one device's tokens/s per device.
2. exchange: one MoE layer's token exchange at EP=N (nodrop.parallel.expert's send_rows and
   return_rows, the bytes that leave each device), against a plain jax.lax.all_to_all of the same
   buffers on the same mesh, in GB/s per device. Target: at least 70% of the plain one.
3. skew: the EP=N MoE block (forward and backward) with uniform, Zipf-skewed and adversarial
   routing (every token to the experts of rank 0): the receive buffer grows 2 -> 4 -> worst case
   on overflow, as the trainer does; rows dropped (must be 0), reruns, each device's compiled
   memory against the worst-case buffer's, and the outputs and gradients against one device.
4. match: 50 training steps at EP=N against one device on the same global batch: the largest
   difference of the per-step losses.

Keep NVLink multicast off on shared machines (NCCL_NVLS_ENABLE=0, set here by default).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import nodrop
from nodrop.models import preset as preset_config
from nodrop.moe import MoEBlock
from nodrop.parallel import make_mesh
from nodrop.parallel.expert import pair_capacity, return_rows, send_rows
from timing import side_by_side

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

SCALING_TARGET = 0.90  # EP=N tokens/s per device over one device's
EXCHANGE_TARGET = 0.70  # the exchange's GB/s per device over a plain all_to_all's
ROUTINGS = ("uniform", "zipf", "every_token_to_rank_0")
BUFFER_FACTORS = (2.0, 4.0, None)  # the trainer's growth on overflow (trainer.EP_BUFFER_FACTORS)
# The largest per-step loss difference, over the loss, of the EP run against one device: float32
# (the dry run) differs by reduction order only; bf16 by its rounding, compounded over the steps.
MATCH_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
# The EP block's outputs and gradients against one device's, max |difference| over max |value|.
BLOCK_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Plan:
    presets: tuple[str, ...]
    batch_per_device: int
    seq_len: int | None  # None: the preset's
    steps: int
    match_steps: int
    data: str | None
    model_overrides: dict
    dry_run: bool = False  # host CPU devices: the code paths run, the targets are not judged

    def verdict(self, held: bool) -> str:
        return "not judged (dry run)" if self.dry_run else "PASS" if held else "FAIL"


def dry_run_plan() -> Plan:
    tiny = dict(num_layers=2, hidden=32, num_heads=2, num_kv_heads=1, head_dim=16, dense_ffn=64,
                num_experts=8, expert_ffn=32)
    return Plan(presets=("tiny",), batch_per_device=2, seq_len=32, steps=6, match_steps=6,
                data=None, model_overrides=tiny, dry_run=True)


# --- 1. scaling --------------------------------------------------------------------------------


def train(plan: Plan, preset: str, mesh: str | None, steps: int, out: pathlib.Path,
          global_batch: int | None = None) -> dict:
    """A `nodrop train` run; its tokens/s per device after the first timing interval, reruns,
    dropped fraction, or the error that stopped it."""
    from nodrop.train import trainer  # nodrop[train]: imported where a section needs it
    from nodrop.train.metrics import read_jsonl

    devices = 1 if mesh is None else len(jax.devices())
    overrides = dict(preset=preset, steps=steps, mesh=mesh, eval_every=steps, eval_batches=1,
                     checkpoint_every=0, log_every=max(1, steps // 5),
                     batch_size=global_batch or plan.batch_per_device * devices,
                     model_overrides=plan.model_overrides)
    if plan.seq_len is not None:
        overrides["seq_len"] = plan.seq_len
    if plan.data is not None:
        overrides["data"] = plan.data
    begin = time.perf_counter()
    try:
        summary = trainer.run(overrides, out=out, progress=False, echo=lambda *_: None)
    except Exception as error:  # out of memory (pure data parallelism), a failed collective
        return dict(status="error", detail=f"{type(error).__name__}: {str(error)[:300]}")
    records = read_jsonl(out / "metrics.jsonl")
    timing = [r for r in records if r["kind"] == "timing"]
    timing = timing[1:] or timing  # the first interval holds the first steps' warm-up
    seconds = sum(r["mean_step_time_s"] * r["steps"] for r in timing)
    tokens = sum(r["tokens_per_s"] * r["mean_step_time_s"] * r["steps"] for r in timing)
    return dict(status="ok", devices=devices, mesh=mesh, batch_size=overrides["batch_size"],
                tokens_per_s_per_device=tokens / seconds / devices,
                reruns=sum(r["kind"] == "ep_rerun" for r in records),
                dropped_fraction=summary.dropped_fraction, val_loss=summary.val_loss,
                losses=[r["loss"] for r in records if r["kind"] == "train"],
                wall_s=time.perf_counter() - begin)


def scaling(plan: Plan, out: pathlib.Path, report) -> None:
    n = len(jax.devices())
    degrees = [d for d in (2 ** i for i in range(int(math.log2(n)) + 1)) if n % d == 0]
    for preset in plan.presets:
        runs = {"1 device": train(plan, preset, None, plan.steps, out / preset / "one-device")}
        for d in degrees:
            mesh = f"data={n // d},expert={d}"
            runs[f"EP={d}"] = train(plan, preset, mesh, plan.steps, out / preset / f"ep{d}")
            print(f"[scaling] {preset} EP={d}: {describe(runs[f'EP={d}'])}", flush=True)
        one = runs["1 device"].get("tokens_per_s_per_device")
        for run in runs.values():
            if one and run["status"] == "ok":
                run["vs_one_device"] = run["tokens_per_s_per_device"] / one
        top = runs[f"EP={degrees[-1]}"].get("vs_one_device")
        report.add("scaling", preset, dict(
            runs=runs, target=SCALING_TARGET,
            verdict="FAIL" if top is None else plan.verdict(top >= SCALING_TARGET)))


def describe(run: dict) -> str:
    if run["status"] != "ok":
        return run["detail"]
    return (f"{run['tokens_per_s_per_device']:,.0f} tokens/s per device, reruns "
            f"{run['reruns']}, dropped {run['dropped_fraction']:.2%}")


# --- 2. exchange -------------------------------------------------------------------------------


def ep_presets(plan: Plan):
    """(devices, the mesh expert=devices, preset, its ModelConfig, sequence length) per preset."""
    n = len(jax.devices())
    mesh = make_mesh(f"expert={n}")
    for preset in plan.presets:
        model = preset_config(preset, **plan.model_overrides)
        yield n, mesh, preset, model, plan.seq_len or model.seq_len


def exchange(plan: Plan, report) -> None:
    for n, mesh, preset, model, seq in ep_presets(plan):
        rows = plan.batch_per_device * seq * model.k  # one device's permuted rows
        capacity = pair_capacity(rows, n, BUFFER_FACTORS[0])
        hidden, experts = model.hidden, model.num_experts
        # Balanced routing: each device's rows spread evenly over the experts.
        sizes = jnp.tile(jnp.full((experts,), rows // experts, jnp.int32).at[0].add(
            rows % experts), n)
        tokens = jax.random.normal(jax.random.key(0), (n * rows, hidden), model.dtype)
        spec = jax.P("expert")

        def round_trip(rows_, sizes_):
            received, _, ex = send_rows(rows_, sizes_, axis="expert", capacity=capacity,
                                        axes=("expert",))
            return return_rows(received, ex, rows_.shape[0], axis="expert")

        def plain(buffer):
            there = jax.lax.all_to_all(buffer, "expert", 0, 0, tiled=True)
            return jax.lax.all_to_all(there, "expert", 0, 0, tiled=True)

        ours = jax.jit(jax.shard_map(round_trip, mesh=mesh, in_specs=(spec, spec),
                                     out_specs=spec))
        baseline = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=spec, out_specs=spec))
        buffers = jnp.zeros((n * n * capacity, hidden), model.dtype)
        # Bytes that leave each device: both all-to-alls send (n - 1) of its n pair buffers.
        moved = 2 * (n - 1) * capacity * hidden * jnp.dtype(model.dtype).itemsize
        timed = side_by_side({"nodrop": (lambda: ours(tokens, sizes), jax.block_until_ready),
                              "all_to_all": (lambda: baseline(buffers), jax.block_until_ready)},
                             10)
        rate = {name: moved / seconds / 1e9 for name, (seconds, _) in timed.items()}
        ratio = rate["nodrop"] / rate["all_to_all"]
        print(f"[exchange] {preset}: {rate['nodrop']:.1f} GB/s per device against "
              f"{rate['all_to_all']:.1f} ({ratio:.2f})", flush=True)
        report.add("exchange", preset, dict(
            devices=n, rows_per_device=rows, pair_capacity=capacity, bytes_per_device=moved,
            ms={name: seconds * 1e3 for name, (seconds, _) in timed.items()},
            gb_per_s_per_device=rate, ratio=ratio, target=EXCHANGE_TARGET,
            verdict=plan.verdict(ratio >= EXCHANGE_TARGET)))


# --- 3. skew -----------------------------------------------------------------------------------


def routing_row(name: str, experts: int, n: int):
    """Router row 0 (every token's feature 0 is 1, so it biases every token's logits): None,
    Zipf weights, or a lead for every expert of rank 0."""
    if name == "uniform":
        return None
    if name == "zipf":
        return -1.5 * jnp.log(jnp.arange(1, experts + 1, dtype=jnp.float32))
    per_rank = experts // n
    return jnp.zeros((experts,), jnp.float32).at[:per_rank].set(
        8.0 - jnp.arange(per_rank, dtype=jnp.float32) / per_rank)


def skew(plan: Plan, report) -> None:
    for n, mesh, preset, model, seq in ep_presets(plan):
        config = dataclasses.replace(model.moe_config(), expert_parallel=True)
        x = jax.random.normal(jax.random.key(1), (plan.batch_per_device * n, seq, model.hidden),
                              jnp.float32).at[..., 0].set(1.0).astype(model.dtype)
        cotangent = jax.random.normal(jax.random.key(2), x.shape, model.dtype)
        cases = {}
        for routing in ROUTINGS:
            block = MoEBlock(config, rngs=nnx.Rngs(0))
            row = routing_row(routing, config.num_experts, n)
            if row is not None:
                block.router[...] = block.router[...].at[0].set(row)
            reference = block_step(block, config, x, cotangent, mesh=None)
            tried = []
            for factor in BUFFER_FACTORS:
                result = block_step(block, dataclasses.replace(config, ep_buffer_factor=factor),
                                    x, cotangent, mesh=mesh)
                tried.append(factor)
                if not result["overflow"]:
                    break
            worst = block_step(block, dataclasses.replace(config, ep_buffer_factor=None), x,
                               cotangent, mesh=mesh, memory_only=True)
            cases[routing] = dict(
                buffer_factor=tried[-1], reruns=len(tried) - 1,
                dropped_fraction=result["dropped_fraction"],
                temp_bytes_per_device=result["temp_bytes"],
                worst_case_temp_bytes_per_device=worst["temp_bytes"],
                output_error=relative_error(result["output"], reference["output"]),
                gradient_error=max(relative_error(a, b) for a, b in zip(
                    jax.tree.leaves(result["grads"]), jax.tree.leaves(reference["grads"]))))
            print(f"[skew] {preset} {routing}: {cases[routing]}", flush=True)
        tolerance = BLOCK_TOLERANCE[model.dtype.name]
        held = all(c["dropped_fraction"] == 0 and c["output_error"] <= tolerance
                   and c["gradient_error"] <= tolerance for c in cases.values())
        # Dropping nothing and matching one device hold on any devices: judged in a dry run too.
        report.add("skew", preset, dict(cases=cases, tolerance=tolerance,
                                        verdict="PASS" if held else "FAIL"))


def block_step(block, config, x, cotangent, *, mesh, memory_only=False) -> dict:
    """The block's output, aux and gradients (params and x) under jit, on `mesh` or one device;
    with the compiled step's temporary memory per device."""
    params = nnx.state(block, nnx.Param)
    graphdef, _, rest = nnx.split(MoEBlock(config, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32)), (y, aux)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = step.lower(params, x).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        if memory_only:
            return dict(temp_bytes=temp)
        (_, (y, aux)), grads = compiled(params, x)
    return dict(output=y, grads=grads, overflow=bool(aux.overflow),
                dropped_fraction=float(aux.dropped_fraction), temp_bytes=temp)


def relative_error(actual, expected) -> float:
    actual, expected = (jnp.asarray(a, jnp.float32) for a in (actual, expected))
    return float(jnp.max(jnp.abs(actual - expected)) / max(float(jnp.max(jnp.abs(expected))),
                                                           1e-30))


# --- 4. match ----------------------------------------------------------------------------------


def match(plan: Plan, out: pathlib.Path, report) -> None:
    n = len(jax.devices())
    steps = plan.match_steps
    for preset in plan.presets:
        batch = plan.batch_per_device * n
        one = train(plan, preset, None, steps, out / preset / "match-one-device", batch)
        ep = train(plan, preset, f"expert={n}", steps, out / preset / "match-ep", batch)
        if one["status"] != "ok" or ep["status"] != "ok":
            report.add("match", preset, dict(one_device=one, ep=ep, verdict="FAIL"))
            continue
        relative = max(abs(a - b) / abs(a) for a, b in zip(one["losses"], ep["losses"]))
        tolerance = MATCH_TOLERANCE[preset_config(preset, **plan.model_overrides).dtype.name]
        print(f"[match] {preset}: largest relative loss difference over {steps} steps "
              f"{relative:.2e} (tolerance {tolerance:.0e})", flush=True)
        report.add("match", preset, dict(
            steps=steps, global_batch=batch, max_relative_loss_difference=relative,
            tolerance=tolerance, final_losses=[one["losses"][-1], ep["losses"][-1]],
            verdict="PASS" if relative <= tolerance else "FAIL"))  # also on host devices


# --- the report --------------------------------------------------------------------------------


class Report:
    """The sections' results, rewritten to DIR after each one (a run cut short keeps them)."""

    def __init__(self, out: pathlib.Path, header: dict):
        self.out, self.results = out, {"header": header}

    def add(self, section: str, preset: str, result: dict) -> None:
        self.results.setdefault(section, {})[preset] = result
        (self.out / "ep-scaling.json").write_text(json.dumps(self.results, indent=1,
                                                             default=str))
        (self.out / "ep-scaling.md").write_text(markdown(self.results))
        if section == "scaling":
            plot(self.results["scaling"], self.out / "ep-scaling.png")


def markdown(results: dict) -> str:
    header = results["header"]
    lines = [f"# Expert parallelism on {header['devices']} x {header['device']}\n",
             f"{header['versions']}; NCCL_NVLS_ENABLE={header['nvls']}\n"]
    for preset, result in results.get("scaling", {}).items():
        lines += [f"## Scaling: {preset} (per-device batch fixed; EP=N target "
                  f"{SCALING_TARGET:.0%} of one device: {result['verdict']})\n",
                  "| run | mesh | tokens/s per device | vs one device | reruns | dropped |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for name, run in result["runs"].items():
            if run["status"] != "ok":
                lines.append(f"| {name} | | {run['detail'][:80]} | | | |")
                continue
            vs = run.get("vs_one_device")
            lines.append(f"| {name} | {run['mesh'] or '-'} | {run['tokens_per_s_per_device']:,.0f}"
                         f" | {'' if vs is None else f'{vs:.2f}'} | {run['reruns']} | "
                         f"{run['dropped_fraction']:.2%} |")
        lines.append("")
    if "exchange" in results:
        lines += [f"## Exchange (GB/s per device; target {EXCHANGE_TARGET:.0%} of "
                  "jax.lax.all_to_all)\n", "| preset | nodrop | all_to_all | ratio | verdict |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for preset, r in results["exchange"].items():
            lines.append(f"| {preset} | {r['gb_per_s_per_device']['nodrop']:.1f} | "
                         f"{r['gb_per_s_per_device']['all_to_all']:.1f} | {r['ratio']:.2f} | "
                         f"{r['verdict']} |")
        lines.append("")
    for preset, result in results.get("skew", {}).items():
        lines += [f"## Skew: {preset} (nothing dropped, errors within {result['tolerance']:.0e}: "
                  f"{result['verdict']})\n",
                  "| routing | buffer factor | reruns | dropped | temp MiB per device | worst "
                  "case MiB | output error | gradient error |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for routing, c in result["cases"].items():
            lines.append(f"| {routing} | {c['buffer_factor'] or 'worst'} | {c['reruns']} | "
                         f"{c['dropped_fraction']:.2%} | {c['temp_bytes_per_device'] / 2**20:.1f}"
                         f" | {c['worst_case_temp_bytes_per_device'] / 2**20:.1f} | "
                         f"{c['output_error']:.1e} | {c['gradient_error']:.1e} |")
        lines.append("")
    for preset, r in results.get("match", {}).items():
        if "max_relative_loss_difference" in r:
            lines.append(f"Match, {preset}: {r['steps']} steps at EP={header['devices']} against "
                         f"one device, global batch {r['global_batch']}: largest per-step loss "
                         f"difference over the loss {r['max_relative_loss_difference']:.2e} "
                         f"(tolerance {r['tolerance']:.0e}): {r['verdict']}.")
        else:
            lines.append(f"Match, {preset}: a run failed: {r}")
    return "\n".join(lines) + "\n"


def plot(scaling: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for preset, result in scaling.items():
        points = [(int(name[3:]), run["tokens_per_s_per_device"])
                  for name, run in result["runs"].items()
                  if name.startswith("EP=") and run["status"] == "ok"]
        if points:
            line, = ax.plot(*zip(*points), marker="o", label=preset)
            one = result["runs"]["1 device"]
            if one["status"] == "ok":
                ax.axhline(one["tokens_per_s_per_device"], color=line.get_color(),
                           linestyle=":", label=f"{preset}, one device")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("expert-parallel degree (data x expert = all devices)")
    ax.set_ylabel("tokens/s per device")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--presets", default="deepseek,qwen3")
    parser.add_argument("--batch-per-device", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each scaling run")
    parser.add_argument("--data", default=None, help="training data (default: the trainer's)")
    parser.add_argument("--sections", default="scaling,exchange,skew,match")
    parser.add_argument("--dry-run", action="store_true",
                        help="the tiny preset, small, on 8 host CPU devices: the code paths only")
    args = parser.parse_args(argv)
    if args.dry_run:  # before JAX starts its backends
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    plan = dry_run_plan() if args.dry_run else Plan(
        presets=tuple(args.presets.split(",")), batch_per_device=args.batch_per_device,
        seq_len=None, steps=args.steps, match_steps=50, data=args.data, model_overrides={})
    args.out.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    report = Report(args.out, dict(
        devices=len(devices), device=devices[0].device_kind, nvls=os.environ["NCCL_NVLS_ENABLE"],
        versions=f"jax {jax.__version__}, nodrop {nodrop.__version__}, python "
                 f"{sys.version.split()[0]}", argv=sys.argv, plan=dataclasses.asdict(plan)))
    sections = args.sections.split(",")
    if "scaling" in sections:
        scaling(plan, args.out / "runs", report)
    if "exchange" in sections:
        exchange(plan, report)
    if "skew" in sections:
        skew(plan, report)
    if "match" in sections:
        match(plan, args.out / "runs", report)
    failed = [f"{section} {preset}" for section, by_preset in report.results.items()
              if section != "header" for preset, r in by_preset.items()
              if r.get("verdict") == "FAIL"]
    print("failed: " + ", ".join(failed) if failed else "every target held", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
