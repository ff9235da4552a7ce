"""Per-row chunk bookkeeping with segment sums over flattened (row, chunk) ids: memory O(B T), no one-hot.

Chunk k of row i is the set of action tokens with chunk_ids == k. Every function is jit-compatible and takes
[B, T] arrays; results are per token ([B, T], 0 outside actions) or per row ([B]). In a packed row (several
sequences, objectives/sequences.py) chunk ids are unique within the row: each sequence's chunks continue the
numbering of the sequence before it, so chunk sums need no segment ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.sequences import Sequences, as_given, sequence_count, sequences_of


def compute_dtype(x: jax.Array) -> jnp.dtype:
    """float64 stays float64; every other input (bf16, f16, f32) is computed in float32."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _flat_segments(action_mask: jax.Array, chunk_ids: jax.Array) -> tuple[jax.Array, int]:
    """seg[i, t] = i * T + chunk_ids[i, t] on actions, B * T (a spare segment) elsewhere. [B, T] -> [B, T]."""
    B, T = action_mask.shape
    rows = jnp.arange(B, dtype=jnp.int32)[:, None] * T
    return jnp.where(action_mask, rows + chunk_ids.astype(jnp.int32), B * T), B * T + 1


def chunk_sum(values: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array) -> jax.Array:
    """Per token: sum of ``values`` over the token's chunk; 0 outside actions. [B, T] -> [B, T]."""
    seg, n = _flat_segments(action_mask, chunk_ids)
    sums = jax.ops.segment_sum(jnp.where(action_mask, values, 0).reshape(-1), seg.reshape(-1), num_segments=n)
    return jnp.where(action_mask, sums[seg], 0)


def chunk_mean(values: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array) -> jax.Array:
    """Per token: mean of ``values`` over the token's chunk, (1/|c_k|) sum_{s in c_k} v_s. [B, T] -> [B, T]."""
    size = chunk_sum(jnp.ones_like(values), action_mask, chunk_ids)
    return chunk_sum(values, action_mask, chunk_ids) / jnp.maximum(size, 1)


def num_chunks(action_mask: jax.Array, chunk_ids: jax.Array, sequences: Sequences | None = None) -> jax.Array:
    """K_i = the number of chunks of sequence i (0 without actions). [B, T] -> int32[B] (int32[B, S] packed)."""
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    return as_given(sequence_count(chunk_starts(action_mask, chunk_ids), seqs), seqs)


def chunk_starts(action_mask: jax.Array, chunk_ids: jax.Array) -> jax.Array:
    """True at the first action token of each chunk. [B, T] -> bool[B, T]."""
    cid = jnp.where(action_mask, chunk_ids.astype(jnp.int32), -1)
    # Largest chunk id seen at positions < t; ids are non-decreasing, so a new chunk starts where it grows.
    prev = jax.lax.cummax(jnp.pad(cid, ((0, 0), (1, 0)), constant_values=-1)[:, :-1], axis=1)
    return action_mask & (cid > prev)
