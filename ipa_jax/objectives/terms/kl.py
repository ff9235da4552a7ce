"""The reference-KL term "kl" (weight kl_weight): L_KL = Agg(k(l, ref)) over action tokens, k the per-token
estimator objective.kl_estimator (objectives/kl.py) of KL(pi_theta || pi_ref), ref the frozen reference policy's
log-probs (the extra input "ref_log_probs"); a positive weight pulls the policy towards the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.kl import kl_estimate
from ipa_jax.objectives.terms.policy_gradient import action_aggregation, policy_gradient_denominator
from ipa_jax.objectives.terms.registry import ObjectiveTerm, TermBatch, register_term


def reference_kl(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """num = sum_{i,t action} scale_{i,t} k(l_{i,t}, ref_{i,t}) with the aggregation's own scale (every action
    token, not only the kept ones), den = its denominator. l [B, T] (with gradient), ref [B, T] -> scalars."""
    masks = batch.masks
    scale, den = action_aggregation(masks, config, batch.log_probs.dtype)
    ref = jax.lax.stop_gradient(batch.extras["ref_log_probs"].astype(batch.log_probs.dtype))
    # ref := l outside the actions (k = 0 there), so no overflow of k3 off the actions reaches the gradient as NaN
    ref = jnp.where(masks.action, ref, jax.lax.stop_gradient(batch.log_probs))
    values = kl_estimate(batch.log_probs, ref, config.kl_estimator)
    return jnp.sum(jnp.where(masks.action, scale * values, 0)), den


register_term(ObjectiveTerm("kl", "kl_weight", reference_kl, policy_gradient_denominator, inputs=("ref_log_probs",)))
