"""MoEBlock with expert parallelism (MoEConfig.expert_parallel) on 8 host devices: outputs,
statistics and gradients equal the single-device block, for uniform, Zipf-skewed and adversarial
routing; the receive buffer's overflow flag is raised exactly when a buffer is too small.
"""

from __future__ import annotations

import dataclasses
import math
import re

import devices  # noqa: F401  (first: 8 host devices)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import F32_TOL, assert_close, random_normal
from flax import nnx

import nodrop
from nodrop.moe import MoEBlock, MoEConfig
from nodrop.parallel import make_mesh, state_shardings
from nodrop.parallel.mesh import token_axes
from nodrop.parallel.expert import pair_capacity

SOFTMAX_TOP2 = MoEConfig(num_experts=8, k=2, hidden=16, ffn=32, renormalize=True,
                         dtype=jnp.float32, expert_parallel=True)
DEEPSEEK = MoEConfig(num_experts=8, k=3, hidden=16, ffn=32, score_function="sigmoid",
                     num_groups=4, topk_groups=2, renormalize=True, scaling_factor=2.5,
                     shared_ffn=24, dtype=jnp.float32, expert_parallel=True)
BATCH, SEQ = 8, 6  # 48 tokens, 6 per device on a mesh of all 8

# name -> (mesh spec, how many devices)
MESHES = {"ep2": ("expert=2", 2), "ep4": ("expert=4", 4), "ep8": ("expert=8", 8),
          "data2_ep4": ("data=2,expert=4", 8)}
# name -> router row 0 (tokens share a constant feature 0, so row 0 biases every token's logits)
ROUTINGS = {
    "uniform": None,
    "zipf": -1.5 * np.log(np.arange(1, 9)),  # expert e's weight ~ (e + 1)^-1.5 * noise
    "every_token_to_expert_0": np.array([8.0, 0, 0, 0, 0, 0, 0, 0]),
    # experts 0 and 1: every token to rank 0 while a rank holds two or more experts
    "every_token_to_rank_0": np.array([8.0, 7.0, 0, 0, 0, 0, 0, 0]),
}


def mesh_of(name):
    spec, count = MESHES[name]
    return make_mesh(spec, devices=jax.devices()[:count])


def make_block(config, routing="uniform"):
    """The same parameters whatever the config's parallel fields (init ignores them)."""
    block = MoEBlock(config, rngs=nnx.Rngs(0))
    row = ROUTINGS[routing]
    if row is not None:
        block.router[...] = block.router[...].at[0].set(jnp.asarray(row, jnp.float32))
    return block


def tokens(seed=0, hidden=16):
    """[BATCH, SEQ, H] tokens whose feature 0 is a constant 1 (the routings' lever)."""
    return random_normal(np.random.default_rng(seed), (BATCH, SEQ, hidden)).at[..., 0].set(1.0)


def loss_and_grads(block, x, cotangent, mesh=None, remat=False):
    """Output, MoEAux and the gradients w.r.t. x and every parameter, under jit (and the mesh;
    with remat, the block's forward is recomputed in the backward pass)."""
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    apply = lambda params, x: nnx.merge(graphdef, params, rest)(x)
    if remat:
        apply = jax.checkpoint(apply)

    def loss(params, x):
        y, aux = apply(params, x)
        return (jnp.sum(y * cotangent) + 0.1 * aux.load_balancing_loss
                + 0.05 * aux.sequence_balance_loss + 0.01 * aux.z_loss, (y, aux))

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    if mesh is None:
        (_, (y, aux)), (grad_params, grad_x) = run(params, x)
    else:
        with jax.set_mesh(mesh):
            (_, (y, aux)), (grad_params, grad_x) = run(params, x)
    return y, aux, {"x": grad_x, **nnx.to_pure_dict(grad_params)}


def assert_same_block(config, routing, mesh, seed=0, remat=False):
    """The block on `mesh` against the block on one device: output, statistics, gradients."""
    x = tokens(seed, config.hidden)
    cotangent = random_normal(np.random.default_rng(seed + 1), x.shape)
    y, aux, grads = loss_and_grads(make_block(dataclasses.replace(config, expert_parallel=False),
                                              routing), x, cotangent)
    ep_y, ep_aux, ep_grads = loss_and_grads(make_block(config, routing), x, cotangent, mesh,
                                            remat)
    assert ep_y.shape == y.shape and ep_y.dtype == y.dtype
    assert_close(ep_y, y, F32_TOL, "output")
    np.testing.assert_array_equal(np.asarray(ep_aux.tokens_per_expert),
                                  np.asarray(aux.tokens_per_expert))
    for name in ("load_balancing_loss", "sequence_balance_loss", "z_loss", "max_over_mean"):
        assert_close(getattr(ep_aux, name), getattr(aux, name), F32_TOL, name)
    assert float(ep_aux.dropped_fraction) == 0.0
    assert not bool(ep_aux.overflow)
    assert sorted(ep_grads) == sorted(grads)
    for name, grad in grads.items():
        assert_close(ep_grads[name], grad, F32_TOL, f"grad {name}")
    return aux


