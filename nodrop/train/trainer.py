"""The training job: configure, load data, build or restore the state, then step, evaluate,
checkpoint and log until `steps`, and summarise.

One process, on one device (the default one) or on a mesh over every device (--mesh,
nodrop.parallel.make_mesh); or several processes (nodrop.parallel.distributed) on a mesh over
all their devices, each reading its own batch rows, process 0 alone writing the run folder. The state is three pytrees split off the Flax NNX model: params
(float32 masters, trained by AdamW), model_state (the MoE layers' expert biases, moved by the
aux-loss-free rule, not by gradients) and the optimizer state. The jitted step takes and returns
them with their buffers donated; on a mesh they carry the NamedShardings the parameters'
logical axis names map to (nodrop.parallel.state_shardings) and the batch is split over data x fsdp x expert.

Expert parallelism's receive buffers are bounded (ModelConfig.ep_buffer_factor). A step whose
buffers overflow changes nothing, decided on the device, and so does every step queued after it
until the host, reading the metrics, notices: it then recompiles with the next factor of
EP_BUFFER_FACTORS, keeps it, and reruns from the overflowing step's batch.

Step n (1-based) reads batch `data.train_batch(train, n, seed, ...)`, so the data position is
the step number; a checkpoint at step n holds the state after n updates, and a resumed run goes
on with step n + 1 exactly as an uninterrupted run would.

Read from `run`: `_run` sets up, `_train` is the loop (`_step`, `_flush`, `_validate`, `_save`)
and `_finish` summarises. The loop's functions share two objects, passed in: `_Job`, what stays
fixed, and `_State`, what changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nodrop
from nodrop.models import ModelConfig, MoELM, cast_compute_weights
from nodrop.moe import updated_expert_bias
from nodrop.ops.adamw import NUM_SUMS, AdamWStep, adamw_update
from nodrop.parallel import (check_batch, check_experts, distributed, make_mesh,
                             state_shardings)
from nodrop.parallel.mesh import token_axes
from nodrop.train import data, environment, lock, plots, tokenizer
from nodrop.train.checkpoint import CheckpointError, Checkpoints, NoCheckpoints
from nodrop.train.config import RESUMABLE_CHANGES, ConfigError, TrainConfig, build
from nodrop.train.metrics import MetricsLog, Progress, Quiet, Records, peak_flops

CONFIG_FILE = "config.json"
# The receive-buffer factors an overflowing run grows through; None: the worst case, which
# cannot overflow.
EP_BUFFER_FACTORS = (2.0, 4.0, None)
SUMMARY_FILE = "summary.json"
# --profile's trace, where TensorBoard's profile plugin finds it beside the run's scalars.
PROFILE_DIR = "tensorboard"


class Diverged(RuntimeError):
    """The loss, the gradients or the updated state stopped being finite; the run stopped
    without saving that state."""


class WriteFailed(RuntimeError):
    """Writing the run folder failed (a full disk, lost permissions): the run stopped, and its
    newest complete checkpoint is where --resume continues."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM: the run saved a checkpoint of its last finished step and stopped (or,
    on a second signal, stopped at once without saving)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


@dataclasses.dataclass
class Summary:
    """A finished run. tokens_per_s and train_time_s cover every step of the run, in this
    process and, resumed, in those before it; compile_s, wall_s and process_train_time_s cover
    this process only, which trained the steps after resumed_from_step."""

    run_dir: str  # absolute
    steps: int
    train_loss: float  # evaluated at the end on evenly spaced training windows
    val_loss: float
    unigram_loss: float  # entropy of the training split's token frequencies (nats)
    tokens_per_s: float  # training steps only, all of them
    train_time_s: float  # training steps only (no compile, evaluation or checkpoints), all
    compile_s: float  # this process
    wall_s: float  # this process, from start to end
    dropped_fraction: float  # mean over the MoE layers and the logged steps
    num_params: int
    num_active_params: int
    resumed_from_step: int = 0  # this process started after this step (0: from the start)
    process_train_time_s: float | None = None  # training steps of this process only

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_run_dir(preset: str) -> Path:
    return Path("runs") / f"{preset}-{datetime.datetime.now():%Y%m%d-%H%M%S}"


# --- configuration and the run folder ------------------------------------------------------------


def _read_saved(run_dir: Path) -> dict:
    path = run_dir / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} holds no {CONFIG_FILE}; is it a run folder?") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None


def configure(overrides: dict, saved: dict | None) -> tuple[TrainConfig, ModelConfig]:
    """The run's configuration. Resuming, the saved config.json is the base and a given flag
    may differ from it only for RESUMABLE_CHANGES; anything else is refused naming the fields."""
    if saved is None:
        return build(overrides)
    config, model = _saved_config(saved, overrides)

    def saved_value(section: str, name: str):
        # A field the saved config lacks (a run older than the field) counts as changed,
        # unless it is one of ADDED_FIELDS at the value those runs computed with.
        return saved[section].get(name, ADDED_FIELDS[section].get(name))

    changed = [f"{name}: {saved_value('train', name)!r} -> {value!r}"
               for name, value in config.to_dict().items()
               if name not in RESUMABLE_CHANGES and name != "model_overrides"
               and value != saved_value("train", name)]
    # expert_parallel follows the mesh's expert axis, which may change.
    changed += [f"model.{name}: {saved_value('model', name)!r} -> {value!r}"
                for name, value in model.to_dict().items()
                if name != "expert_parallel" and value != saved_value("model", name)]
    if changed:
        raise ConfigError(
            "cannot resume: the configuration differs from the run's config.json in "
            + "; ".join(changed) + f" (on --resume only {', '.join(RESUMABLE_CHANGES)} may "
            "change; start a new run with another --out for the rest)")
    return config, model


# Fields added after runs were saved, with the value that computes what those runs computed
# (one device, so no expert-parallel buffer); a saved config.json that lacks one resumes with
# it. (The mesh itself may change on --resume.)
ADDED_FIELDS = {"train": {"seq_aux_loss_coef": 0.0, "bias_update_rule": "sign"},
                "model": {"ep_buffer_factor": 2.0, "fp8": "off", "fp8_weight_gradient": "fp8",
                          "router_matmul": "float32"}}
# Model fields whose default changed after runs were saved: the model is rebuilt from its preset
# and model_overrides, so a resumed or loaded run is given the value it computed with (its
# config.json's, or the ADDED_FIELDS one) unless a flag says otherwise.
CHANGED_DEFAULTS = ("router_matmul", "fp8_weight_gradient")


