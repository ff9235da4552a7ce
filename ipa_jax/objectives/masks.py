"""Token masks: the train/inference mismatch masks (ratio range, probability difference) and the failure-token
entropy filter."""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp


def mismatch_mask(log_rho: jax.Array, action_mask: jax.Array, ratio_range: tuple[float, float]) -> jax.Array:
    """keep = low <= exp(log_rho) <= high on action tokens; log_rho [B, T] is the token or chunk level
    log-ratio (ratios.level_log_ratio). An overflowing ratio is inf > high, so it is masked, never NaN."""
    low, high = ratio_range
    ratio = jnp.exp(jnp.where(action_mask, log_rho, 0))
    return action_mask & (ratio >= low) & (ratio <= high)


def probability_difference_mask(prob_diff: jax.Array, action_mask: jax.Array, threshold: float) -> jax.Array:
    """keep = |prob_diff| <= threshold on action tokens; prob_diff [B, T] is the token, chunk or sequence mean of
    exp(old) - exp(b) (ratios.level_mean). A token whose learner and sampler probabilities differ by more than
    the threshold is dropped (ROLL's diff filter with diff_low = -threshold, diff_high = threshold)."""
    return action_mask & (jnp.abs(prob_diff) <= threshold)


def entropy_filter_mask(entropies: jax.Array, action_mask: jax.Array, failures: jax.Array,
                        fraction: float) -> jax.Array:
    """Keep every action token of a successful row and the ceil(q T_i) highest-entropy action tokens of a
    failed row (ties: earlier token first). entropies [B, T], failures bool[B] -> bool[B, T].

    q is a static Python float. ceil(q T_i) is evaluated exactly in integers with q as a fraction of
    denominator <= 1000 (q = 0.2, T_i = 5 keeps 1 token; float32 rounding could say 2)."""
    if fraction >= 1.0:
        return action_mask
    q = Fraction(fraction).limit_denominator(1000)
    n = action_mask.sum(axis=1, dtype=jnp.int32)
    keep_count = (n * q.numerator + q.denominator - 1) // q.denominator
    score = jnp.where(action_mask, entropies.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(score, axis=1, descending=True, stable=True)
    rank = jnp.argsort(order, axis=1)  # rank[t] = position of token t in the descending order
    top = rank < keep_count[:, None]
    return action_mask & (top | ~failures[:, None])
