"""adamw_update (the training step's AdamW, one engine call per parameter) against the float64
reference of optax's arithmetic: parameters, moments, the update's sums; 16-bit gradients; in
place under donation; non-finite values; bad input; jit, vmap and scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, f64, random_normal

import nodrop
from nodrop.ops import adamw, reference

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8)
SHAPES = [(), (1,), (5,), (1003,), (7, 129), (3, 16, 8)]


def state(shape, seed=0, grad_scale=1e-3):
    rng = np.random.default_rng(seed)
    return (random_normal(rng, shape), random_normal(rng, shape, scale=grad_scale),
            random_normal(rng, shape, scale=1e-3), jnp.abs(random_normal(rng, shape, scale=1e-3)))


def step_args(count=3, step_size=-3e-4, **kwargs):
    return dict(step_size=jnp.float32(step_size), count=jnp.int32(count), **HYPER, **kwargs)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("clip", ["off", "not_reached", "clips"])
def test_matches_the_float64_reference(shape, clip):
    param, grad, mu, nu = state(shape)
    kwargs = dict(weight_decay=0.1, update_scale=0.5)
    if clip != "off":
        kwargs.update(max_grad_norm=1.0, grad_norm=jnp.float32(0.5 if clip == "not_reached" else 4))
    # A step of 0.05: the updates (1e-4 to 1e-2) keep 4 digits after their parameter's rounding.
    got = jax.jit(lambda *a: nodrop.adamw_update(*a, **step_args(step_size=-0.05, **kwargs)))(
        param, grad, mu, nu)
    want_kwargs = dict(kwargs)
    if "grad_norm" in want_kwargs:
        want_kwargs["grad_norm"] = f64(want_kwargs["grad_norm"])
    want = reference.adamw_update(*map(f64, (param, grad, mu, nu)),
                                  **step_args(step_size=-0.05, **want_kwargs))
    assert got.param.shape == got.mu.shape == got.nu.shape == shape
    assert got.sums.shape == (adamw.NUM_SUMS,)
    assert_close(got.param, want[0], 2e-7, "param")  # one rounding of param + update
    assert_close(got.mu, want[1], 1e-6, "mu")
    assert_close(got.nu, want[2], 1e-6, "nu")
    assert_close(got.sums[0], want[3][0], 1e-5, "sum of squares")
    np.testing.assert_array_equal(got.sums[3:], [0, 0])
    # The update itself, to float32 rounding of the parameters it was added to.
    step = np.asarray(got.param, np.float64) - np.asarray(param, np.float64)
    assert_close(step, want[0] - f64(param), 1e-4, "update")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1003,), (7, 129)], ids=str)
def test_a_16_bit_gradient_is_the_step_on_its_float32_values(shape, dtype):
    """Bit for bit: the trainer passes the bfloat16 gradients of the weights the model computes
    in bfloat16, which carry no more bits than that."""
    param, grad, mu, nu = state(shape, grad_scale=1.0)
    grad = grad.astype(dtype).at[(0,) * len(shape)].set(jnp.nan)
    kwargs = step_args(weight_decay=0.1, max_grad_norm=1.0, grad_norm=jnp.float32(4))
    step = jax.jit(lambda *a: nodrop.adamw_update(*a, **kwargs))
    got = step(param, grad, mu, nu)
    want = step(param, grad.astype(jnp.float32), mu, nu)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert np.isnan(got.param[(0,) * len(shape)]) and float(got.sums[3]) == 1
    # The custom call reads the 16-bit gradient itself: no float32 copy is made first.
    text = step.lower(param, grad, mu, nu).as_text()
    call = next(line for line in text.splitlines() if "nodrop_adamw_update" in line)
    short = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(dtype).name]
    assert f"x{short}>" in call, call


def test_count_starts_the_bias_correction_and_weight_decay_is_per_parameter():
    param, grad, mu, nu = state((64,))
    first = nodrop.adamw_update(param, grad, jnp.zeros_like(mu), jnp.zeros_like(nu),
                                **step_args(count=1, step_size=-1.0))
    # At step 1 Adam's step is grad / (|grad| + eps): about one per element, of the gradient's sign.
    grad64 = np.asarray(grad, np.float64)
    np.testing.assert_allclose(first.param - param, -grad64 / (np.abs(grad64) + 1e-8), rtol=1e-6)
    decayed = nodrop.adamw_update(param, jnp.zeros_like(grad), jnp.zeros_like(mu),
                                  jnp.zeros_like(nu), weight_decay=0.5,
                                  **step_args(count=1, step_size=-0.1))
    np.testing.assert_allclose(decayed.param, param * (1 - 0.05), rtol=1e-6)


def test_the_step_is_written_in_place_under_donation():
    param, grad, mu, nu = state((256, 64))
    step = jax.jit(lambda *a: nodrop.adamw_update(*a, **step_args()), donate_argnums=(0, 2, 3))
    text = step.lower(param, grad, mu, nu).compile().as_text()
    call = next(line for line in text.splitlines() if "nodrop_adamw_update" in line)
    assert "output_to_operand_aliasing={{0}: (0, {}), {1}: (2, {}), {2}: (3, {})}" in call, call
    want = nodrop.adamw_update(param, grad, mu, nu, **step_args())
    got = step(jnp.array(param), grad, jnp.array(mu), jnp.array(nu))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_non_finite_values_and_overflowing_squares_are_counted():
    param, grad, mu, nu = state((40,))
    grad = grad.at[3].set(jnp.nan)
    param = param.at[30].set(jnp.inf)
    got = nodrop.adamw_update(param, grad, mu, nu, **step_args())
    assert np.isnan(got.param[3]) and np.isinf(got.param[30])
    assert float(got.sums[3]) == 2  # the NaN update, the infinite parameter
    huge = nodrop.adamw_update(*state((40,)), **step_args(step_size=-1e30))
    assert float(huge.sums[4]) == 40 and np.isinf(huge.sums[0]) and np.isfinite(huge.sums[1])


def test_a_nan_norm_clips_as_optax_does():
    got = nodrop.adamw_update(*state((8,)), max_grad_norm=1.0, grad_norm=jnp.float32(jnp.nan),
                              **step_args())
    assert np.isnan(got.param).all() and float(got.sums[3]) == 8


@pytest.mark.parametrize("change, message", [
    (dict(param=np.zeros(4, np.float16)), "param must be float32"),
    (dict(grad=np.zeros(5, np.float32)), "grad must have param's shape (4,), got (5,)"),
    (dict(grad=np.zeros(4, np.int32)), "grad must be float32, bfloat16 or float16, got int32"),
    (dict(nu=np.zeros((4, 1), np.float32)), "nu must have param's shape"),
    (dict(b1=1.0), "b1 must be in [0.0, 1.0), got 1.0"),
    (dict(b2=-0.5), "b2 must be in"),
    (dict(eps=float("nan")), "eps must be finite and >= 0"),
    (dict(weight_decay=-1.0), "weight_decay must be finite and >= 0"),
    (dict(update_scale=float("inf")), "update_scale must be finite"),
    (dict(max_grad_norm=1.0), "grad_norm must be given"),
    (dict(count=jnp.float32(2)), "count must be an integer scalar"),
    (dict(count=jnp.int32([1, 2])), "count must be an integer scalar"),
])
def test_bad_input_names_the_argument(change, message):
    args = dict(param=np.zeros(4, np.float32), grad=np.zeros(4, np.float32),
                mu=np.zeros(4, np.float32), nu=np.zeros(4, np.float32), **step_args())
    args.update(change)
    with pytest.raises(ValueError) as error:
        nodrop.adamw_update(**args)
    assert message in str(error.value)


def test_vmap_and_scan_give_the_calls_one_by_one():
    stacked = state((3, 50))
    vmapped = jax.vmap(lambda *a: nodrop.adamw_update(*a, **step_args()))(*stacked)
    for i in range(3):
        one = nodrop.adamw_update(*(x[i] for x in stacked), **step_args())
        for a, b in zip(vmapped, one):
            np.testing.assert_array_equal(a[i], b)

    def body(carry, count):
        param, mu, nu = carry
        out = nodrop.adamw_update(param, stacked[1][0], mu, nu, **{**step_args(), "count": count})
        return (out.param, out.mu, out.nu), out.sums

    carry = (stacked[0][0], stacked[2][0], stacked[3][0])
    scanned, sums = jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(1, 4, dtype=jnp.int32)))(
        carry)
    for count in (1, 2, 3):
        out = nodrop.adamw_update(carry[0], stacked[1][0], carry[1], carry[2],
                                  **{**step_args(), "count": jnp.int32(count)})
        np.testing.assert_array_equal(sums[count - 1], out.sums)
        carry = (out.param, out.mu, out.nu)
    for a, b in zip(scanned, carry):
        np.testing.assert_array_equal(a, b)


def test_chunks_bound_the_partial_sums():
    assert [adamw.num_chunks(n) for n in (0, 1, 16384, 16385, 10 ** 10)] == [1, 1, 1, 2, 8192]
