"""Imitation term: negative log-likelihood of the expert-prefilled tokens (the recovery signal at forks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def imitation_term(log_probs: jax.Array, expert_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NLL = -sum_{t in expert} l_t / #expert tokens, returned as (numerator, denominator) [B, T] -> scalars.

    The denominator is the raw count (it adds across microbatches, and may be 0 in one of them);
    combine_terms divides by max(total count, 1), so a batch without expert tokens contributes 0."""
    num = -jnp.sum(jnp.where(expert_mask, log_probs, 0))
    return num, expert_mask.sum().astype(log_probs.dtype)
