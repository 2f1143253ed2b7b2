"""Shared helpers for nodrop's Python tests.

Every op is compared against its pure-JAX reference (nodrop/ops/reference.py) run on float64
copies of the inputs, so x64 is switched on before anything else imports JAX arrays. With x64 on,
inputs must be created with explicit dtypes (int32 group sizes, float32 arrays).
"""

from __future__ import annotations

import functools
import pathlib

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import nodrop  # noqa: E402
from nodrop._deps import INSTALL_TRAIN, missing_train_packages  # noqa: E402
import ml_dtypes  # noqa: E402

from nodrop.ops import reference  # noqa: E402
from nodrop.ops.fp8 import BLOCK, E4M3_MAX  # noqa: E402

settings.register_profile(
    "nodrop", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("nodrop")

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
DTYPE_IDS = ("f32", "f16", "bf16")
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)

# Relative error bounds (max abs diff / max abs reference) against the float64 reference.
F32_TOL = 1e-5
LOW_PRECISION_TOL = 1e-2


MULTIDEVICE = pathlib.Path(__file__).parent / "multidevice"

# Without the `train` extra the trainer's tests skip, saying so (a test module of the trainer
# imports needs_train first); with it nothing is skipped, and a broken package fails its tests.
TRAIN_MISSING = missing_train_packages()
WITHOUT_TRAIN = (f"needs the train extra ({INSTALL_TRAIN}); not installed: "
                 f"{', '.join(TRAIN_MISSING)}")
needs_train = pytest.mark.skipif(bool(TRAIN_MISSING), reason=WITHOUT_TRAIN)


def pytest_ignore_collect(collection_path, config):
    """tests/python/multidevice needs 8 host devices, which JAX takes only before it starts: it
    runs in a pytest process of its own (`pytest tests/python/multidevice`, as `make test-python`
    does), never beside the other tests, which keep one device."""
    if collection_path != MULTIDEVICE:
        return None
    asked = [(config.invocation_params.dir / arg.split("::")[0]).resolve()
             for arg in config.args]
    return not all(path.is_relative_to(MULTIDEVICE) for path in asked)


@pytest.fixture(autouse=True)
def _no_checked_mode():
    """Every test runs in unchecked mode unless it opts in (whatever NODROP_CHECKS says)."""
    with nodrop.checks(False):
        yield


# --- numbers ---------------------------------------------------------------------------------


def tolerance(*dtypes) -> float:
    """1e-5 when every dtype involved is float32 (or wider), else the bf16/fp16 bound 1e-2."""
    narrow = [d for d in dtypes if d is not None and jnp.dtype(d).itemsize < 4]
    return LOW_PRECISION_TOL if narrow else F32_TOL


def as_f64(x) -> np.ndarray:
    """A float64 numpy copy of any float array (bfloat16 included), holding exactly its values."""
    return np.asarray(x).astype(np.float64)


def relative_error(actual, expected, floor: float = 1e-300) -> float:
    """max |actual - expected| / max |expected|. The denominator is at least `floor`: by default
    an all-zero reference demands an (essentially) exactly zero result; a gradient that is zero
    up to rounding passes a floor of the scale its terms have. NaN gives NaN (fails)."""
    actual, expected = as_f64(actual), as_f64(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != reference {expected.shape}"
    if actual.size == 0:
        return 0.0
    denom = max(float(np.max(np.abs(expected))), floor)
    return float(np.max(np.abs(actual - expected))) / denom


def assert_close(actual, expected, tol: float, what: str = "result", floor: float = 1e-300):
    err = relative_error(actual, expected, floor)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def random_normal(rng: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0):
    """A jax array of normal samples, rounded to `dtype` (explicit, since x64 is on)."""
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def int32(values):
    return jnp.asarray(np.asarray(values, dtype=np.int64).astype(np.int32), dtype=jnp.int32)


def f64(x):
    """A float64 jax copy of a float array, for the reference."""
    return jnp.asarray(as_f64(x), dtype=jnp.float64)


# --- references ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _jitted_reference(fn, static: tuple):
    return jax.jit(functools.partial(fn, **dict(static)))


def ref64(fn, *arrays, **static):
    """Runs a reference (a function, or the name of one in nodrop.ops.reference), jitted and
    keyed by its static keyword arguments, on float64 copies of the float arrays; integer
    arrays are passed unchanged."""
    fn = getattr(reference, fn) if isinstance(fn, str) else fn
    args = [f64(a) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else jnp.asarray(a)
            for a in arrays]
    return _jitted_reference(fn, tuple(sorted(static.items())))(*args)


def ref64_vjp(fn, primals, cotangent):
    """Gradients of `fn` (a reference closure over static arguments) in float64: the vjp of the
    float64 copies of `primals` applied to a float64 copy of `cotangent`."""
    primals64 = tuple(f64(p) for p in primals)
    _, vjp = jax.vjp(fn, *primals64)
    return vjp(f64(cotangent))


def group_offsets(group_sizes, rows: int) -> np.ndarray:
    """The engine's clamped offsets: negative sizes count as zero, the total stops at `rows`."""
    sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
    return np.minimum(np.concatenate([[0], np.cumsum(sizes)]), rows)


# --- hypothesis strategies -------------------------------------------------------------------


@st.composite
def valid_group_sizes(draw, rows: int, groups: int):
    """Sizes >= 0 with sum <= rows: empty groups, skewed groups, and totals short of `rows`."""
    total = draw(st.one_of(st.just(rows), st.integers(0, rows)))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=groups - 1,
                                max_size=groups - 1)))
    return np.diff(np.asarray([0, *cuts, total], np.int64)).astype(np.int32)


