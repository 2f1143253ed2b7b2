"""The decoder-only MoE language model (nodrop.models): shapes, causality, attention against an
einsum reference, RoPE, layer layout, parameter and FLOP counts against the real parameters,
tied embeddings, MoE statistics, ragged_dot against nodrop experts, jit / grad / remat, config
and input checks, serialisation and presets."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, random_normal
from flax import nnx

from nodrop.models import PRESETS, ModelAux, ModelConfig, MoELM, preset
from nodrop.models import lm
from nodrop.moe import MoEBlock

# Small enough to run eagerly in a fraction of a second; float32 so comparisons are tight.
SMALL = ModelConfig(vocab_size=64, seq_len=16, num_layers=2, hidden=32, num_heads=4,
                    num_kv_heads=2, head_dim=8, dense_ffn=48, num_experts=4, k=2, expert_ffn=16,
                    dtype=jnp.float32)
DEEPSEEK_LIKE = SMALL.replace(num_layers=3, first_dense=1, shared_ffn=24, score_function="sigmoid",
                              num_groups=2, topk_groups=1, renormalize=True, scaling_factor=2.5)


def make_model(config: ModelConfig, seed: int = 0) -> MoELM:
    return MoELM(config, rngs=nnx.Rngs(seed))


def random_tokens(config: ModelConfig, batch: int = 2, seq: int | None = None, seed: int = 0):
    seq = config.seq_len if seq is None else seq
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq)), jnp.int32)


def param_count(state) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(state))


def forward_and_grads(model: MoELM, tokens):
    """Logits and the gradient of a loss that touches the logits and the MoE losses."""
    def loss_fn(model):
        logits, aux = model(tokens)
        log_probs = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(log_probs[:, :-1], tokens[:, 1:, None], axis=-1).mean()
        return nll + 0.01 * aux.load_balancing_loss.sum() + 1e-3 * aux.z_loss.sum(), logits
    (_, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return logits, grads


# --- shapes, dtypes, causality ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_logits_and_aux_shapes_and_dtypes(dtype):
    config = DEEPSEEK_LIKE.replace(dtype=dtype)
    logits, aux = make_model(config)(random_tokens(config, batch=3, seq=10))
    assert logits.shape == (3, 10, config.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    num_moe = len(config.moe_layers())
    assert num_moe == 2
    for name in ("load_balancing_loss", "sequence_balance_loss", "z_loss", "dropped_fraction",
                 "max_over_mean"):
        value = getattr(aux, name)
        assert value.shape == (num_moe,) and value.dtype == jnp.float32, name
    assert aux.tokens_per_expert.shape == (num_moe, config.num_experts)
    assert aux.tokens_per_expert.dtype == jnp.int32
    # Every (token, slot) pair is counted once per MoE layer.
    np.testing.assert_array_equal(aux.tokens_per_expert.sum(axis=1), 3 * 10 * config.k)


def test_params_stay_in_param_dtype_under_bfloat16_compute():
    model = make_model(SMALL.replace(dtype=jnp.bfloat16))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32)}


def test_aux_without_moe_layers_has_a_zero_leading_dimension():
    config = SMALL.replace(first_dense=SMALL.num_layers)
    model = make_model(config)
    assert config.moe_layers() == () and model.moe_blocks() == []
    _, aux = model(random_tokens(config))
    assert aux.tokens_per_expert.shape == (0, config.num_experts)
    assert aux.tokens_per_expert.dtype == jnp.int32
    for name in ("load_balancing_loss", "sequence_balance_loss", "z_loss", "dropped_fraction",
                 "max_over_mean"):
        assert getattr(aux, name).shape == (0,) and getattr(aux, name).dtype == jnp.float32
    assert aux.overflow.shape == () and aux.overflow.dtype == jnp.bool_ and not aux.overflow


def test_aux_is_a_pytree():
    _, aux = make_model(SMALL)(random_tokens(SMALL))
    assert isinstance(aux, ModelAux)
    assert len(jax.tree.leaves(aux)) == 7
    # One device: no expert-parallel buffer, nothing can overflow.
    assert aux.overflow.shape == () and aux.overflow.dtype == jnp.bool_ and not aux.overflow
    doubled = jax.tree.map(lambda a: a * 2, aux)
    np.testing.assert_array_equal(doubled.tokens_per_expert, aux.tokens_per_expert * 2)


@pytest.mark.parametrize("config", [SMALL, DEEPSEEK_LIKE], ids=["softmax", "deepseek_like"])
def test_logits_do_not_depend_on_later_tokens(config):
    model = make_model(config)
    tokens = random_tokens(config, batch=2)
    cut = 6
    changed = tokens.at[:, cut + 1:].set((tokens[:, cut + 1:] + 17) % config.vocab_size)
    logits, _ = model(tokens)
    logits_changed, _ = model(changed)
    assert_close(logits_changed[:, :cut + 1], logits[:, :cut + 1], 1e-6, "logits up to the cut")
    # ...and the change is visible after it, so the test can fail.
    assert float(jnp.max(jnp.abs(logits_changed[:, cut + 1:] - logits[:, cut + 1:]))) > 1e-3


# --- attention and RoPE -----------------------------------------------------------------------


def reference_attention(config, attention, x, cos, sin):
    """Causal softmax attention in float64 einsums, each KV head repeated for its query heads."""
    f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    x, cos, sin = f64(x), f64(cos), f64(sin)

    def rope(t):
        half = head_dim // 2
        rotated = jnp.concatenate([-t[..., half:], t[..., :half]], axis=-1)
        return t * cos[:, None] + rotated * sin[:, None]

    q = rope((x @ f64(attention.query[...])).reshape(batch, seq, heads, head_dim))
    k = rope((x @ f64(attention.key[...])).reshape(batch, seq, kv_heads, head_dim))
    v = (x @ f64(attention.value[...])).reshape(batch, seq, kv_heads, head_dim)
    k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(batch, seq, heads * head_dim)
    return out @ f64(attention.output[...])


@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_attention_matches_an_einsum_reference(kv_heads):
    config = SMALL.replace(num_kv_heads=kv_heads)
    attention = lm.Attention(config, rngs=nnx.Rngs(1))
    x = random_normal(np.random.default_rng(0), (2, 12, config.hidden))
    cos, sin = lm.rope_tables(12, config.head_dim, config.rope_theta)
    assert_close(attention(x, cos, sin), reference_attention(config, attention, x, cos, sin),
                 1e-5, "attention")


def reference_forward(model: MoELM, tokens):
    """The model's logits from its parameters in float64, with MoEBlock (tested on its own in
    test_moe_block.py) as the MoE feed-forward."""
    config = model.config
    f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731

    def rms_norm(x, norm):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + config.norm_eps) \
            * f64(norm.scale[...])

    x = f64(model.embedding[...])[tokens]
    cos, sin = lm.rope_tables(tokens.shape[1], config.head_dim, config.rope_theta)
    for layer in model.layers:
        x = x + reference_attention(config, layer.attention, rms_norm(x, layer.attention_norm),
                                    cos, sin)
        h = rms_norm(x, layer.ffn_norm)
        if isinstance(layer.ffn, MoEBlock):
            x = x + f64(layer.ffn(h.astype(jnp.float32))[0])
        else:
            gate_up, ffn = f64(layer.ffn.gate_up[...]), config.dense_ffn
            x = x + (jax.nn.silu(h @ gate_up[:, :ffn]) * (h @ gate_up[:, ffn:])) \
                @ f64(layer.ffn.down[...])
    if config.tie_embeddings:  # T5's tied head: the output scaled by hidden ** -0.5
        return rms_norm(x, model.final_norm) * config.hidden ** -0.5 @ f64(model.embedding[...]).T
    return rms_norm(x, model.final_norm) @ f64(model.lm_head[...])


@pytest.mark.parametrize("config", [SMALL, DEEPSEEK_LIKE.replace(tie_embeddings=True)],
                         ids=["softmax_untied", "deepseek_like_tied"])
def test_model_matches_a_float64_reference(config):
    model = make_model(config)
    tokens = random_tokens(config)
    assert_close(model(tokens)[0], reference_forward(model, tokens), 1e-5, "logits")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_head_logits_gradient_is_the_float32_one_of_a_rounded_cotangent(dtype):
    """The head's backward rounds the logits' gradient to the compute dtype, then runs the same
    products with float32 accumulation; in float32 it is the plain dot's gradient."""
    rng = np.random.default_rng(0)
    x = random_normal(rng, (2, 5, 64), dtype)
    head = random_normal(rng, (64, 96), dtype, scale=0.1)
    grad = random_normal(rng, (2, 5, 96), jnp.float32)
    logits, vjp = jax.vjp(jax.jit(lm.head_logits), x, head)
    grad_x, grad_head = vjp(grad)
    assert logits.dtype == jnp.float32 and (grad_x.dtype, grad_head.dtype) == (dtype, dtype)

    def plain(x, head):
        return jnp.dot(x, head, precision=jax.lax.Precision.HIGHEST)

    as_f32 = lambda a: jnp.asarray(a, jnp.float32)
    expected_logits, plain_vjp = jax.vjp(plain, as_f32(x), as_f32(head))
    expected_x, expected_head = plain_vjp(as_f32(grad.astype(dtype)))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # the gradients' own rounding to dtype
    assert_close(logits, expected_logits, 1e-5, "logits")
    assert_close(as_f32(grad_x), expected_x, tol, "grad x")
    assert_close(as_f32(grad_head), expected_head, tol, "grad head")
    # The rounding itself (the tolerance above cannot see it): every product of the backward
    # reads operands of the compute dtype, none a float32 logits gradient.
    backward = jax.jit(lambda x, head, grad: jax.vjp(lm.head_logits, x, head)[1](grad))
    text = backward.lower(x, head, grad).as_text()
    operand_types = re.findall(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, "
                               r"tensor<[^>]*x(\w+)>\)", text)
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[jnp.dtype(dtype).name]
    assert operand_types == [(short, short)] * 2, operand_types