# --- the same block as on one device -----------------------------------------------------------


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("mesh", list(MESHES))
def test_expert_parallel_block_equals_single_device(mesh, routing):
    """Worst-case buffers (ep_buffer_factor=None): any routing fits, adversarial included."""
    config = dataclasses.replace(SOFTMAX_TOP2, ep_buffer_factor=None)
    aux = assert_same_block(config, routing, mesh_of(mesh))
    counts = np.asarray(aux.tokens_per_expert)
    if routing == "every_token_to_expert_0":
        assert counts[0] == BATCH * SEQ
    if routing == "every_token_to_rank_0":
        assert counts[0] == counts[1] == BATCH * SEQ
    if routing == "zipf":
        assert float(aux.max_over_mean) > 2


@pytest.mark.parametrize("routing", ["uniform", "zipf", "every_token_to_expert_0"])
@pytest.mark.parametrize("spec", ["data=8", "fsdp=8", "data=2,fsdp=4", "data=2,fsdp=2,expert=2"])
def test_block_on_a_sharded_batch_and_sharded_weights_equals_single_device(spec, routing):
    """Data parallelism and FSDP as the trainer lays them out: the batch split over the token
    axes, every weight where nodrop.parallel.state_shardings puts it (matrices over fsdp,
    experts over expert). Output, statistics and gradients are the single-device block's."""
    config = dataclasses.replace(SOFTMAX_TOP2, ep_buffer_factor=None)
    mesh = make_mesh(spec)
    x = tokens(0)
    cotangent = random_normal(np.random.default_rng(1), x.shape)
    y, aux, grads = loss_and_grads(make_block(dataclasses.replace(config, expert_parallel=False),
                                              routing), x, cotangent)

    block = make_block(config, routing)
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    placed = jax.device_put(nnx.to_pure_dict(params),
                            nnx.to_pure_dict(state_shardings(params, mesh)))
    if spec != "data=8":  # something is split beyond the batch
        assert any(not value.sharding.is_fully_replicated for value in placed.values())
    nnx.replace_by_pure_dict(params, placed)
    batch_sharding = jax.NamedSharding(mesh, jax.P(token_axes(mesh)))
    sharded_x = jax.device_put(x, batch_sharding)
    sharded_cotangent = jax.device_put(cotangent, batch_sharding)

    def loss(params, x, cotangent):
        out, aux = nnx.merge(graphdef, params, rest)(x)
        return (jnp.sum(out * cotangent) + 0.1 * aux.load_balancing_loss
                + 0.05 * aux.sequence_balance_loss + 0.01 * aux.z_loss, (out, aux))

    with jax.set_mesh(mesh):
        (_, (got_y, got_aux)), (grad_params, grad_x) = jax.jit(jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True))(params, sharded_x, sharded_cotangent)
    assert_close(got_y, y, F32_TOL, "output")
    np.testing.assert_array_equal(np.asarray(got_aux.tokens_per_expert),
                                  np.asarray(aux.tokens_per_expert))
    for name in ("load_balancing_loss", "sequence_balance_loss", "z_loss", "max_over_mean"):
        assert_close(getattr(got_aux, name), getattr(aux, name), F32_TOL, name)
    got = {"x": grad_x, **nnx.to_pure_dict(grad_params)}
    assert sorted(got) == sorted(grads)
    for name, grad in grads.items():
        assert_close(got[name], grad, F32_TOL, f"grad {name}")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_expert_parallel_with_shared_experts_and_group_limited_routing(mesh):
    """The DeepSeek-style block (sigmoid, group-limited top-3, shared experts) with the default
    buffer, which balanced routing fits."""
    assert_same_block(DEEPSEEK, "uniform", mesh_of(mesh))


@pytest.mark.parametrize("variant", ["remat", "reference_ops", "ragged_dot_experts",
                                     "fp8_blockwise"])
