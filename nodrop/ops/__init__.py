"""Differentiable JAX ops over nodrop's FFI calls, one module per op family, each with a pure-JAX
reference (reference.py). The functions are exported from the top-level package
(`nodrop.grouped_matmul`, ...); `nodrop.ops.<family>` is the module that defines them."""