def _saved_config(saved: dict, overrides: dict) -> tuple[TrainConfig, ModelConfig]:
    """The saved config.json's configuration with `overrides` applied; a field it lacks takes
    its ADDED_FIELDS value, or today's default."""
    base = TrainConfig.from_dict({**ADDED_FIELDS["train"], **saved["train"]})
    # The run's vocabulary is the one it trained with, wherever it came from (a run that took
    # it from its data, or from its preset, before vocab_size was recorded in model_overrides).
    vocabulary = ({"vocab_size": saved["model"]["vocab_size"]}
                  if "vocab_size" in saved.get("model", {}) else {})
    computed_with = {name: saved.get("model", {}).get(name, ADDED_FIELDS["model"][name])
                     for name in CHANGED_DEFAULTS}
    return build({**base.to_dict(), **overrides,
                  "model_overrides": {**vocabulary, **computed_with, **base.model_overrides,
                                      **overrides.get("model_overrides", {})}})


def load_data(config: TrainConfig, model_config: ModelConfig, *,
              dataset: data.Dataset | None = None, run_dir: Path | None = None,
              echo=print) -> tuple[data.Dataset, tokenizer.Tokenizer | None, TrainConfig,
                                   ModelConfig]:
    """The run's tokens and tokenizer: `dataset` (else config.data, read) encoded by the
    tokenizer (the one saved in `run_dir` where there is one), every id checked against the
    model's vocabulary; and the configuration again, with the data's vocabulary where it comes
    from the data: token ids without a tokenizer, and vocab_size not set (data.vocabulary; the
    log says which and why). It is then recorded in model_overrides, so that config.json's
    train record, a resume and every use of the run rebuild the same model."""
    if dataset is None:
        dataset = data.load(config.data, None, echo=echo)
    run_tokenizer = None
    if config.tokenizer is not None:
        dataset, run_tokenizer = tokenizer.apply(
            config.tokenizer, dataset, model_config.vocab_size,
            None if run_dir is None else Path(run_dir) / tokenizer.FILE, echo=echo)
    elif not dataset.text and "vocab_size" not in config.model_overrides:
        size, why = data.vocabulary(dataset)
        config, model_config = build({**config.to_dict(), "model_overrides": {
            **config.model_overrides, "vocab_size": size}})
        echo(f"nodrop: vocabulary {size} from the data: {why} (--set vocab_size=N to choose; "
             f"the model has {model_config.num_params() / 1e6:.2f}M parameters)")
    if config.tokenizer is None and dataset.meta is not None and not dataset.text:
        # nanoGPT's character map: the run keeps it as its tokenizer, for generate and eval.
        run_tokenizer = tokenizer.from_meta(data.read_meta(dataset.meta), dataset.meta)
        if run_tokenizer is not None:
            echo(f"nodrop: the characters of {dataset.meta} are the run's tokenizer "
                 f"({tokenizer.FILE}: generate and eval read and write text with it)")
    explicit = config.tokenizer is None and "vocab_size" in config.model_overrides
    data.check_ids(dataset, model_config.vocab_size,
                   "--set vocab_size" if explicit else None)
    return dataset, run_tokenizer, config, model_config


def _write_json(path: Path, value: dict) -> None:
    _write_text(path, json.dumps(value, indent=2) + "\n")


def _write_text(path: Path, text: str) -> None:
    """Written atomically, by process 0 only: on several processes it owns the run folder."""
    if not distributed.is_primary():
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError:
        tmp.unlink(missing_ok=True)  # the file stays as it was
        raise
    os.replace(tmp, path)


def _write_failure(error: OSError, run_dir: Path) -> str:
    """One line: what could not be written, and how the run continues once it can be."""
    where = error.filename if error.filename is not None else run_dir
    if not (run_dir / CONFIG_FILE).exists():
        then = "then start the run again"
    else:
        folder = run_dir / "checkpoints"
        steps = sorted(int(p.name) for p in folder.iterdir()
                       if p.name.isdigit()) if folder.is_dir() else []
        then = (f"then continue with --resume --out {run_dir} (from "
                + (f"its newest checkpoint, step {steps[-1]})" if steps else "step 0: it has "
                   "no checkpoint)"))
    return (f"cannot write {where}: {error.strerror or error}; the run stopped. Free space or "
            f"restore write access, {then}")


# --- the model, the optimizer and the steps -------------------------------------------------------


def learning_rate_schedule(config: TrainConfig):
    """lr for the update number `count` (0-based): linear warm-up to config.lr over
    warmup_steps (the first update already gets lr / warmup_steps, none is wasted at 0), then
    cosine decay to lr * min_lr_ratio at the last step."""
    peak, floor = config.lr, config.lr * config.min_lr_ratio
    warmup, total = config.warmup_steps, config.steps

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        warm = peak * step / max(warmup, 1)
        progress = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
        decayed = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step <= warmup, warm, decayed).astype(jnp.float32)

    return schedule


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(config), b1=config.beta1, b2=config.beta2, eps=config.adam_eps,
        weight_decay=config.weight_decay,
        mask=lambda params: jax.tree.map(_decays, params))
    clip = [clip_by_global_norm(config.grad_clip)] if config.grad_clip > 0 else []
    # The routers' steps scaled by router_lr_scale (docs/quality.md: why); left out at 1, so the
    # optimizer state, and with it a checkpoint, has the structure of runs that predate it.
    router = ([optax.masked(optax.scale(config.router_lr_scale), _router_mask)]
              if config.router_lr_scale != 1 else [])
    chain = [*clip, adamw, *router]
    # update(..., grad_norm=) reaches the clip; the wrapper keeps the state's structure.
    return optax.with_extra_args_support(chain[0] if len(chain) == 1 else optax.chain(*chain))


def fused_adamw_update(config: TrainConfig, params, opt_state, grads, grad_norm):
    """optimizer(config)'s update and optax.apply_updates, one engine call per parameter
    (nodrop.ops.adamw: the parameter and both moments read once and written in place), and
    the update's TreeStats (its values and the new parameters') from the same pass. The state
    keeps optax's structure, so a checkpoint is the same whichever path wrote it.
    Returns (params, opt_state, update_stats)."""
    is_counted = lambda node: isinstance(node, (optax.ScaleByAdamState,
                                                optax.ScaleByScheduleState))
    counted = [node for node in jax.tree.leaves(opt_state, is_leaf=is_counted)
               if is_counted(node)]
    adam = next(node for node in counted if isinstance(node, optax.ScaleByAdamState))
    schedule = next(node for node in counted if isinstance(node, optax.ScaleByScheduleState))
    count = optax.safe_increment(adam.count)
    step_size = -learning_rate_schedule(config)(schedule.count)  # scale_by_learning_rate's
    routers = (_router_mask(params) if config.router_lr_scale != 1
               else jax.tree.map(lambda _: False, params))

    def step(param, grad, mu, nu, router):
        return adamw_update(
            param, grad, mu, nu, step_size=step_size, count=count, b1=config.beta1,
            b2=config.beta2, eps=config.adam_eps,
            weight_decay=config.weight_decay if _decays(param) else 0.0,
            update_scale=config.router_lr_scale if router else 1.0,
            max_grad_norm=config.grad_clip, grad_norm=grad_norm)

    steps = jax.tree.map(step, params, grads, adam.mu, adam.nu, routers)
    is_step = lambda node: isinstance(node, AdamWStep)
    field = lambda name: jax.tree.map(lambda s: getattr(s, name), steps, is_leaf=is_step)
    mu, nu = field("mu"), field("nu")

    def advance(node):
        if isinstance(node, optax.ScaleByAdamState):
            return optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
        if isinstance(node, optax.ScaleByScheduleState):
            return optax.ScaleByScheduleState(count=optax.safe_increment(node.count))
        return node

    opt_state = jax.tree.map(advance, opt_state, is_leaf=is_counted)
    sums = [tuple(s.sums[i] for i in range(NUM_SUMS))
            for s in jax.tree.leaves(steps, is_leaf=is_step)]
    return field("param"), opt_state, stats_from_sums(sums)


