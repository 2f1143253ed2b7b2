"""The training job's configuration: TrainConfig, its checks, and the command-line flags.

Everything a run depends on lives in two frozen dataclasses written to the run folder's
config.json: TrainConfig (optimizer, schedule, data, cadence) and the model's ModelConfig (a
preset with overrides). Both are validated before anything is compiled; an error names the field
and its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import typing
from typing import Any

import jax
import numpy as np

from nodrop._fields import is_finite_number, is_int, requirer, unknown_fields
from nodrop.models import PRESETS, ModelConfig, preset
from nodrop.moe.block import FP8_MODES, FP8_WEIGHT_GRADIENTS, ROUTER_MATMULS
from nodrop.parallel import parse_mesh_spec
from nodrop.train import tokenizer


MAX_SEED = 2**63 - 1  # jax.random.key's largest seed


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field and its flag."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    preset, model_overrides: the model (`nodrop.models.preset(preset, **model_overrides)`).
    data: None for the Python standard library's .py files, else a path (see nodrop.train.data).
    tokenizer: None (text as bytes, token-id files as they are), "bpe" (a byte-level BPE of
      model.vocab_size trained on the training split) or a Hugging Face tokenizer.json
      (nodrop.train.tokenizer).
    steps, batch_size, seq_len: optimizer steps; sequences per step; tokens per sequence (None:
      the model's seq_len, its longest).
    lr, warmup_steps, min_lr_ratio: linear warm-up to lr over warmup_steps (None: a tenth of
      steps), then cosine decay to lr * min_lr_ratio at `steps`.
    weight_decay, beta1, beta2, adam_eps: AdamW (decay applied to matrices only, not to norm
      scales). grad_clip: global-norm clipping threshold (0: off). fused_adamw: the step in
      one engine call per parameter (nodrop.ops.adamw), which also sums the update's norm;
      False runs optax's (the same arithmetic and state; XLA reads the update back to sum it).
      compute_dtype_gradients: on one device, the weights the model reads only in its compute
      dtype are cast to it before the step (nodrop.models.cast_compute_weights), so their
      gradients come in that dtype: the same step bit for bit, without float32 copies of
      those gradients in memory. False, or on a mesh (whose gradient reductions stay float32),
      they are cast at each use and their gradients are float32.
    aux_loss_coef, z_loss_coef: weights of each MoE layer's load-balancing and router z-losses,
      summed over the MoE layers and added to the cross-entropy. seq_aux_loss_coef: the same
      for DeepSeek-V3's sequence-wise balance loss (0: off).
    bias_update_rate, bias_update_rule: aux-loss-free balancing (DeepSeek-V3): after every
      optimizer step each expert's bias moves by the rate (0: off) times the sign of its load
      error ("sign", DeepSeek-V3's rule) or times its relative load error clipped to 1
      ("proportional"; nodrop.moe.updated_expert_bias). None: DEFAULT_BIAS_UPDATE_RATE and
      DEFAULT_BIAS_UPDATE_RULE of the model's score function.
    router_lr_scale: multiplies the learning rate of the MoE routers' weights.
    eval_every, eval_batches: validation every N steps (and at the end) on eval_batches batches;
      eval_every None: steps / DEFAULT_EVALUATIONS, so a run of any length has about that many.
    checkpoint_every, keep_checkpoints: Orbax checkpoint every N steps (and at the end), keeping
      the newest few; checkpoint_every 0 saves none (benchmark runs: a GPU preset's state is
      tens of GB), and such a run cannot be resumed. log_every: metrics are fetched from the device (one sync) every N steps.
    seed: model initialisation and data order.
    profile: 'START:STOP' traces steps START to STOP (1-based, inclusive) with the JAX profiler
      into RUN/tensorboard/plugins/profile/ (TensorBoard's profile plugin; Perfetto reads its
      perfetto_trace.json.gz); None: no trace. The traced steps run slower, timed apart.
    mesh: None (one device) or a device mesh 'data=2,fsdp=1,expert=4' (axes left out are 1,
      nodrop.parallel.make_mesh) over every device: the batch split over data x fsdp x expert,
      the experts over expert (expert parallelism), the dense matrices over fsdp.
    """

    preset: str = "tiny"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    data: str | None = None
    tokenizer: str | None = None
    steps: int = 400
    batch_size: int = 16
    seq_len: int | None = None
    lr: float = 3e-3
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    fused_adamw: bool = True
    compute_dtype_gradients: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    seq_aux_loss_coef: float = 0.0
    bias_update_rate: float | None = None
    bias_update_rule: str | None = None
    router_lr_scale: float = 1.0
    eval_every: int | None = None
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    seed: int = 0
    mesh: str | None = None
    profile: str | None = None

    def __post_init__(self):
        require = requirer(self, describe, ConfigError)

        def number(field: str) -> bool:
            return is_finite_number(getattr(self, field))

        def integer(field: str, low: int) -> None:
            value = getattr(self, field)
            require(is_int(value) and value >= low, field,
                    "a positive int" if low == 1 else f"an int >= {low}")

        require(self.preset in PRESETS, "preset", f"one of {sorted(PRESETS)}")
        require(isinstance(self.model_overrides, dict), "model_overrides", "a dict")
        require(self.data is None or isinstance(self.data, str), "data", "a path or None")
        require(self.tokenizer is None or (isinstance(self.tokenizer, str) and self.tokenizer),
                "tokenizer", "None, 'bpe' or the path of a tokenizer.json")
        for field in ("steps", "batch_size", "eval_batches", "keep_checkpoints", "log_every"):
            integer(field, 1)
        if self.eval_every is not None:
            integer("eval_every", 1)
        integer("checkpoint_every", 0)
        # JAX's PRNG keys take a seed that fits a signed 64-bit integer.
        require(is_int(self.seed) and 0 <= self.seed <= MAX_SEED, "seed",
                f"an int in [0, {MAX_SEED}]")
        if self.seq_len is not None:
            integer("seq_len", 1)
        if self.warmup_steps is not None:
            integer("warmup_steps", 0)
            require(self.warmup_steps <= self.steps, "warmup_steps",
                    f"at most steps={self.steps}")
        require(number("lr") and self.lr > 0, "lr", "a positive finite number")
        require(number("min_lr_ratio") and 0 <= self.min_lr_ratio <= 1, "min_lr_ratio",
                "a number in [0, 1]")
        for field in ("beta1", "beta2"):
            require(number(field) and 0 <= getattr(self, field) < 1, field,
                    "a number in [0, 1)")
        require(number("adam_eps") and self.adam_eps > 0, "adam_eps", "a positive number")
        for field in ("weight_decay", "grad_clip", "aux_loss_coef", "z_loss_coef",
                      "seq_aux_loss_coef"):
            require(number(field) and getattr(self, field) >= 0, field,
                    "a finite number >= 0")
        require(isinstance(self.fused_adamw, bool), "fused_adamw", "true or false")
        require(isinstance(self.compute_dtype_gradients, bool), "compute_dtype_gradients",
                "true or false")
        require(number("router_lr_scale") and self.router_lr_scale > 0, "router_lr_scale",
                "a positive finite number")
        require(self.bias_update_rate is None
                or (number("bias_update_rate") and self.bias_update_rate >= 0),
                "bias_update_rate", "a finite number >= 0 (or None for the preset's default)")
        require(self.bias_update_rule in (None, "sign", "proportional"), "bias_update_rule",
                "'sign' or 'proportional' (or None for the preset's default)")
        if self.mesh is not None:
            self.mesh_shape()  # raises for a malformed spec
        if self.profile is not None:
            require(self.profile_steps()[1] <= self.steps, "profile",
                    f"steps within 1..steps={self.steps}")

    def profile_steps(self) -> tuple[int, int] | None:
        """(START, STOP) of `profile`; None without one."""
        if self.profile is None:
            return None
        match = isinstance(self.profile, str) and re.fullmatch(r"(\d+):(\d+)", self.profile)
        if not match or not 1 <= int(match[1]) <= int(match[2]):
            raise ConfigError(f"{describe('profile')} must be 'START:STOP' with 1 <= START <= "
                              f"STOP, got {self.profile!r}")
        return int(match[1]), int(match[2])

    def mesh_shape(self) -> dict[str, int] | None:
        """{'data': .., 'fsdp': .., 'expert': ..} of `mesh`; None without one."""
        if self.mesh is None:
            return None
        if not isinstance(self.mesh, str):
            raise ConfigError(f"{describe('mesh')} must be a spec like 'data=2,expert=4' or None, "
                              f"got {self.mesh!r}")
        try:
            return parse_mesh_spec(self.mesh, name="--mesh")
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def model_config(self) -> ModelConfig:
        """The model: the preset with the overrides, validated; raises ConfigError naming the
        field."""
        try:
            model = preset(self.preset, **self.model_overrides)
        except TypeError as error:  # an unknown field
            raise ConfigError(f"--set: {error}") from None
        except ValueError as error:
            message = re.sub(r"^ModelConfig\.(\w+)", lambda m: describe_model(m[1]), str(error))
            raise ConfigError(message) from None
        if (self.mesh_shape() or {}).get("expert", 1) > 1:
            # The mesh's expert axis is what the MoE layers' expert parallelism runs on.
            if model.capacity_factor is not None:
                raise ConfigError(
                    f"{describe_model('capacity_factor')} must be none (dropless) on a mesh "
                    f"with an expert axis (--mesh {self.mesh}), got {model.capacity_factor}")
            model = model.replace(expert_parallel=True)
        return model

    def resolved(self, model: ModelConfig) -> TrainConfig:
        """A copy with the defaults that depend on the model or on other fields filled in
        (seq_len, bias_update_rate and _rule, warmup_steps, eval_every), and the checks that need the
        model."""
        seq_len = model.seq_len if self.seq_len is None else self.seq_len
        if seq_len > model.seq_len:
            raise ConfigError(
                f"{describe('seq_len')} must be at most the model's seq_len={model.seq_len} "
                f"(the longest sequence it accepts; raise it with --set seq_len={seq_len}), "
                f"got {seq_len}")
        rate = (DEFAULT_BIAS_UPDATE_RATE[model.score_function] if self.bias_update_rate is None
                else self.bias_update_rate)
        rule = (DEFAULT_BIAS_UPDATE_RULE[model.score_function] if self.bias_update_rule is None
                else self.bias_update_rule)
        warmup = self.steps // 10 if self.warmup_steps is None else self.warmup_steps
        eval_every = (max(1, self.steps // DEFAULT_EVALUATIONS) if self.eval_every is None
                      else self.eval_every)
        return dataclasses.replace(self, seq_len=seq_len, bias_update_rate=rate,
                                   bias_update_rule=rule,
                                   warmup_steps=warmup, eval_every=eval_every)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> TrainConfig:
        unknown = unknown_fields(cls, fields)
        if unknown:
            raise ConfigError(f"unknown training config fields {unknown}")
        return cls(**fields)


# The expert-bias step by score function, in the units the bias moves (nodrop.topk_router):
# softmax logits, sigmoid scores. DeepSeek-V3 moves its sigmoid biases by 1e-3 a step over
# batches of millions of tokens and tens of thousands of steps; runs of hundreds to thousands of
# steps need the routers balanced sooner. Measured over steps 20-60 (docs/quality.md, section
# 9): with the sign rule a softmax rate of 0.1 held qwen3's worst layer at 1.71 (0.03 let it reach
# 2.7; 0.3 oscillated at 2.3); the proportional rule at 0.3 held it at 1.42 and balanced tiny,
# small and mixtral as well or better, where at 1.0 it oscillated. Sigmoid: sign 1e-2 beat 5e-3
# and 3e-2 on deepseek.
DEFAULT_BIAS_UPDATE_RATE = {"softmax": 0.3, "sigmoid": 1e-2}
DEFAULT_BIAS_UPDATE_RULE = {"softmax": "proportional", "sigmoid": "sign"}

# Evaluations per run when --eval-every is not given: a fixed cadence would give a 30-step run
# one point and a 20000-step run hundreds.
DEFAULT_EVALUATIONS = 10

# Fields that may change when a run is resumed: they do not change what is computed (steps
# extends or shortens the run, and with it the cosine schedule's remaining steps; mesh only
# where the state lives, up to float32 rounding: Orbax reshards the checkpoint onto it;
# fused_adamw and compute_dtype_gradients only which kernels run the same step on the same
# state).
RESUMABLE_CHANGES = ("steps", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "log_every", "mesh", "profile", "fused_adamw", "compute_dtype_gradients")

# The GPU presets' training defaults (the tiny preset's are TrainConfig's own).
# Their routers read a 2048-wide residual stream: Adam moves every router weight by about lr a
# step, so a logit by about lr * hidden, 16 times faster than on `tiny`. A tenth of the lr
# narrowed dropless's gap to capacity 1.25 on mixtral (docs/quality.md).
# They train on subword tokens: with bytes, one token (the space, 28% of the bytes) would fill
# more than an expert's share of slots wherever routing follows token identity, as it does at
# init; the BPE's most frequent token is under 5%. A load-balancing weight of 0.1 held mixtral's
# and deepseek's late layers near balance through the warm-up, where 0.01 let them reach 3.0
# and 5.1; on qwen3 it lowered dropless's loss on two seeds of 300 steps. docs/quality.md.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    **{name: dict(steps=2000, batch_size=16, lr=3e-4, router_lr_scale=0.1,
                  checkpoint_every=500, tokenizer="bpe", aux_loss_coef=0.1)
       for name in ("mixtral", "deepseek", "qwen3")},
    "small": dict(steps=2000, batch_size=16, lr=1e-3, checkpoint_every=500, tokenizer="bpe"),
}


