"""The training step's tail on one GPU: AdamW's update of a preset's parameters and the metrics
the step reports of it (gradient and update norms, finiteness checks), timed alone with the
state donated as the trainer donates it, in three versions:

- before: the trainer until 2026-12-06 (optax.clip_by_global_norm; each norm a max pass, then
  a scaled sum of squares; the finiteness checks separate reductions), written out here;
- after: the trainer's own functions (nodrop.train.trainer: tree_stats, one variadic reduction
  per leaf, of the gradients, shared with the clip, and of the updates beside the updated
  parameters; the moments' finiteness follows from the gradients');
- after, no update stats: after without the updates' pass (what it costs);
- update only: the optax update without any metric (the floor).

Also writes each version's optimized HLO and counts its copies and fusions.

    python3 tail_bench.py PRESET [PRESET...] --out DIR
"""
import argparse
import pathlib
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from nodrop.models import MoELM  # noqa: E402
from nodrop.train import trainer  # noqa: E402
from nodrop.train.config import build  # noqa: E402


def old_norm(tree):
    leaves = jax.tree.leaves(tree)
    largest = jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in leaves]))
    scale = jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)
    return scale * jnp.sqrt(sum(jnp.sum(jnp.square(leaf / scale)) for leaf in leaves))


def old_all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                              if jnp.issubdtype(leaf.dtype, jnp.floating)]))


def old_optimizer(config):
    adamw = optax.adamw(
        trainer.learning_rate_schedule(config), b1=config.beta1, b2=config.beta2,
        eps=config.adam_eps, weight_decay=config.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)


def tails(config):
    new_tx, old_tx = trainer.optimizer(config), old_optimizer(config)

    def before(params, opt_state, grads):
        updates, opt_state = old_tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, (old_norm(grads), old_norm(updates), old_all_finite(grads),
                                   old_all_finite((params, opt_state)))

    def after(params, opt_state, grads):  # as trainer.make_steps' train_step
        grad_stats = trainer.tree_stats(grads)
        updates, opt_state = new_tx.update(grads, opt_state, params, grad_norm=grad_stats.norm)
        params = optax.apply_updates(params, updates)
        update_stats = trainer.tree_stats(updates, also=params)
        return params, opt_state, (grad_stats.norm, update_stats.norm, grad_stats.finite,
                                   update_stats.finite & grad_stats.finite
                                   & grad_stats.squares_finite)

    def after_no_update_stats(params, opt_state, grads):
        grad_stats = trainer.tree_stats(grads)
        updates, opt_state = new_tx.update(grads, opt_state, params, grad_norm=grad_stats.norm)
        return optax.apply_updates(params, updates), opt_state, tuple(grad_stats)

    def update_only(params, opt_state, grads):
        updates, opt_state = old_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ()

    return {"before": (before, old_tx), "after": (after, new_tx),
            "after, no update stats": (after_no_update_stats, new_tx),
            "update only": (update_only, old_tx)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# The step's tail (AdamW update + metrics), {jax.devices()[0].device_kind}", "",
             "| preset | parameters | version | ms (median) | min | copies in HLO | fusions |"
             " vs update only |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in args.presets:
        config, model_config = build({"preset": name})
        params = nnx.split(nnx.eval_shape(lambda: MoELM(model_config, rngs=nnx.Rngs(0))),
                           nnx.Param, ...)[1]
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        counter = iter(range(1 << 30))
        make = lambda shapes, scale: jax.tree.map(
            lambda x: jax.random.normal(jax.random.fold_in(jax.random.key(0), next(counter)),
                                        x.shape, x.dtype) * scale, shapes)
        results = {}
        for version, (fn, tx) in tails(config).items():
            p = make(params, 0.02)
            state = tx.init(p)
            grads = make(params, 1e-4)
            step = jax.jit(fn, donate_argnums=(0, 1))
            compiled = step.lower(p, state, grads).compile()
            hlo = compiled.as_text()
            (out / f"{name}-{re.sub('[^a-z]+', '-', version)}.hlo.txt").write_text(hlo)
            copies = len(re.findall(r"= \S+ copy(-start)?\(", hlo))
            fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M))
            times = []
            for i in range(args.iters + 3):
                begin = time.perf_counter()
                p, state, metrics = compiled(p, state, grads)
                jax.block_until_ready((p, state, metrics))
                if i >= 3:
                    times.append((time.perf_counter() - begin) * 1e3)
            results[version] = statistics.median(times)
            lines.append(f"| {name} | {count / 1e9:.2f}B | {version} | {results[version]:.2f} | "
                         f"{min(times):.2f} | {copies} | {fusions} | "
                         f"{{ratio_{version}}} |")
            print(lines[-1], flush=True)
            del p, state, grads
        floor = results["update only"]
        lines[-4:] = [line.format(**{f"ratio_{v}": f"{t / floor:.2f}x" for v, t in results.items()})
                      for line in lines[-4:]]
    (out / "tail.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
