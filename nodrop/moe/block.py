"""The MoE block (Flax NNX): router -> permute -> SwiGLU experts -> un-permute, on nodrop's ops.

Dropless by default: every (token, slot) pair reaches its expert, so a token's output depends on
that token alone. With `capacity_factor` set, the block instead drops tokens the way most JAX
training runs do today (nodrop/moe/capacity.py), with the experts as one batched einsum over
[E, C, H] buffers; it is kept as the baseline to compare against. With `ops="reference"` the
same block runs on the pure-JAX references of nodrop's ops (nodrop/ops/reference.py): `nodrop
demo` checks one against the other. With `fp8` set, the experts' matmuls run one of the FP8
recipes of nodrop/ops/fp8.py, emulated (quantised and dequantised operands), but for the
blockwise recipe on nodrop's FP8 kernels on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from nodrop import _ffi
from nodrop._fields import is_finite_number, is_int, requirer
from nodrop.moe.capacity import capacity_rows, combine, dispatch
from nodrop.moe.losses import (load_balancing_loss, router_z_loss, sequence_balance_loss,
                               tokens_per_expert)
from nodrop.ops import reference
from nodrop.ops._checks import FLOAT_DTYPES
from nodrop.ops.fp8 import RECIPES as FP8_RECIPES
from nodrop.ops.fp8 import WEIGHT_GRADIENTS as FP8_WEIGHT_GRADIENTS
from nodrop.ops.fp8 import fp8_grouped_matmul, permute_fp8, tensor_scale
from nodrop.ops.grouped_matmul import grouped_matmul
from nodrop.ops.permute import permute, unpermute
from nodrop.ops.router import SCORE_FUNCTIONS, topk_router
from nodrop.parallel import expert as ep_exchange
from nodrop.parallel.mesh import (EXPERT_AXIS, check_batch, check_experts, expert_shards,
                                  logical_metadata, logical_param, token_axes)

EXPERT_MATMULS = ("nodrop", "ragged_dot")
ROUTER_MATMULS = ("float32", "split")
FP8_MODES = ("off", *FP8_RECIPES)
# Chosen by measurement (docs/performance.md, "FP8 grouped matmul"): the FP8 weight gradient's
# transposed quantisation costs more than its faster kernel saves on most layer shapes.
DEFAULT_FP8_WEIGHT_GRADIENT = "unquantised"
# config.ops -> the implementation of each op the block calls.
OPS = {
    "nodrop": dict(topk_router=topk_router, permute=permute, grouped_matmul=grouped_matmul,
                   unpermute=unpermute),
    "reference": dict(topk_router=reference.topk_router, permute=reference.permute,
                      grouped_matmul=reference.grouped_matmul, unpermute=reference.unpermute),
}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE block.

    num_experts: E. k: experts per token. hidden: H. ffn: F, each expert's SwiGLU width.
    score_function, num_groups, topk_groups, renormalize, scaling_factor: the router, as in
      `nodrop.topk_router` (softmax top-k: Mixtral, Qwen; sigmoid with group-limited top-k:
      DeepSeek-V3).
    shared_ffn: width of a dense SwiGLU applied to every token and added (0: none).
    capacity_factor: None for dropless; else each expert takes C = ceil(cf * T * k / E) slots
      and drops the rest.
    matmul: the dropless experts' grouped matmul: "nodrop" (nodrop's grouped GEMM) or
      "ragged_dot" (`jax.lax.ragged_dot`, XLA's own lowering; kept as a peer to measure against).
    ops: the implementation of the router, permute, grouped matmul ("nodrop" matmul) and
      unpermute: "nodrop" (nodrop's ops, on its C++/CUDA engine) or "reference" (their pure-JAX
      references in nodrop/ops/reference.py, to check the former against).
    residual_init_scale: multiplies the std of the down projections' lecun_normal init (the
      model sets 1 / sqrt(2 * num_layers): they write into the residual stream).
    dtype: compute dtype; None (the default, Flax's convention) computes in the dtype of the
      block's input x. The presets and the trainer set it (bfloat16 is the GPU setting).
    param_dtype: master weights.
    expert_parallel: split the experts over the `expert` axis of the mesh set with
      `jax.set_mesh` (nodrop.parallel.make_mesh); see MoEBlock. Without such an axis, or with
      size 1, the block is the single-device one. Dropless only (capacity_factor None).
    ep_buffer_factor: expert parallelism's receive buffer, as a factor of the balanced load
      (nodrop.parallel.expert.pair_capacity); None sizes it for the worst case (every token to
      one rank), where it cannot overflow.
    fp8: the experts' matmuls (gate_up and down, forward and both gradients) on FP8 operands:
      "off" (the default), "blockwise" (DeepSeek-V3's 1x128 / 128x128 scales) or "tensorwise"
      (one scale per tensor), as `nodrop.fp8_grouped_matmul`. Emulated: the operands are
      quantised and dequantised, then multiplied in float32 by the block's matmul (or, with
      capacity_factor, its einsum); on nodrop's ops on the GPU, in bfloat16, the forward and
      both gradients run nodrop's FP8 kernels instead. The router, the shared
      experts and everything outside the block stay as they are.
    fp8_weight_gradient: under an fp8 recipe, the experts' weight gradients on the unquantised
      activations and output gradients ("unquantised", the default: without the transposed
      quantisation the FP8 one needs, faster on every layer shape timed but Mixtral's gate and
      up projection; see docs/performance.md) or on FP8 operands ("fp8", DeepSeek-V3's
      recipe), as `nodrop.fp8_grouped_matmul`'s `weight_gradient`.
    router_matmul: how the router's float32 logits are multiplied (see `router_logits`):
      "split" (the default: the float32 weights split exactly into three bfloat16 parts, so the
      same products run as bfloat16 GEMMs with float32 accumulation, on tensor cores; where the
      router's input is not bfloat16 it runs the float32 GEMM) or "float32" (one float32 GEMM,
      on a GPU's CUDA cores).
    """

    num_experts: int
    k: int
    hidden: int
    ffn: int
    score_function: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = False
    scaling_factor: float = 1.0
    shared_ffn: int = 0
    capacity_factor: float | None = None
    matmul: str = "nodrop"
    ops: str = "nodrop"
    residual_init_scale: float = 1.0
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    expert_parallel: bool = False
    ep_buffer_factor: float | None = 2.0
    fp8: str = "off"
    fp8_weight_gradient: str = DEFAULT_FP8_WEIGHT_GRADIENT
    router_matmul: str = "split"

    def __post_init__(self) -> None:
        require = requirer(self, lambda field: f"MoEConfig.{field}")
        for field in ("num_experts", "hidden", "ffn"):
            require(is_int(getattr(self, field)) and getattr(self, field) >= 1, field,
                    "a positive int")
        require(is_int(self.k) and 1 <= self.k <= self.num_experts, "k",
                f"an int in [1, num_experts={self.num_experts}]")
        require(self.score_function in SCORE_FUNCTIONS, "score_function",
                f"one of {SCORE_FUNCTIONS}")
        require(is_int(self.num_groups) and self.num_groups >= 1
                and self.num_experts % self.num_groups == 0, "num_groups",
                f"a positive int dividing num_experts={self.num_experts}")
        require(is_int(self.topk_groups) and 1 <= self.topk_groups <= self.num_groups,
                "topk_groups", f"an int in [1, num_groups={self.num_groups}]")
        selectable = self.topk_groups * (self.num_experts // self.num_groups)
        require(self.k <= selectable, "k",
                f"at most the {selectable} experts of the topk_groups={self.topk_groups} "
                "groups that may be chosen")
        require(isinstance(self.renormalize, bool), "renormalize", "a bool")
        require(is_finite_number(self.scaling_factor) and self.scaling_factor > 0,
                "scaling_factor", "a positive finite number")
        require(is_int(self.shared_ffn) and self.shared_ffn >= 0, "shared_ffn",
                "an int >= 0 (0: no shared experts)")
        require(self.capacity_factor is None or (
            is_finite_number(self.capacity_factor) and self.capacity_factor > 0),
            "capacity_factor", "None (dropless) or a positive finite number")
        require(self.matmul in EXPERT_MATMULS, "matmul", f"one of {EXPERT_MATMULS}")
        require(self.ops in OPS, "ops", f"one of {tuple(OPS)}")
        require(is_finite_number(self.residual_init_scale) and self.residual_init_scale > 0,
                "residual_init_scale", "a positive finite number")
        require(isinstance(self.expert_parallel, bool), "expert_parallel", "a bool")
        require(not self.expert_parallel or self.capacity_factor is None, "capacity_factor",
                "None (dropless) with expert_parallel")
        require(self.ep_buffer_factor is None or (
            is_finite_number(self.ep_buffer_factor) and self.ep_buffer_factor > 0),
            "ep_buffer_factor", "None (the worst case) or a positive finite number")
        require(self.fp8 in FP8_MODES, "fp8", f"one of {FP8_MODES}")
        require(self.fp8_weight_gradient in FP8_WEIGHT_GRADIENTS, "fp8_weight_gradient",
                f"one of {FP8_WEIGHT_GRADIENTS}")
        require(self.router_matmul in ROUTER_MATMULS, "router_matmul",
                f"one of {ROUTER_MATMULS}")
        for field in ("dtype", "param_dtype"):
            if field == "dtype" and self.dtype is None:
                continue  # the input's dtype
            try:
                dtype = jnp.dtype(getattr(self, field))
            except TypeError:
                dtype = None
            require(dtype in FLOAT_DTYPES, field, "float32, float16 or bfloat16" + (
                " (or None: the input's dtype)" if field == "dtype" else ""))
            object.__setattr__(self, field, dtype)  # canonical, so configs compare equal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
    """What one block call reports besides its output.

    load_balancing_loss: Switch/GShard loss over every token of the call (1 when balanced).
    sequence_balance_loss: the same loss per sequence, averaged over the sequences
      (DeepSeek-V3's sequence-wise term; a [T, H] input counts as one sequence).
    z_loss: ST-MoE router z-loss.
    tokens_per_expert: [E] int32, the (token, slot) pairs the router sent to each expert, before
      any drop.
    dropped_fraction: the fraction of the T*k slots that reached no expert (0 when dropless).
    max_over_mean: the busiest expert's load over the mean load (1 when balanced).
    overflow: bool scalar, true when expert parallelism's receive buffer was too small: then
      rows were not computed and the output must not be used (see MoEBlock). Always false on
      one device.
    """

    load_balancing_loss: jax.Array
    sequence_balance_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped_fraction: jax.Array
    max_over_mean: jax.Array
    overflow: jax.Array


class ExpertBias(nnx.Variable):
    """The aux-loss-free balancing bias [E] (DeepSeek-V3): moves the router scores for
    selection only (added to sigmoid scores, to softmax logits; see `nodrop.topk_router`). Not
    a Param, so optimizers and `nnx.grad` leave it alone; the trainer sets it after each step
    with `updated_expert_bias`."""


def updated_expert_bias(bias: jax.Array, tokens_per_expert: jax.Array, rate: float,
                        rule: str = "sign") -> jax.Array:
    """Aux-loss-free balancing step: overloaded experts' bias falls, underloaded ones' rises.

    rule "sign" (DeepSeek-V3): bias + rate * sign(mean load - load), every expert by rate.
    rule "proportional": bias + rate * clip((mean load - load) / mean load, -1, 1), so an expert
    at twice the mean load or more moves by rate and one near the mean barely moves: a larger
    rate then corrects the busiest experts faster without making the balanced ones oscillate.
    Call it after the optimizer step and store the result: `block.expert_bias[...] =
    updated_expert_bias(block.expert_bias[...], aux.tokens_per_expert, rate)`. Pass the global
    batch's counts: under data parallelism where each call sees one shard (shard_map, pmap),
    psum tokens_per_expert over the data axis first.
    """
    load = tokens_per_expert.astype(jnp.float32)
    mean = load.mean()
    if rule == "sign":
        return bias + rate * jnp.sign(mean - load)
    if rule == "proportional":
        return bias + rate * jnp.clip((mean - load) / jnp.maximum(mean, 1.0), -1.0, 1.0)
    raise ValueError(f"updated_expert_bias: rule must be 'sign' or 'proportional', got {rule!r}")


class MoEBlock(nnx.Module):
    """x [B, S, H] or [T, H] -> (y of x's shape in config.dtype, MoEAux).

    The compute dtype is config.dtype, or x's dtype where it is None (the default).
    Parameters (float32 masters by default, cast to the compute dtype at use): router [H, E];
    gate_up [E, H, 2F] with each expert's gate in [..., :F] and up in [..., F:] (one grouped matmul
    instead of two); down [E, F, H]; with shared experts shared_gate_up [H, 2Fs], shared_down
    [Fs, H]. Plus the non-trainable expert_bias [E] (ExpertBias), zero unless the trainer moves it.

    The losses and counts cover every token of the call: a [B, S] batch is flattened, so the
    balance is that of the whole batch, not of each sequence. Under jit with the batch sharded
    across devices that is the global batch. Where each call sees only its shard (shard_map,
    pmap) they are the shard's statistics and the caller must aggregate them: psum
    tokens_per_expert over the data axis before `updated_expert_bias` and the load metrics;
    the load-balancing loss is then the shard's (micro-batch) loss, not the global one.

    Expert parallelism (config.expert_parallel, under `jax.set_mesh(mesh)` with an `expert`
    axis of size ep > 1, nodrop.parallel.make_mesh): the block runs in `jax.shard_map`, the
    batch (x's first dimension) split over the mesh's data, fsdp and expert axes, gate_up and
    down over expert (each rank holds E/ep experts; E and the batch must divide). Each rank
    routes its tokens, sends their rows to the ranks holding their experts, runs its experts
    and combines the rows that come back (nodrop.parallel.expert). The router, the expert bias
    and the shared experts are replicated. The losses and counts are those of the whole batch,
    the same on every device, as on one device.

    The receive buffers are bounded (config.ep_buffer_factor). When routing sends more rows
    to a rank than its buffer holds, the rows past it are not computed and aux.overflow is true
    on every device: that call's output, losses and gradients must not be used. The caller
    discards the step (parameters, optimizer state and step count unchanged) and reruns the
    batch with a larger factor, or with None (the worst case, which cannot overflow). No row is
    ever dropped silently: dropped_fraction counts the rows cut, and is 0 without overflow.
    """

    # The weights every path reads only cast to the compute dtype (the router and the bias are
    # read in float32): nodrop.models.cast_compute_weights may cast them beforehand.
    COMPUTE_WEIGHTS = ("gate_up", "down", "shared_gate_up", "shared_down")

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        num_experts, hidden, ffn = config.num_experts, config.hidden, config.ffn
        dense_init = nnx.initializers.lecun_normal()
        expert_init = nnx.initializers.lecun_normal(batch_axis=0)  # fan-in per expert
        expert_down_init = residual_init(config.residual_init_scale, batch_axis=0)

        def param(init, shape, axes):
            return logical_param(init(rngs.params(), shape, config.param_dtype), axes)

        # Logical axis names (nodrop.parallel.LOGICAL_AXIS_RULES maps them to the mesh): the
        # experts of gate_up and down are "expert"; the router's and the bias's expert axis is
        # "routing", which the expert mesh axis does not split (every rank routes every token).
        self.router = param(dense_init, (hidden, num_experts), ("embed", "routing"))
        self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32),
                                      **logical_metadata(("routing",)))
        self.gate_up = param(expert_init, (num_experts, hidden, 2 * ffn),
                             ("expert", "embed", "mlp"))
        self.down = param(expert_down_init, (num_experts, ffn, hidden), ("expert", "mlp", "embed"))
        shared = config.shared_ffn
        self.shared_gate_up = (param(dense_init, (hidden, 2 * shared), ("embed", "mlp"))
                               if shared else None)
        self.shared_down = (param(residual_init(config.residual_init_scale), (shared, hidden),
                                  ("mlp", "embed")) if shared else None)

    # Named scopes mark the profile's regions (bench/gpu_profile.py): router, experts,
    # shared_experts, and the rest of moe (permute and unpermute, or dispatch and combine).
    @jax.named_scope("moe")
    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux]:
        cfg = compute_config(self.config, x)
        if x.ndim not in (2, 3) or x.shape[-1] != cfg.hidden:
            raise ValueError(f"x must be [B, S, H] or [T, H] with H = hidden = {cfg.hidden}, "
                             f"got shape {tuple(x.shape)}")
        shared = (self.shared_gate_up[...], self.shared_down[...]) if cfg.shared_ffn else ()
        mesh = jax.sharding.get_abstract_mesh()
        if cfg.expert_parallel and not mesh.empty and expert_shards(mesh) > 1:
            return self._expert_parallel(cfg, x, mesh, shared)
        flat = x.reshape(-1, cfg.hidden)
        tokens = flat.astype(cfg.dtype)
        num_slots = tokens.shape[0] * cfg.k
        logits, weights, ids = _route(cfg, flat, self.router[...], self.expert_bias[...])
        ops = OPS[cfg.ops]
        gate_up = self.gate_up[...].astype(cfg.dtype)
        down = self.down[...].astype(cfg.dtype)

        if cfg.capacity_factor is None:
            rows, group_sizes, row_map, rows_fp8 = _permute(cfg, tokens, ids, cfg.num_experts)
            out_rows = _experts(cfg, rows, group_sizes, gate_up, down, rows_fp8)
            y = ops["unpermute"](out_rows, row_map, weights)
            load = processed = group_sizes  # measured, not assumed: what the experts received
        else:
            capacity = capacity_rows(num_slots, cfg.num_experts, cfg.capacity_factor)
            rows, row_map = dispatch(tokens, ids, cfg.num_experts, capacity)
            # Every expert's buffer is C rows: groups of C rows, on the batched einsum.
            sizes = jnp.full((cfg.num_experts,), capacity, jnp.int32)
            matmul = _fp8_or(cfg, _capacity_einsum)
            with jax.named_scope("experts"):
                out = swiglu(lambda a, w: matmul(a, w, sizes), rows, gate_up, down)
            y = combine(out, row_map, weights)
            load = tokens_per_expert(ids, cfg.num_experts)
            processed = jnp.minimum(load, capacity)

        y = _add_shared(cfg, y, tokens, shared)
        aux = _aux(cfg, logits, ids, load, processed.sum(), jnp.zeros((), bool),
                   num_sequences=_num_sequences(x))
        return y.astype(cfg.dtype).reshape(x.shape), aux

    def _expert_parallel(self, cfg, x, mesh, shared):
        """The block in `jax.shard_map` over `mesh`: tokens split over its token axes, experts
        over its expert axis; each rank routes its tokens, sends their rows to the ranks holding
        their experts (nodrop.parallel.expert), runs its experts and combines what comes back."""
        check_experts(cfg.num_experts, mesh, name="MoEConfig.num_experts")
        check_batch(x.shape[0], mesh, name="x.shape[0]")
        axes = token_axes(mesh)
        tokens_spec = jax.P(axes)
        replicated, by_expert = jax.P(), jax.P(EXPERT_AXIS)
        per_rank = jax.shard_map(
            functools.partial(_expert_parallel_rank, cfg, axes), mesh=mesh,
            in_specs=(tokens_spec, replicated, replicated, by_expert, by_expert,
                      (replicated,) * len(shared)),
            out_specs=(tokens_spec, replicated))
        return per_rank(x, self.router[...], self.expert_bias[...], self.gate_up[...],
                        self.down[...], shared)