def describe(field: str) -> str:
    return f"{field} (--{field.replace('_', '-')})"


def describe_model(field: str) -> str:
    flag = _MODEL_FLAGS.get(field, f"--set {field}=...")
    return f"model.{field} ({flag})"


def build(overrides: dict[str, Any]) -> tuple[TrainConfig, ModelConfig]:
    """TrainConfig and ModelConfig from the preset's defaults and `overrides` (TrainConfig
    fields; model_overrides holds the ModelConfig ones), resolved and validated."""
    overrides = dict(overrides)
    name = overrides.get("preset", TrainConfig.preset)
    if name not in PRESETS:
        raise ConfigError(f"{describe('preset')} must be one of {sorted(PRESETS)}, got {name!r}")
    config = TrainConfig(**{**PRESET_DEFAULTS.get(name, {}), **overrides})
    if config.tokenizer not in (None, "bpe") and "vocab_size" not in config.model_overrides:
        # A given tokenizer sets the vocabulary (a trained BPE is sized by it instead).
        config = dataclasses.replace(config, model_overrides={
            **config.model_overrides, "vocab_size": tokenizer.vocab_size(config.tokenizer)})
    model = config.model_config()
    check_backend(model, jax.default_backend())
    return config.resolved(model), model


def check_backend(model: ModelConfig, platform: str) -> None:
    """Refuses, before anything compiles, a compute dtype the platform cannot run."""
    if platform == "cpu" and model.dtype == np.dtype("float16"):
        # XLA's CPU dot has no float16 x float16 -> float32 kernel, which every layer asks for.
        raise ConfigError(f"{describe_model('dtype')} must be float32 or bfloat16 on the CPU "
                          "(float16 needs a GPU), got 'float16'")


