"""Loads nodrop's shared libraries, registers every FFI target with XLA, and calls them.

`libnodrop_ffi_cpu.so` (the CPU engine) is always built; `libnodrop_ffi_cuda.so` (the Hopper
engine) when the build found nvcc and CUTLASS. Each exports one handler symbol per target; the
same target name is registered for platform "cpu" and for "CUDA", and `call` lowers whichever
the computation runs on.
"""

from __future__ import annotations

import ctypes
import pathlib
import warnings

import jax
import jax.numpy as jnp

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent

# target name -> exported handler symbol (without its Cpu / Cuda suffix), one per FFI handler.
TARGETS = {
    "nodrop_grouped_matmul": "NodropGroupedMatmul",
    "nodrop_grouped_matmul_contract": "NodropGroupedMatmulContract",
    "nodrop_permute": "NodropPermute",
    "nodrop_scatter_rows": "NodropScatterRows",
    "nodrop_gather_rows": "NodropGatherRows",
    "nodrop_gather_row_dots": "NodropGatherRowDots",
    "nodrop_topk_router": "NodropTopkRouter",
    "nodrop_topk_router_grad": "NodropTopkRouterGrad",
}
CPU_TARGETS = {target: symbol + "Cpu" for target, symbol in TARGETS.items()}
CUDA_TARGETS = {target: symbol + "Cuda" for target, symbol in TARGETS.items()}


def _load(name: str) -> ctypes.CDLL | None:
    path = _PACKAGE_DIR / name
    if not path.exists():
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:  # e.g. a GPU machine without the CPU engine's oneDNN
        warnings.warn(f"nodrop: cannot load {path.name}: {error}", stacklevel=3)
        return None


def _register(lib: ctypes.CDLL, symbols: dict[str, str], platform: str) -> None:
    for target, symbol in symbols.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform=platform)


_cpu_lib = _load("libnodrop_ffi_cpu.so")
_cuda_lib = _load("libnodrop_ffi_cuda.so")
if _cpu_lib is None and _cuda_lib is None:
    raise ImportError(
        f"nodrop: no engine library in {_PACKAGE_DIR}; the package was not built. Install it "
        "with `pip install .` (see README), which compiles the C++ engine.")
if _cpu_lib is not None:
    _register(_cpu_lib, CPU_TARGETS, "cpu")
if _cuda_lib is not None:
    _register(_cuda_lib, CUDA_TARGETS, "CUDA")
    _cuda_lib.NodropGroupedMatmulWorkspaceBytes.restype = ctypes.c_int64
    _cuda_lib.NodropGroupedMatmulWorkspaceBytes.argtypes = [ctypes.c_int64]
    _cuda_lib.NodropSortByExpertWorkspaceBytes.restype = ctypes.c_int64
    _cuda_lib.NodropSortByExpertWorkspaceBytes.argtypes = [ctypes.c_int64] * 3


def backends() -> dict[str, bool]:
    """Which engines this build registered with XLA."""
    return {"cpu": _cpu_lib is not None, "cuda": _cuda_lib is not None}


def grouped_matmul_workspace_bytes(num_groups: int) -> int:
    return _cuda_lib.NodropGroupedMatmulWorkspaceBytes(num_groups)


def sort_by_expert_workspace_bytes(num_tokens: int, k: int, num_experts: int) -> int:
    return _cuda_lib.NodropSortByExpertWorkspaceBytes(num_tokens, k, num_experts)


def call(target: str, result_types, *args, cuda_workspace=None, **attrs):
    """`jax.ffi.ffi_call` of `target` on the platform the computation runs on.

    cuda_workspace: a function giving the workspace bytes of the CUDA handler, which returns the
    workspace as one more (uint8) result; it is dropped here. Results are as `result_types`.
    """
    single = not isinstance(result_types, (tuple, list))
    results = (result_types,) if single else tuple(result_types)

    def lower(extra_results):
        def run(*operands):
            out = jax.ffi.ffi_call(target, results + extra_results,
                                   vmap_method="sequential")(*operands, **attrs)
            out = tuple(out)[:len(results)]
            return out[0] if single else out
        return run

    cpu = lower(())
    if _cuda_lib is None:
        return cpu(*args)
    workspace = ()
    if cuda_workspace is not None:
        workspace = (jax.ShapeDtypeStruct((cuda_workspace(),), jnp.uint8),)
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=lower(workspace))