def compute_config(config: MoEConfig, x: jax.Array) -> MoEConfig:
    """config with its compute dtype set: config.dtype, or x's dtype where that is None."""
    if config.dtype is not None:
        return config
    dtype = jax.dtypes.canonicalize_dtype(jnp.result_type(x))
    if dtype not in FLOAT_DTYPES:
        raise TypeError("x must be float32, float16 or bfloat16 where MoEConfig.dtype is None "
                        f"(the block computes in x's dtype), got {dtype.name}")
    return dataclasses.replace(config, dtype=dtype)


@jax.named_scope("router")
def _route(cfg: MoEConfig, flat, router, expert_bias):
    """flat [T, H] -> (logits [T, E] float32, weights [T, k], ids [T, k])."""
    # The router runs in float32 whatever the compute dtype: rounding its inputs or logits to
    # bf16 would flip near-tied expert choices.
    logits = router_logits(flat, router.astype(jnp.float32), cfg.router_matmul)
    weights, ids = OPS[cfg.ops]["topk_router"](
        logits, cfg.k, score_function=cfg.score_function, expert_bias=expert_bias,
        num_groups=cfg.num_groups, topk_groups=cfg.topk_groups, renormalize=cfg.renormalize,
        scaling_factor=cfg.scaling_factor)
    return logits, weights, ids


