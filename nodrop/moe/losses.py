"""Load-balancing terms for MoE routers (pure JAX: they are cheap reductions XLA fuses well)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tokens_per_expert(ids, num_experts: int):
    """[E] int32: how many (token, slot) pairs chose each expert; ids outside [0, E) count nowhere."""
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    return jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, 0)].add(
        valid.astype(jnp.int32))


def load_balancing_loss(probs, ids, num_experts: int | None = None, *, axis_name=None):
    """Switch/GShard auxiliary loss: E * sum_e f_e * P_e.

    f_e is the fraction of the T*k routed slots that went to expert e and P_e the mean router
    probability of e over the T tokens; perfectly uniform routing gives 1. Pass the probabilities
    and ids of the global batch (gather them across data-parallel shards first) so the loss sees
    the balance the experts see. Gradients flow through probs only.

    Args:
      probs: [T, E] router probabilities (softmax of the logits, or normalised sigmoid scores).
      ids: [T, k] chosen experts.
      axis_name: inside `jax.shard_map`, the mesh axes the batch is split over: the loss is then
        that of the whole batch, the same on every device.
    """
    num_tokens, num_experts_probs = probs.shape
    num_experts = num_experts or num_experts_probs
    if num_experts != num_experts_probs:
        raise ValueError(f"probs has {num_experts_probs} experts but num_experts is {num_experts}")
    counts = jax.lax.stop_gradient(tokens_per_expert(ids, num_experts)).astype(jnp.float32)
    if axis_name is None:
        fraction = counts / max(ids.size, 1)
        mean_prob = probs.astype(jnp.float32).mean(axis=0)
    else:
        shards = jax.lax.axis_size(axis_name)
        counts, prob_sums = jax.lax.psum((counts, probs.astype(jnp.float32).sum(axis=0)),
                                         axis_name)
        fraction = counts / max(ids.size * shards, 1)
        mean_prob = prob_sums / (num_tokens * shards)
    return num_experts * jnp.sum(fraction * mean_prob)


def sequence_balance_loss(probs, ids, num_sequences: int, *, axis_name=None):
    """DeepSeek-V3's complementary sequence-wise balance loss: the load-balancing loss of each
    sequence on its own, averaged over the sequences.

    The batch-wise loss lets a sequence send all its tokens to a few experts as long as other
    sequences make up for it; with fine-grained experts one such sequence (a table, a long list)
    is a large part of an expert's share of the batch. This term penalises that per sequence.

    Args:
      probs: [T, E] router probabilities, T = num_sequences * S in sequence order.
      ids: [T, k] chosen experts.
      num_sequences: how many sequences the T tokens are (1: the whole call is one sequence).
      axis_name: inside `jax.shard_map`, the mesh axes the sequences are split over: the loss is
        then the mean over every sequence of the mesh, the same on every device.
    """
    num_tokens, num_experts = probs.shape
    if num_sequences < 1 or num_tokens % num_sequences:
        raise ValueError(f"num_sequences must divide the {num_tokens} tokens, got {num_sequences}")
    per_sequence = jax.vmap(lambda p, i: load_balancing_loss(p, i, num_experts))(
        probs.reshape(num_sequences, -1, num_experts), ids.reshape(num_sequences, -1, ids.shape[-1]))
    if axis_name is None:
        return per_sequence.mean()
    return jax.lax.pmean(per_sequence.mean(), axis_name)


def router_z_loss(logits, *, axis_name=None):
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps logits small).

    axis_name: inside `jax.shard_map`, the mesh axes the tokens are split over (the mean is then
    over every token)."""
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    if axis_name is None:
        return jnp.mean(jnp.square(z))
    return jax.lax.psum(jnp.sum(jnp.square(z)), axis_name) / (
        z.size * jax.lax.axis_size(axis_name))
