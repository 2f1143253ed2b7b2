"""The expert-parallel token exchange: inside `jax.shard_map`, each rank's permuted rows go to the
ranks holding their experts and come back, through two `jax.lax.all_to_all` calls over padded
per-rank buffers.

Why padded buffers and not `jax.lax.ragged_all_to_all`: in jax 0.11.2 XLA's CPU backend has no
ragged all-to-all ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), and the same
code must run in the CPU tests and on GPUs. Each (source, destination) pair gets `capacity` rows;
a rank receives ep x capacity rows.

The receive buffer is bounded (`pair_capacity`): at a factor of the balanced load, or for the
worst case (every row of every source to one rank), where no overflow can happen. Rows past a
pair's capacity are not sent, and the exchange says so in its overflow flag, which every rank
agrees on: the caller must not trust that step's output (the contract is in `MoEBlock`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def pair_capacity(num_rows: int, num_ranks: int, buffer_factor: float | None) -> int:
    """Rows each (source, destination) pair may carry: ceil(factor * num_rows / num_ranks).

    num_rows: the rows one rank sends (its tokens x k); balanced routing sends num_rows /
    num_ranks to each rank, so a rank's receive buffer (num_ranks pairs) holds about factor x
    its balanced load. None: the worst case, num_rows (every row of each source to one rank).
    """
    if buffer_factor is None:
        return num_rows
    return max(1, min(num_rows, math.ceil(buffer_factor * num_rows / num_ranks)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Exchange:
    """One rank's side of the exchange, to send the expert outputs back (`return_rows`).

    send_index: [ep * capacity] the permuted row each send-buffer row holds (a distinct index
      past the rows where the pair's buffer is not full). sent: [ep] rows sent to each rank,
      after the capacity cut. overflow: bool scalar, some pair on some rank had more rows than
      its capacity (the same on every rank of `axes`).
    """

    send_index: jax.Array
    sent: jax.Array
    overflow: jax.Array


def send_rows(rows, group_sizes, *, axis: str, capacity: int, axes: tuple[str, ...]):
    """Sends each rank's permuted rows to the ranks holding their experts.

    Call inside `jax.shard_map` over a mesh whose axis `axis` (size ep) splits the E experts:
    rank r holds experts [r * E/ep, (r + 1) * E/ep).

    Args:
      rows: [N, H] this rank's rows ordered by expert (`nodrop.permute`'s rows).
      group_sizes: [E] this rank's rows per expert.
      capacity: rows per (source, destination) pair (`pair_capacity`).
      axes: every mesh axis the tokens are split over (the overflow flag is agreed over them).

    Returns:
      (received [ep * capacity, H], the rows from source s in [s * capacity, (s + 1) *
      capacity), each source's rows ordered by local expert and zero past them;
      received_sizes [ep, E/ep], the rows source s sent for each local expert (after the
      capacity cut); the Exchange.)
    """
    num_rows = rows.shape[0]
    ep = jax.lax.axis_size(axis)
    counts = group_sizes.reshape(ep, -1)  # [destination, its local expert]
    wanted = counts.sum(axis=1)
    sent = jnp.minimum(wanted, capacity)
    # The rows for rank d start where the rows of experts before d * E/ep end.
    starts = jnp.cumsum(wanted) - wanted
    slot = jnp.arange(capacity)
    filled = slot[None, :] < sent[:, None]
    # Unfilled slots read distinct indices past the rows (filled with 0), so every index is
    # unique and the gradient (a scatter) needs no atomics.
    send_index = jnp.where(filled, starts[:, None] + slot[None, :],
                           num_rows + jnp.arange(ep * capacity).reshape(ep, capacity))
    send_index = send_index.reshape(-1)
    buffer = rows.at[send_index].get(mode="fill", fill_value=0, unique_indices=True)
    received = jax.lax.all_to_all(buffer, axis, 0, 0, tiled=True)
    received_sizes = jax.lax.all_to_all(_cut(counts, capacity), axis, 0, 0, tiled=True)
    overflow = jax.lax.psum(jnp.any(wanted > capacity).astype(jnp.int32), axes) > 0
    return received, received_sizes, Exchange(send_index, sent, overflow)


def _cut(counts, capacity: int):
    """Per-expert counts [ep, E/ep] after each row of them is cut at `capacity` rows: the
    first experts keep theirs, as the send buffer keeps the first rows."""
    ends = jnp.minimum(jnp.cumsum(counts, axis=1), capacity)
    return jnp.diff(ends, axis=1, prepend=jnp.zeros_like(ends[:, :1]))


def received_expert_ids(received_sizes, capacity: int):
    """[ep * capacity] the local expert of each received row, E/ep for the padding rows."""
    ends = jnp.cumsum(received_sizes, axis=1)  # [source, local expert]
    slot = jnp.arange(capacity)
    ids = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1)  # past the last: E/ep
    return ids.reshape(-1).astype(jnp.int32)


def return_rows(out, exchange: Exchange, num_rows: int, *, axis: str):
    """The expert outputs [ep * capacity, H] (in the received layout) back to the ranks that
    sent them: [num_rows, H] in the sender's permuted order, zero for rows cut by the
    capacity."""
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
    return jnp.zeros((num_rows, out.shape[1]), out.dtype).at[exchange.send_index].set(
        back, mode="drop", unique_indices=True)
