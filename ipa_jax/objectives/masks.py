"""Token masks: the train/inference mismatch masks (ratio range, probability difference) and the failure-token
entropy filter."""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

from ipa_jax.objectives.sequences import Sequences, as_slots, count_before, sequence_count, sequences_of, to_tokens


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


def entropy_filter_mask(
    entropies: jax.Array,
    action_mask: jax.Array,
    failures: jax.Array,
    fraction: float,
    sequences: Sequences | None = None,
) -> jax.Array:
    """Keep every action token of a successful sequence and the ceil(q T_i) highest-entropy action tokens of a
    failed sequence (ties: earlier token first). entropies [B, T], failures bool[B] ([B, S] packed) ->
    bool[B, T].

    q is a static Python float. ceil(q T_i) is evaluated exactly in integers with q as a fraction of
    denominator <= 1000 (q = 0.2, T_i = 5 keeps 1 token; float32 rounding could say 2)."""
    if fraction >= 1.0:
        return action_mask
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    q = Fraction(fraction).limit_denominator(1000)
    n = sequence_count(action_mask, seqs)
    keep_count = to_tokens((n * q.numerator + q.denominator - 1) // q.denominator, seqs)
    score = jnp.where(action_mask, entropies.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(score, axis=1, descending=True, stable=True)
    if seqs.packed:  # group the order by sequence (stable: still descending entropy within each sequence)
        order = jnp.take_along_axis(
            order, jnp.argsort(jnp.take_along_axis(seqs.slot, order, axis=1), axis=1, stable=True), axis=1
        )
    rank = jnp.argsort(order, axis=1)  # rank[t] = position of token t in that order
    if seqs.packed:  # ... counted from where its sequence's block starts (a block per sequence, as long as it)
        rank -= to_tokens(count_before(sequence_count(jnp.ones(action_mask.shape, bool), seqs)), seqs)
    top = rank < keep_count
    return action_mask & (top | ~to_tokens(as_slots(failures, seqs), seqs))
