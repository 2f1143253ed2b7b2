"""Loads nodrop's shared libraries, registers every FFI target with XLA, and calls them.

`libnodrop_ffi_cpu.so` (the CPU engine) is always built; `libnodrop_ffi_cuda.so` (the Hopper
engine) when the build found nvcc and CUTLASS. Each exports one handler symbol per target; the
same target name is registered for platform "cpu" and for "CUDA". `on_platform` is the one place
that chooses between them.
"""

from __future__ import annotations

import ctypes
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp

# target name -> exported handler symbol (without its Cpu / Cuda suffix), one per FFI handler.
TARGETS = {
    "nodrop_adamw_update": "NodropAdamWUpdate",
    "nodrop_grouped_matmul": "NodropGroupedMatmul",
    "nodrop_grouped_matmul_contract": "NodropGroupedMatmulContract",
    "nodrop_permute": "NodropPermute",
    "nodrop_permute_rows": "NodropPermuteRows",
    "nodrop_unpermute": "NodropUnpermute",
    "nodrop_gather_row_dots": "NodropGatherRowDots",
    "nodrop_topk_router": "NodropTopkRouter",
    "nodrop_topk_router_grad": "NodropTopkRouterGrad",
    "nodrop_quantize_fp8": "NodropQuantizeFp8",
    "nodrop_permute_fp8": "NodropPermuteFp8",
    "nodrop_grouped_matmul_fp8_blockwise": "NodropGroupedMatmulFp8Blockwise",
    "nodrop_grouped_matmul_fp8_tensorwise": "NodropGroupedMatmulFp8Tensorwise",
    "nodrop_quantize_fp8_transposed": "NodropQuantizeFp8Transposed",
    "nodrop_transpose_fp8_codes": "NodropTransposeFp8Codes",
    "nodrop_quantize_fp8_weights": "NodropQuantizeFp8Weights",
    "nodrop_quantize_fp8_weights_transposed": "NodropQuantizeFp8WeightsTransposed",
    "nodrop_grouped_matmul_fp8_blockwise_contract": "NodropGroupedMatmulFp8BlockwiseContract",
    "nodrop_grouped_matmul_fp8_tensorwise_contract": "NodropGroupedMatmulFp8TensorwiseContract",
}
CPU_TARGETS = {target: symbol + "Cpu" for target, symbol in TARGETS.items()}
CUDA_TARGETS = {target: symbol + "Cuda" for target, symbol in TARGETS.items()}


def _load(name: str) -> ctypes.CDLL | None:
    # The package's folders: this one for an installed wheel; in an editable install (the
    # README's set-up) also the site-packages folder where pip put the built libraries.
    for folder in sys.modules[__package__].__path__:
        path = pathlib.Path(folder) / name
        if path.exists():
            try:
                return ctypes.CDLL(str(path))
            except OSError as error:  # e.g. a GPU machine without the CPU engine's oneDNN
                warnings.warn(f"nodrop: cannot load {path}: {error}", stacklevel=3)
                return None
    return None


def _register(lib: ctypes.CDLL, symbols: dict[str, str], platform: str) -> None:
    for target, symbol in symbols.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform=platform)


_cpu_lib = _load("libnodrop_ffi_cpu.so")
_cuda_lib = _load("libnodrop_ffi_cuda.so")
if _cpu_lib is None and _cuda_lib is None:
    raise ImportError(
        "nodrop: its C++ engine is not built (no libnodrop_ffi_cpu.so in "
        f"{', '.join(sys.modules[__package__].__path__)}). Run `make setup` in the repository "
        "(or `pip install .`), which compiles it.")
if _cpu_lib is not None:
    _register(_cpu_lib, CPU_TARGETS, "cpu")
if _cuda_lib is not None:
    _register(_cuda_lib, CUDA_TARGETS, "CUDA")
    _cuda_lib.NodropGroupedMatmulWorkspaceBytes.restype = ctypes.c_int64
    _cuda_lib.NodropGroupedMatmulWorkspaceBytes.argtypes = [ctypes.c_int64]
    _cuda_lib.NodropGroupedMatmulFp8BlockwiseWorkspaceBytes.restype = ctypes.c_int64
    _cuda_lib.NodropGroupedMatmulFp8BlockwiseWorkspaceBytes.argtypes = [ctypes.c_int64]
    _cuda_lib.NodropSortByExpertWorkspaceBytes.restype = ctypes.c_int64
    _cuda_lib.NodropSortByExpertWorkspaceBytes.argtypes = [ctypes.c_int64] * 3


def engines_built() -> dict[str, bool]:
    """Which engines this build has and registered with XLA, whether or not JAX can run them."""
    return {"cpu": _cpu_lib is not None, "cuda": _cuda_lib is not None}


