"""Trace-time argument checks shared by the ops, and the opt-in checked mode.

Shapes, ranks and dtypes are checked when an op is traced, so a mistake surfaces with a message
that names the argument before anything runs; the checks are the same eagerly and under jit.
Values that only exist at run time (group sizes, expert ids) are clamped by the engine; in
checked mode the engine raises instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
# JAX keys its trace and compile caches on the options defined with include_in_jit_key and
# include_in_trace_context (as jax_pallas_enable_debug_checks); the public jax.config cannot
# define one.
from jax._src import config as jax_config

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
INT32 = np.iinfo(np.int32)

# Read from NODROP_CHECKS at import (1/0, true/false, yes/no, on/off); `checks()` sets it.
_CHECKS = jax_config.bool_state(
    name="nodrop_checks", default=False,
    help="nodrop's checked mode: invalid group sizes and expert ids raise instead of being "
         "clamped.",
    include_in_jit_key=True, include_in_trace_context=True)


def checks_enabled() -> bool:
    """True inside `nodrop.checks()`, or where NODROP_CHECKS=1 was set when nodrop was
    imported."""
    return _CHECKS.value


@contextlib.contextmanager
def checks(enabled: bool = True) -> Iterator[None]:
    """Checked mode: run-time values that would otherwise be clamped raise an error instead.

    Group sizes that are negative or sum past the rows, and expert ids outside [0, E), raise
    jax.errors.JaxRuntimeError (INVALID_ARGUMENT, naming the argument) when the computation
    runs, on the CPU engine. The setting is process-wide, the same on every thread, and part
    of what JAX caches traces and compilations on: a function jitted before the block is traced
    again inside it, and the other way round.
    """
    previous = _CHECKS.get_global()
    jax.config.update("nodrop_checks", enabled)
    try:
        yield
    finally:
        jax.config.update("nodrop_checks", previous)


def as_array(x):
    """A Python list or tuple as a numpy array (integers stay int64 there: as_int32 converts
    them without wrapping); arrays as they are."""
    return np.asarray(x) if isinstance(x, (list, tuple)) else x


def require_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(x.shape)}")


def require_float(name: str, x) -> None:
    # The dtype jit would trace with: float64 is float32 when x64 is off, eagerly as under jit.
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {dtype.name}")


def require_dim(name: str, x, axis: int, expected: int, why: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name} has {x.shape[axis]} {why} but expected {expected} "
            f"(shape {tuple(x.shape)})")


def as_int32(name: str, x):
    """Integer arrays (group sizes, ids, row maps) as the engine's int32, any integer dtype.

    Values outside int32 saturate to its bounds, never wrap: the ops treat a saturated value as
    its true value (a size past int32 is past any number of rows, a negative one counts as 0;
    an id or row past it is out of range). Host arrays are converted on the host, before JAX
    would wrap an int64 to int32 with x64 off.
    """
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {jnp.dtype(x.dtype).name}")
    bounds = np.iinfo(x.dtype)
    if bounds.min < INT32.min or bounds.max > INT32.max:
        low, high = max(bounds.min, INT32.min), min(bounds.max, INT32.max)
        x = np.clip(x, low, high) if isinstance(x, np.ndarray) else jnp.clip(x, low, high)
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
