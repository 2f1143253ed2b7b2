"""tokamax.ragged_dot (Google's Pallas kernel library), the GPU benchmarks' other grouped-matmul
peer: optional, like torch, and never a dependency of nodrop itself."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import jax

import nodrop.moe.block as moe_block

# MoEConfig(ops=MOE_OPS): the MoE block on tokamax_ops' table entry.
MOE_OPS = "tokamax"


def implementation() -> str:
    """The tokamax implementation this backend runs. On an NVIDIA GPU "mosaic", its Pallas Mosaic
    GPU kernels (on Hopper the sm90 ones: wgmma, TMA), tokamax's own first choice there; its
    "triton" kernels need jax_triton, and its "xla" one is a masked dense product, no GPU kernel.
    Elsewhere (the CPU tests) "xla", the only one that runs there. Chosen explicitly, so that a
    GPU on which the Mosaic kernels fail records the failure rather than falling back."""
    return "mosaic" if jax.default_backend() == "gpu" else "xla"


def load_tokamax():
    """(ragged_dot(lhs, rhs, group_sizes), what ran) where tokamax imports: its ragged_dot bound
    to `implementation()`. Else (a stand-in that raises why not, why not): each tokamax case
    then fails, and is recorded as failed, like any other."""
    try:
        import tokamax
    except Exception as error:  # ImportError, or a dependency of the wrong version
        why = f"tokamax does not import: {type(error).__name__}: {error}"

        def unavailable(*args):
            raise RuntimeError(why)

        return unavailable, why
    return (functools.partial(tokamax.ragged_dot, implementation=implementation()),
            f"tokamax {tokamax.__version__}, implementation={implementation()!r}")


@contextlib.contextmanager
def tokamax_ops(ragged_dot):
    """nodrop.moe's op table with an entry MOE_OPS: nodrop's router, permute and unpermute around
    `ragged_dot` as the experts' grouped matmul, so the same routing as the dropless block. In
    force while such blocks are built (MoEConfig checks the name) and traced."""
    entry = dict(moe_block.OPS["nodrop"], grouped_matmul=ragged_dot)
    with mock.patch.dict(moe_block.OPS, {MOE_OPS: entry}):
        yield