def jax_has(platform: str) -> bool:
    """Whether JAX has a device of `platform` ("cpu", "cuda"): "cuda" needs jaxlib's CUDA plugin
    and a GPU it can use."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # JAX has no such platform, or its plugin found no device
        return False


def backends() -> dict[str, bool]:
    """Which engines can run here: built, registered with XLA, and on a platform JAX has a
    device of (a CUDA engine is of no use to a jaxlib without its CUDA plugin)."""
    return {name: built and jax_has(name) for name, built in engines_built().items()}


def grouped_matmul_workspace_bytes(num_groups: int) -> int:
    return _cuda_lib.NodropGroupedMatmulWorkspaceBytes(num_groups)


def grouped_matmul_fp8_blockwise_workspace_bytes(num_groups: int) -> int:
    return _cuda_lib.NodropGroupedMatmulFp8BlockwiseWorkspaceBytes(num_groups)


def sort_by_expert_workspace_bytes(num_tokens: int, k: int, num_experts: int) -> int:
    return _cuda_lib.NodropSortByExpertWorkspaceBytes(num_tokens, k, num_experts)


def on_platform(*operands, cpu, cuda):
    """cpu(*operands) where the computation runs on the CPU, cuda(*operands) on a GPU."""
    if _cuda_lib is None:
        return cpu(*operands)
    return jax.lax.platform_dependent(*operands, cpu=cpu, cuda=cuda)


def varying_axes(*operands) -> frozenset:
    """The manual mesh axes (inside `jax.shard_map`) over which any operand varies: its value
    differs between the devices of that axis. Empty outside shard_map or with check_vma=False."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in operands))


def match_vma(*operands):
    """The operands cast to vary over the union of their varying manual axes.

    Inside `jax.shard_map` with check_vma (its default) every operand of an op, and every
    cotangent a custom_vjp rule returns, must have the type of its primal, varying axes
    included. An op whose operands differ (tokens varying over the mesh, weights replicated)
    casts them all to the union first: the cast (`pcast` to varying) is free, and its
    transpose sums the replicated operand's gradient over the axes, as JAX does for its own
    primitives. A no-op outside shard_map.
    """
    varying = varying_axes(*operands)
    return tuple(
        jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")
        if (missing := varying - jax.typeof(x).mat.varying) else x
        for x in operands)


def _typed_like(operands, shape, dtype):
    """A result type varying over the manual axes the operands vary over. The type names the
    operands' (shard_map's) mesh, on which those axes are manual."""
    varying = varying_axes(*operands)
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    mesh = jax.typeof(operands[0]).sharding.mesh
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P()),
        manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def typed_like(x, shape, dtype):
    """The type of an array of `shape` and `dtype` varying over the manual axes x varies over
    (inside `jax.shard_map`; a plain ShapeDtypeStruct outside it): for `jax.linear_transpose`
    of a function of x, whose cotangent must have x's type."""
    return _typed_like((x,), shape, dtype)


def cotangent_like(grad, primal):
    """grad with primal's type inside `jax.shard_map`, as a custom_vjp rule must return it:
    summed over the manual axes only grad varies over (the primal is the same on those devices,
    so its cotangent is the sum of theirs), cast to vary over those only the primal varies
    over. A no-op outside shard_map."""
    extra = varying_axes(grad) - varying_axes(primal)
    if extra:
        grad = jax.lax.psum(grad, tuple(sorted(extra, key=str)))
    missing = varying_axes(primal) - varying_axes(grad)
    if missing:
        grad = jax.lax.pcast(grad, tuple(sorted(missing, key=str)), to="varying")
    return grad


def engine_call(target: str, result_types, *, workspace_bytes=None, aliases=None, **attrs):
    """The function of the operands that runs `target`'s handler (`jax.ffi.ffi_call`).

    workspace_bytes: for a CUDA handler, a function giving its workspace size; the handler
    returns the workspace as one more (uint8) result, dropped here. aliases: {operand index:
    result index} for results written into their operand's buffer (where XLA can give it up,
    as for a donated argument; else it copies the operand first). Results are as
    `result_types` (one, or a tuple); inside `jax.shard_map` they vary over the axes the
    operands vary over (`ffi_call` cannot know that: it takes the types it is given).
    """
    single = not isinstance(result_types, (tuple, list))
    results = (result_types,) if single else tuple(result_types)

    def run(*operands):
        operands = match_vma(*operands)
        typed = tuple(_typed_like(operands, r.shape, r.dtype) for r in results)
        workspace = ()  # sized when traced: only the CUDA branch asks the CUDA library
        if workspace_bytes is not None:
            workspace = (_typed_like(operands, (workspace_bytes(),), jnp.uint8),)
        out = jax.ffi.ffi_call(target, typed + workspace, vmap_method="sequential",
                               input_output_aliases=aliases)(*operands, **attrs)
        out = tuple(out)[:len(results)]
        return out[0] if single else out
    return run


def call(target: str, result_types, *operands, cuda_workspace=None, aliases=None, **attrs):
    """`target` on the platform the computation runs on, the same handler name on both.

    cuda_workspace: the CUDA handler's workspace size function; aliases: results written in
    place (see `engine_call`).
    """
    return on_platform(
        *operands, cpu=engine_call(target, result_types, aliases=aliases, **attrs),
        cuda=engine_call(target, result_types, workspace_bytes=cuda_workspace, aliases=aliases,
                         **attrs))
