"""nodrop: dropless Mixture-of-Experts training in JAX on a C++/CUDA engine."""

from nodrop import _ffi
from nodrop._ffi import backends
from nodrop.moe.losses import load_balancing_loss, router_z_loss, tokens_per_expert
from nodrop.ops._checks import checks, checks_enabled
from nodrop.ops.adamw import adamw_update
from nodrop.ops.fp8 import (
    dequantize,
    fp8_grouped_matmul,
    grouped_matmul_fp8_blockwise,
    grouped_matmul_fp8_blockwise_contract,
    grouped_matmul_fp8_tensorwise,
    grouped_matmul_fp8_tensorwise_contract,
    quantize,
)
from nodrop.ops.grouped_matmul import grouped_matmul, grouped_matmul_contract, ragged_dot
from nodrop.ops.permute import permute, unpermute
from nodrop.ops.router import topk_router
from nodrop.serve import load

__version__ = "0.1.0"
__all__ = [
    "adamw_update", "backends", "checks", "checks_enabled", "dequantize", "fp8_grouped_matmul",
    "grouped_matmul", "grouped_matmul_contract", "grouped_matmul_fp8_blockwise",
    "grouped_matmul_fp8_blockwise_contract", "grouped_matmul_fp8_tensorwise",
    "grouped_matmul_fp8_tensorwise_contract", "load", "load_balancing_loss", "permute",
    "quantize", "ragged_dot", "router_z_loss", "tokens_per_expert", "topk_router", "unpermute",
]
del _ffi