def router_logits(x: jax.Array, router: jax.Array, method: str = "float32") -> jax.Array:
    """float32 logits x [T, H] @ router [H, E] (float32), with x's values as they are.

    method "float32": one float32 GEMM at the highest precision. "split" (x bfloat16): the same
    exact products as bfloat16 GEMMs accumulated in float32 (`_split_router_logits`); for any
    other dtype of x, "float32". The gradient of x is in x's dtype, the router's float32.
    """
    if method == "split" and x.dtype == jnp.bfloat16:
        return _split_router_logits(*_ffi.match_vma(x, router))
    return jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)


def _bfloat16_parts(v: jax.Array) -> list[jax.Array]:
    """Three bfloat16 arrays whose float32 sum is float32 v exactly: each part is the leading
    16 bits of what the parts before it left (sign, exponent and 7 of the 24 significant bits),
    so the rest after two parts has at most 8 significant bits and is the third. (Cut by a
    bit mask, not by rounding to bfloat16: XLA may drop a float32 -> bfloat16 -> float32 round
    trip, and the rest would then be zero.) Exact for |v| >= 2^-103, where every bit of v
    lands in a normal float32 number; below, the subnormal bits may flush to zero. A
    non-finite value gives NaN parts."""
    parts, rest = [], v.astype(jnp.float32)
    for _ in range(2):
        bits = jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000)
        head = jax.lax.bitcast_convert_type(bits, jnp.float32)
        parts.append(head.astype(jnp.bfloat16))
        rest = rest - head
    return [*parts, rest.astype(jnp.bfloat16)]