def test_expert_parallel_under_remat_and_on_the_other_implementations(variant):
    """jax.checkpoint around the block; MoEConfig(ops="reference") and matmul="ragged_dot" take
    the same expert-parallel path on their own ops; with the blockwise FP8 recipe each rank
    regroups its received rows with permute_fp8. FP8 runs on expert=8 (each expert's rows all on
    one rank, under 128 of them): a data axis would split an expert's rows between ranks, and
    the weight gradient's blocks of 128 rows with them, which changes its quantisation."""
    worst_case = dataclasses.replace(SOFTMAX_TOP2, ep_buffer_factor=None)
    config = {"remat": worst_case,
              "reference_ops": dataclasses.replace(worst_case, ops="reference"),
              "ragged_dot_experts": dataclasses.replace(worst_case, matmul="ragged_dot"),
              "fp8_blockwise": dataclasses.replace(worst_case, fp8="blockwise")}
    mesh = mesh_of("ep8" if variant == "fp8_blockwise" else "data2_ep4")
    assert_same_block(config[variant], "zipf", mesh, remat=variant == "remat")


def test_expert_parallel_tensorwise_fp8_takes_its_scale_over_the_received_rows(monkeypatch):
    """With the tensorwise FP8 recipe each rank regroups its received rows with permute_fp8, the
    scale given from the whole receive buffer: its padding rows are zeros, which leave the amax
    of the rows in the experts' groups as it is, so output and gradients are bitwise those of
    the recipe quantising the regrouped rows itself."""
    from nodrop.moe import block as block_module
    config = dataclasses.replace(SOFTMAX_TOP2, fp8="tensorwise")
    x = tokens(5)
    cotangent = random_normal(np.random.default_rng(6), x.shape)
    mesh = mesh_of("data2_ep4")
    graphdef, state = nnx.split(make_block(config, "zipf"))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(state, x).as_text()
    assert "nodrop_permute_fp8" in hlo
    fused_y, _, fused = loss_and_grads(make_block(config, "zipf"), x, cotangent, mesh)
    monkeypatch.setattr(block_module, "_permute", lambda cfg, tokens, ids, experts: (
        *nodrop.permute(tokens, ids, experts), None))
    y, _, grads = loss_and_grads(make_block(config, "zipf"), x, cotangent, mesh)
    np.testing.assert_array_equal(np.asarray(fused_y), np.asarray(y))
    assert sorted(fused) == sorted(grads)
    for name, grad in grads.items():
        np.testing.assert_array_equal(np.asarray(fused[name]), np.asarray(grad), err_msg=name)


def test_expert_parallel_with_the_split_router_matmul():
    """In bfloat16 with router_matmul="split", each rank's router (a custom VJP) routes its
    tokens as one device does, and the router's gradient sums over the ranks."""
    config = dataclasses.replace(SOFTMAX_TOP2, dtype=jnp.bfloat16, ep_buffer_factor=None,
                                 router_matmul="split")
    x = tokens(3).astype(jnp.bfloat16)
    cotangent = random_normal(np.random.default_rng(4), x.shape)
    y, aux, grads = loss_and_grads(make_block(dataclasses.replace(config, expert_parallel=False),
                                              "zipf"), x, cotangent)
    ep_y, ep_aux, ep_grads = loss_and_grads(make_block(config, "zipf"), x, cotangent,
                                            mesh_of("data2_ep4"))
    np.testing.assert_array_equal(np.asarray(ep_aux.tokens_per_expert),
                                  np.asarray(aux.tokens_per_expert))
    assert_close(ep_y, y, 1e-2, "output")
    assert sorted(ep_grads) == sorted(grads)
    for name, grad in grads.items():
        assert_close(ep_grads[name], grad, 1e-2, f"grad {name}")
    assert float(jnp.abs(ep_grads["router"]).max()) > 0


def test_expert_parallel_block_exchanges_rows_with_all_to_all():
    """The path runs in shard_map with the tokens' rows crossing devices (not a silent fallback
    to the single-device block)."""
    block = make_block(SOFTMAX_TOP2)
    graphdef, state = nnx.split(block)
    with jax.set_mesh(mesh_of("data2_ep4")):
        hlo = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(
            state, tokens()).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo


# --- expert axis of size 1: the block is today's ---------------------------------------------


@pytest.mark.parametrize("axes", ["data=8", "no_expert_axis"])
def test_expert_axis_of_size_one_is_the_single_device_block(axes):
    """expert_parallel on a mesh whose expert axis is 1 (or absent) runs the single-device
    block: no shard_map and no collective in what it compiles to, and the same output and
    gradients up to float32 rounding (XLA compiles for 8 devices, which may fuse differently)."""
    if axes == "no_expert_axis":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    else:
        mesh = make_mesh(axes)
    x = tokens()
    cotangent = random_normal(np.random.default_rng(1), x.shape)
    single = loss_and_grads(make_block(dataclasses.replace(SOFTMAX_TOP2, expert_parallel=False)),
                            x, cotangent)
    block = make_block(SOFTMAX_TOP2)
    on_mesh = loss_and_grads(block, x, cotangent, mesh)
    for got, want in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(single)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    graphdef, state = nnx.split(block)
    with jax.set_mesh(mesh):
        lowered = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(state, x)
    hlo = lowered.compile().as_text()
    for collective in ("all-to-all", "all-gather", "all-reduce", "collective-permute"):
        assert collective not in hlo, collective


