"""Per-token estimators of KL(pi_theta || pi_ref) from the sampled token's log-probs, and the KL reward penalty.

Schulman, "Approximating KL divergence" (2020), with x ~ pi_theta and r = pi_ref(x) / pi_theta(x), so that
log r = ref - l for the log-probs l (policy) and ref (reference) of the sampled token:

    k1 = -log r              (unbiased, high variance, can be negative)
    k2 = (log r)^2 / 2       (biased, low variance, >= 0)
    k3 = (r - 1) - log r     (unbiased, low variance, >= 0)

These are the signs of verl's `kl_penalty` (verl/trainer/ppo/core_algos.py: "kl"/"k1" = logprob - ref_logprob,
"mse"/"k2" = 0.5 (logprob - ref_logprob)^2, "low_var_kl"/"k3" = exp(ref - logprob) - (ref - logprob) - 1);
verl also clamps k3 to [-10, 10] (and ref - logprob to [-20, 20]), which is not done here: a non-finite value
reaches the train step, which skips the update and counts it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.config import KL_ESTIMATORS
from ipa_jax.objectives.sequences import Sequences, as_given, sequence_sum, sequences_of


def kl_k1(log_probs: jax.Array, ref_log_probs: jax.Array) -> jax.Array:
    """k1 = -log r = l - ref. [B, T] -> [B, T]."""
    return log_probs - ref_log_probs


def kl_k2(log_probs: jax.Array, ref_log_probs: jax.Array) -> jax.Array:
    """k2 = (log r)^2 / 2 = (ref - l)^2 / 2. [B, T] -> [B, T]."""
    return 0.5 * jnp.square(ref_log_probs - log_probs)


def kl_k3(log_probs: jax.Array, ref_log_probs: jax.Array) -> jax.Array:
    """k3 = (r - 1) - log r, log r = ref - l. [B, T] -> [B, T]. expm1 keeps r - 1 exact for r near 1."""
    log_r = ref_log_probs - log_probs
    return jnp.expm1(log_r) - log_r


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(log_probs: jax.Array, ref_log_probs: jax.Array, estimator: str) -> jax.Array:
    """The per-token KL estimate `estimator` ("k1", "k2" or "k3") of pi_theta vs pi_ref. [B, T] -> [B, T]."""
    if estimator not in _ESTIMATORS:
        raise ValueError(f"kl estimator: {estimator!r} is not one of {KL_ESTIMATORS}")
    return _ESTIMATORS[estimator](log_probs, ref_log_probs)


def sequence_kl(
    log_probs: jax.Array,
    ref_log_probs: jax.Array,
    action_mask: jax.Array,
    estimator: str,
    sequences: Sequences | None = None,
) -> jax.Array:
    """KL_i = sum_{t in actions of i} k(l_t, ref_t): the sequence's summed estimate. [B, T] -> [B] ([B, S] packed)."""
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    return as_given(sequence_sum(kl_estimate(log_probs, ref_log_probs, estimator), action_mask, seqs), seqs)


def kl_penalized_rewards(rewards: jax.Array, sequence_kl_values: jax.Array, beta: float) -> jax.Array:
    """R'_i = R_i - beta * KL_i (Ziegler et al. 2019, the PPO-RLHF reward), before the baseline and credit.
    rewards, sequence_kl_values: [B] ([B, S] packed) -> [B]."""
    return rewards - beta * jax.lax.stop_gradient(sequence_kl_values)
