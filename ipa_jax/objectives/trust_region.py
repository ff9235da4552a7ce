"""Sequence Trust Region: Bernoulli-KL proxy of the drift between behaviour and current policy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_mean
from ipa_jax.objectives.sequences import Sequences, as_given, sequence_mean, sequences_of

PROB_CLAMP = 1e-6


def bernoulli_kl(behavior_log_probs: jax.Array, log_probs: jax.Array) -> jax.Array:
    """d = p log(p/q) + (1-p) log((1-p)/(1-q)), p = exp(b), q = exp(l), both clamped to [1e-6, 1 - 1e-6].

    The clamp is applied in log space (same values) so p log(p/q) uses the exact difference b - l, and the
    (1 - p) terms use log1p. [B, T] -> [B, T]."""
    lo, hi = math.log(PROB_CLAMP), math.log1p(-PROB_CLAMP)
    log_p = jnp.clip(behavior_log_probs, lo, hi)
    log_q = jnp.clip(log_probs, lo, hi)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    return p * (log_p - log_q) + (1 - p) * (jnp.log1p(-p) - jnp.log1p(-q))


def sequence_divergence(kl: jax.Array, action_mask: jax.Array, sequences: Sequences | None = None) -> jax.Array:
    """D_i = max(0, (1/T_i) sum_t d_{i,t}) over the action tokens of sequence i; the clamp at 0 keeps float
    round-off from rejecting an on-policy sample. [B, T] -> [B] ([B, S] packed)."""
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    return as_given(jnp.maximum(sequence_mean(kl, action_mask, seqs), 0), seqs)


def chunk_divergence(kl: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array) -> jax.Array:
    """D_{i,k} = max(0, mean_{t in c_k} d_{i,t}), per token. [B, T] -> [B, T] (0 outside actions)."""
    return jnp.maximum(chunk_mean(kl, action_mask, chunk_ids), 0)