def _decays(param) -> bool:
    """Whether AdamW decays a parameter: matrices (and the embedding) only; norm scales
    stay undecayed."""
    return param.ndim >= 2


def _router_mask(params):
    """True at the MoE routers' weights."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(key, "key", None) == "router" for key in path), params)


def _mean(values):
    """Mean over the MoE layers; 0 for a model without any."""
    return values.sum() / max(values.shape[0], 1)


# One pass over a tree gives its L2 norm, even where the plain sum of squares overflows (values
# past 1.8e19) or underflows (values below 1e-19): beside it, the sums of the squares scaled by
# these fixed powers of two, which stay in float32's range there.
_SCALE_DOWN, _SCALE_UP = 2.0 ** -70, 2.0 ** 70
_TINY_SUM = 1e-20  # below it the plain sum may have lost squares that underflowed


class TreeStats(NamedTuple):
    norm: jax.Array  # the global L2 norm of the floating-point values
    finite: jax.Array  # every value finite, and every value of `also`
    squares_finite: jax.Array  # every value's square finite (|x| < 1.8e19)


def tree_stats(tree, also=None) -> TreeStats:
    """A tree's norm and finiteness in ONE pass: per leaf one variadic reduction of five sums
    (squares plain and scaled both ways, non-finite values, non-finite squares), where separate
    reductions took six passes over the gradients and updates and kept XLA from writing the new
    state in place. `also`, a tree shaped like `tree` (the updated parameters beside their
    updates), is checked for finiteness leaf by leaf in the same pass.
    The norm overflows only where it is itself past float32's range (optax's squares overflow
    from 1.8e19) and is NaN where a value is."""
    leaves = jax.tree.leaves(tree)
    others = jax.tree.leaves(also) if also is not None else [None] * len(leaves)
    sums = []
    for leaf, other in zip(leaves, others, strict=True):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        x = jnp.asarray(leaf, jnp.float32)
        nonfinite = (~jnp.isfinite(x)).astype(jnp.float32)
        if other is not None:
            nonfinite = nonfinite + (~jnp.isfinite(other)).astype(jnp.float32)
        operands = (x * x, jnp.square(x * _SCALE_DOWN), jnp.square(x * _SCALE_UP), nonfinite,
                    (~jnp.isfinite(x * x)).astype(jnp.float32))
        sums.append(jax.lax.reduce(operands, (jnp.float32(0),) * len(operands),
                                   lambda a, b: tuple(i + j for i, j in zip(a, b)),
                                   tuple(range(x.ndim))))
    return stats_from_sums(sums)


def stats_from_sums(sums) -> TreeStats:
    """TreeStats from each leaf's five sums (tree_stats', or nodrop.ops.adamw's of an update)."""
    plain, down, up, nonfinite, square_overflows = (
        sum(column, jnp.float32(0)) for column in zip(*sums, strict=True)) if sums else (
        jnp.float32(0),) * 5
    norm = jnp.where(~jnp.isfinite(plain), jnp.sqrt(down) / _SCALE_DOWN,
                     jnp.where(plain < _TINY_SUM, jnp.sqrt(up) / _SCALE_UP, jnp.sqrt(plain)))
    return TreeStats(norm, nonfinite == 0, square_overflows == 0)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm (the same state and scaling) on tree_stats' norm, or on the
    `grad_norm` the caller passes (the train step's, computed once for the clip and its
    metrics); a norm that clips gradients past 1.8e19 instead of zeroing them (optax's
    overflows to inf)."""

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = tree_stats(updates).norm if grad_norm is None else grad_norm
        trigger = norm < max_norm
        return jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
            updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make_steps(config: TrainConfig, graphdef, tx, *, can_overflow: bool = False):
    """(train_step, eval_step), pure functions of the state pytrees, for jit.

    train_step(params, opt_state, model_state, batch, step, halted) also returns halted: with
    can_overflow (expert parallelism's bounded buffers), a step whose buffers overflow, or that
    runs while halted, returns the state it was given and halted true. eval_step returns
    (cross-entropy, tokens_per_expert [L_moe, E], overflow).
    """
    schedule = learning_rate_schedule(config)

    def forward(model, batch):
        logits, aux = model(batch[:, :-1])
        with jax.named_scope("loss"):
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return ce, aux

    def loss_fn(model, batch):
        ce, aux = forward(model, batch)
        # Each MoE layer's losses carry the full coefficient (summed over layers), as Switch,
        # ST-MoE and Megatron-Core define them; a mean would weaken every layer's balancing by
        # the number of MoE layers.
        loss = (ce + config.aux_loss_coef * aux.load_balancing_loss.sum()
                + config.seq_aux_loss_coef * aux.sequence_balance_loss.sum()
                + config.z_loss_coef * aux.z_loss.sum())
        return loss, (ce, aux)

    def train_step(params, opt_state, model_state, batch, step, halted):
        # The arrays themselves: the expert-bias update below writes into model_state's variables.
        given = jax.tree.leaves((params, opt_state, model_state))
        # nnx.value_and_grad (gradients of the nnx.Param leaves only), not jax's: the model's
        # nnx.remat must see the model's variables under an nnx transform.
        cast = config.compute_dtype_gradients and jax.sharding.get_abstract_mesh().size <= 1
        model = nnx.merge(graphdef, params, model_state, copy=cast)
        if cast:  # gradients in the compute dtype where they are computed in it
            cast_compute_weights(model)
        (loss, (ce, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        grad_stats = tree_stats(grads)
        with jax.named_scope("optimizer"):
            if config.fused_adamw:  # the engine widens 16-bit gradients as it reads them
                params, opt_state, update_stats = fused_adamw_update(
                    config, params, opt_state, grads, grad_stats.norm)
            else:
                grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
                updates, opt_state = tx.update(grads, opt_state, params,
                                               grad_norm=grad_stats.norm)
                params = optax.apply_updates(params, updates)
        if config.bias_update_rate > 0:
            model = nnx.merge(graphdef, params, model_state)
            for block, counts in zip(model.moe_blocks(), aux.tokens_per_expert):
                block.expert_bias[...] = updated_expert_bias(
                    block.expert_bias[...], counts, config.bias_update_rate,
                    config.bias_update_rule)
            _, _, model_state = nnx.split(model, nnx.Param, ...)
        if can_overflow:
            # Decided here, not by the host, so that the host need not wait for this step
            # before queueing the next; the host reruns from the first overflowing step.
            halted = halted | aux.overflow
            new, treedef = jax.tree.flatten((params, opt_state, model_state))
            params, opt_state, model_state = jax.tree.unflatten(
                treedef, [jnp.where(halted, old, value) for old, value in zip(given, new)])
        if not config.fused_adamw:
            update_stats = tree_stats(updates, also=params)
        metrics = {
            "loss": loss, "ce": ce, "aux_loss": _mean(aux.load_balancing_loss),
            "seq_aux_loss": _mean(aux.sequence_balance_loss),
            "z_loss": _mean(aux.z_loss), "grad_norm": grad_stats.norm,
            "update_norm": update_stats.norm,
            "lr": schedule(step - 1), "max_over_mean": aux.max_over_mean,
            "dropped_fraction": aux.dropped_fraction,
            # What is finite, each checked on its values (a norm can overflow while they do
            # not): only a state with all three true is kept. Adam's moments are convex
            # combinations of their previous values (finite: no other state is kept) and of the
            # gradients and their squares, so they are finite where those are: checked in the
            # gradients' pass, where reading both moments again would cost two passes.
            "finite": {"loss": jnp.isfinite(loss), "gradients": grad_stats.finite,
                       "state": update_stats.finite & grad_stats.finite
                       & grad_stats.squares_finite},
            "overflow": aux.overflow,
        }
        return params, opt_state, model_state, metrics, halted

    def eval_step(params, model_state, batch):
        ce, aux = forward(nnx.merge(graphdef, params, model_state), batch)
        return ce, aux.tokens_per_expert, aux.overflow

    return train_step, eval_step


# --- the run ---------------------------------------------------------------------------------------


def run(overrides: dict, *, out: str | os.PathLike | None = None, resume: bool = False,
        resume_from: int | None = None,
        progress: bool | None = None, dataset: data.Dataset | None = None,
        echo=print) -> Summary:
    """Trains as configured by `overrides` (TrainConfig fields, model ones under
    model_overrides) into the run folder `out`; resumes it with `resume`. Raises ConfigError,
    data.DataError or CheckpointError for unusable input (before anything compiles, except a
    checkpoint that does not fit), Diverged, Interrupted, or WriteFailed (an OSError while
    writing: a full disk, lost permissions).

    Everything is traced with x64 off, whatever the caller's setting: with it on, Python
    scalars inside optax would promote to float64 and the numbers would differ in the last bits
    from those of `nodrop train`.
    """
    resume = resume or resume_from is not None
    if resume and out is None:
        raise ConfigError("--resume needs --out, the run folder to continue")
    run_dir = Path(out) if out is not None else default_run_dir(
        overrides.get("preset", TrainConfig.preset))
    with jax.enable_x64(False):
        try:
            return _run(overrides, run_dir=run_dir, resume=resume, resume_from=resume_from,
                        progress=progress, dataset=dataset, echo=echo)
        except OSError as error:  # the outside world: one line, no traceback
            raise WriteFailed(_write_failure(error, run_dir)) from None


def _run(overrides, *, run_dir, resume, resume_from, progress, dataset, echo) -> Summary:
    wall_start = time.perf_counter()
    saved = _read_saved(run_dir) if resume else None
    config, model_config = configure(overrides, saved)
    mesh = _mesh(config, model_config)
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    echo(banner(config, model_config, devices, run_dir))
    dataset, run_tokenizer, config, model_config = load_data(
        config, model_config, dataset=dataset, run_dir=run_dir if resume else None, echo=echo)
    data.check_length(dataset, config.seq_len)
    if saved is not None and saved.get("data") != dataset.describe():
        raise ConfigError(f"cannot resume: the data differs from when the run started "
                          f"(now {dataset.describe()}, then {saved.get('data')})")
    primary = distributed.is_primary()  # process 0 writes the folder; the others only read it
    if not primary:
        echo, progress = (lambda *_: None), False
    with _hold_run_dir(run_dir, saved, run_tokenizer, echo):
        device = jax.devices()[0]
        tx = optimizer(config)

        _, init, abstract = _state_structure(config, model_config, tx, device, mesh)
        if resume_from is not None:
            _set_aside_checkpoints_after(run_dir / "checkpoints", resume_from, echo)
            distributed.barrier("nodrop: checkpoints set aside")
        # --checkpoint-every 0 makes no checkpoints/ folder (a resumed run keeps its own).
        checkpoints = (Checkpoints(run_dir / "checkpoints", config.keep_checkpoints)
                       if config.checkpoint_every > 0 or (run_dir / "checkpoints").exists()
                       else NoCheckpoints(run_dir / "checkpoints"))
        start = checkpoints.latest_step() if resume else None
        if start is not None and start > config.steps:
            raise ConfigError(f"--steps {config.steps} is below the checkpoint's step {start}")
        _write_json(run_dir / CONFIG_FILE, {
            "train": config.to_dict(), "model": model_config.to_dict(),
            "data": dataset.describe(), "tokens": dataset.encoding,
            "environment": environment.record(devices)})
        if start is None:
            if resume:
                echo(f"nodrop train: {run_dir} has no complete checkpoint; starting from step 0")
            state = _State(*jax.jit(init, out_shardings=_shardings(abstract))(), step=0,
                           elapsed_s=0.0, ep_buffer_factor=model_config.ep_buffer_factor)
        else:
            state = _restore(checkpoints, start, abstract, model_config.ep_buffer_factor)
            echo(f"nodrop train: resuming {run_dir} from step {start}")
        begun = (state.step, state.elapsed_s)  # where this process started: step, training time

        metrics = MetricsLog(run_dir, state.step) if primary else Records(run_dir, state.step)
        try:
            device_peak = peak_flops(device.device_kind)
            placement = _placement(mesh, device)
            job = _Job(
                config=config, model_config=model_config, dataset=dataset, run_dir=run_dir,
                compile_steps=functools.partial(
                    _compile, config=config, model_config=model_config, tx=tx,
                    abstract=abstract, mesh=mesh, placement=placement, metrics=metrics),
                batch_sharding=placement[0], replicated=placement[1],
                val_batches=data.eval_batches(dataset.val, config.eval_batches,
                                              config.batch_size, config.seq_len),
                checkpoints=checkpoints, metrics=metrics,
                progress=(Progress(config.steps, state.step, progress) if primary
                          else Quiet()),
                peak_flops=None if device_peak is None else device_peak * (
                    1 if mesh is None else mesh.size))
            echo(f"nodrop train: compiling the steps (step {state.step + 1} on)")
            _use_steps(job, state, state.ep_buffer_factor)
            state.halted = jax.device_put(np.bool_(False), job.replicated)
            _train(job, state)
            summary = _finish(job, state, wall_start=wall_start, begun=begun)
        except BaseException:
            with contextlib.suppress(OSError):  # the error in flight says why the run stopped
                metrics.close()
            raise
        finally:
            checkpoints.close()
        metrics.close()
        return summary


def _set_aside_checkpoints_after(directory: Path, step: int, echo) -> None:
    """--resume-from STEP: the checkpoints after STEP move to checkpoints-set-aside/ (kept, not
    deleted), so that STEP is the newest; ConfigError if the run has no checkpoint STEP."""
    checkpoints = Checkpoints(directory, keep=1)
    try:
        steps = checkpoints.all_steps()
    finally:
        checkpoints.close()
    if step not in steps:
        raise ConfigError(f"--resume-from {step}: {directory} holds checkpoints of steps "
                          f"{sorted(steps)}")
    later = sorted(s for s in steps if s > step)
    if later and distributed.is_primary():  # the others wait for it (barrier)
        aside = directory.parent / "checkpoints-set-aside"
        aside.mkdir(exist_ok=True)
        for s in later:
            target = aside / str(s)
            if target.exists():  # set aside before: keep both
                target = aside / f"{s}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
            os.replace(directory / str(s), target)
        echo(f"nodrop train: resuming from step {step}; the checkpoints of steps {later} are "
             f"in {aside}")


def _check_new_run_dir(run_dir: Path, saved: dict | None) -> None:
    """A new run needs an empty or missing folder (its lock file aside)."""
    if saved is None and run_dir.is_dir() and any(
            p.name != lock.FILE for p in run_dir.iterdir()):
        raise ConfigError(f"--out {run_dir} is not empty; continue the run there with "
                          "--resume, or choose another folder")


@contextlib.contextmanager
def _hold_run_dir(run_dir: Path, saved: dict | None, run_tokenizer, echo):
    """Holds the run folder until the run ends, however it ends: a second run on this folder
    stops here (lock.RunLock). On several processes process 0 holds it and writes into it; the
    others wait until it has, and stop with its error where it could not."""
    with contextlib.ExitStack() as held:
        error = None
        if distributed.is_primary():
            try:
                _check_new_run_dir(run_dir, saved)  # before the lock, which writes a file there
                held.enter_context(lock.RunLock(run_dir, echo))
                _check_new_run_dir(run_dir, saved)  # again: a run may have ended there meanwhile
                if run_tokenizer is not None:  # what generating from or evaluating will need
                    _write_text(run_dir / tokenizer.FILE, run_tokenizer.to_str())
            except (ConfigError, lock.RunFolderError, OSError) as caught:
                if distributed.process_count() == 1:
                    raise
                error = caught
        message = distributed.broadcast_error(
            None if error is None else f"{type(error).__name__}:{error}")
        if error is not None:
            raise error
        if message is not None:
            kind, _, text = message.partition(":")
            raise (ConfigError if kind == "ConfigError" else lock.RunFolderError)(
                f"process 0: {text}")
        yield


def _mesh(config: TrainConfig, model_config: ModelConfig):
    """The run's mesh (None without --mesh); ConfigError, before anything compiles, for a mesh
    that does not use every device or does not divide the experts or the batch."""
    processes = distributed.describe()  # '' for one process
    if config.mesh is None:
        if processes:
            raise ConfigError(f"--mesh is needed on several processes ({processes}): give a "
                              f"mesh over all {jax.device_count()} devices, e.g. --mesh "
                              f"data={jax.device_count()}")
        return None
    try:
        mesh = make_mesh(config.mesh, name="--mesh")
    except ValueError as error:
        raise ConfigError(f"{error}{f' ({processes})' if processes else ''}") from None
    try:
        check_batch(config.batch_size, mesh, name="--batch-size")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        check_experts(model_config.num_experts, mesh, name="model.num_experts")
    except ValueError as error:
        raise ConfigError(f"--mesh {config.mesh}: {error}") from None
    return mesh


def _placement(mesh, device):
    """(batch sharding, replicated sharding): batches split over the mesh's token axes (data
    x fsdp x expert) and scalars on every device; without a mesh both on `device`."""
    if mesh is None:
        return (jax.sharding.SingleDeviceSharding(device),) * 2
    return jax.NamedSharding(mesh, jax.P(token_axes(mesh))), jax.NamedSharding(mesh, jax.P())


def _shardings(abstract):
    return jax.tree.map(lambda leaf: leaf.sharding, abstract)


def _state_structure(config: TrainConfig, model_config: ModelConfig, tx, device, mesh=None):
    """(graphdef, init, abstract): the model's graph, a function that initialises the state
    pytrees (params, opt_state, model_state) from config.seed, and their abstract values on
    `device`, or on `mesh` as nodrop.parallel.state_shardings places them (shapes and shardings
    only: the restore target, and what the steps compile for)."""

    def init():
        model = MoELM(model_config, rngs=nnx.Rngs(config.seed))
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        return params, tx.init(params), model_state

    shapes = jax.eval_shape(init)
    # On a mesh, every array where the logical axis names of its nnx Variable put it (Adam's
    # moments are built from the params' Variables and carry the same names); no names matched.
    shardings = (jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes)
                 if mesh is None else state_shardings(shapes, mesh))
    abstract = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        shapes, shardings)
    return _graphdef(model_config), init, abstract


def _graphdef(model_config: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: MoELM(model_config, rngs=nnx.Rngs(0))),
                     nnx.Param, ...)[0]


def run_config(run_dir: str | os.PathLike) -> tuple[TrainConfig, ModelConfig]:
    """The configuration a run folder was trained with (its config.json); a field the run
    predates takes its ADDED_FIELDS value, or today's default."""
    return _saved_config(_read_saved(Path(run_dir)), {})


