"""How the engine's calls partition under `jit` on sharded arrays (outside `jax.shard_map`).

XLA cannot see into a custom call, so by default it gathers every operand to each device and
runs the whole call everywhere. Each op here tells it, through
`jax.experimental.custom_partitioning` and a Shardy sharding rule (Shardy is jax 0.11.2's
partitioner by default), which of its dimensions it computes locally; a dimension named as
needing replication is gathered. `partition` is the shared callback: the operands keep the
shardings of their local dimensions, and the per-device function receives each local
dimension's mesh axes, to compute its shard's part (the grouped matmuls turn the global group
sizes into the shard's own from its row range) and reduce it (`psum`) where a reduced
dimension is split.

On one device, and inside a `jax.shard_map` that is manual over every mesh axis, the call
lowers as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# custom_partitioning needs the devices when it is lowered; jit provides them where the
# program holds a primitive of this set (private: JAX's own callbacks register there).
from jax._src import dispatch as _dispatch  # noqa: E402

Axes = tuple[str, ...]


def register_lowering(primitive, lower: Callable, multiple_results: bool = False) -> None:
    """Lowers `primitive` with lower(*operands, partition=..., **params): partition is True
    where the program is partitioned over several devices by XLA (the custom_partitioning
    path), False on one device and inside `jax.shard_map` (any manual axis), where the call
    lowers as it is."""
    _dispatch.prim_requires_devices_during_lowering.add(primitive)

    def rule(ctx, *args, **params):
        context = ctx.module_context.axis_context
        devices = getattr(context, "device_assignment", None)
        partition = (not getattr(context, "manual_axes", None) and devices is not None
                     and len(devices) > 1)
        return mlir.lower_fun(lambda *a: lower(*a, partition=partition, **params),
                              multiple_results=multiple_results)(ctx, *args)

    mlir.register_lowering(primitive, rule)


def _axes(entry) -> Axes:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: Axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def dim_axes(shape_with_sharding, ndim: int) -> list[Axes]:
    """The mesh axes each dimension of an operand (or result) is split over."""
    sharding = shape_with_sharding.sharding
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return [_axes(e) for e in spec] + [()] * (ndim - len(spec))


def axes_size(mesh, axes: Axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def shard_index(axes: Axes):
    """This device's index along `axes` (major to minor, as a PartitionSpec entry splits)."""
    index = 0
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return index


def partitioned(fn: Callable, rule: str, dims: Sequence[Sequence[str]],
                result_dims: Sequence[Sequence[str]], local: Callable, local_factors,
                **rule_factors):
    """fn(*operands) (one result, or a tuple), with XLA told which dimensions stay split.

    rule: the Shardy sharding rule (einsum-like, one factor per dimension); dims and
    result_dims: each operand's and result's factors, as in the rule. local_factors: the
    factors that may stay split; a factor is kept split (over the axes its first operand with
    it is split over) only where its size divides by those axes' size, and no other factor
    uses them. Every other dimension is gathered. local(axes_of, *operands): the per-device
    function, given `axes_of` (each split factor -> its mesh axes).
    rule_factors: need_replication_factors / reduction_factors for the rule.
    """
    op = custom_partitioning(fn)

    def partition(mesh, arg_shapes, result_shape):
        axes_of: dict[str, Axes] = {}
        used: set[str] = set()
        for shape, factors in zip(arg_shapes, dims):
            for size, axes, factor in zip(shape.shape, dim_axes(shape, len(factors)), factors):
                if (factor in local_factors and axes and factor not in axes_of
                        and not used.intersection(axes) and size % axes_size(mesh, axes) == 0):
                    axes_of[factor] = axes
                    used.update(axes)

        def sharding(factors):
            return NamedSharding(mesh, P(*(_entry(axes_of.get(f, ())) for f in factors)))

        arg_shardings = tuple(sharding(f) for f in dims)
        result_shardings = tuple(sharding(f) for f in result_dims)
        if not isinstance(result_shape, (tuple, list)):
            result_shardings = result_shardings[0]
        return mesh, lambda *args: local(axes_of, *args), result_shardings, arg_shardings

    op.def_partition(partition=partition, sharding_rule=rule, **rule_factors)
    return op
