"""The training step's tail on one GPU: AdamW's update of a preset's parameters and the
statistics the step reports of it, timed alone with the state donated as the trainer donates
it. Five versions, each the trainer's own code:

- fused: `trainer.fused_adamw_update` (nodrop.ops.adamw: one engine call per parameter, which
  also sums the update's squares), after the gradients' `tree_stats`; the default;
- optax: the same step on optax (`--no-fused-adamw`): `tx.update`, `optax.apply_updates`, then
  `tree_stats` of the updates beside the new parameters;
- optax, update only: optax's update with the gradients' norm its clip needs and no other
  statistic (XLA's floor for this program);
- fused, widened in the step / fused, compute-dtype gradients: `fused` given the gradients as
  the training step computes them (the weights the model reads in bfloat16 have bfloat16
  gradients), widened to float32 inside the program as the step without
  `--compute-dtype-gradients` has them, or passed to the engine as they are (the default).

Writes a markdown table (median and min of --iters calls, ms) and counts each version's copies
and fusions in its optimized HLO.

    python3 bench/gpu_optimizer.py PRESET [PRESET...] --out DIR
"""
import argparse
import pathlib
import re
import statistics
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from nodrop.models import MoELM, cast_compute_weights  # noqa: E402
from nodrop.train import trainer  # noqa: E402
from nodrop.train.config import build  # noqa: E402


def versions(config):
    tx = trainer.optimizer(config)

    def fused(params, opt_state, grads):
        grad_stats = trainer.tree_stats(grads)
        params, opt_state, update_stats = trainer.fused_adamw_update(
            config, params, opt_state, grads, grad_stats.norm)
        return params, opt_state, (*grad_stats, *update_stats)

    def with_optax(params, opt_state, grads):
        grad_stats = trainer.tree_stats(grads)
        updates, opt_state = tx.update(grads, opt_state, params, grad_norm=grad_stats.norm)
        params = optax.apply_updates(params, updates)
        return params, opt_state, (*grad_stats, *trainer.tree_stats(updates, also=params))

    def update_only(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params,
                                       grad_norm=trainer.tree_stats(grads).norm)
        return optax.apply_updates(params, updates), opt_state, ()

    def widened(params, opt_state, grads):
        return fused(params, opt_state,
                     jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params))

    return {"fused": fused, "optax": with_optax, "optax, update only": update_only,
            "fused, widened in the step": widened, "fused, compute-dtype gradients": fused}, tx


def gradient_shapes(model_config):
    """The gradients' shapes and dtypes in the training step: each parameter's, in bfloat16
    where the model reads it only in bfloat16 (nodrop.models.cast_compute_weights)."""
    def cast_params():
        model = MoELM(model_config, rngs=nnx.Rngs(0))
        cast_compute_weights(model)
        return nnx.split(model, nnx.Param, ...)[1]

    return jax.eval_shape(cast_params)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# The step's tail (AdamW update + statistics), {jax.devices()[0].device_kind}", "",
             "| preset | parameters | version | ms (median) | min | copies in HLO | fusions |"
             " optax / version |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in args.presets:
        config, model_config = build({"preset": name})
        shapes = nnx.split(nnx.eval_shape(lambda: MoELM(model_config, rngs=nnx.Rngs(0))),
                           nnx.Param, ...)[1]
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
        counter = iter(range(1 << 30))
        make = lambda scale, like: jax.tree.map(
            lambda x: (jax.random.normal(jax.random.fold_in(jax.random.key(0), next(counter)),
                                         x.shape) * scale).astype(x.dtype), like)
        step_grads = gradient_shapes(model_config)
        fns, tx = versions(config)
        results, rows = {}, []
        for version, fn in fns.items():
            params = make(0.02, shapes)
            state = tx.init(params)
            grads = make(1e-4, step_grads if version.startswith("fused, ") else shapes)
            step = jax.jit(fn, donate_argnums=(0, 1))
            compiled = step.lower(params, state, grads).compile()
            hlo = compiled.as_text()
            copies = len(re.findall(r"= \S+ copy(-start)?\(", hlo))
            fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M))
            times = []
            for i in range(args.iters + 3):
                begin = time.perf_counter()
                params, state, metrics = compiled(params, state, grads)
                jax.block_until_ready((params, state, metrics))
                if i >= 3:
                    times.append((time.perf_counter() - begin) * 1e3)
            results[version] = statistics.median(times)
            rows.append((version, min(times), copies, fusions))
            print(f"{name} {version}: {results[version]:.2f} ms", flush=True)
            del params, state, grads
        for version, fastest, copies, fusions in rows:
            lines.append(f"| {name} | {count / 1e9:.2f}B | {version} | {results[version]:.2f} | "
                         f"{fastest:.2f} | {copies} | {fusions} | "
                         f"{results['optax'] / results[version]:.2f}x |")
    (out / "optimizer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
