"""Loads nodrop's shared libraries and registers every FFI target with XLA.

The CPU library (`libnodrop_ffi_cpu.so`) is always built; each of its exported handler symbols is
registered for platform "cpu" under one target name. Importing nodrop does this once.
"""

from __future__ import annotations

import ctypes
import pathlib

import jax

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent

# target name -> exported handler symbol, one pair per FFI handler (csrc/ffi/*.cc).
CPU_TARGETS = {
    "nodrop_grouped_matmul": "NodropGroupedMatmulCpu",
    "nodrop_grouped_matmul_contract": "NodropGroupedMatmulContractCpu",
    "nodrop_permute": "NodropPermuteCpu",
    "nodrop_scatter_rows": "NodropScatterRowsCpu",
    "nodrop_gather_rows": "NodropGatherRowsCpu",
    "nodrop_gather_row_dots": "NodropGatherRowDotsCpu",
    "nodrop_topk_router": "NodropTopkRouterCpu",
    "nodrop_topk_router_grad": "NodropTopkRouterGradCpu",
}


def _load(name: str) -> ctypes.CDLL:
    path = _PACKAGE_DIR / name
    if not path.exists():
        raise ImportError(
            f"nodrop: {path} is missing; the package was not built. Install it with "
            "`pip install .` (see README), which compiles the C++ engine.")
    return ctypes.CDLL(str(path))


def _register_cpu() -> None:
    lib = _load("libnodrop_ffi_cpu.so")
    for target, symbol in CPU_TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")


_register_cpu()


def backends() -> dict[str, bool]:
    """Which engines this build registered with XLA."""
    return {"cpu": True, "cuda": False}
