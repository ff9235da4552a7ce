"""PPO's clipped surrogate with dual clip, per token (Schulman et al. 2017, arXiv:1707.06347; dual clip: Ye et al.
2020, arXiv:1912.09729; asymmetric clip range: DAPO's clip-higher, arXiv:2503.14476)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def ppo_clipped_loss(
    log_ratio: jax.Array,
    advantages: jax.Array,
    clip_low: float,
    clip_high: float,
    dual_clip: float = math.inf,
    log_ratio_clamp: float = math.inf,
) -> tuple[jax.Array, jax.Array]:
    """log_ratio log r = l - p, advantages A (per token) [B, T] -> (token loss [B, T], clipped bool[B, T]).

    r = exp(clamp(log r, -log_ratio_clamp, log_ratio_clamp)); loss = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high)); for A < 0 with a finite dual clip c: min(that, -c A). Gradient flows through log_ratio only,
    and not beyond the clamp. clipped: the tokens whose loss has no gradient (a clipped branch, or a log-ratio
    beyond the clamp)."""
    # r = exp(clamp(log r)): a finite loss in float32 (exp overflows past 88.7), as verl's clamp at +-20
    clamped = jnp.abs(log_ratio) > log_ratio_clamp
    ratio = jnp.exp(jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped) | clamped
    if math.isfinite(dual_clip):
        # the dual clip bounds a negative advantage's loss at -c A: a huge ratio cannot dominate the update
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = jnp.where(dual, bound, loss)
        is_clipped |= dual
    return loss, is_clipped
