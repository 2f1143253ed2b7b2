"""The device mesh: axes `data`, `fsdp` and `expert`, from a spec string or keywords, and the
checks a run makes before it compiles anything.

Every token axis shards the batch: a batch is split over data x fsdp x expert. The expert weights
are split over `expert` (each rank holds E / expert of them). The axes are `Auto`: XLA
propagates shardings through `jit`, and `jax.shard_map` (the expert-parallel MoE block) moves its
inputs to the layout it asks for. Errors are one line naming the argument, what it must be and
what it got.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh

from nodrop._fields import is_int

AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"


def parse_mesh_spec(spec: str, *, name: str = "mesh") -> dict[str, int]:
    """'data=2,fsdp=1,expert=4' -> {'data': 2, 'fsdp': 1, 'expert': 4}; axes left out are 1.

    name: what the error messages call the spec (the CLI passes its flag, `--mesh`).
    """
    sizes = {}
    for part in spec.split(","):
        axis, sep, size = part.strip().partition("=")
        axis, size = axis.strip(), size.strip()
        if not sep or not size.lstrip("-").isdigit():
            raise ValueError(f"{name} must be comma-separated axis=size pairs like "
                             f"'data=2,fsdp=1,expert=4', got {spec!r}")
        if axis in sizes:
            raise ValueError(f"{name} must name each axis once, got {axis!r} twice in {spec!r}")
        sizes[axis] = int(size)
    return _complete(sizes, name)


def _complete(sizes: dict, name: str) -> dict[str, int]:
    for axis, size in sizes.items():
        if axis not in AXES:
            raise ValueError(f"{name} axis must be one of {AXES}, got {axis!r}")
        if not is_int(size) or size < 1:
            raise ValueError(f"{name} axis {axis} must be a positive int, got {size!r}")
    return {axis: sizes.get(axis, 1) for axis in AXES}


def make_mesh(spec: str | None = None, *, devices=None, name: str = "mesh",
              **sizes: int) -> Mesh:
    """A `jax.sharding.Mesh` with axes (data, fsdp, expert), all of them Auto.

    Args:
      spec: 'data=2,fsdp=1,expert=4' (axes left out are 1), or None to give the sizes as
        keywords: make_mesh(data=2, expert=4).
      devices: the devices to lay out (default: all of `jax.devices()`); the mesh must use
        every one of them.
      name: what the error messages call the spec.
    """
    if spec is not None and sizes:
        raise ValueError(f"{name} must be given as a spec string or as keywords, got both "
                         f"{spec!r} and {sizes}")
    shape = parse_mesh_spec(spec, name=name) if spec is not None else _complete(sizes, name)
    devices = jax.devices() if devices is None else list(devices)
    total = math.prod(shape.values())
    if total != len(devices):
        product = " x ".join(f"{axis}={size}" for axis, size in shape.items())
        raise ValueError(f"{name} must use all {len(devices)} devices, got {product} = {total}")
    return jax.make_mesh(tuple(shape.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)


def token_axes(mesh) -> tuple[str, ...]:
    """The mesh's axes a batch is split over: those of (data, fsdp, expert) it has."""
    return tuple(axis for axis in AXES if axis in mesh.axis_names)


def token_shards(mesh) -> int:
    """How many pieces a batch is split into: the product of the token axes' sizes."""
    return math.prod(mesh.shape[axis] for axis in token_axes(mesh))


def expert_shards(mesh) -> int:
    """The size of the mesh's expert axis (1 without one)."""
    return mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.axis_names else 1


def check_batch(batch_size: int, mesh, *, name: str = "batch_size") -> None:
    """Refuses a batch that does not split evenly over data x fsdp x expert."""
    shards = token_shards(mesh)
    if batch_size % shards:
        split = " x ".join(f"{axis}={mesh.shape[axis]}" for axis in token_axes(mesh))
        raise ValueError(f"{name} must be divisible by {split} = {shards}, got {batch_size}")


def check_experts(num_experts: int, mesh, *, name: str = "num_experts") -> None:
    """Refuses experts that do not split evenly over the expert axis."""
    shards = expert_shards(mesh)
    if num_experts % shards:
        raise ValueError(f"{name} must be divisible by the mesh's expert axis ({shards}), "
                         f"got {num_experts}")