def _sum_of_blocks(y: jax.Array, parts: int) -> jax.Array:
    """y [..., parts * E] -> the float32 sum of its `parts` column blocks, the smallest first."""
    blocks = jnp.split(y, parts, axis=-1)
    total = blocks[-1]
    for block in reversed(blocks[:-1]):
        total = total + block
    return total


@jax.custom_vjp
def _split_router_logits(x, router):
    """router_logits for bfloat16 x: x @ [r0 | r1 | r2] in one bfloat16 GEMM (router = r0 + r1
    + r2, `_bfloat16_parts`), its three column blocks summed. Every product of a bfloat16 x and a
    part is exact in float32, so the logits are the float32 GEMM's up to the order of the sums,
    from a GEMM a GPU runs on its tensor cores (docs/design.md, "The router on tensor cores")."""
    parts = jnp.concatenate(_bfloat16_parts(router), axis=1)
    return _sum_of_blocks(jnp.dot(x, parts, preferred_element_type=jnp.float32), 3)


def _split_router_logits_fwd(x, router):
    return _split_router_logits(x, router), (x, router)


def _split_router_logits_bwd(residuals, grad):
    """The router's gradient x^T @ grad with grad's three parts (exact products, as forward);
    x's, grad @ router^T, from the three largest of the nine part products (g0 r0, g0 r1,
    g1 r0): each part leaves less than 2^-7 of what it cuts, so the products left out are
    below 3 * 2^-14 of sum |grad| |router|, under the rounding to x's bfloat16 but where the
    sum cancels."""
    x, router = residuals
    g0, g1, g2 = _bfloat16_parts(grad)
    r0, r1, _ = _bfloat16_parts(router)
    grad_router = _sum_of_blocks(
        jnp.einsum("th,te->he", x, jnp.concatenate([g0, g1, g2], axis=1),
                   preferred_element_type=jnp.float32), 3)
    grad_x = jnp.dot(jnp.concatenate([g0, g0, g1], axis=1),
                     jnp.concatenate([r0, r1, r0], axis=1).T, preferred_element_type=jnp.float32)
    return grad_x.astype(x.dtype), grad_router


