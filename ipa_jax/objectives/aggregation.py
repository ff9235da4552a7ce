"""Aggregation of token terms into (numerator, denominator) with denominators over the whole batch.

Denominators depend only on the masks (counts of rows with actions, of action tokens), so they ADD across
microbatches: the full-batch value is sum(numerators) / sum(denominators). A row without actions (padding
row) contributes nothing to either. A per-row divisor that depends on the kept tokens (kept_row_scale) is part
of the numerator's scale: rows are never split across microbatches, so it is exact in each of them. "Row" below
is a sequence: in packed rows (objectives/sequences.py) every sequence is a row of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_starts, chunk_sum
from ipa_jax.objectives.config import AGGREGATIONS
from ipa_jax.objectives.sequences import Sequences, sequence_count, sequences_of, to_tokens


def aggregation_weights(
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    aggregation: str,
    dtype: jnp.dtype = jnp.float32,
    sequences: Sequences | None = None,
    norm_length: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """(scale [B, T], denominator scalar) such that Agg(v) = sum(scale * v) / denominator.

    sample_mean:    (1/B) sum_i (1/T_i) sum_t v                          scale 1/T_i,            den B
    token_mean:     sum_i sum_t v / sum_i T_i                            scale 1,                den sum T_i
    chunk_mean:     (1/B) sum_i (1/K_i) sum_k (1/|c_k|) sum_{t in c_k} v  scale 1/(K_i |c_k|),    den B
    sequence_sum:   (1/B) sum_i sum_t v                                  scale 1,                den B
    token_sum_norm: (1/B) sum_i sum_t v / L  (Dr.GRPO, L = norm_length)  scale 1,                den B L
    B counts rows (sequences) with at least one action token.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: {aggregation!r} is not one of {AGGREGATIONS}")
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    mask = action_mask.astype(dtype)
    tokens_per_row = sequence_count(action_mask, seqs)
    rows = (tokens_per_row > 0).sum().astype(dtype)
    if aggregation == "sample_mean":
        return mask / to_tokens(jnp.maximum(tokens_per_row, 1), seqs).astype(dtype), rows
    if aggregation == "token_mean":
        return mask, tokens_per_row.sum().astype(dtype)
    if aggregation == "sequence_sum":
        return mask, rows
    if aggregation == "token_sum_norm":
        if norm_length <= 0:
            raise ValueError(f"norm_length: must be > 0 for aggregation='token_sum_norm', got {norm_length!r}")
        return mask, rows * norm_length
    if chunk_ids is None:
        raise ValueError("chunk_ids: required for aggregation='chunk_mean'")
    chunk_size = chunk_sum(mask, action_mask, chunk_ids)
    k = to_tokens(sequence_count(chunk_starts(action_mask, chunk_ids), seqs), seqs).astype(dtype)
    return jnp.where(action_mask, 1 / jnp.maximum(chunk_size * k, 1), 0), rows


def kept_row_scale(keep: jax.Array, dtype: jnp.dtype = jnp.float32, sequences: Sequences | None = None) -> jax.Array:
    """sample_mean's scale with row_denominator="kept": 1/|kept_i| on the kept tokens of row (sequence) i, 0
    elsewhere. keep bool[B, T] -> [B, T].

    Agg(v) = (1/B) sum_i (1/|kept_i|) sum_{t kept} v with B from aggregation_weights (rows with actions, masks
    only): a row without kept tokens adds 0 and still counts in B (ROLL's seq-mean-token-mean over its filtered
    loss mask)."""
    seqs = sequences_of(keep.shape) if sequences is None else sequences
    kept_per_row = to_tokens(sequence_count(keep, seqs), seqs)
    return keep.astype(dtype) / jnp.maximum(kept_per_row, 1).astype(dtype)


def aggregate(
    values: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    aggregation: str,
    sequences: Sequences | None = None,
    norm_length: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """values [B, T] -> (numerator, denominator) scalars; Agg(values) = numerator / denominator."""
    scale, den = aggregation_weights(action_mask, chunk_ids, aggregation, values.dtype, sequences, norm_length)
    return jnp.sum(jnp.where(action_mask, scale * values, 0)), den
