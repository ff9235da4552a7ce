"""The entropy bonus "entropy" (weight entropy_weight): L_H = -Agg(H) over action tokens, H_t = -sum_v p log p of
the distribution token t was drawn from; a positive weight raises the policy's entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.terms.policy_gradient import action_aggregation, policy_gradient_denominator
from ipa_jax.objectives.terms.registry import ObjectiveTerm, TermBatch, register_term


def entropy_bonus(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """num = -sum_{i,t action} scale_{i,t} H_{i,t} with the aggregation's own scale (every action token, not only
    the kept ones), den = its denominator. entropies [B, T] (with gradient) -> scalars."""
    scale, den = action_aggregation(batch.masks, config, batch.log_probs.dtype)
    entropies = batch.entropies.astype(batch.log_probs.dtype)
    return -jnp.sum(jnp.where(batch.masks.action, scale * entropies, 0)), den


register_term(
    ObjectiveTerm("entropy", "entropy_weight", entropy_bonus, policy_gradient_denominator, needs_entropy=True)
)