_split_router_logits.defvjp(_split_router_logits_fwd, _split_router_logits_bwd)


def _on_nodrop(cfg: MoEConfig) -> bool:
    """The experts run on nodrop's ops and grouped matmul (not the references or XLA's)."""
    return cfg.ops == "nodrop" and cfg.matmul == "nodrop"


def _permute(cfg: MoEConfig, tokens, ids, num_experts):
    """(rows, group_sizes, row_map, rows_fp8): the tokens permuted, and with an FP8 recipe on
    nodrop's ops also quantised (`permute_fp8`: each token once, as it is moved), so the
    experts' first matmul reads rows_fp8 (codes, scales) instead of quantising the rows again;
    else rows_fp8 is None.

    The tensorwise scale is the rows' in the groups (`_tensor_rows`'s), taken over the tokens:
    every row is a copy of a token and the block's ids are all in range, so the tokens' amax is
    the rows'. In the expert-parallel path the tokens are the receive buffer, whose padding
    rows (zeros) form a group past the experts' that the scale must not see: zeros leave the
    amax as it is."""
    if cfg.fp8 == "off" or not _on_nodrop(cfg):
        return (*OPS[cfg.ops]["permute"](tokens, ids, num_experts), None)
    if cfg.fp8 == "tensorwise":
        scale = tensor_scale(tokens)
        rows, group_sizes, row_map, rows_q, _ = permute_fp8(tokens, ids, num_experts, scale=scale)
        return rows, group_sizes, row_map, (rows_q, scale)
    rows, group_sizes, row_map, rows_q, rows_scale = permute_fp8(tokens, ids, num_experts)
    return rows, group_sizes, row_map, (rows_q, rows_scale)