# --- command line --------------------------------------------------------------------------------

# ModelConfig fields with a flag of their own; any field can be set with --set FIELD=VALUE.
_MODEL_FLAGS = {"capacity_factor": "--capacity-factor", "moe_matmul": "--moe-matmul",
                "remat": "--remat", "dtype": "--dtype", "ep_buffer_factor": "--ep-buffer",
                "fp8": "--fp8", "fp8_weight_gradient": "--fp8-weight-gradient",
                "router_matmul": "--router-matmul"}


def add_arguments(parser: argparse.ArgumentParser, *, resume: bool = True) -> None:
    """The training flags. Every default is left out of the namespace (SUPPRESS), so that
    `overrides_from_args` sees exactly what the user gave: on --resume those are compared with
    the saved configuration, the rest taken from it."""
    S = argparse.SUPPRESS
    d = TrainConfig()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the --set table's layout
    parser.epilog = model_fields_help()
    run = parser.add_argument_group("run")
    run.add_argument("--config", default=S, metavar="FILE",
                     help="settings from a JSON or YAML file: a run's config.json (repeats that "
                          "run) or a mapping of training fields (steps: 100, lr: 0.001, "
                          "model_overrides: {hidden: 64}); flags given beside it win")
    run.add_argument("--preset", choices=sorted(PRESETS), default=S,
                     help=f"model preset (default {d.preset})")
    run.add_argument("--data", default=S, metavar="PATH",
                     help="text file, folder of text files, .bin (uint16 token ids) or .npy; "
                          "default: this Python's standard library .py files")
    run.add_argument("--tokenizer", type=_optional_str, default=S, metavar="none|bpe|FILE",
                     help="none: text as bytes (vocab 256), token files as they are; bpe: a "
                          "byte-level BPE of the model's vocab_size trained on the training "
                          "text; FILE: a Hugging Face tokenizer.json (default: bpe for the GPU "
                          "presets, none for tiny)")
    run.add_argument("--out", default=S, metavar="DIR",
                     help="output folder (default runs/<preset>-<YYYYmmdd-HHMMSS>, for "
                          "compare runs/compare-<preset>-<YYYYmmdd-HHMMSS>)")
    if resume:
        run.add_argument("--resume", action="store_true", default=S,
                         help="continue the run in --out from its latest complete checkpoint")
        run.add_argument("--resume-from", type=int, default=S, metavar="STEP",
                         help="continue the run in --out from its checkpoint of STEP (the "
                              "later ones are moved to checkpoints-set-aside/)")
    run.add_argument("--seed", type=int, default=S, help=f"default {d.seed}")
    run.add_argument("--steps", type=int, default=S, help=f"optimizer steps (default {d.steps})")
    run.add_argument("--batch-size", type=int, default=S,
                     help=f"sequences per step (default {d.batch_size})")
    run.add_argument("--seq-len", type=int, default=S,
                     help="tokens per sequence (default: the model's seq_len)")
    run.add_argument("--mesh", default=S, metavar="data=N,fsdp=N,expert=N",
                     help="train on a mesh over all devices (axes left out are 1): the batch "
                          "split over data x fsdp x expert, the experts over expert, the dense "
                          "matrices over fsdp (default: one device, no mesh)")
    run.add_argument("--no-progress", action="store_true", default=S,
                     help="no progress bar (one line per log interval instead)")
    opt = parser.add_argument_group("optimizer (AdamW, warm-up then cosine decay)")
    opt.add_argument("--lr", type=float, default=S, help=f"peak learning rate (default {d.lr})")
    opt.add_argument("--warmup-steps", type=int, default=S,
                     help="linear warm-up steps (default: a tenth of --steps)")
    opt.add_argument("--min-lr-ratio", type=float, default=S,
                     help=f"final lr / peak lr (default {d.min_lr_ratio})")
    opt.add_argument("--weight-decay", type=float, default=S, help=f"default {d.weight_decay}")
    opt.add_argument("--beta1", type=float, default=S, help=f"default {d.beta1}")
    opt.add_argument("--beta2", type=float, default=S, help=f"default {d.beta2}")
    opt.add_argument("--adam-eps", type=float, default=S, help=f"default {d.adam_eps}")
    opt.add_argument("--grad-clip", type=float, default=S,
                     help=f"global-norm clip, 0 for none (default {d.grad_clip})")
    opt.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=S,
                     help="the AdamW step and its update norm in one engine call per "
                          "parameter (the default); --no-fused-adamw runs optax's")
    opt.add_argument("--compute-dtype-gradients", action=argparse.BooleanOptionalAction,
                     default=S,
                     help="on one device, the gradients of the weights the model computes in "
                          "--dtype kept in that dtype (the default: the same step, without "
                          "float32 copies); --no-compute-dtype-gradients casts each weight at "
                          "use, with float32 gradients")
    moe = parser.add_argument_group("MoE losses and balancing")
    moe.add_argument("--aux-loss-coef", type=float, default=S,
                     help=f"load-balancing loss weight (default {d.aux_loss_coef})")
    moe.add_argument("--seq-aux-loss-coef", type=float, default=S,
                     help="sequence-wise load-balancing loss weight (DeepSeek-V3; default "
                          f"{d.seq_aux_loss_coef:g}: off)")
    moe.add_argument("--z-loss-coef", type=float, default=S,
                     help=f"router z-loss weight (default {d.z_loss_coef})")
    moe.add_argument("--bias-update-rate", type=float, default=S,
                     help="aux-loss-free expert-bias step, 0 for off (default "
                          f"{DEFAULT_BIAS_UPDATE_RATE['softmax']:g} for softmax routers, "
                          f"{DEFAULT_BIAS_UPDATE_RATE['sigmoid']:g} for sigmoid ones)")
    moe.add_argument("--bias-update-rule", choices=("sign", "proportional"), default=S,
                     help="expert-bias step per expert: rate * sign of its load error "
                          "(DeepSeek-V3's; the default for sigmoid routers) or rate * its "
                          "relative load error (the default for softmax routers)")
    moe.add_argument("--router-lr-scale", type=float, default=S,
                     help="multiplies the routers' learning rate (default 1; 0.1 for mixtral, "
                          "deepseek and qwen3)")
    cadence = parser.add_argument_group("evaluation, checkpoints, logs")
    cadence.add_argument("--eval-every", type=int, default=S,
                         help=f"validation every N steps and at the end (default: steps / "
                              f"{DEFAULT_EVALUATIONS}, at least 1)")
    cadence.add_argument("--eval-batches", type=int, default=S, help=f"default {d.eval_batches}")
    cadence.add_argument("--checkpoint-every", type=int, default=S,
                         help=f"default {d.checkpoint_every}; 0: no checkpoints")
    cadence.add_argument("--keep-checkpoints", type=int, default=S,
                         help=f"default {d.keep_checkpoints}")
    cadence.add_argument("--log-every", type=int, default=S,
                         help=f"steps between metric fetches (default {d.log_every})")
    cadence.add_argument("--profile", default=S, metavar="START:STOP",
                         help="trace steps START to STOP with the JAX profiler into "
                              "RUN/tensorboard/ (TensorBoard's profile tab, or Perfetto)")
    model = parser.add_argument_group("model overrides (on top of the preset)")
    model.add_argument("--capacity-factor", type=_optional_float, default=S, metavar="CF",
                       help="drop tokens past CF * T * k / E per expert; 'none' is dropless "
                            "(the default)")
    model.add_argument("--moe-matmul", choices=("nodrop", "ragged_dot"), default=S,
                       help="dropless expert matmuls: nodrop's grouped matmul (default) or "
                            "jax.lax.ragged_dot")
    model.add_argument("--remat", action=argparse.BooleanOptionalAction, default=S,
                       help="recompute each layer's activations in the backward pass")
    model.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=S,
                       help="compute dtype (parameters stay float32)")
    model.add_argument("--fp8", choices=FP8_MODES, default=S,
                       help="the experts' matmuls on FP8 (E4M3) operands: blockwise "
                            "(DeepSeek-V3's 1x128 and 128x128 scales), tensorwise (one scale "
                            "per tensor) or off (the default). On the GPU in bfloat16 the "
                            "forward and both gradients run nodrop's FP8 kernels; elsewhere "
                            "emulated by quantising and dequantising")
    model.add_argument("--fp8-weight-gradient", choices=FP8_WEIGHT_GRADIENTS, default=S,
                       help="under --fp8, the experts' weight gradients on the unquantised "
                            "activations and output gradients (unquantised, the default: no "
                            "transposed quantisation; on the GPU the bf16 kernel) or on FP8 "
                            "operands (fp8, DeepSeek-V3's recipe)")
    model.add_argument("--router-matmul", choices=ROUTER_MATMULS, default=S,
                       help="the router's float32 logits: for bfloat16 inputs, the float32 "
                            "weights split into three bfloat16 parts (split, the default: the "
                            "same exact products on a GPU's tensor cores), or one float32 GEMM "
                            "(float32)")
    model.add_argument("--ep-buffer", type=_buffer_factor, default=S, metavar="F|worst",
                       dest="ep_buffer_factor",
                       help="expert parallelism's receive buffer, F x the balanced load "
                            "(default 2; an overflowing step is undone and rerun with 4, then "
                            "worst); worst: sized for every token to one rank")
    model.add_argument("--set", action="append", default=S, metavar="FIELD=VALUE",
                       dest="model_set",
                       help="any ModelConfig field, e.g. --set num_layers=2 --set hidden=64 "
                            "(repeatable; the fields are listed below)")


