"""Importance ratios rho (always stop-gradient) at token, chunk or sequence level, in log space first so
that exp is only taken where the ratio is used (a rejected or padded token never overflows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_mean, row_mean
from ipa_jax.objectives.config import IS_LEVELS


def level_log_ratio(log_ratio: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array | None,
                    level: str) -> jax.Array:
    """log_ratio = l - b, [B, T] -> the log of the ratio at ``level``, per token [B, T] (0 outside actions).

    none: 0; token: l_t - b_t; chunk: mean_{s in c_k}(l - b) (log of the geometric mean);
    sequence: mean_{s in row}(l - b).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level: {level!r} is not one of {IS_LEVELS}")
    if level == "none":
        return jnp.zeros_like(log_ratio)
    if level == "token":
        return jnp.where(action_mask, log_ratio, 0)
    if level == "chunk":
        if chunk_ids is None:
            raise ValueError("chunk_ids: required for chunk-level ratios")
        return chunk_mean(log_ratio, action_mask, chunk_ids)
    return jnp.where(action_mask, row_mean(log_ratio, action_mask)[:, None], 0)


def importance_weights(log_rho: jax.Array, used: jax.Array, advantages: jax.Array, apply_to: str,
                       clip_max: float | None) -> tuple[jax.Array, jax.Array]:
    """rho [B, T] and clipped bool[B, T] from the level log-ratio [B, T], on the ``used`` tokens (1 elsewhere).

    rho = min(exp(log_rho), clip_max) on ``used`` and, for apply_to='negatives', only where A_i < 0
    (positives keep plain return-weighted updates: TOPR/IPA asymmetry); 1 everywhere else.
    """
    applies = used if apply_to == "all" else used & (advantages[:, None] < 0)
    # exp of 0 where the ratio is not used: no overflow there.
    rho = jnp.exp(jnp.where(applies, log_rho, 0))
    if clip_max is None:
        return rho, jnp.zeros_like(applies)
    clipped = applies & (rho > clip_max)
    return jnp.where(clipped, jnp.asarray(clip_max, rho.dtype), rho), clipped