@jax.named_scope("experts")
def _experts(cfg: MoEConfig, rows, group_sizes, gate_up, down, rows_fp8=None):
    """The SwiGLU experts over rows grouped by expert (group_sizes [G] against G experts);
    rows_fp8: the rows' quantisation under cfg.fp8's recipe made already (`_permute`), or
    None."""
    matmul = _fp8_or(cfg, OPS[cfg.ops]["grouped_matmul"] if cfg.matmul == "nodrop"
                     else jax.lax.ragged_dot, forward="auto" if _on_nodrop(cfg) else "emulated")
    def gate_up_matmul(a, w):
        return matmul(a, w, group_sizes, lhs_quantized=rows_fp8)

    return swiglu(lambda a, w: matmul(a, w, group_sizes), rows, gate_up, down,
                  gate_up_matmul=None if rows_fp8 is None else gate_up_matmul)


def _fp8_or(cfg: MoEConfig, matmul, forward: str = "emulated"):
    """The experts' grouped matmul (lhs, rhs, group_sizes) under cfg.fp8's recipe, or as it is.
    forward: the recipe's `forward`; "auto" (nodrop's FP8 kernel on the GPU) only where the
    block runs on nodrop's ops, so the reference and XLA baselines stay what they are."""
    if cfg.fp8 == "off":
        return matmul
    return functools.partial(fp8_grouped_matmul, recipe=cfg.fp8, matmul=matmul, forward=forward,
                             weight_gradient=cfg.fp8_weight_gradient)


