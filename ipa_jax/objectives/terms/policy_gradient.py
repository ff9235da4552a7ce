"""The policy-gradient term "rl" (weight rl_weight): L_RL = -Agg(w * l), w = keep * rho * c * G stop-gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.aggregation import aggregation_weights
from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.terms.registry import ObjectiveTerm, TermBatch, TermMasks, register_term


def policy_gradient_term(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """num = -sum_{i,t kept} scale_{i,t} w_{i,t} l_{i,t}, den = the aggregation's denominator. [B, T] -> scalars."""
    num = -jnp.sum(jnp.where(batch.keep, batch.weights * batch.scale * batch.log_probs, 0))
    return num, batch.rl_denominator


def policy_gradient_denominator(masks: TermMasks, config: ObjectiveConfig) -> jax.Array:
    """The aggregation's denominator (rows or action tokens with actions: masks only)."""
    return aggregation_weights(masks.action, masks.chunk_ids, config.aggregation, sequences=masks.sequences)[1]


register_term(ObjectiveTerm("rl", "rl_weight", policy_gradient_term, policy_gradient_denominator, always=True))