def load_model(run_dir: str | os.PathLike, *, step: int | None = None,
               **model_changes) -> tuple[MoELM, int]:
    """The trained model of a run folder, from its newest complete checkpoint (or `step`'s), and
    that checkpoint's step. Only the params and the expert biases are read (and checked against
    their CRC32s), not the optimizer state.

    model_changes replace ModelConfig fields that leave the parameters as they are
    (capacity_factor, moe_matmul, fp8, fp8_weight_gradient, router_matmul, dtype, remat): the
    same weights, dispatched another way.
    Raises ConfigError for a folder that is not a run, CheckpointError for a missing or
    unusable checkpoint.
    """
    run_dir = Path(run_dir)
    config, model_config = run_config(run_dir)
    model_config = model_config.replace(**model_changes)
    graphdef, _, (params, _, model_state) = _state_structure(
        config, model_config, optimizer(config), jax.devices()[0])
    checkpoints = Checkpoints(run_dir / "checkpoints", config.keep_checkpoints)
    try:
        step = checkpoints.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{run_dir / 'checkpoints'} holds no complete checkpoint")
        if step not in checkpoints.all_steps():
            raise CheckpointError(f"{run_dir / 'checkpoints'} holds no checkpoint of step "
                                  f"{step}; it has {checkpoints.all_steps()}")
        arrays, _ = checkpoints.restore(step, {"params": params, "model_state": model_state},
                                        partial=True)
    finally:
        checkpoints.close()
    return nnx.merge(graphdef, arrays["params"], arrays["model_state"]), step


