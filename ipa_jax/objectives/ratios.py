"""Importance ratios rho (always stop-gradient) at token, chunk or sequence level, in log space first so
that exp is only taken where the ratio is used (a rejected or padded token never overflows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_mean
from ipa_jax.objectives.config import IS_LEVELS
from ipa_jax.objectives.sequences import Sequences, sequence_mean, sequences_of, to_tokens


def level_mean(
    values: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    level: str,
    sequences: Sequences | None = None,
) -> jax.Array:
    """Per token [B, T] -> the mean of ``values`` over the token's unit at ``level``, per token [B, T] (0 outside
    actions). none: 0; token: v_t; chunk: mean_{s in c_k} v_s; sequence: mean_{s in the token's sequence} v_s."""
    if level not in IS_LEVELS:
        raise ValueError(f"level: {level!r} is not one of {IS_LEVELS}")
    if level == "none":
        return jnp.zeros_like(values)
    if level == "token":
        return jnp.where(action_mask, values, 0)
    if level == "chunk":
        if chunk_ids is None:
            raise ValueError("chunk_ids: required for chunk-level ratios")
        return chunk_mean(values, action_mask, chunk_ids)
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    return jnp.where(action_mask, to_tokens(sequence_mean(values, action_mask, seqs), seqs), 0)


def level_log_ratio(
    log_ratio: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    level: str,
    sequences: Sequences | None = None,
) -> jax.Array:
    """log_ratio = x - y per token, [B, T] -> the log of the ratio at ``level`` per token [B, T]: the level mean of
    the log-ratio, so that a chunk's (sequence's) ratio is the geometric mean of its token ratios."""
    return level_mean(log_ratio, action_mask, chunk_ids, level, sequences)


def importance_weights(
    log_rho: jax.Array, used: jax.Array, negative_tokens: jax.Array, apply_to: str, clip_max: float | None
) -> tuple[jax.Array, jax.Array]:
    """rho [B, T] and clipped bool[B, T] from the level log-ratio [B, T], on the ``used`` tokens (1 elsewhere).

    rho = min(exp(log_rho), clip_max) on ``used`` and, for apply_to='negatives', only on the tokens of the
    sequences marked negative, negative_tokens bool[B, T] (positives keep plain return-weighted updates: TOPR/IPA
    asymmetry); 1 everywhere else.
    """
    applies = used if apply_to == "all" else used & negative_tokens
    # exp of 0 where the ratio is not used: no overflow there.
    rho = jnp.exp(jnp.where(applies, log_rho, 0))
    if clip_max is None:
        return rho, jnp.zeros_like(applies)
    clipped = applies & (rho > clip_max)
    return jnp.where(clipped, jnp.asarray(clip_max, rho.dtype), rho), clipped