def _capacity_einsum(lhs, rhs, group_sizes):
    """The capacity-factor mode's experts: lhs [E*C, H] holds E buffers of C rows (group_sizes
    all C), so one batched einsum against rhs [E, H, F]."""
    del group_sizes
    buffers = lhs.reshape(rhs.shape[0], -1, lhs.shape[-1])
    return jnp.einsum("ech,ehf->ecf", buffers, rhs).reshape(lhs.shape[0], rhs.shape[-1])


@jax.named_scope("shared_experts")
def _add_shared(cfg: MoEConfig, y, tokens, shared):
    if not shared:
        return y
    gate_up, down = shared
    return y + swiglu(jnp.dot, tokens, gate_up.astype(cfg.dtype), down.astype(cfg.dtype))


def _num_sequences(x) -> int:
    return x.shape[0] if x.ndim == 3 else 1


@jax.named_scope("router")
def _aux(cfg: MoEConfig, logits, ids, load, processed, overflow, *, num_sequences: int,
         axis_name=None):
    """MoEAux from this call's routing (num_sequences of equal length); with axis_name (inside
    shard_map) over every token of the mesh. load: [E] slots per expert, processed: slots the
    experts computed (both already summed over the mesh)."""
    shards = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    num_slots = ids.size * shards
    if cfg.score_function == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
    else:  # normalised sigmoid scores, as DeepSeek-V3's balance loss uses
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(axis=-1, keepdims=True)
    return MoEAux(
        load_balancing_loss=load_balancing_loss(probs, ids, axis_name=axis_name),
        sequence_balance_loss=sequence_balance_loss(probs, ids, num_sequences,
                                                    axis_name=axis_name),
        z_loss=router_z_loss(logits, axis_name=axis_name),
        tokens_per_expert=load,
        dropped_fraction=(num_slots - processed).astype(jnp.float32) / num_slots,
        max_over_mean=load.max().astype(jnp.float32) * cfg.num_experts / num_slots,
        overflow=overflow)


