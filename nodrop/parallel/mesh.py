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


def state_spec(names: tuple[str, ...], shape: tuple[int, ...], mesh) -> jax.P:
    """Where one array of the training state lives on `mesh`, from its key path `names` and
    shape: the one rule for parameters and the optimizer state that mirrors them.

    Expert weights (3-D `gate_up` or `down`, [E, ...]) are split over `expert`, as the
    expert-parallel MoEBlock holds them, and within it over `fsdp` along their first other axis
    that fsdp divides. With fsdp > 1 every other matrix is split over `fsdp` along its first axis
    that fsdp divides (its gradients and Adam moments with it). The rest (norm scales, expert
    biases, step counts, matrices fsdp divides nowhere) is replicated. XLA gathers an
    fsdp-split weight where it is used and reduce-scatters its gradient.
    """
    experts = len(shape) == 3 and bool(names) and names[-1] in ("gate_up", "down")
    leading = (EXPERT_AXIS,) if experts else ()
    fsdp = mesh.shape["fsdp"]
    if fsdp > 1 and len(shape) >= 2:
        for axis in range(len(leading), len(shape)):
            if shape[axis] % fsdp == 0:
                return jax.P(*leading, *(None,) * (axis - len(leading)), "fsdp")
    return jax.P(*leading)