@dataclasses.dataclass
class _State:
    """What the loop changes: the state pytrees after `step` updates, the training time so far,
    the log interval in progress, and the steps compiled for the receive buffer in use."""

    params: Any
    opt_state: Any
    model_state: Any
    step: int  # updates done; the state is that after step `step` (1-based)
    elapsed_s: float  # training steps only: no compile, evaluation or checkpoints
    ep_buffer_factor: float | None  # expert parallelism's buffer (grows on overflow)
    train_step: Callable | None = None  # compiled; donates the state pytrees it is given
    eval_step: Callable | None = None  # compiled
    compile_s: float = 0.0
    halted: Any = None  # on the device: a step overflowed, the steps after it change nothing
    # The log interval: the steps whose metrics are still on the device (fetched together, so
    # the host need not wait for each step), and when its timing began.
    pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    interval_start: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Job:
    """What stays fixed while the loop runs: the configuration, the data, the compiled steps and
    where the numbers go."""

    config: TrainConfig
    model_config: ModelConfig
    dataset: data.Dataset
    run_dir: Path
    compile_steps: Callable  # (ep_buffer_factor, step) -> (train_step, eval_step, seconds)
    batch_sharding: Any  # where a batch goes: split over the mesh's token axes
    replicated: Any  # where scalars go: every device
    val_batches: list[np.ndarray]  # the same windows at every evaluation
    checkpoints: Checkpoints
    metrics: MetricsLog
    progress: Progress
    peak_flops: float | None  # of the devices trained on; None: no MFU logged

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.seq_len


