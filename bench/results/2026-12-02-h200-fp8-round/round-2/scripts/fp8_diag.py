"""Which of the FP8 recipe's forward paths differs on the GPU (inputs of
test_fp8_blockwise_recipe_runs_the_kernel_forward_on_the_gpu). Everything on the GPU: the spec
is the emulation with XLA's quantisation and the pure-JAX reference matmul."""
import jax, jax.numpy as jnp, numpy as np
import nodrop
from nodrop.ops import fp8, reference

def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32)); b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

m, k, n, g = 777, 256, 384, 8
keys = jax.random.split(jax.random.key(12), 3)
lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16); rhs = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16)
share = 1.0 / np.arange(1, g + 1); sizes = jnp.asarray(np.floor(m * share / share.sum()), jnp.int32)
a = fp8.dequantize(*fp8.quantize(lhs, fp8.ACTIVATION_BLOCK), fp8.ACTIVATION_BLOCK)
b = fp8.dequantize(*fp8.quantize(rhs, fp8.WEIGHT_BLOCK), fp8.WEIGHT_BLOCK)
spec = jax.jit(reference.grouped_matmul)(a, b, sizes)
print(f"nodrop.grouped_matmul f32 (gpu) vs reference f32 (gpu), dequantised operands: {rel(jax.jit(nodrop.grouped_matmul)(a, b, sizes), spec):.3g}")
print(f"ragged_dot f32 vs reference: {rel(jax.jit(jax.lax.ragged_dot)(a, b, sizes), spec):.3g}")
print(f"ragged_dot HIGHEST vs reference: {rel(jax.jit(lambda x, y, s: jax.lax.ragged_dot(x, y, s, precision=jax.lax.Precision.HIGHEST))(a, b, sizes), spec):.3g}")
for name, f in {
  "kernel": lambda x, y, s: fp8.fp8_grouped_matmul(x, y, s, forward="kernel"),
  "emulated nodrop matmul": lambda x, y, s: fp8.fp8_grouped_matmul(x, y, s, forward="emulated"),
  "emulated reference matmul": lambda x, y, s: fp8.fp8_grouped_matmul(x, y, s, forward="emulated", matmul=reference.grouped_matmul),
}.items():
    print(f"{name:28s} vs spec: {rel(jax.jit(f)(lhs, rhs, sizes), spec):.3g}")