def test_rope_scores_depend_only_on_the_position_difference():
    head_dim, seq = 16, 40
    cos, sin = lm.rope_tables(seq, head_dim, 10000.0)
    rng = np.random.default_rng(0)
    q_vec, k_vec = (random_normal(rng, (head_dim,)) for _ in range(2))
    # Every position holds the same q and k vector, so only the rotation differs.
    rotated_q = lm.apply_rope(jnp.broadcast_to(q_vec, (1, seq, 1, head_dim)), cos, sin)[0, :, 0]
    rotated_k = lm.apply_rope(jnp.broadcast_to(k_vec, (1, seq, 1, head_dim)), cos, sin)[0, :, 0]
    scores = np.asarray(rotated_q @ rotated_k.T, np.float64)  # [query position, key position]
    for offset in (0, 1, 7, 30):
        diagonal = np.diagonal(scores, offset=-offset)  # query position = key position + offset
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-4, atol=1e-4)
    assert abs(scores[1, 0] - scores[7, 0]) > 1e-3  # different offsets do differ
    # Position 0 is not rotated, and rotations keep the norm.
    np.testing.assert_allclose(rotated_q[0], q_vec, rtol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(rotated_q, axis=-1), jnp.linalg.norm(q_vec),
                               rtol=1e-5)