def _expert_parallel_rank(cfg: MoEConfig, axes, x, router, expert_bias, gate_up, down, shared):
    """One rank of MoEBlock._expert_parallel: x [B/n, ...] its tokens, gate_up and down its
    E/ep experts; the other parameters whole."""
    ops = OPS[cfg.ops]
    flat = x.reshape(-1, cfg.hidden)
    tokens = flat.astype(cfg.dtype)
    logits, weights, ids = _route(cfg, flat, router, expert_bias)
    rows, group_sizes, row_map = ops["permute"](tokens, ids, cfg.num_experts)
    num_ranks = jax.lax.axis_size(EXPERT_AXIS)
    capacity = ep_exchange.pair_capacity(rows.shape[0], num_ranks, cfg.ep_buffer_factor)
    received, received_sizes, exchange = ep_exchange.send_rows(
        rows, group_sizes, axis=EXPERT_AXIS, capacity=capacity, axes=axes)
    # Regroup the received rows (by source, then local expert) by local expert; the padding rows
    # form one more group that no expert computes (its output rows stay zero).
    num_local = gate_up.shape[0]
    local_ids = ep_exchange.received_expert_ids(received_sizes, capacity)
    local_rows, local_sizes, local_map, local_fp8 = _permute(cfg, received, local_ids[:, None],
                                                             num_local + 1)
    local_out = _experts(cfg, local_rows, local_sizes[:num_local], gate_up.astype(cfg.dtype),
                         down.astype(cfg.dtype), local_fp8)
    out = ops["unpermute"](local_out, local_map,
                           jnp.ones_like(local_map, jnp.float32, shape=(local_map.shape[0], 1)))
    out_rows = ep_exchange.return_rows(out, exchange, rows.shape[0], axis=EXPERT_AXIS)
    y = _add_shared(cfg, ops["unpermute"](out_rows, row_map, weights), tokens, shared)
    load = jax.lax.psum(group_sizes, axes)
    processed = jax.lax.psum(exchange.sent.sum(), axes)
    aux = _aux(cfg, logits, ids, load, processed, exchange.overflow,
               num_sequences=_num_sequences(x), axis_name=axes)
    return y.astype(cfg.dtype).reshape(x.shape), aux


def residual_init(scale: float, batch_axis=()):
    """lecun_normal (fan-in, truncated normal) with its std multiplied by `scale`: for the
    projections that write into the residual stream."""
    return nnx.initializers.variance_scaling(scale ** 2, "fan_in", "truncated_normal",
                                             batch_axis=batch_axis)


def swiglu(matmul, x, gate_up, down, *, gate_up_matmul=None):
    """down(silu(gate) * up), with gate and up computed by one matmul against [..., 2F];
    gate_up_matmul: that matmul, where it differs from `matmul` (default: `matmul`)."""
    gate, up = jnp.split((gate_up_matmul or matmul)(x, gate_up), 2, axis=-1)
    return matmul(jax.nn.silu(gate) * up, down)

