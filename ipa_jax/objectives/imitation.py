"""Imitation term: negative log-likelihood of the expert-prefilled tokens (the recovery signal at forks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.config import IL_AGGREGATIONS
from ipa_jax.objectives.sequences import Sequences, sequence_count, sequence_sum, sequences_of


def imitation_term(log_probs: jax.Array, expert_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NLL = -sum_{t in expert} l_t / #expert tokens, returned as (numerator, denominator) [B, T] -> scalars.

    The denominator is the raw count (it adds across microbatches, and may be 0 in one of them);
    combine_terms divides by max(total count, 1), so a batch without expert tokens contributes 0."""
    num = -jnp.sum(jnp.where(expert_mask, log_probs, 0))
    return num, expert_mask.sum().astype(log_probs.dtype)


def imitation_sample_mean(
    log_probs: jax.Array, expert_mask: jax.Array, sequences: Sequences | None = None
) -> tuple[jax.Array, jax.Array]:
    """NLL = -(1/N) sum_i (1/n_i) sum_{t in expert_i} l_t over the N sequences with n_i > 0 expert tokens, as
    (numerator, denominator N) [B, T] -> scalars: every imitated episode weighs the same, as the RL term's
    sample_mean weighs every sampled one (the token mean weighs long episodes more)."""
    seqs = sequences_of(log_probs.shape) if sequences is None else sequences
    n = sequence_count(expert_mask, seqs)
    row_sums = sequence_sum(log_probs, expert_mask, seqs)
    num = -jnp.sum(jnp.where(n > 0, row_sums / jnp.maximum(n, 1).astype(log_probs.dtype), 0))
    return num, imitation_denominator(expert_mask, "sample_mean", seqs).astype(log_probs.dtype)


def imitation_denominator(expert_mask: jax.Array, aggregation: str, sequences: Sequences | None = None) -> jax.Array:
    """The imitation term's raw denominator from the mask alone: expert tokens (token_mean) or sequences with expert
    tokens (sample_mean). bool[B, T] -> float32 scalar."""
    if aggregation not in IL_AGGREGATIONS:
        raise ValueError(f"il_aggregation: {aggregation!r} is not one of {IL_AGGREGATIONS}")
    mask = expert_mask.astype(bool)
    if aggregation == "token_mean":
        return mask.sum().astype(jnp.float32)
    seqs = sequences_of(mask.shape) if sequences is None else sequences
    return jnp.sum(sequence_count(mask, seqs) > 0).astype(jnp.float32)