def test_attention_implementation_picks_cudnn_only_where_it_runs(monkeypatch):
    assert lm.attention_implementation(jnp.bfloat16, 128) == ("cudnn" if jax.default_backend()
                                                              == "gpu" else "xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert lm.attention_implementation(jnp.bfloat16, 128) == "cudnn"
    assert lm.attention_implementation(jnp.float16, 64) == "cudnn"
    assert lm.attention_implementation(jnp.float32, 128) == "xla"
    assert lm.attention_implementation(jnp.bfloat16, 12) == "xla"
    assert lm.attention_implementation(jnp.bfloat16, 512) == "xla"


# --- layout and counts --------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers, moe_every, first_dense, expected", [
    (4, 1, 0, (0, 1, 2, 3)),
    (4, 2, 0, (0, 2)),
    (5, 2, 1, (1, 3)),
    (6, 3, 2, (2, 5)),
    (3, 1, 3, ()),
    (3, 1, 5, ()),
])
def test_moe_layers(num_layers, moe_every, first_dense, expected):
    config = SMALL.replace(num_layers=num_layers, moe_every=moe_every, first_dense=first_dense)
    assert config.moe_layers() == expected
    assert tuple(i for i in range(num_layers) if config.is_moe_layer(i)) == expected


def test_moe_blocks_are_the_moe_layers_in_order():
    config = SMALL.replace(num_layers=5, moe_every=2, first_dense=1)
    model = make_model(config)
    blocks = model.moe_blocks()
    assert [id(b) for b in blocks] == [id(model.layers[i].ffn) for i in config.moe_layers()]
    assert all(isinstance(b, MoEBlock) for b in blocks)
    assert not any(isinstance(model.layers[i].ffn, MoEBlock) for i in (0, 2, 4))


