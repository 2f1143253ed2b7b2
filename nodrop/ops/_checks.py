"""Trace-time argument checks shared by the ops, and the opt-in checked mode.

Shapes, ranks and dtypes are checked when an op is traced, so a mistake surfaces with a message
that names the argument before anything runs. Values that only exist at run time (group sizes,
expert ids) are clamped by the engine; in checked mode the engine raises instead.
"""

from __future__ import annotations

import contextlib
import os
import threading

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

_state = threading.local()


def checks_enabled() -> bool:
    """True inside `nodrop.checks()` or when the environment sets NODROP_CHECKS=1."""
    override = getattr(_state, "enabled", None)
    if override is not None:
        return override
    return os.environ.get("NODROP_CHECKS", "0") not in ("", "0", "false", "False")


@contextlib.contextmanager
def checks(enabled: bool = True):
    """Checked mode: run-time values that would otherwise be clamped raise an error instead.

    Group sizes that are negative or sum past the rows, and expert ids outside [0, E), raise an
    error naming the argument when the computation runs. The flag is read when an op is traced,
    so it applies to functions traced (jitted) inside the block.
    """
    previous = getattr(_state, "enabled", None)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def require_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(x.shape)}")


def require_float(name: str, x) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16, got {jnp.dtype(x.dtype).name}")


def require_dim(name: str, x, axis: int, expected: int, why: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name} has {x.shape[axis]} {why} but expected {expected} "
            f"(shape {tuple(x.shape)})")


def as_int32(name: str, x):
    """Integer arrays (group sizes, ids) are passed to the engine as int32."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {jnp.dtype(x.dtype).name}")
    return x.astype(jnp.int32)


def out_dtype(name: str, dtype, default):
    if dtype is None:
        return jnp.dtype(default)
    dtype = jnp.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {dtype.name}")
    return dtype


def attr_bool(value: bool):
    return np.bool_(value)