_OPTION_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - {"preset", "model_overrides"}


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields the user gave (model ones under model_overrides): those of the
    --config file, overridden by the flags."""
    given = vars(args)
    from_file = read_config_file(given["config"]) if "config" in given else {}
    overrides = {**from_file, **{field: given[field] for field in _OPTION_FIELDS
                                 if field in given}}
    if "preset" in given:
        overrides["preset"] = given["preset"]
    for field in ("data", "tokenizer"):  # absolute, so a resume may run elsewhere
        if overrides.get(field) not in (None, "bpe"):
            overrides[field] = os.path.abspath(overrides[field])
    model = dict(from_file.get("model_overrides", {}))
    for text in given.get("model_set", []):
        field, value = parse_model_setting(text)
        model[field] = value
    for field, flag in _MODEL_FLAGS.items():
        if field in given:
            model[field] = given[field]
    if model:
        overrides["model_overrides"] = model
    return overrides


# The top-level keys of a run folder's config.json; only "train" configures (the model is the
# preset with train.model_overrides; "data", "tokens" and "environment" describe the run).
RUN_CONFIG_KEYS = ("train", "model", "data", "tokens", "environment")


def read_config_file(path: str) -> dict[str, Any]:
    """The TrainConfig fields of a --config file: JSON, or YAML (.yaml, .yml; needs PyYAML).
    The file is either a run folder's config.json, whose "train" record is taken (its "model",
    "data", "tokens" and "environment" are records of the run, not settings), or a mapping of
    TrainConfig fields. Unknown keys are refused, naming them."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it: {error.strerror or error}") from None
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); "
                              "or give the same settings as a .json file") from None
        try:
            fields = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"--config {path}: not valid YAML: {error}") from None
    else:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--config {path}: not valid JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"--config {path}: expected a mapping of training fields, got "
                          f"{type(fields).__name__}")
    if "train" in fields:  # a run folder's config.json
        unknown = sorted(set(fields) - set(RUN_CONFIG_KEYS))
        if unknown:
            raise ConfigError(f"--config {path}: unknown keys {unknown} beside 'train' (a run's "
                              f"config.json holds {list(RUN_CONFIG_KEYS)})")
        fields = fields["train"]
        if not isinstance(fields, dict):
            raise ConfigError(f"--config {path}: 'train' must be a mapping of training fields, "
                              f"got {type(fields).__name__}")
    unknown = unknown_fields(TrainConfig, fields)
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {unknown}; the training fields are "
                          f"{sorted(f.name for f in dataclasses.fields(TrainConfig))} (model "
                          "fields go under model_overrides)")
    overrides = fields.get("model_overrides", {})
    if not isinstance(overrides, dict):
        raise ConfigError(f"--config {path}: model_overrides must be a mapping of ModelConfig "
                          f"fields, got {overrides!r}")
    unknown = unknown_fields(ModelConfig, overrides)
    if unknown:
        raise ConfigError(f"--config {path}: unknown model_overrides keys {unknown}; the model "
                          f"fields are {sorted(f.name for f in dataclasses.fields(ModelConfig))}")
    return dict(fields)


