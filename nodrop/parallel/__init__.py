"""Scale-out: the device mesh (mesh.py) and the expert-parallel token exchange (expert.py) that
MoEBlock runs inside `jax.shard_map`."""

from nodrop.parallel.mesh import (AXES, check_batch, check_experts, make_mesh,
                                  parse_mesh_spec, state_spec)

__all__ = ["AXES", "check_batch", "check_experts", "make_mesh", "parse_mesh_spec", "state_spec"]
