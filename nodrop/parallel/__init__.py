"""Scale-out: the device mesh (mesh.py) and the expert-parallel token exchange (expert.py) that
MoEBlock runs inside `jax.shard_map`."""

from nodrop.parallel.mesh import (AXES, LOGICAL_AXIS_RULES, check_batch, check_experts,
                                  logical_metadata, logical_param, logical_spec, make_mesh,
                                  parse_mesh_spec, state_shardings)

__all__ = ["AXES", "LOGICAL_AXIS_RULES", "check_batch", "check_experts", "logical_metadata",
           "logical_param", "logical_spec", "make_mesh", "parse_mesh_spec", "state_shardings"]