# One line on each ModelConfig field, for --help (the --set table).
MODEL_FIELD_HELP = {
    "vocab_size": "tokens in the vocabulary (set by --tokenizer FILE; by token-id data)",
    "seq_len": "the longest sequence the model accepts",
    "num_layers": "decoder layers",
    "hidden": "width of the residual stream",
    "num_heads": "query heads",
    "num_kv_heads": "key/value heads (grouped-query attention; divides num_heads)",
    "head_dim": "width of each attention head",
    "dense_ffn": "SwiGLU width of the dense (non-MoE) layers",
    "num_experts": "experts per MoE layer",
    "k": "experts each token is routed to (top-k)",
    "expert_ffn": "SwiGLU width of each expert",
    "shared_ffn": "width of the shared experts every token goes through (0: none)",
    "score_function": "router scores: softmax or sigmoid",
    "num_groups": "expert groups for group-limited routing (1: off)",
    "topk_groups": "groups each token may pick experts from",
    "renormalize": "rescale each token's k routing weights to sum to 1",
    "scaling_factor": "multiplies the routing weights",
    "moe_every": "every n-th layer (after first_dense) is MoE, the others dense",
    "first_dense": "leading dense layers",
    "tie_embeddings": "the output head is the embedding table transposed",
    "capacity_factor": "token dropping past CF * T * k / E per expert (none: dropless)",
    "moe_matmul": "dropless expert matmuls: nodrop or ragged_dot",
    "rope_theta": "rotary embedding base",
    "norm_eps": "RMSNorm epsilon",
    "remat": "recompute each layer's activations in the backward pass",
    "expert_parallel": "experts split over the mesh's expert axis (set by --mesh)",
    "ep_buffer_factor": "expert parallelism's receive buffer, x the balanced load (none: worst)",
    "fp8": "the experts' FP8 recipe: off, blockwise or tensorwise (GPU kernels in bfloat16)",
    "fp8_weight_gradient": "under fp8, the experts' weight gradients: fp8 or unquantised",
    "router_matmul": "the router's float32 logits: float32 GEMM, or split (bfloat16 GEMMs)",
    "dtype": "compute dtype: float32, bfloat16 or float16",
    "param_dtype": "dtype of the master weights",
}


