"""The decoder-only MoE language model's configuration, parameter and FLOP counts, and presets."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp

from nodrop._fields import is_finite_number, is_int, requirer, unknown_fields
from nodrop.moe import MoEConfig
from nodrop.moe.block import DEFAULT_FP8_WEIGHT_GRADIENT

# ModelConfig fields that MoEConfig names differently; MoEConfig's errors are reported under ours.
_MOE_FIELD_NAMES = {"ffn": "expert_ffn", "matmul": "moe_matmul"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE language model (see `nodrop.models.MoELM`).

    vocab_size: V. seq_len: the longest sequence the model accepts. hidden: H.
    num_heads, num_kv_heads, head_dim: grouped-query attention (num_kv_heads divides num_heads).
    dense_ffn: SwiGLU width of the dense (non-MoE) layers.
    num_experts, k, expert_ffn, shared_ffn, score_function, num_groups, topk_groups, renormalize,
      scaling_factor, capacity_factor: each MoE layer, as in `nodrop.moe.MoEConfig`
      (expert_ffn is its `ffn`). moe_matmul: its `matmul`, "nodrop" or "ragged_dot". fp8:
      its `fp8`, the experts' FP8 recipe ("off", "blockwise" or "tensorwise").
      fp8_weight_gradient: its `fp8_weight_gradient` ("unquantised" or "fp8"). router_matmul:
      its `router_matmul` ("float32" or "split").
    moe_every, first_dense: layer i (0-based) is MoE iff i >= first_dense and
      (i - first_dense) % moe_every == 0; the first `first_dense` layers are dense.
    tie_embeddings: the LM head is the embedding table transposed (no separate head weights).
    rope_theta: rotary embedding base. norm_eps: RMSNorm epsilon.
    remat: recompute each layer's activations in the backward pass (`nnx.remat`).
    expert_parallel, ep_buffer_factor: each MoE layer's, as in `nodrop.moe.MoEConfig` (the
      trainer sets expert_parallel when its mesh has an expert axis).
    dtype: compute dtype. param_dtype: master weights.
    """

    vocab_size: int = 256
    seq_len: int = 256
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dense_ffn: int = 512
    num_experts: int = 8
    k: int = 2
    expert_ffn: int = 256
    shared_ffn: int = 0
    score_function: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = False
    scaling_factor: float = 1.0
    moe_every: int = 1
    first_dense: int = 0
    tie_embeddings: bool = False
    capacity_factor: float | None = None
    moe_matmul: str = "nodrop"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    remat: bool = False
    expert_parallel: bool = False
    ep_buffer_factor: float | None = 2.0
    fp8: str = "off"
    fp8_weight_gradient: str = DEFAULT_FP8_WEIGHT_GRADIENT
    router_matmul: str = "split"
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        require = requirer(self, lambda field: f"ModelConfig.{field}")

        def is_positive_number(value) -> bool:
            return is_finite_number(value) and value > 0

        for field in ("vocab_size", "seq_len", "num_layers", "num_heads", "dense_ffn",
                      "moe_every"):
            require(is_int(getattr(self, field)) and getattr(self, field) >= 1, field,
                    "a positive int")
        require(is_int(self.num_kv_heads) and self.num_kv_heads >= 1
                and is_int(self.num_heads) and self.num_heads % self.num_kv_heads == 0,
                "num_kv_heads", f"a positive int dividing num_heads={self.num_heads}")
        # Rotary embeddings rotate pairs of features.
        require(is_int(self.head_dim) and self.head_dim >= 2 and self.head_dim % 2 == 0,
                "head_dim", "a positive even int")
        require(is_int(self.first_dense) and self.first_dense >= 0, "first_dense", "an int >= 0")
        for field in ("tie_embeddings", "remat"):
            require(isinstance(getattr(self, field), bool), field, "a bool")
        require(is_positive_number(self.rope_theta), "rope_theta", "a positive finite number")
        require(is_positive_number(self.norm_eps), "norm_eps", "a positive finite number")
        # The MoE fields (hidden and the dtypes too) are MoEConfig's to check; a model always
        # names its compute dtype (MoEConfig's None, the input's dtype, is not one).
        require(self.dtype is not None, "dtype", "float32, float16 or bfloat16")
        try:
            moe = self.moe_config()
        except ValueError as error:
            match = re.fullmatch(r"MoEConfig\.(\w+) (.*)", str(error), flags=re.DOTALL)
            if match is None:
                raise
            field = _MOE_FIELD_NAMES.get(match[1], match[1])
            raise ValueError(f"ModelConfig.{field} {match[2]}") from None
        object.__setattr__(self, "dtype", moe.dtype)  # canonical, so configs compare equal
        object.__setattr__(self, "param_dtype", moe.param_dtype)

    # --- structure ---------------------------------------------------------------------------

    def moe_config(self) -> MoEConfig:
        """The MoEConfig of every MoE layer."""
        return MoEConfig(
            num_experts=self.num_experts, k=self.k, hidden=self.hidden, ffn=self.expert_ffn,
            score_function=self.score_function, num_groups=self.num_groups,
            topk_groups=self.topk_groups, renormalize=self.renormalize,
            scaling_factor=self.scaling_factor, shared_ffn=self.shared_ffn,
            capacity_factor=self.capacity_factor, matmul=self.moe_matmul,
            residual_init_scale=self.residual_init_scale, dtype=self.dtype,
            param_dtype=self.param_dtype, expert_parallel=self.expert_parallel,
            ep_buffer_factor=self.ep_buffer_factor, fp8=self.fp8,
            fp8_weight_gradient=self.fp8_weight_gradient, router_matmul=self.router_matmul)

    @property
    def residual_init_scale(self) -> float:
        """The std multiplier of the projections that write into the residual stream (two per
        layer): 1 / sqrt(2 * num_layers), GPT-2's and Megatron's scaled init."""
        return (2 * self.num_layers) ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense and (layer - self.first_dense) % self.moe_every == 0

    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    # --- counts ------------------------------------------------------------------------------

    def _attention_params(self) -> int:
        """q, k, v and output projections of one layer (no biases)."""
        return self.hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    def _layer_matmul_params(self, experts: int) -> tuple[int, int]:
        """(dense-layer, MoE-layer) matmul weights of one layer, counting `experts` experts."""
        attention = self._attention_params()
        dense = attention + 3 * self.hidden * self.dense_ffn
        moe = (attention + self.hidden * self.num_experts  # router
               + experts * 3 * self.hidden * self.expert_ffn
               + 3 * self.hidden * self.shared_ffn)
        return dense, moe

    def _matmul_params(self, experts: int) -> int:
        """Every layer's matmul weights plus the LM head, counting `experts` experts per MoE
        layer. The head counts even when tied: it is a matmul all the same."""
        dense, moe = self._layer_matmul_params(experts)
        num_moe = len(self.moe_layers())
        return (self.num_layers - num_moe) * dense + num_moe * moe + self.hidden * self.vocab_size

    def _params(self, experts: int) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden
        embedding = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        return self._matmul_params(experts) + norms + embedding

    def num_params(self) -> int:
        """Every trainable parameter (the non-trainable expert bias excluded)."""
        return self._params(self.num_experts)

    def num_active_params(self) -> int:
        """The parameters one token uses: as num_params, with k of the num_experts experts."""
        return self._params(self.k)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), for model FLOPs utilisation.

        6 * (matmul weights one token uses: attention projections, dense SwiGLU, router, its k
        experts, shared experts, LM head) + 12 * num_layers * num_heads * head_dim * seq_len for
        the attention scores and their weighted sum (PaLM, appendix B). Not counted: the
        embedding lookup, norms, RoPE, softmax, routing and permutation. The attention term is
        the full seq_len x seq_len product, as PaLM counts it, although causal attention needs
        only about half of it. seq_len defaults to config.seq_len.
        """
        seq_len = self.seq_len if seq_len is None else seq_len
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return float(6 * self._matmul_params(self.k) + attention)

    # --- copies and serialisation ------------------------------------------------------------

    def replace(self, **changes) -> ModelConfig:
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (dtypes by name); `from_dict` rebuilds the same config."""
        fields = dataclasses.asdict(self)
        fields["dtype"] = self.dtype.name
        fields["param_dtype"] = self.param_dtype.name
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """The config `to_dict` wrote; missing fields take their defaults, unknown ones raise."""
        unknown = unknown_fields(cls, fields)
        if unknown:
            raise ValueError(f"ModelConfig.from_dict: unknown fields {unknown}")
        return cls(**fields)