@st.composite
def invalid_group_sizes(draw, rows: int, groups: int):
    """Sizes the engine must clamp: negative entries, totals past `rows`, int32 extremes."""
    entry = st.one_of(st.integers(-rows - 2, rows + 2), st.sampled_from([INT32_MIN, INT32_MAX]))
    sizes = draw(st.lists(entry, min_size=groups, max_size=groups))
    if all(s >= 0 for s in sizes) and sum(sizes) <= rows:  # make it invalid
        index = draw(st.integers(0, groups - 1))
        sizes[index] = draw(st.one_of(st.integers(-rows - 2, -1),
                                      st.integers(rows - sum(sizes) + sizes[index] + 1,
                                                  rows + 3)))
    return np.asarray(sizes, np.int64).astype(np.int32)


seeds = st.integers(0, 2**32 - 1)


# --- a small MoE model for the composition tests ---------------------------------------------


def moe_layer(ops, x, params, *, k: int):
    """route -> permute -> grouped_matmul -> tanh -> grouped_matmul -> unpermute, residual.

    `ops` is the nodrop module or nodrop.ops.reference; params = (router [H, E], w_in [E, H, F],
    w_out [E, F, H]).
    """
    router, w_in, w_out = params
    num_experts = router.shape[1]
    acc = jnp.promote_types(x.dtype, jnp.float32)  # router logits in float32 (or float64)
    logits = jnp.dot(x.astype(acc), router.astype(acc), precision=jax.lax.Precision.HIGHEST)
    weights, ids = ops.topk_router(logits, k, renormalize=True)
    rows, group_sizes, row_map = ops.permute(x, ids, num_experts)
    hidden = jnp.tanh(ops.grouped_matmul(rows, w_in, group_sizes))
    out = ops.grouped_matmul(hidden, w_out, group_sizes)
    return x + ops.unpermute(out, row_map, weights.astype(x.dtype))


def moe_params(rng, *, layers: int, hidden: int, ffn: int, experts: int, dtype=jnp.float32):
    return (random_normal(rng, (layers, hidden, experts), dtype),
            random_normal(rng, (layers, experts, hidden, ffn), dtype, scale=hidden**-0.5),
            random_normal(rng, (layers, experts, ffn, hidden), dtype, scale=ffn**-0.5))


def numpy_quantize_transposed(x, sizes, given_scale=None):
    """quantize_transposed written out in numpy: each group's (clamped) rows in blocks of 128
    from its first row, numbered on over the groups; a block's scale per column is amax *
    float32(1 / 448) (1 for zeros, NaN for a NaN or an inf), or given_scale for every block (the
    unused ones too), its codes x * (1 / scale) in float32, clipped to +-448 and rounded to
    nearest even (ml_dtypes' cast); the codes of block b's row j at column 128 * b + j. Returns
    the codes' bytes and the scales."""
    x = as_f64(x).astype(np.float32)
    m, c = x.shape
    blocks = -(-m // BLOCK) + len(sizes)
    values = np.zeros((c, BLOCK * blocks), np.float32)
    scale = np.full((blocks, c), 1 if given_scale is None else given_scale, np.float32)
    bounds, b = group_offsets(sizes, m), 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        for first in range(start, end, BLOCK):
            block = x[first:min(first + BLOCK, end)]
            if given_scale is None:
                amax = np.max(np.abs(np.where(np.isfinite(block), block, 0)), axis=0)
                s = amax * np.float32(1 / E4M3_MAX)
                s = np.where(np.isfinite(block).all(axis=0), np.where(s > 0, s, 1), np.nan)
                scale[b] = s.astype(np.float32)
            with np.errstate(invalid="ignore"):
                v = block * (np.float32(1) / scale[b])
                v = np.where(np.isnan(v), v, np.clip(v, -E4M3_MAX, E4M3_MAX))
            values[:, BLOCK * b:BLOCK * b + len(block)] = v.T
            b += 1
    return values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale
