"""What nodrop's JAX primitives share: abstract values that keep shard_map's varying axes,
eager calls, sequential batching, and registration (the lowering is `_partition`'s)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching

from nodrop.ops import _partition


def result_aval(avals, shape, dtype):
    """A result's abstract value: varying over the manual axes the operands vary over."""
    varying = frozenset().union(*(a.mat.varying for a in avals))
    if not varying:
        return jax.core.ShapedArray(shape, dtype)
    return jax.core.ShapedArray(
        shape, dtype, sharding=jax.sharding.NamedSharding(avals[0].sharding.mesh, jax.P()),
        manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _eager(primitive):
    """Eager calls of a primitive run it jitted (the lowering is the only implementation)."""
    @functools.lru_cache(maxsize=None)
    def jitted(**params):
        return jax.jit(functools.partial(primitive.bind, **params))

    return lambda *args, **params: jitted(**params)(*args)


def sequential(primitive, args, dims, params):
    """Batching by one call per batch element (`ffi_call`'s "sequential")."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims)]
    out = jax.lax.map(lambda xs: primitive.bind(*xs, **params), args)
    return out, ([0] * len(out) if primitive.multiple_results else 0)


def zero_cotangents(*operands):
    return tuple(ad.Zero(x.aval.to_ct_aval()) if ad.is_undefined_primal(x) else None
                 for x in operands)


def bilinear_jvp(bind: Callable, linear: tuple[int, ...]) -> Callable:
    """The JVP rule of an op bilinear in the operands at positions `linear`: one call of `bind`
    per nonzero tangent, summed; zero tangents are skipped. The terms are summed in reverse, so
    that reverse mode (which transposes them last to first) emits the gradient of the first
    operand (the rows) first; the order measured no faster or slower on an H200
    (bench/results/2026-12-03-h200-layer-ab, round 2)."""
    def jvp(primals, tangents, **params):
        out = bind(*primals, **params)
        terms = []
        for index in reversed(linear):
            if type(tangents[index]) is not ad.Zero:
                args = list(primals)
                args[index] = tangents[index]
                terms.append(bind(*args, **params))
        if not terms:
            return out, ad.Zero.from_primal_value(out)
        return out, functools.reduce(jnp.add, terms)
    return jvp


def define(name, *, abstract_eval: Callable, lower: Callable, jvp: Callable | None = None,
           transpose: Callable | None = None, batch: Callable | None = None,
           multiple_results: bool = False):
    """A primitive (named, or one already made) with these rules; batching defaults to
    `sequential`."""
    primitive = jax.extend.core.Primitive(name) if isinstance(name, str) else name
    primitive.multiple_results = multiple_results
    primitive.def_impl(_eager(primitive))
    primitive.def_abstract_eval(abstract_eval)
    _partition.register_lowering(primitive, lower, multiple_results=multiple_results)
    if jvp is not None:
        ad.primitive_jvps[primitive] = jvp
    if transpose is not None:
        ad.primitive_transposes[primitive] = transpose
    batching.primitive_batchers[primitive] = batch or (
        lambda args, dims, **params: sequential(primitive, args, dims, params))
    return primitive