def _checkpoint_tree(params, opt_state, model_state) -> dict:
    """The pytree a checkpoint holds."""
    return {"params": params, "opt_state": opt_state, "model_state": model_state}


def _restore(checkpoints: Checkpoints, step: int, abstract,
             ep_buffer_factor: float | None) -> _State:
    """The state of checkpoint `step`, with the receive buffer it was saved with (the
    configured `ep_buffer_factor` for checkpoints that predate the record)."""
    arrays, meta = checkpoints.restore(step, _checkpoint_tree(*abstract))
    return _State(arrays["params"], arrays["opt_state"], arrays["model_state"], step=step,
                  elapsed_s=float(meta["elapsed_s"]),
                  ep_buffer_factor=meta.get("ep_buffer_factor", ep_buffer_factor))


def _compile(ep_buffer_factor: float | None, step: int, *, config: TrainConfig,
             model_config: ModelConfig, tx, abstract, mesh, placement,
             metrics: MetricsLog):
    """(train_step, eval_step, seconds), compiled ahead of the loop for the abstract state and
    the receive buffer `ep_buffer_factor` (on `mesh`, under jax.set_mesh, so that the MoE
    blocks see its expert axis; placement: _placement's); logs a compile record at `step`."""
    model_config = model_config.replace(ep_buffer_factor=ep_buffer_factor)
    train_step, eval_step = make_steps(config, _graphdef(model_config), tx,
                                       can_overflow=model_config.expert_parallel)
    params, opt_state, model_state = abstract
    state_shardings = _shardings(abstract)
    batch_sharding, replicated = placement
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
    begin = time.perf_counter()
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        # The outputs placed as the inputs: the next step takes them as they are.
        train_compiled = jax.jit(
            train_step, donate_argnums=(0, 1, 2, 5),
            out_shardings=(*state_shardings, replicated, replicated)).lower(
            params, opt_state, model_state, batch, scalar(jnp.int32), scalar(bool)).compile()
        middle = time.perf_counter()
        eval_compiled = jax.jit(eval_step).lower(params, model_state, batch).compile()
    end = time.perf_counter()
    metrics.write({"kind": "compile", "step": step, "ep_buffer_factor": ep_buffer_factor,
                   "train_step_s": middle - begin, "eval_step_s": end - middle})
    return train_compiled, eval_compiled, end - begin


def _use_steps(job: _Job, state: _State, ep_buffer_factor: float | None) -> None:
    """Compiles the steps for the receive buffer `ep_buffer_factor` and makes them the run's."""
    state.train_step, state.eval_step, seconds = job.compile_steps(ep_buffer_factor, state.step)
    state.ep_buffer_factor = ep_buffer_factor
    state.compile_s += seconds


def _grow_buffer(job: _Job, state: _State, step: int, during: str) -> None:
    """Expert parallelism's receive buffer overflowed at `step` (during "training" or
    "evaluation"): recompiles for the next factor of EP_BUFFER_FACTORS, logged."""
    old = state.ep_buffer_factor
    # Only a bounded buffer can overflow, so `old` is a number.
    new = next((f for f in EP_BUFFER_FACTORS if f is None or f > old), None)
    job.metrics.write({"kind": "ep_rerun", "step": step, "evaluation": during == "evaluation",
                       "old_factor": old, "new_factor": new})
    job.progress.write(f"step {step}: expert-parallel receive buffer overflowed during {during}; "
                       f"rerunning with factor {'worst' if new is None else f'{new:g}'} "
                       f"(was {old:g})")
    _use_steps(job, state, new)


