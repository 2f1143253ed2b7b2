import jax, jax.numpy as jnp, numpy as np
from nodrop.ops import fp8
def rel(a, b):
    a = np.asarray(a, np.float32); b = np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
rhs = jax.random.normal(jax.random.key(1), (8, 256, 384), jnp.bfloat16)
eager = fp8.dequantize(*fp8.quantize(rhs, fp8.WEIGHT_BLOCK), fp8.WEIGHT_BLOCK)
fused = jax.jit(lambda r: fp8.dequantize(*fp8.quantize(r, fp8.WEIGHT_BLOCK), fp8.WEIGHT_BLOCK))(rhs)
def barrier(r):
    q, s = fp8.quantize(r, fp8.WEIGHT_BLOCK)
    return fp8.dequantize(jax.lax.optimization_barrier(q), s, fp8.WEIGHT_BLOCK)
print("qdq jitted vs eager:", rel(fused, eager), " vs bf16 input:", rel(fused, rhs), " eager vs input:", rel(eager, rhs))
print("qdq jitted with a barrier vs eager:", rel(jax.jit(barrier)(rhs), eager))
x = jax.random.normal(jax.random.key(2), (257, 300), jnp.float16)
print("f16 quantize jitted vs eager codes equal:", bool((np.asarray(jax.jit(lambda v: fp8.quantize(v, fp8.ACTIVATION_BLOCK)[0])(x).view(jnp.uint8)) == np.asarray(fp8.quantize(x, fp8.ACTIVATION_BLOCK)[0].view(jnp.uint8))).all()))