def model_fields_help() -> str:
    """The --set table: every ModelConfig field with its type, its default (the tiny preset's;
    the other presets change some) and what it means."""
    hints = typing.get_type_hints(ModelConfig)
    default = preset("tiny")
    rows = []
    for f in dataclasses.fields(ModelConfig):
        kind = hints[f.name]
        kind = getattr(kind, "__name__", None) if isinstance(kind, type) else str(kind)
        kind = {"Any": "dtype", None: str(hints[f.name])}.get(kind, kind).replace("typing.", "")
        value = getattr(default, f.name)
        value = np.dtype(value).name if f.name in ("dtype", "param_dtype") else value
        rows.append((f.name, kind, str(value), MODEL_FIELD_HELP[f.name]))
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["--set FIELD=VALUE fields (ModelConfig; defaults of the tiny preset, which the other "
             "presets change):"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row[:3], width)) + "  " + row[3]
              for row in rows]
    return "\n".join(lines)


def parse_model_setting(text: str) -> tuple[str, Any]:
    """'FIELD=VALUE' -> (field, value typed like the ModelConfig field)."""
    field, sep, value = text.partition("=")
    field = field.strip().replace("-", "_")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    if not sep or field not in fields:
        raise ConfigError(f"--set {text!r}: expected FIELD=VALUE with FIELD one of "
                          f"{sorted(fields)}")
    hints = typing.get_type_hints(ModelConfig)
    kind = hints[field]
    value = value.strip()
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError("expected true or false")
            return field, value.lower() in ("true", "1")
        if kind is int:
            return field, int(value)
        if kind is float:
            return field, float(value)
        if kind == (float | None):
            return field, _optional_float(value)
        return field, value  # str and dtype fields: ModelConfig checks the name
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise ConfigError(f"--set {text!r}: {error}") from None


def _optional_str(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text


def _buffer_factor(text: str) -> float | None:
    if text.strip().lower() == "worst":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'worst', got {text!r}") from None


def _optional_float(text: str) -> float | None:
    if text.strip().lower() in ("none", "null", "dropless"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None
