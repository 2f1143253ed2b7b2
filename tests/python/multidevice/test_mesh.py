"""nodrop.parallel.make_mesh and the checks a run makes before compiling: one line naming the
argument, what it must be and what it got."""

from __future__ import annotations

import re

import devices  # noqa: F401  (first: 8 host devices)
import jax
import pytest
from jax.sharding import AxisType

from nodrop.parallel import (AXES, check_batch, check_experts, make_mesh, parse_mesh_spec,
                             state_spec)


def test_mesh_from_a_spec_and_from_keywords():
    for mesh in (make_mesh("data=2,fsdp=1,expert=4"), make_mesh(" expert=4 , data=2"),
                 make_mesh(data=2, expert=4)):
        assert mesh.axis_names == AXES
        assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4}
        assert mesh.axis_types == (AxisType.Auto,) * 3
        assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_axes_left_out_are_one_and_a_subset_of_devices_can_be_given():
    mesh = make_mesh("expert=2", devices=jax.devices()[:2])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 2}
    assert dict(make_mesh("fsdp=8").shape) == {"data": 1, "fsdp": 8, "expert": 1}
    assert parse_mesh_spec("data=4") == {"data": 4, "fsdp": 1, "expert": 1}


BAD_SPECS = {
    "data=3": "mesh must use all 8 devices, got data=3 x fsdp=1 x expert=1 = 3",
    "data=2,expert=8": "mesh must use all 8 devices, got data=2 x fsdp=1 x expert=8 = 16",
    "tensor=8": "mesh axis must be one of ('data', 'fsdp', 'expert'), got 'tensor'",
    "expert=0": "mesh axis expert must be a positive int, got 0",
    "data=-2,expert=4": "mesh axis data must be a positive int, got -2",
    "data:8": "mesh must be comma-separated axis=size pairs like 'data=2,fsdp=1,expert=4', "
              "got 'data:8'",
    "data=2.5": "mesh must be comma-separated axis=size pairs like 'data=2,fsdp=1,expert=4', "
                "got 'data=2.5'",
    "data=8,": "mesh must be comma-separated axis=size pairs like 'data=2,fsdp=1,expert=4', "
               "got 'data=8,'",
    "data=4,data=2": "mesh must name each axis once, got 'data' twice in 'data=4,data=2'",
}


@pytest.mark.parametrize("spec", list(BAD_SPECS))
def test_bad_specs_are_refused_in_one_line(spec):
    with pytest.raises(ValueError, match="^" + re.escape(BAD_SPECS[spec]) + "$"):
        make_mesh(spec)


def test_bad_keywords_are_refused_and_errors_name_the_caller_argument():
    with pytest.raises(ValueError, match=re.escape("mesh axis expert must be a positive int, "
                                                   "got 0")):
        make_mesh(data=8, expert=0)
    with pytest.raises(ValueError, match=re.escape("mesh axis must be one of")):
        make_mesh(pipeline=8)
    with pytest.raises(ValueError, match=re.escape(
            "mesh must be given as a spec string or as keywords, got both 'data=8' and "
            "{'expert': 1}")):
        make_mesh("data=8", expert=1)
    with pytest.raises(ValueError, match=re.escape(
            "--mesh must use all 8 devices, got data=4 x fsdp=1 x expert=1 = 4")):
        make_mesh("data=4", name="--mesh")


def test_experts_and_batch_must_divide_over_the_mesh():
    mesh = make_mesh("data=2,expert=4")
    check_experts(8, mesh)
    check_batch(16, mesh)
    with pytest.raises(ValueError, match="^" + re.escape(
            "num_experts must be divisible by the mesh's expert axis (4), got 6") + "$"):
        check_experts(6, mesh)
    with pytest.raises(ValueError, match="^" + re.escape(
            "--batch-size must be divisible by data=2 x fsdp=1 x expert=4 = 8, got 12") + "$"):
        check_batch(12, mesh, name="--batch-size")
    check_experts(3, make_mesh("data=8"))  # no experts to split


def test_state_spec_splits_experts_over_expert_and_fsdp_and_matrices_over_fsdp():
    mesh = make_mesh("fsdp=2,expert=4")
    layer = ("params", "layers", "0", "ffn")
    # Experts over expert, and within it over fsdp along their first other axis it divides.
    assert state_spec((*layer, "gate_up"), (8, 128, 512), mesh) == jax.P("expert", "fsdp")
    assert state_spec(("opt_state", "0", "mu", *layer[1:], "down"), (8, 256, 128),
                      mesh) == jax.P("expert", "fsdp")
    assert state_spec((*layer, "down"), (8, 3, 128), mesh) == jax.P("expert", None, "fsdp")
    assert state_spec((*layer, "down"), (8, 3, 5), mesh) == jax.P("expert")
    assert state_spec((*layer, "gate_up"), (8, 128, 512),
                      make_mesh("data=2,expert=4")) == jax.P("expert")
    assert state_spec((*layer, "router"), (128, 8), mesh) == jax.P("fsdp")
    # The first axis fsdp divides; none: replicated.
    assert state_spec(("params", "embedding"), (255, 128), mesh) == jax.P(None, "fsdp")
    assert state_spec(("params", "odd"), (3, 5), mesh) == jax.P()
    assert state_spec(("params", "final_norm", "scale"), (128,), mesh) == jax.P()
    assert state_spec((*layer, "router"), (128, 8), make_mesh("data=2,expert=4")) == jax.P()