COUNT_CONFIGS = {
    "default": SMALL,
    "tied": SMALL.replace(tie_embeddings=True),
    "deepseek_like": DEEPSEEK_LIKE,
    "moe_every_2": SMALL.replace(num_layers=4, moe_every=2, first_dense=1, shared_ffn=8),
    "dense_only": SMALL.replace(first_dense=2),
}


@pytest.mark.parametrize("config", COUNT_CONFIGS.values(), ids=COUNT_CONFIGS.keys())
def test_num_params_counts_the_real_parameters(config):
    assert config.num_params() == param_count(nnx.state(make_model(config), nnx.Param))


def test_num_active_params_and_flops_by_hand():
    config = SMALL.replace(num_layers=3, first_dense=1, shared_ffn=8, tie_embeddings=True)
    hidden, vocab, experts, k = 32, 64, 4, 2
    attention = hidden * 4 * 8 + 2 * hidden * 2 * 8 + 4 * 8 * hidden  # q, k, v, output
    dense = 3 * hidden * 48
    moe_active = hidden * experts + k * 3 * hidden * 16 + 3 * hidden * 8  # router, experts, shared
    norms = (2 * 3 + 1) * hidden
    head = hidden * vocab  # the tied embedding, counted once
    assert config.num_active_params() == 3 * attention + dense + 2 * moe_active + norms + head
    assert config.num_params() == config.num_active_params() + 2 * (experts - k) * 3 * hidden * 16
    matmuls = 3 * attention + dense + 2 * moe_active + head
    assert config.flops_per_token() == 6 * matmuls + 12 * 3 * 4 * 8 * 16
    assert config.flops_per_token(seq_len=100) == 6 * matmuls + 12 * 3 * 4 * 8 * 100


def test_tied_embeddings_share_the_table():
    config = SMALL.replace(tie_embeddings=True)
    model = make_model(config)
    assert model.lm_head is None
    untied = make_model(SMALL)
    assert (param_count(nnx.state(untied, nnx.Param)) - param_count(nnx.state(model, nnx.Param))
            == config.vocab_size * config.hidden)
    # Token 7 never occurs, so its embedding row reaches the logits only through a tied head.
    tokens = random_tokens(config) % 7
    for m, tied in ((model, True), (untied, False)):
        logits, _ = m(tokens)
        m.embedding[...] = m.embedding[...].at[7].add(1.0)
        moved, _ = m(tokens)
        column_moved = bool(jnp.any(moved[..., 7] != logits[..., 7]))
        assert column_moved == tied
        np.testing.assert_array_equal(moved[..., :7], logits[..., :7])


