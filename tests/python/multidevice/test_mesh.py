"""nodrop.parallel.make_mesh and the checks a run makes before compiling: one line naming the
argument, what it must be and what it got."""

from __future__ import annotations

import re

import devices  # noqa: F401  (first: 8 host devices)
import jax
import pytest
from jax.sharding import AxisType

from flax import nnx

from nodrop.models.config import preset
from nodrop.moe import MoEBlock, MoEConfig
from nodrop.parallel import (AXES, check_batch, check_experts, logical_param, logical_spec,
                             make_mesh, parse_mesh_spec)
from nodrop.train import trainer
from nodrop.train.config import TrainConfig


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


def test_logical_spec_splits_experts_over_expert_and_fsdp_and_matrices_over_fsdp():
    mesh = make_mesh("fsdp=2,expert=4")
    experts = ("expert", "embed", "mlp")
    # Experts over expert, and within it over fsdp along their first other axis it divides.
    assert logical_spec(experts, (8, 128, 512), mesh) == jax.P("expert", "fsdp")
    assert logical_spec(("expert", "mlp", "embed"), (8, 3, 128), mesh) == jax.P(
        "expert", None, "fsdp")
    assert logical_spec(experts, (8, 3, 5), mesh) == jax.P("expert")
    assert logical_spec(experts, (8, 128, 512), make_mesh("data=2,expert=4")) == jax.P("expert")
    # The router's experts are "routing": fsdp may split them, expert never does.
    assert logical_spec(("embed", "routing"), (128, 8), mesh) == jax.P("fsdp")
    assert logical_spec(("embed", "routing"), (3, 8), mesh) == jax.P(None, "fsdp")
    assert logical_spec(("embed", "routing"), (128, 8), make_mesh("data=2,expert=4")) == jax.P()
    # The first axis fsdp divides; none: replicated. Vectors and unnamed arrays: replicated.
    assert logical_spec(("vocab", "embed"), (255, 128), mesh) == jax.P(None, "fsdp")
    assert logical_spec(("embed", "mlp"), (3, 5), mesh) == jax.P()
    assert logical_spec(("routing",), (8,), mesh) == jax.P()
    assert logical_spec(("norm",), (128,), mesh) == jax.P()
    assert logical_spec(None, (), mesh) == jax.P()


def test_logical_spec_refuses_names_outside_the_rules_and_a_wrong_count():
    mesh = make_mesh("fsdp=8")
    with pytest.raises(ValueError, match="^logical axis names must be ones of LOGICAL_AXIS_RULES"
                       r" \(.*\), got 'hidden' in \('hidden', 'mlp'\)$"):
        logical_spec(("hidden", "mlp"), (128, 512), mesh)
    with pytest.raises(ValueError, match="^" + re.escape(
            "axes must name each of the 2 dimensions, got ('embed',) for shape (128, 512)")):
        logical_spec(("embed",), (128, 512), mesh)
    with pytest.raises(ValueError, match="^axes must name each of the parameter's 1 dim"):
        logical_param(jax.numpy.zeros(3), ("embed", "mlp"))


def test_a_moe_block_declares_the_logical_names_of_its_axes():
    """A user's own NNX model built of MoEBlocks gets the annotations: nnx.get_partition_spec
    reads them."""
    block = MoEBlock(MoEConfig(num_experts=4, hidden=8, ffn=16, k=2, shared_ffn=8),
                     rngs=nnx.Rngs(0))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(block)))
    assert specs == {"router": jax.P("embed", "routing"), "expert_bias": jax.P("routing"),
                     "gate_up": jax.P("expert", "embed", "mlp"),
                     "down": jax.P("expert", "mlp", "embed"),
                     "shared_gate_up": jax.P("embed", "mlp"), "shared_down": jax.P("mlp", "embed")}
    # Under a mesh the block is built as on one device: the names are logical, not mesh axes.
    with jax.set_mesh(make_mesh("fsdp=2,expert=4")):
        built = MoEBlock(MoEConfig(num_experts=4, hidden=8, ffn=16, k=2), rngs=nnx.Rngs(0))
    assert built.gate_up.get_metadata()["out_sharding"] == ("expert", "embed", "mlp")
    assert built.gate_up[...].sharding.is_fully_replicated


# Every array of the training state by its name and rank: (placement with fsdp > 1, without).
# Three-dimensional gate_up / down are the experts; two-dimensional ones the dense or shared FFN.
PLACEMENTS = {
    ("gate_up", 3): (jax.P("expert", "fsdp"), jax.P("expert")),
    ("down", 3): (jax.P("expert", "fsdp"), jax.P("expert")),
    **{(name, 2): (jax.P("fsdp"), jax.P()) for name in (
        "embedding", "lm_head", "query", "key", "value", "output", "router", "gate_up", "down",
        "shared_gate_up", "shared_down")},
    ("scale", 1): (jax.P(), jax.P()),
    ("expert_bias", 1): (jax.P(), jax.P()),
    ("count", 0): (jax.P(), jax.P()),
}


@pytest.mark.parametrize("spec", ["fsdp=2,expert=4", "data=2,expert=4", "fsdp=8",
                                  "fsdp=4,expert=2", "data=8"])
@pytest.mark.parametrize("name", ["tiny", "deepseek"])
def test_the_training_state_lands_where_the_name_based_rule_put_it(name, spec):
    """The trainer's placements, from the parameters' logical names, of the params, the Adam
    moments and the expert biases: those of the rule by key names it replaced."""
    config, model, mesh = TrainConfig(), preset(name), make_mesh(spec)
    _, _, abstract = trainer._state_structure(config, model, trainer.optimizer(config),
                                              jax.devices()[0], mesh)
    fsdp = mesh.shape["fsdp"] > 1
    seen = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
        # The last dict key names a parameter (a Variable's own `.value` is an attribute); an
        # optimizer's step count is the attribute `count`.
        keys = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
        leaf_name = keys[-1] if keys else names[-1]
        want = PLACEMENTS[(leaf_name, leaf.ndim)][0 if fsdp else 1]
        assert leaf.sharding.spec == want, jax.tree_util.keystr(path)
        seen.add((leaf_name, "mu" in names or "nu" in names))
    assert ("gate_up", True) in seen and ("embedding", True) in seen  # the moments, checked
    if name == "deepseek":
        assert ("shared_down", True) in seen and ("gate_up", False) in seen
