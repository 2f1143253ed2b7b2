"""Differentiable JAX ops over nodrop's FFI calls, each with a pure-JAX reference (reference.py)."""

from nodrop.ops._checks import checks, checks_enabled
from nodrop.ops.grouped_matmul import grouped_matmul, grouped_matmul_contract, ragged_dot
from nodrop.ops.permute import permute, unpermute
from nodrop.ops.router import topk_router

__all__ = [
    "checks", "checks_enabled", "grouped_matmul", "grouped_matmul_contract", "permute",
    "ragged_dot", "topk_router", "unpermute",
]