# --- MoE statistics, expert matmul ------------------------------------------------------------


def test_capacity_factor_drops_a_skewed_batch_and_dropless_does_not():
    tokens = random_tokens(SMALL, batch=2)
    for capacity_factor in (None, 1.0):
        config = SMALL.replace(capacity_factor=capacity_factor)
        model = make_model(config)
        for block in model.moe_blocks():  # every token picks experts 0 and 1
            block.expert_bias[...] = jnp.asarray([100.0, 100.0, 0.0, 0.0], jnp.float32)
        logits, aux = model(tokens)
        assert bool(jnp.all(jnp.isfinite(logits)))
        num_tokens = tokens.size
        np.testing.assert_array_equal(aux.tokens_per_expert,
                                      [[num_tokens, num_tokens, 0, 0]] * SMALL.num_layers)
        np.testing.assert_allclose(aux.max_over_mean, 2.0)
        # Capacity 1.0 * T * k / E = T / 2 slots for each of the two chosen experts: half drop.
        expected_dropped = 0.0 if capacity_factor is None else 0.5
        np.testing.assert_allclose(aux.dropped_fraction, expected_dropped)


@pytest.fixture(scope="module")
def deepseek_like_step():
    """(tokens, logits, grads) of the jitted DEEPSEEK_LIKE model, which several tests compare
    against (compiled once)."""
    tokens = random_tokens(DEEPSEEK_LIKE)
    return (tokens, *nnx.jit(forward_and_grads)(make_model(DEEPSEEK_LIKE), tokens))


def test_a_capacity_that_drops_nothing_trains_exactly_as_dropless(deepseek_like_step):
    """The two modes differ only in what they drop: with a buffer of T * k rows per expert
    (capacity factor E) nothing is dropped, and the logits and every gradient, router included,
    are dropless's. So a quality gap between them is the dropping, not a second code path."""
    tokens, logits, grads = deepseek_like_step
    no_drop = DEEPSEEK_LIKE.replace(capacity_factor=float(DEEPSEEK_LIKE.num_experts))
    logits_capacity, grads_capacity = nnx.jit(forward_and_grads)(make_model(no_drop), tokens)
    assert_close(logits_capacity, logits, 1e-5, "logits")
    for (path, grad), grad_capacity in zip(jax.tree.leaves_with_path(grads),
                                           jax.tree.leaves(grads_capacity)):
        assert_close(grad_capacity, grad, 1e-4, f"gradient {jax.tree_util.keystr(path)}")


def test_ragged_dot_experts_give_the_same_logits_and_grads(deepseek_like_step):
    tokens, logits, grads = deepseek_like_step
    logits_ragged, grads_ragged = nnx.jit(forward_and_grads)(
        make_model(DEEPSEEK_LIKE.replace(moe_matmul="ragged_dot")), tokens)
    assert_close(logits_ragged, logits, 1e-5, "logits")
    for (path, grad), grad_ragged in zip(jax.tree.leaves_with_path(grads),
                                         jax.tree.leaves(grads_ragged)):
        assert_close(grad_ragged, grad, 1e-4, f"gradient {jax.tree_util.keystr(path)}")


# --- jit, grad, remat -------------------------------------------------------------------------


def test_jit_matches_eager_and_gradients_are_finite(deepseek_like_step):
    tokens, logits_jit, grads = deepseek_like_step
    model = make_model(DEEPSEEK_LIKE)
    logits, _ = model(tokens)
    assert_close(logits_jit, logits, 1e-5, "jitted logits")
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)  # every parameter is trained