# The GPU presets share seq_len 2048, bfloat16 compute and a vocabulary of 8192 subword tokens
# (the trainer's BPE: on the default data, 8192 entries give 3.6 bytes a token and 32768 only
# 4.0; the tiny preset reads bytes, vocab 256). Their
# per-layer shapes follow the named models (hidden 2048 keeps every GEMM large enough to fill an
# H100/H200) with fewer layers, so that each fits 0.5-2B parameters for one GPU.
PRESETS: dict[str, ModelConfig] = {
    # Trains on 2 CPU cores in minutes (float32: bf16 matmuls are slow on CPUs). All layers MoE.
    # 3.4M total, 1.1M active.
    "tiny": ModelConfig(
        seq_len=256, num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32,
        dense_ffn=512, num_experts=8, k=2, expert_ffn=256, dtype=jnp.float32),
    # The quality studies' GPU model: Mixtral's routing (8 experts top-2, softmax) at a width
    # that trains 2000 steps of 16 x 1024 tokens in minutes on one H100/H200. 153M total, 49M
    # active.
    "small": ModelConfig(
        vocab_size=8192, seq_len=1024, num_layers=8, hidden=512, num_heads=8, num_kv_heads=4,
        head_dim=64, num_experts=8, k=2, expert_ffn=1408, dtype=jnp.bfloat16),
    # Mixtral: 8 experts top-2, softmax, GQA, untied. 1.77B total, 0.52B active.
    "mixtral": ModelConfig(
        vocab_size=8192, seq_len=2048, num_layers=6, hidden=2048, num_heads=16, num_kv_heads=8,
        head_dim=128, num_experts=8, k=2, expert_ffn=5632, rope_theta=1e6, dtype=jnp.bfloat16),
    # DeepSeek-V3: 64 fine-grained experts top-6 plus two shared ones, sigmoid scores with
    # group-limited routing (8 groups, top 4), renormalised and scaled, the first layer dense.
    # 1.78B total, 0.32B active.
    "deepseek": ModelConfig(
        vocab_size=8192, seq_len=2048, num_layers=5, hidden=2048, num_heads=16, num_kv_heads=4,
        head_dim=128, dense_ffn=5632, num_experts=64, k=6, expert_ffn=1024, shared_ffn=2048,
        score_function="sigmoid", num_groups=8, topk_groups=4, renormalize=True,
        scaling_factor=2.5, first_dense=1, dtype=jnp.bfloat16),
    # Qwen3-30B-A3B's layer: 128 experts top-8 of width 768, softmax, renormalised,
    # 32 query / 4 KV heads. 1.90B total, 0.20B active.
    "qwen3": ModelConfig(
        vocab_size=8192, seq_len=2048, num_layers=3, hidden=2048, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, k=8, expert_ffn=768, renormalize=True, rope_theta=1e6,
        dtype=jnp.bfloat16),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The named preset with `overrides` applied (validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
