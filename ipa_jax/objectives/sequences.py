"""Which sequence (trajectory) each token belongs to, and per-sequence reductions: one sequence per row, or several
per row in packed rows.

A packed row holds its sequences as contiguous runs of segment ids 1, 2, ..., S_i from left to right (0 =
padding); slot s of row i is the sequence with segment id s + 1, and per-sequence arrays are [B, S] (S >= every
row's segment count; unused slots have no tokens). Without segment ids each row is one sequence: per-sequence
arrays are [B] and the reductions are plain row sums. Every per-sequence quantity of the objective (T_i, K_i,
sequence ratios, the sequence trust region, advantages) is a reduction over its tokens here, so a packed row gives
each of its sequences exactly what that sequence gets in a row of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sequences(NamedTuple):
    """slot int32[B, T]: i * S + s for the tokens of slot s of row i, B * S (a spare slot) on padding; num_slots S
    (static); packed: False for one sequence per row (slot = i, S = 1, per-sequence arrays [B])."""

    slot: jax.Array
    num_slots: int
    packed: bool

    @property
    def rows(self) -> int:
        return self.slot.shape[0]


def sequences_of(
    shape: tuple[int, int], segment_ids: jax.Array | None = None, num_slots: int | None = None
) -> Sequences:
    """The Sequences of a [B, T] batch: one per row without segment_ids; with segment_ids int32[B, T] (0 = padding,
    1..S in each row), S = num_slots (default T, an upper bound that needs no knowledge of the packing)."""
    b, t = shape
    if segment_ids is None:
        return Sequences(jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)), 1, False)
    s = t if num_slots is None else num_slots
    seg = segment_ids.astype(jnp.int32)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None] * s
    return Sequences(jnp.where(seg > 0, rows + seg - 1, b * s), s, True)


def as_slots(per_sequence: jax.Array, seqs: Sequences) -> jax.Array:
    """A per-sequence array as given ([B] or [B, S]) -> [B, S]."""
    return per_sequence if seqs.packed else per_sequence[:, None]


def as_given(per_slot: jax.Array, seqs: Sequences) -> jax.Array:
    """[B, S] -> the caller's per-sequence shape: [B] without segment ids, [B, S] with."""
    return per_slot if seqs.packed else per_slot[:, 0]


def sequence_sum(values: jax.Array, mask: jax.Array, seqs: Sequences) -> jax.Array:
    """Per sequence: sum of values over its masked tokens. [B, T] -> [B, S]."""
    masked = jnp.where(mask, values, jnp.zeros((), values.dtype))
    if not seqs.packed:
        return masked.sum(axis=1, keepdims=True)
    b, s = seqs.rows, seqs.num_slots
    sums = jax.ops.segment_sum(masked.reshape(-1), seqs.slot.reshape(-1), num_segments=b * s + 1)
    return sums[: b * s].reshape(b, s)


def sequence_count(mask: jax.Array, seqs: Sequences) -> jax.Array:
    """Per sequence: number of masked tokens (T_i for the action mask). bool[B, T] -> int32[B, S]."""
    return sequence_sum(jnp.ones(mask.shape, jnp.int32), mask, seqs)


def sequence_mean(values: jax.Array, mask: jax.Array, seqs: Sequences) -> jax.Array:
    """Per sequence: (1/n) sum of values over its n masked tokens (0 when n = 0). [B, T] -> [B, S]."""
    return sequence_sum(values, mask, seqs) / jnp.maximum(sequence_count(mask, seqs), 1).astype(values.dtype)


def to_tokens(per_slot: jax.Array, seqs: Sequences) -> jax.Array:
    """Each token gets its sequence's value (padding of a packed row gets 0). [B, S] -> [B, T]."""
    if not seqs.packed:
        return jnp.broadcast_to(per_slot, seqs.slot.shape)
    flat = jnp.concatenate([per_slot.reshape(-1), jnp.zeros((1,), per_slot.dtype)])
    return flat[seqs.slot]


def count_before(per_slot: jax.Array) -> jax.Array:
    """Per sequence: the sum over the sequences left of it in its row (exclusive cumsum over slots). [B, S] ->
    [B, S]. With per_slot = token counts this is where a sequence's tokens start among its row's."""
    return jnp.cumsum(per_slot, axis=1) - per_slot