def test_remat_gives_the_same_logits_and_gradients(deepseek_like_step):
    tokens, logits, grads = deepseek_like_step
    graph, state = nnx.split(make_model(DEEPSEEK_LIKE.replace(remat=True)))
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graph, s)(tokens)[0])(state)
    checkpoints = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]
    assert len(checkpoints) == DEEPSEEK_LIKE.num_layers  # one per layer
    logits_remat, grads_remat = nnx.jit(forward_and_grads)(
        make_model(DEEPSEEK_LIKE.replace(remat=True)), tokens)
    assert_close(logits_remat, logits, 1e-6, "remat logits")
    for (path, grad), grad_remat in zip(jax.tree.leaves_with_path(grads),
                                        jax.tree.leaves(grads_remat)):
        assert_close(grad_remat, grad, 1e-5, f"remat gradient {jax.tree_util.keystr(path)}")


# --- config and input checks ------------------------------------------------------------------


BAD_FIELDS = [
    ("vocab_size", 0), ("vocab_size", 2.5), ("seq_len", 0), ("num_layers", 0),
    ("num_layers", True), ("hidden", 0), ("num_heads", 0), ("num_kv_heads", 3),
    ("num_kv_heads", 0), ("head_dim", 7), ("head_dim", 0), ("dense_ffn", 0),
    ("num_experts", 0), ("k", 9), ("k", 0), ("expert_ffn", 0), ("shared_ffn", -1),
    ("score_function", "relu"), ("num_groups", 3), ("topk_groups", 2), ("renormalize", "yes"),
    ("scaling_factor", 0.0), ("moe_every", 0), ("first_dense", -1), ("tie_embeddings", 1),
    ("capacity_factor", -1.0), ("moe_matmul", "cutlass"), ("rope_theta", 0.0),
    ("rope_theta", float("inf")), ("norm_eps", -1e-6), ("remat", None), ("dtype", "int8"),
    ("param_dtype", "float64"), ("param_dtype", "not a dtype"), ("fp8", "e5m2"),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS,
                         ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_bad_config_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{field} must be .*got {value!r}"):
        ModelConfig(**{field: value})


def test_replace_and_preset_overrides_are_validated():
    with pytest.raises(ValueError, match=r"ModelConfig\.k "):
        SMALL.replace(k=5)
    with pytest.raises(ValueError, match=r"ModelConfig\.num_kv_heads "):
        preset("tiny", num_kv_heads=3)
    assert preset("tiny", num_layers=2).num_layers == 2


def test_dtypes_are_canonical():
    config = ModelConfig(dtype="bfloat16", param_dtype=np.float32)
    assert config.dtype == jnp.dtype(jnp.bfloat16) and config.param_dtype == jnp.dtype("float32")
    assert config == ModelConfig()
    assert config.moe_config().dtype == config.dtype


@pytest.mark.parametrize("tokens", [
    np.zeros((2, 17), np.int32),         # longer than seq_len
    np.zeros((16,), np.int32),           # no batch dimension
    np.zeros((2, 4, 1), np.int32),       # extra dimension
    np.zeros((2, 0), np.int32),          # empty sequence
    np.zeros((2, 4), np.float32),        # not integers
    np.zeros((2, 4), np.int64),          # not int32
], ids=["too_long", "1d", "3d", "empty", "float", "int64"])
def test_bad_tokens_are_refused(tokens):
    with pytest.raises(ValueError, match=r"tokens must be int32 \[B, S\].*seq_len=16.*got"):
        make_model(SMALL)(jnp.asarray(tokens))


# --- serialisation and presets ----------------------------------------------------------------


@pytest.mark.parametrize("config", [SMALL, DEEPSEEK_LIKE.replace(capacity_factor=1.25,
                                                                 tie_embeddings=True, remat=True),
                                    *PRESETS.values()])
def test_to_dict_round_trips_through_json(config):
    fields = json.loads(json.dumps(config.to_dict()))
    assert fields["dtype"] == config.dtype.name
    assert ModelConfig.from_dict(fields) == config


def test_from_dict_refuses_unknown_fields():
    fields = SMALL.to_dict() | {"num_expert": 8, "hiden": 3}
    with pytest.raises(ValueError, match=r"unknown fields \['hiden', 'num_expert'\]"):
        ModelConfig.from_dict(fields)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown preset 'gpt'.*deepseek.*mixtral.*qwen3.*tiny"):
        preset("gpt")


def test_tiny_preset_is_small_float32():
    config = preset("tiny")
    assert config.dtype == jnp.float32 and config.vocab_size == 256
    assert config.num_params() < 5e6


def test_small_preset_is_mixtral_routing_at_a_study_size():
    config = preset("small")
    assert (config.num_experts, config.k, config.score_function) == (8, 2, "softmax")
    assert config.dtype == jnp.bfloat16 and 1e8 <= config.num_params() <= 2e8
    assert config.vocab_size == 8192


@pytest.mark.parametrize("name", ["mixtral", "deepseek", "qwen3"])
def test_gpu_presets_have_0_5_to_2_billion_params(name):
    config = preset(name)
    assert config.vocab_size == 8192 and config.dtype == jnp.bfloat16  # the trainer's BPE
    assert 0.5e9 <= config.num_params() <= 2e9
    assert config.num_active_params() < config.num_params()


@pytest.mark.parametrize("name", PRESETS)
def test_presets_build_and_trace_without_allocating(name):
    config = preset(name)
    abstract = nnx.eval_shape(lambda: MoELM(config, rngs=nnx.Rngs(0)))
    assert config.num_params() == param_count(nnx.state(abstract, nnx.Param))
    # The logits' shape, traced without running (or allocating) anything.
    graph, state = nnx.split(abstract)
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    logits, aux = jax.eval_shape(lambda s, t: nnx.merge(graph, s)(t), state, tokens)
    assert logits.shape == (1, config.seq_len, config.vocab_size)
    assert logits.dtype == jnp.float32
    assert aux.tokens_per_expert.shape == (len(config.moe_layers()), config.num_experts)


def test_preset_shapes():
    mixtral, deepseek, qwen3 = preset("mixtral"), preset("deepseek"), preset("qwen3")
    assert (mixtral.num_experts, mixtral.k, mixtral.score_function) == (8, 2, "softmax")
    assert mixtral.hidden >= 2048 and mixtral.num_kv_heads < mixtral.num_heads
    assert not mixtral.tie_embeddings
    assert (deepseek.score_function, deepseek.renormalize, deepseek.first_dense) == (
        "sigmoid", True, 1)
    assert deepseek.shared_ffn > 0 and deepseek.num_groups > deepseek.topk_groups > 0
    assert deepseek.moe_layers()[0] == 1
    assert (qwen3.num_experts, qwen3.k, qwen3.score_function, qwen3.renormalize) == (
        128, 8, "softmax", True)


@pytest.mark.parametrize("config", [SMALL, DEEPSEEK_LIKE.replace(tie_embeddings=True)],
                         ids=["small", "deepseek-like-tied"])
def test_decode_with_the_cache_gives_the_full_passes_logits(config):
    """A prompt into an empty cache, then one token at a time, to the end of seq_len: each
    position's logits as the full pass over the whole sequence gives them."""
    model = make_model(config)
    tokens = random_tokens(config)
    full = model(tokens)[0]
    prompt = 5
    logits, cache = model.decode(tokens[:, :prompt], model.init_cache(tokens.shape[0]))
    pieces = [logits]
    step = nnx.jit(lambda m, t, c: m.decode(t, c))
    for position in range(prompt, config.seq_len):
        logits, cache = step(model, tokens[:, position:position + 1], cache)
        pieces.append(logits)
    assert int(cache.length) == config.seq_len
    assert_close(jnp.concatenate(pieces, axis=1), full, 1e-5, "decoded logits")