# --- the bounded receive buffer ------------------------------------------------------------------


def busiest_pair(config, routing, mesh_name):
    """The most rows one rank sends to one rank, computed on one device from the router: the
    token shard s (in the order of the mesh's devices) is on expert rank s % ep."""
    mesh, count = mesh_of(mesh_name), MESHES[mesh_name][1]
    ep = mesh.shape["expert"]
    block = make_block(config, routing)
    flat = tokens(0, config.hidden).reshape(count, -1, config.hidden)
    ids = [nodrop.topk_router(shard @ block.router[...], config.k,
                              renormalize=config.renormalize)[1] for shard in flat]
    experts_per_rank = config.num_experts // ep
    pairs = [np.bincount(np.asarray(shard_ids).reshape(-1) // experts_per_rank, minlength=ep)
             for shard_ids in ids]
    return int(np.max(pairs)), int(flat.shape[1] * config.k), ep, pairs


def factor_for(capacity, rows, ep):
    """The ep_buffer_factor that gives `capacity` rows per pair (pair_capacity rounds up)."""
    factor = (capacity - 0.5) * ep / rows
    assert pair_capacity(rows, ep, factor) == capacity
    return factor


@pytest.mark.parametrize("routing", ["zipf", "every_token_to_rank_0"])
@pytest.mark.parametrize("mesh", ["ep4", "data2_ep4"])
def test_overflow_flag_is_raised_exactly_when_a_buffer_is_too_small(mesh, routing):
    busiest, rows, ep, pairs = busiest_pair(SOFTMAX_TOP2, routing, mesh)
    assert 1 < busiest and busiest > math.ceil(rows / ep)  # skewed: more than the balanced load

    # Just large enough: no overflow, and the block is the single-device one.
    fits = dataclasses.replace(SOFTMAX_TOP2, ep_buffer_factor=factor_for(busiest, rows, ep))
    assert_same_block(fits, routing, mesh_of(mesh))

    # One row short: the flag is up, and the rows cut are reported as dropped.
    short = dataclasses.replace(SOFTMAX_TOP2, ep_buffer_factor=factor_for(busiest - 1, rows, ep))
    x = tokens()
    _, aux, _ = loss_and_grads(make_block(short, routing), x, jnp.ones_like(x), mesh_of(mesh))
    assert bool(aux.overflow)
    cut = sum(np.maximum(p - (busiest - 1), 0).sum() for p in pairs)
    assert float(aux.dropped_fraction) == pytest.approx(cut / (BATCH * SEQ * SOFTMAX_TOP2.k))
    assert int(np.asarray(aux.tokens_per_expert).sum()) == BATCH * SEQ * SOFTMAX_TOP2.k


def test_default_buffer_overflows_on_adversarial_routing_and_worst_case_never_does():
    x = tokens()
    mesh = mesh_of("ep8")
    flags = {}
    for factor in (2.0, None):
        config = dataclasses.replace(SOFTMAX_TOP2, ep_buffer_factor=factor)
        _, aux, _ = loss_and_grads(make_block(config, "every_token_to_expert_0"), x,
                                   jnp.ones_like(x), mesh)
        flags[factor] = bool(aux.overflow)
    assert flags == {2.0: True, None: False}


def test_pair_capacity():
    assert pair_capacity(96, 4, 2.0) == 48  # twice the balanced 24 rows per pair
    assert pair_capacity(96, 4, 1.01) == 25  # rounded up
    assert pair_capacity(96, 4, 8.0) == 96  # never more than the worst case
    assert pair_capacity(96, 4, None) == 96  # the worst case: every row to one rank
    assert pair_capacity(96, 4, 1e-9) == 1


# --- refused before compiling --------------------------------------------------------------------


def test_experts_not_divisible_by_the_expert_axis_are_refused():
    config = dataclasses.replace(SOFTMAX_TOP2, num_experts=6)
    block = make_block(config)
    with jax.set_mesh(mesh_of("ep4")), pytest.raises(ValueError, match=re.escape(
            "MoEConfig.num_experts must be divisible by the mesh's expert axis (4), got 6")):
        block(tokens())


def test_batch_not_divisible_by_the_token_axes_is_refused():
    block = make_block(SOFTMAX_TOP2)
    with jax.set_mesh(mesh_of("data2_ep4")), pytest.raises(ValueError, match=re.escape(
            "x.shape[0] must be divisible by data=2 x fsdp=1 x expert=4 = 8, got 4")):
        block(tokens()[:4])