# The logical axis names parameters declare (nnx variable metadata `out_sharding`, set by
# `logical_param`) and the mesh axis each maps to: experts over `expert`; the axes of dense
# weights FSDP candidates; norm scales nowhere. A name missing here is refused.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "expert": EXPERT_AXIS,  # the experts of gate_up / down [E, ...]
    "vocab": "fsdp",
    "embed": "fsdp",
    "heads": "fsdp",  # query heads x head_dim
    "kv_heads": "fsdp",  # key / value heads x head_dim
    "mlp": "fsdp",  # feed-forward width (gate and up, or down's input)
    "routing": "fsdp",  # the router's (and expert bias's) experts: not split over `expert`
    "norm": None,
}


def logical_metadata(axes: tuple[str, ...]) -> dict:
    """The nnx Variable metadata declaring a weight's logical axis names: pass it as keywords
    to a Variable (`nnx.Param(value, **logical_metadata(("embed", "mlp")))`) or as a module's
    `*_metadata`. Not sharded at creation (eager_sharding off): the names are logical, the
    placement is chosen by `logical_spec` when a mesh is known."""
    return {"out_sharding": tuple(axes), "eager_sharding": False}


def logical_param(value, axes: tuple[str, ...]):
    """nnx.Param(value) declaring the logical names of its axes, one per dimension."""
    if len(axes) != value.ndim:
        raise ValueError(f"axes must name each of the parameter's {value.ndim} dimensions, "
                         f"got {axes} for shape {tuple(value.shape)}")
    return nnx.Param(value, **logical_metadata(axes))


def logical_spec(axes: tuple[str, ...] | None, shape: tuple[int, ...], mesh) -> jax.P:
    """Where an array whose dimensions have the logical names `axes` lives on `mesh`, by
    LOGICAL_AXIS_RULES: the one rule for parameters and the optimizer state that mirrors them.

    A dimension named for `expert` is split over it (E divides by it: check_experts). With
    fsdp > 1 a matrix (2 dimensions or more) is split over `fsdp` along its first dimension
    whose name maps to fsdp and whose size fsdp divides (gradients and Adam moments with it);
    XLA gathers it where it is used and reduce-scatters its gradient. Vectors (norm scales,
    expert biases), matrices fsdp divides nowhere and arrays without names (axes None: step
    counts) are replicated.
    """
    if axes is None:
        return jax.P()
    if len(axes) != len(shape):
        raise ValueError(f"axes must name each of the {len(shape)} dimensions, got {axes} "
                         f"for shape {tuple(shape)}")
    unknown = [name for name in axes if name not in LOGICAL_AXIS_RULES]
    if unknown:
        raise ValueError(f"logical axis names must be ones of LOGICAL_AXIS_RULES "
                         f"({sorted(LOGICAL_AXIS_RULES)}), got {unknown[0]!r} in {axes}")
    spec = [EXPERT_AXIS if LOGICAL_AXIS_RULES[name] == EXPERT_AXIS else None for name in axes]
    fsdp = mesh.shape["fsdp"]
    if fsdp > 1 and len(shape) >= 2:
        for dim, name in enumerate(axes):
            if LOGICAL_AXIS_RULES[name] == "fsdp" and spec[dim] is None and shape[dim] % fsdp == 0:
                spec[dim] = "fsdp"
                break
    while spec and spec[-1] is None:
        spec.pop()
    return jax.P(*spec)


def state_shardings(tree, mesh):
    """The NamedSharding of every array of `tree` (a model's nnx.State, an optimizer state
    built from one, or a tuple of them; arrays or jax.ShapeDtypeStructs), from the logical
    axis names its nnx Variables carry (logical_spec). Optimizer moments mirror the
    parameters' Variables, metadata included, so they land where their parameter does; bare
    arrays (step counts) and Variables without names are replicated. Returns `tree`'s
    structure with Variables' values replaced by shardings."""

    def sharding(leaf):
        if isinstance(leaf, nnx.Variable):
            axes = leaf.get_metadata().get("out_sharding") or None
            return leaf.replace(jax.NamedSharding(mesh, logical_spec(axes, leaf.shape, mesh)))
        return jax.NamedSharding(mesh, jax.P())

    return jax.tree.map(sharding, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