class _StopFlag:
    """SIGINT (Ctrl-C) or SIGTERM (what schedulers send before preemption) asks the loop to stop
    after the current step: stopping mid-call could lose donated buffers, so the loop checks the
    flag between steps. A second signal stops the run at once with Interrupted, without saving
    the current step, except during a checkpoint save, which it lets finish (an interrupted save
    would leave a temporary folder behind)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir  # named in the message of a second signal
        self.signum: int | None = None  # the first signal received
        self.saving = False
        self._previous = {}

    @property
    def raised(self) -> bool:
        return self.signum is not None

    def __enter__(self):
        for signum in self.SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: no handler, signals behave as usual
                break
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and not self.saving:
            raise Interrupted(signum, (
                f"interrupted again ({signal.Signals(signum).name}): stopped at once, without "
                "saving the current step. Continue from the last checkpoint with --resume --out "
                f"{self.run_dir}"))
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _train(job: _Job, state: _State) -> None:
    """Steps from state.step to config.steps, logging, evaluating and saving on the way.
    SIGINT or SIGTERM makes it save the current step (unless --checkpoint-every 0) and raise
    Interrupted."""
    config = job.config
    profile = config.profile_steps() if distributed.is_primary() else None
    if profile is not None and state.step >= profile[0]:
        profile = None  # resumed past the traced steps' start
    tracing = False
    state.interval_start = time.perf_counter()
    try:
        with _StopFlag(job.run_dir) as stop:
            while state.step < config.steps:
                if profile is not None and state.step + 1 == profile[0] and not tracing:
                    jax.profiler.start_trace(job.run_dir / PROFILE_DIR, create_perfetto_trace=True)
                    tracing = True
                _step(job, state)
                step = state.step
                last = step == config.steps
                stopping = stop.raised  # read once: a Ctrl-C from here on waits a step
                if distributed.process_count() > 1:
                    # All processes stop together, at a step where the host waits anyway: a
                    # signal reaches them at different steps, or only some of them.
                    stopping = (step % config.log_every == 0 or step % config.eval_every == 0
                                or last) and distributed.agree(stopping)
                do_eval = step % config.eval_every == 0 or last
                do_save = config.checkpoint_every > 0 and (
                    step % config.checkpoint_every == 0 or last or stopping)
                # The traced steps are flushed on their own: their timing is not the others'.
                profile_edge = profile is not None and step in (profile[0] - 1, profile[1])
                if step % config.log_every == 0 or do_eval or do_save or profile_edge:
                    overflow = _flush(job, state)
                    if profile is not None and step == profile[1]:
                        _stop_profile(job, state, profile)
                        profile, tracing = None, False
                        state.interval_start = time.perf_counter()  # not timing the trace's write
                    if overflow is not None:
                        # Nothing after it changed the state: go on from its batch.
                        _grow_buffer(job, state, overflow, "training")
                        state.step = overflow - 1
                        state.halted = jax.device_put(np.bool_(False), job.replicated)
                        state.interval_start = time.perf_counter()  # not timing the recompile
                        continue
                if do_eval:
                    _validate(job, state)
                if do_save:
                    stop.saving = True
                    _save(job, state)
                    stop.saving = False
                if stopping:
                    # Of several processes, one that received no signal stops with another's.
                    signum = stop.signum if stop.raised else signal.SIGTERM
                    name = (signal.Signals(signum).name if stop.raised
                            else "a signal to another process")
                    raise Interrupted(signum, (
                        f"interrupted ({name}) at step {step}; saved a checkpoint there. "
                        f"Continue with --resume --out {job.run_dir}" if do_save else
                        f"interrupted ({name}) at step {step} (--checkpoint-every 0: nothing "
                        "saved)"))
                if do_eval or do_save:
                    state.interval_start = time.perf_counter()  # not timing evaluation and saving
    except BaseException:
        if tracing:  # keep the trace so far
            jax.profiler.stop_trace()
        job.progress.close()  # a failed or interrupted run: plot what was logged, then re-raise
        with contextlib.suppress(OSError):  # a full disk must not hide why the run stopped
            _plots(job)
        raise
    job.progress.close()


def _stop_profile(job: _Job, state: _State, profile: tuple[int, int]) -> None:
    """Ends --profile's trace and writes beside it the optimized HLO of the step it traced,
    which names the op behind each kernel (its metadata's op_name holds the named scopes)."""
    jax.profiler.stop_trace()
    traces = sorted((job.run_dir / PROFILE_DIR / "plugins" / "profile").iterdir())
    _write_text(traces[-1] / "train_step.hlo.txt", state.train_step.as_text())
    job.metrics.write({"kind": "profile", "step": profile[1], "first_step": profile[0]})


def _step(job: _Job, state: _State) -> None:
    """One update, queued on the device: its metrics stay there until the next flush."""
    step, config = state.step + 1, job.config
    # Each process reads only the rows its devices hold.
    batch = _global_batch(job, lambda rows: data.train_batch(
        job.dataset.train, step, config.seed, config.batch_size, config.seq_len, rows=rows))
    (state.params, state.opt_state, state.model_state, metrics,
     state.halted) = state.train_step(state.params, state.opt_state, state.model_state,
                                      batch, np.int32(step), state.halted)
    state.pending.append((step, metrics))
    state.step = step


def _global_batch(job: _Job, rows: Callable[[slice], np.ndarray]) -> jax.Array:
    """The batch, split over the mesh's token axes, from `rows(slice)`: the windows of the batch
    rows this process's devices hold (each process reads only its own)."""
    config = job.config
    return jax.make_array_from_callback((config.batch_size, config.seq_len + 1),
                                        job.batch_sharding, lambda index: rows(index[0]))


def _flush(job: _Job, state: _State) -> int | None:
    """Fetches the pending steps' metrics (this is where the host waits for the device), logs
    them, and stops the run if one is not finite. Returns the first step whose receive buffer
    overflowed, else None: that step and those after it changed nothing and are not logged."""
    if not state.pending:
        return None
    values = jax.device_get([m for _, m in state.pending])
    overflow = next((step for (step, _), value in zip(state.pending, values)
                     if value.pop("overflow")), None)
    seconds = time.perf_counter() - state.interval_start
    state.elapsed_s += seconds
    # The steps run asynchronously: the host sees the interval, not a step, so the timing is
    # one record for the interval, an average, not a value repeated on every step.
    step_time = seconds / len(state.pending)
    timing = {"kind": "timing", "step": state.pending[-1][0],
              "first_step": state.pending[0][0], "steps": len(state.pending),
              "mean_step_time_s": step_time, "tokens_per_s": job.tokens_per_step / step_time,
              "elapsed_s": state.elapsed_s}
    if job.peak_flops is not None:
        flops_per_token = job.model_config.flops_per_token(job.config.seq_len)
        timing["mfu"] = flops_per_token * timing["tokens_per_s"] / job.peak_flops
    record, finite = None, {}
    for (step, _), value in zip(state.pending, values):
        if overflow is not None and step >= overflow:
            break
        finite = {what: bool(ok) for what, ok in value.pop("finite").items()}
        record = {"kind": "train", "step": step,
                  **{key: np.asarray(v).tolist() for key, v in value.items()}}
        job.metrics.write(record)
        if not all(finite.values()):
            break
    job.metrics.write(timing)
    state.pending.clear()
    if record is not None:
        job.progress.update(record["step"], {**record, **timing})
    if not all(finite.values()):
        raise Diverged(_divergence(job, record, finite))
    state.interval_start = time.perf_counter()
    return overflow


def _divergence(job: _Job, record: dict, finite: dict[str, bool]) -> str:
    """What stopped being finite at the record's step, and what the run can go back to."""
    if finite["loss"] and finite["gradients"]:
        what = "the update overflowed: the updated parameters or optimizer state are"
    else:
        what = " and ".join(name for key, name in (("loss", "the loss"),
                                                  ("gradients", "the gradients"))
                            if not finite[key]) + (" is" if finite["gradients"] else " are")
    latest = job.checkpoints.latest_step()
    where = (f"The last checkpoint is step {latest} in {job.checkpoints.directory}"
             if latest is not None else "The run has no checkpoint yet")
    return (f"{what} not finite at step {record['step']} (loss {record['loss']}, gradient norm "
            f"{record['grad_norm']}, update norm {record['update_norm']}); stopped without "
            f"saving this state. {where}")


def _evaluate(job: _Job, state: _State, batches: list[np.ndarray]) -> tuple[float, list]:
    """The mean loss over `batches`, and per MoE layer the busiest expert's load over the mean
    load counted over all of them (the routers' balance on more tokens than a training step
    sees); on a receive-buffer overflow, again with a larger buffer."""
    while True:
        results = jax.device_get([
            state.eval_step(state.params, state.model_state,
                            _global_batch(job, b.__getitem__)) for b in batches])
        if not any(overflow for *_, overflow in results):
            break
        _grow_buffer(job, state, state.step, "evaluation")
    counts = np.sum([load for _, load, _ in results], axis=0, dtype=np.float64)
    max_over_mean = counts.max(axis=-1, initial=0) / np.maximum(counts.mean(axis=-1), 1)
    return float(np.mean([loss for loss, *_ in results])), max_over_mean.tolist()


def _validate(job: _Job, state: _State) -> None:
    val_loss, val_load = _evaluate(job, state, job.val_batches)
    job.metrics.write({"kind": "eval", "step": state.step, "val_loss": val_loss,
                       "val_max_over_mean": val_load, "elapsed_s": state.elapsed_s})
    job.progress.write(f"step {state.step}: validation loss {val_loss:.4f}")


def _save(job: _Job, state: _State) -> None:
    """Checkpoints the state after state.step; every checkpoint of the run is saved here."""
    job.metrics.sync()  # the records up to this step are on disk before the checkpoint is
    job.checkpoints.save(
        state.step, _checkpoint_tree(state.params, state.opt_state, state.model_state), {
            "step": state.step, "elapsed_s": state.elapsed_s,
            "ep_buffer_factor": state.ep_buffer_factor,  # the grown buffer, kept on --resume
            # The loader is stateless: step n + 1 reads train_batch(seed, n + 1).
            "data_position": {"seed": job.config.seed, "next_step": state.step + 1,
                              "tokens_seen": state.step * job.tokens_per_step}})


def _finish(job: _Job, state: _State, *, wall_start: float,
            begun: tuple[int, float]) -> Summary:
    """The final losses on both splits, the plots and summary.json. The last step needs no
    evaluation or save here: the loop did both, or, resumed at its last step, the run before.
    begun: the step and the training time this process started from."""
    config, model_config = job.config, job.model_config
    train_loss, _ = _evaluate(job, state, data.eval_batches(
        job.dataset.train, config.eval_batches, config.batch_size, config.seq_len))
    val_loss, _ = _evaluate(job, state, job.val_batches)
    job.metrics.write({"kind": "final", "step": config.steps, "train_loss": train_loss,
                       "val_loss": val_loss})
    _plots(job)
    train_records = [r for r in job.metrics.records if r.get("kind") == "train"]
    dropped = [v for r in train_records for v in r["dropped_fraction"]]
    summary = Summary(
        run_dir=str(job.run_dir.absolute()), steps=config.steps, train_loss=train_loss,
        val_loss=val_loss,
        unigram_loss=data.unigram_loss(job.dataset.train, model_config.vocab_size),
        tokens_per_s=(len(train_records) * job.tokens_per_step / state.elapsed_s
                      if state.elapsed_s else 0.0),
        train_time_s=state.elapsed_s, compile_s=state.compile_s,
        wall_s=time.perf_counter() - wall_start,
        dropped_fraction=float(np.mean(dropped)) if dropped else 0.0,
        num_params=model_config.num_params(),
        num_active_params=model_config.num_active_params(),
        resumed_from_step=begun[0], process_train_time_s=state.elapsed_s - begun[1])
    _write_json(job.run_dir / SUMMARY_FILE, summary.to_dict())
    return summary


def _plots(job: _Job) -> None:
    if not distributed.is_primary():
        return
    model_config = job.model_config
    unigram = data.unigram_loss(job.dataset.train, model_config.vocab_size)
    title = f"{job.config.preset} ({model_config.num_params() / 1e6:.1f}M parameters)"
    plots.plot_losses(job.metrics.records, job.run_dir / "loss.png", unigram, title)
    plots.plot_expert_load(job.metrics.records, job.run_dir / "expert_load.png", title)


def banner(config: TrainConfig, model_config: ModelConfig, devices: list,
           run_dir: Path) -> str:
    """The lines printed before data loading and compiling, which take seconds to minutes:
    what is about to train, on what, and where it writes."""
    kinds = sorted({f"{d.platform} ("
                    f"{environment.cpu_model() if d.platform == 'cpu' else d.device_kind})"
                    for d in devices})
    source = config.data if config.data is not None else "this Python's standard library"
    return "\n".join([
        f"nodrop {nodrop.__version__} train: {config.preset}, "
        f"{model_config.num_params() / 1e6:.2f}M parameters "
        f"({model_config.num_active_params() / 1e6:.2f}M active per token), {config.steps} "
        f"steps of {config.batch_size} x {config.seq_len} tokens",
        f"  devices: {len(devices)} x {', '.join(kinds)}"
        + (f", mesh {config.mesh}" if config.mesh else ""),
        f"  data: {source} (tokenizer: {config.tokenizer or 'none, bytes'})",
        f"  run folder: {run_dir.absolute()}"])


def format_summary(summary: Summary) -> str:
    def duration(seconds: float) -> str:
        minutes, seconds = divmod(seconds, 60)
        return f"{int(minutes)}m{seconds:04.1f}s" if minutes else f"{seconds:.1f}s"

    dropped = ("0 (dropless)" if summary.dropped_fraction == 0
               else f"{summary.dropped_fraction:.2%} of token slots")
    run_dir = Path(summary.run_dir)
    outputs = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir()
                     if p.name != lock.FILE) if run_dir.is_dir() else []
    process = (f"this process: compile {duration(summary.compile_s)}, wall "
               f"{duration(summary.wall_s)}")
    if summary.resumed_from_step:
        training = (f"  {summary.tokens_per_s:,.0f} tokens/s over {duration(summary.train_time_s)}"
                    f" of training steps (all {summary.steps} steps, before and after the resume)"
                    f"\n  {process}, training {duration(summary.process_train_time_s or 0.0)} "
                    f"(steps {summary.resumed_from_step + 1}-{summary.steps}, resumed at step "
                    f"{summary.resumed_from_step})")
    else:
        training = (f"  {summary.tokens_per_s:,.0f} tokens/s over {duration(summary.train_time_s)}"
                    f" of training steps; {process}")
    return "\n".join([
        f"done: {summary.steps} steps, {summary.num_params / 1e6:.2f}M parameters "
        f"({summary.num_active_params / 1e6:.2f}M active per token)",
        f"  train loss       {summary.train_loss:.4f}  (at the end, on evenly spaced "
        "training windows)",
        f"  validation loss  {summary.val_loss:.4f}",
        f"  unigram baseline {summary.unigram_loss:.4f}  (entropy of the training split's "
        "token frequencies, nats)",
        training,
        f"  tokens dropped   {dropped}",
        f"  outputs in {run_dir}/: {', '.join(outputs)}",
    ])
