"""The decoder-only MoE language model (Flax NNX).

tokens -> embedding -> layers -> RMSNorm -> LM head -> logits. Each layer is pre-norm:
x + attention(norm(x)), then x + ffn(norm(x)), where ffn is a nodrop MoEBlock on the MoE layers
and a dense SwiGLU elsewhere. Attention is causal grouped-query attention with rotary position
embeddings through `jax.nn.dot_product_attention` (cuDNN flash attention on NVIDIA GPUs).

Matmuls run in config.dtype from float32 masters; norms, RoPE, the attention softmax, the router
and the logits are float32.

Initialisation (docs/quality.md measures why): the embedding table is normal(1), as T5's and
muP's input layer, and every other matrix lecun_normal (fan-in), except the projections that write
into the residual stream (attention output, the dense and expert down projections), whose
variance is divided by 2 * num_layers (GPT-2's and Megatron's scaled init). With the usual
normal(0.02) embedding the residual stream at init is mostly attention's output, an average over
the context that is nearly the same vector for every token: every router then sends nearly every
token to the same experts (max/mean load 3.4 of at most 4 on `tiny` at step 0). With the token's
own vector dominant, the routers see inputs as diverse as the tokens are. Norm scales start at one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from nodrop.models.config import ModelConfig
from nodrop.moe import MoEAux, MoEBlock
from nodrop.moe.block import residual_init, swiglu
from nodrop.parallel.mesh import logical_metadata, logical_param


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelAux:
    """The MoE layers' statistics (MoEAux), stacked over the MoE layers in layer order.

    load_balancing_loss, sequence_balance_loss, z_loss, dropped_fraction, max_over_mean:
      [L_moe] float32.
    tokens_per_expert: [L_moe, E] int32. With no MoE layers the leading dimension is 0.
    overflow: bool scalar, some MoE layer's expert-parallel receive buffer overflowed: the
      call's outputs and gradients must not be used (see MoEBlock).
    """

    load_balancing_loss: jax.Array
    sequence_balance_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped_fraction: jax.Array
    max_over_mean: jax.Array
    overflow: jax.Array

    @classmethod
    def stack(cls, layers: list[MoEAux], num_experts: int) -> ModelAux:
        """The MoE layers' MoEAux (in layer order) stacked, in the documented dtypes."""
        if not layers:
            empty = jnp.zeros((0,), jnp.float32)
            return cls(load_balancing_loss=empty, sequence_balance_loss=empty, z_loss=empty,
                       tokens_per_expert=jnp.zeros((0, num_experts), jnp.int32),
                       dropped_fraction=empty, max_over_mean=empty,
                       overflow=jnp.zeros((), bool))

        def stacked(name, dtype):
            return jnp.stack([getattr(aux, name) for aux in layers]).astype(dtype)

        return cls(load_balancing_loss=stacked("load_balancing_loss", jnp.float32),
                   sequence_balance_loss=stacked("sequence_balance_loss", jnp.float32),
                   z_loss=stacked("z_loss", jnp.float32),
                   tokens_per_expert=stacked("tokens_per_expert", jnp.int32),
                   dropped_fraction=stacked("dropped_fraction", jnp.float32),
                   max_over_mean=stacked("max_over_mean", jnp.float32),
                   overflow=jnp.any(stacked("overflow", bool)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """MoELM.decode's cache: per layer, the rotated keys and the values of the positions so far,
    [B, seq_len, num_kv_heads, head_dim] in config.dtype (zeros past `length`), and `length`,
    int32 [], the positions filled."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    length: jax.Array


# --- rotary embeddings -----------------------------------------------------------------------


def rope_tables(seq_len: int, head_dim: int, theta: float):
    """(cos, sin), each [seq_len, head_dim] float32, for positions 0..seq_len-1 in the
    rotate-half layout: feature i and i + head_dim/2 form a pair rotated at frequency
    theta^(-2i/head_dim)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates x [B, S, heads, head_dim] by the tables of its positions (float32 result)."""
    x = x.astype(jnp.float32)
    first, second = jnp.split(x, 2, axis=-1)
    rotated_half = jnp.concatenate([-second, first], axis=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


# --- layers ----------------------------------------------------------------------------------


@jax.custom_vjp
def head_logits(x, head):
    """float32 logits x [..., H] @ head [H, V], accumulated in float32 from x's dtype.

    The backward rounds the logits' gradient to x's dtype before its two GEMMs: as float32 it
    made them float32 GEMMs (TF32 on an H200), 8.7 ms of the `mixtral` preset's 217 ms step
    (bench/results/2026-12-02-h200-step-profile/), against about 2 in bfloat16. Each GEMM still
    accumulates in float32; the rounding is the one the other layers' gradients get.
    """
    return jnp.dot(x, head, preferred_element_type=jnp.float32)


def _head_logits_fwd(x, head):
    return head_logits(x, head), (x, head)


def _head_logits_bwd(residuals, grad):
    x, head = residuals
    grad = grad.astype(x.dtype)
    grad_x = jnp.einsum("...v,hv->...h", grad, head, preferred_element_type=jnp.float32)
    grad_head = jnp.einsum("...h,...v->hv", x, grad, preferred_element_type=jnp.float32)
    return grad_x.astype(x.dtype), grad_head.astype(head.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def _param(rngs: nnx.Rngs, init, shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter declaring the logical names of its axes (nodrop.parallel.LOGICAL_AXIS_RULES
    maps them to the mesh)."""
    return logical_param(init(rngs.params(), shape, dtype), axes)


def attention_implementation(dtype, head_dim: int) -> str:
    """"cudnn" (flash attention) where it runs, else "xla".

    `implementation=None` would not pick cuDNN: in jax 0.11.2 it always means XLA, which
    materialises the [B, heads, S, S] scores. cuDNN's flash attention needs an NVIDIA GPU,
    bf16 or fp16 and a head_dim that is a multiple of 8 up to 128 (256 on Hopper; 128 is
    the bound every supported GPU meets). The platform is JAX's default backend, the one jit
    compiles for.
    """
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if jax.default_backend() == "gpu" and half and fits else "xla"


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE: x [B, S, H] -> [B, S, H].

    Parameters: query [H, heads * head_dim], key and value [H, kv_heads * head_dim],
    output [heads * head_dim, H]. Query head n reads KV head n // (heads / kv_heads).
    """

    COMPUTE_WEIGHTS = ("query", "key", "value", "output")  # see cast_compute_weights

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        init = nnx.initializers.lecun_normal()
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        self.query = _param(rngs, init, (config.hidden, q_width), config.param_dtype,
                            ("embed", "heads"))
        self.key = _param(rngs, init, (config.hidden, kv_width), config.param_dtype,
                          ("embed", "kv_heads"))
        self.value = _param(rngs, init, (config.hidden, kv_width), config.param_dtype,
                            ("embed", "kv_heads"))
        self.output = _param(rngs, residual_init(config.residual_init_scale),
                             (q_width, config.hidden), config.param_dtype, ("heads", "embed"))

    def _qkv(self, x, cos, sin):
        """q [B, S, heads, D] and k, v [B, S, kv_heads, D] in config.dtype, q and k rotated."""
        cfg = self.config
        batch, seq, _ = x.shape
        x = x.astype(cfg.dtype)

        def project(weight, heads):
            return jnp.dot(x, weight[...].astype(cfg.dtype)).reshape(
                batch, seq, heads, cfg.head_dim)

        q = apply_rope(project(self.query, cfg.num_heads), cos, sin).astype(cfg.dtype)
        k = apply_rope(project(self.key, cfg.num_kv_heads), cos, sin).astype(cfg.dtype)
        return q, k, project(self.value, cfg.num_kv_heads)

    def _output(self, out):
        batch, seq = out.shape[:2]
        return jnp.dot(out.reshape(batch, seq, -1), self.output[...].astype(self.config.dtype))

    @jax.named_scope("attention")  # profile regions: bench/gpu_profile.py reads them
    def __call__(self, x, cos, sin):
        cfg = self.config
        q, k, v = self._qkv(x, cos, sin)
        # K and V keep their num_kv_heads heads: dot_product_attention does GQA itself.
        return self._output(jax.nn.dot_product_attention(
            q, k, v, is_causal=True,
            implementation=attention_implementation(cfg.dtype, cfg.head_dim)))

    def decode(self, x, cos, sin, keys, values, position):
        """x [B, S, H] at positions position..position+S-1 (cos, sin: theirs), attending to the
        cached keys and values [B, seq_len, kv_heads, D] of the positions before and to
        themselves. Returns (out [B, S, H], keys, values) with this step's written in."""
        q, k, v = self._qkv(x, cos, sin)
        keys = jax.lax.dynamic_update_slice_in_dim(keys, k, position, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(values, v, position, axis=1)
        # Query i sees cached position j <= position + i; the slots past the sequence hold
        # zeros and stay masked. XLA's implementation: cuDNN's takes no such mask.
        visible = (jnp.arange(keys.shape[1])[None, :]
                   <= position + jnp.arange(x.shape[1])[:, None])
        out = jax.nn.dot_product_attention(q, keys, values, mask=visible[None, None],
                                           implementation="xla")
        return self._output(out), keys, values


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward of the dense layers, laid out like MoEBlock's shared expert:
    gate_up [H, 2F] (gate in [:, :F], up in [:, F:]), down [F, H]."""

    COMPUTE_WEIGHTS = ("gate_up", "down")  # see cast_compute_weights

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        init = nnx.initializers.lecun_normal()
        self.gate_up = _param(rngs, init, (config.hidden, 2 * config.dense_ffn),
                              config.param_dtype, ("embed", "mlp"))
        self.down = _param(rngs, residual_init(config.residual_init_scale),
                           (config.dense_ffn, config.hidden), config.param_dtype, ("mlp", "embed"))

    @jax.named_scope("dense_ffn")
    def __call__(self, x):
        dtype = self.config.dtype
        return swiglu(jnp.dot, x.astype(dtype), self.gate_up[...].astype(dtype),
                       self.down[...].astype(dtype))


def _rms_norm(config: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # dtype float32: the statistics and the scaled output are float32 whatever the compute dtype.
    return nnx.RMSNorm(config.hidden, epsilon=config.norm_eps, dtype=jnp.float32,
                       param_dtype=config.param_dtype, rngs=rngs,
                       scale_metadata=logical_metadata(("norm",)))


class DecoderLayer(nnx.Module):
    """x -> x + attention(norm(x)) -> x + ffn(norm(x)); returns (x, MoEAux or None)."""

    def __init__(self, config: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
        self.config = config
        self.attention_norm = _rms_norm(config, rngs)
        self.attention = Attention(config, rngs=rngs)
        self.ffn_norm = _rms_norm(config, rngs)
        self.ffn = (MoEBlock(config.moe_config(), rngs=rngs) if moe
                    else DenseMLP(config, rngs=rngs))

    def __call__(self, x, cos, sin):
        dtype = self.config.dtype
        return self._ffn(x + self.attention(self.attention_norm(x).astype(dtype), cos, sin))

    def decode(self, x, cos, sin, keys, values, position):
        """As __call__ on new positions, with Attention.decode's cache: (x, keys, values)."""
        attended, keys, values = self.attention.decode(
            self.attention_norm(x).astype(self.config.dtype), cos, sin, keys, values, position)
        return self._ffn(x + attended)[0], keys, values

    def _ffn(self, x):
        dtype = self.config.dtype
        hidden = self.ffn_norm(x).astype(dtype)
        if isinstance(self.ffn, MoEBlock):
            out, aux = self.ffn(hidden)
        else:
            out, aux = self.ffn(hidden), None
        return (x + out).astype(dtype), aux


def _call_layer(layer: DecoderLayer, x, cos, sin):
    return layer(x, cos, sin)


# Saves only each layer's input; everything inside is recomputed in the backward pass.
_call_layer_remat = nnx.remat(_call_layer)


# --- the model -------------------------------------------------------------------------------


class MoELM(nnx.Module):
    """tokens int32 [B, S] (S <= seq_len) -> (logits float32 [B, S, vocab_size], ModelAux).

    Parameters: embedding [V, H]; layers (a list of DecoderLayer); final_norm; lm_head [H, V]
    unless tie_embeddings, where the head is embedding.T. Token values are not range-checked
    (they cannot be under jit): an id >= vocab_size embeds as NaN, so it shows in the loss.
    """

    # The embedding table is read in float32 (gathered, then cast), tied or not.
    COMPUTE_WEIGHTS = ("lm_head",)  # see cast_compute_weights

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embedding = _param(rngs, nnx.initializers.normal(1.0),
                                (config.vocab_size, config.hidden), config.param_dtype,
                                ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(config, config.is_moe_layer(i), rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = _rms_norm(config, rngs)
        self.lm_head = (None if config.tie_embeddings else _param(
            rngs, nnx.initializers.lecun_normal(), (config.hidden, config.vocab_size),
            config.param_dtype, ("embed", "vocab")))

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE layers' blocks in layer order (the trainer moves their expert_bias)."""
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoEBlock)]

    def __call__(self, tokens):
        cfg = self.config
        tokens = self._check_tokens(tokens, cfg.seq_len)
        x = self._embed(tokens)
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
        call_layer = _call_layer_remat if cfg.remat else _call_layer
        moe_aux = []
        for layer in self.layers:
            x, aux = call_layer(layer, x, cos, sin)
            if aux is not None:
                moe_aux.append(aux)
        return self._logits(x), ModelAux.stack(moe_aux, cfg.num_experts)

    def init_cache(self, batch: int) -> KVCache:
        """An empty cache for `batch` sequences of up to seq_len tokens."""
        cfg = self.config
        shape = (batch, cfg.seq_len, cfg.num_kv_heads, cfg.head_dim)
        empty = tuple(jnp.zeros(shape, cfg.dtype) for _ in self.layers)
        return KVCache(keys=empty, values=empty, length=jnp.zeros((), jnp.int32))

    def decode(self, tokens, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The logits [B, S, vocab_size] of tokens [B, S] that continue the cached sequences (at
        positions cache.length..cache.length+S-1), and the cache with them added: a prompt into
        an empty cache, then one token at a time. The same logits as __call__ on the whole
        sequence, up to float rounding. The caller keeps cache.length + S <= seq_len: under jit
        it cannot be checked, and a write past the end would land on the last slots."""
        cfg = self.config
        tokens = self._check_tokens(tokens, cfg.seq_len)
        position = cache.length
        cos, sin = (jax.lax.dynamic_slice_in_dim(table, position, tokens.shape[1])
                    for table in rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta))
        x = self._embed(tokens)
        keys, values = [], []
        for layer, layer_keys, layer_values in zip(self.layers, cache.keys, cache.values):
            x, layer_keys, layer_values = layer.decode(x, cos, sin, layer_keys, layer_values,
                                                       position)
            keys.append(layer_keys)
            values.append(layer_values)
        return self._logits(x), KVCache(keys=tuple(keys), values=tuple(values),
                                        length=position + tokens.shape[1])

    @staticmethod
    def _check_tokens(tokens, seq_len: int):
        tokens = jnp.asarray(tokens)
        if (tokens.ndim != 2 or tokens.dtype != jnp.int32 or not 1 <= tokens.shape[1]
                <= seq_len or tokens.shape[0] < 1):
            raise ValueError(
                f"tokens must be int32 [B, S] with B >= 1 and 1 <= S <= seq_len={seq_len}, "
                f"got {tokens.dtype} {tuple(tokens.shape)}")
        return tokens

    @jax.named_scope("embed")
    def _embed(self, tokens):
        return jnp.take(self.embedding[...], tokens, axis=0, mode="fill",
                        fill_value=jnp.nan).astype(self.config.dtype)

    @jax.named_scope("lm_head")
    def _logits(self, x):
        cfg = self.config
        x = self.final_norm(x).astype(cfg.dtype)
        if self.lm_head is None:  # T5's tied head: the normal(1) table would give logits ~ sqrt(H)
            x = (x * cfg.hidden ** -0.5).astype(cfg.dtype)
        head = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        return head_logits(x, head.astype(cfg.dtype))


def cast_compute_weights(model: nnx.Module) -> None:
    """Casts, in place, every weight that a module of `model` reads only cast to its compute
    dtype (each module's COMPUTE_WEIGHTS: the attention projections, the dense and expert
    feed-forward matrices, an untied LM head) to that dtype.

    The forward is the same bit for bit (each use casts the weight first), and the gradients of
    these weights come out in the compute dtype, which holds every bit they have: the trainer's
    AdamW (nodrop.adamw_update) widens them as it reads them, where float32 masters would make
    XLA write and read back a float32 copy of each (6 bytes a parameter). The router, the norms
    and the embedding table, read in float32, keep their dtype. Cast a copy of the model
    (`nnx.merge(..., copy=True)`): its variables are the caller's otherwise. A module whose
    compute dtype follows its input (MoEBlock with config.dtype None) is left as it is.
    """
    for _, module in nnx.iter_modules(model):
        dtype = getattr(getattr(module, "config", None), "dtype", None)
        for name in getattr(module, "COMPUTE_WEIGHTS", ()) if dtype is not None else ():
            weight = getattr(module, name)
            if weight is not None:
                weight.set_value(weight[...].astype(dtype))
