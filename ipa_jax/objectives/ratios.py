"""Importance ratios rho (always stop-gradient) at token, chunk or sequence level, in log space first so
that exp is only taken where the ratio is used (a rejected or padded token never overflows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_mean, row_mean
from ipa_jax.objectives.config import IS_LEVELS


def level_mean(values: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array | None, level: str) -> jax.Array:
    """Per token [B, T] -> the mean of ``values`` over the token's unit at ``level``, per token [B, T] (0 outside
    actions). none: 0; token: v_t; chunk: mean_{s in c_k} v_s; sequence: mean_{s in row} v_s."""
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
    return jnp.where(action_mask, row_mean(values, action_mask)[:, None], 0)


def level_log_ratio(log_ratio: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array | None,
                    level: str) -> jax.Array:
    """log_ratio = x - y per token, [B, T] -> the log of the ratio at ``level`` per token [B, T]: the level mean of
    the log-ratio, so that a chunk's (sequence's) ratio is the geometric mean of its token ratios."""
    return level_mean(log_ratio, action_mask, chunk_ids, level)


def importance_weights(log_rho: jax.Array, used: jax.Array, negatives: jax.Array, apply_to: str,
                       clip_max: float | None) -> tuple[jax.Array, jax.Array]:
    """rho [B, T] and clipped bool[B, T] from the level log-ratio [B, T], on the ``used`` tokens (1 elsewhere).

    rho = min(exp(log_rho), clip_max) on ``used`` and, for apply_to='negatives', only in the rows marked by
    negatives bool[B] (positives keep plain return-weighted updates: TOPR/IPA asymmetry); 1 everywhere else.
    """
    applies = used if apply_to == "all" else used & negatives[:, None]
    # exp of 0 where the ratio is not used: no overflow there.
    rho = jnp.exp(jnp.where(applies, log_rho, 0))
    if clip_max is None:
        return rho, jnp.zeros_like(applies)
    clipped = applies & (rho > clip_max)
    return jnp.where(clipped, jnp.asarray(clip_max, rho.dtype), rho), clipped
