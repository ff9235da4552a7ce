"""The policy-gradient term "rl" (weight rl_weight), by the config's surrogate: reinforce, L_RL = -Agg(w * l) with
w = keep * rho * c * G stop-gradient; ppo, L_RL = Agg(keep * c * ppo_loss(l - p, G)), the clipped surrogate of the
ratio current / proximal (surrogates.py) weighted by the mismatch weight c."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.aggregation import aggregation_weights
from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.surrogates import ppo_clipped_loss
from ipa_jax.objectives.terms.registry import ObjectiveTerm, TermBatch, TermMasks, register_term


def policy_gradient_term(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """reinforce: num = -sum_{i,t kept} scale w l; ppo: num = sum_{i,t kept} scale c ppo_loss(l - p, G); den = the
    aggregation's denominator. [B, T] -> scalars."""
    if config.surrogate == "ppo":
        # the ratio of the tokens left out is 1 (log 0): an overflowing one must not reach the gradient
        log_ratio = jnp.where(batch.keep, batch.log_probs - batch.proximal, 0)
        token_loss, _ = ppo_token_loss(log_ratio, batch.returns, config)
        num = jnp.sum(jnp.where(batch.keep, batch.mismatch_weight * batch.scale * token_loss, 0))
        return num, batch.rl_denominator
    num = -jnp.sum(jnp.where(batch.keep, batch.weights * batch.scale * batch.log_probs, 0))
    return num, batch.rl_denominator


def ppo_token_loss(log_ratio: jax.Array, returns: jax.Array, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """ppo_clipped_loss with the config's clip range, dual clip and log-ratio clamp: log r, G [B, T] -> (token loss
    [B, T], clipped bool[B, T])."""
    return ppo_clipped_loss(
        log_ratio,
        returns,
        config.ppo_clip_low,
        config.ppo_clip_high,
        config.ppo_dual_clip,
        config.ppo_log_ratio_clamp,
    )


def action_aggregation(
    masks: TermMasks, config: ObjectiveConfig, dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """(scale [B, T], denominator): config.aggregation over every action token, Agg(v) = sum(scale * v) / den
    (aggregation_weights with all of the config's aggregation settings, norm_length included)."""
    return aggregation_weights(
        masks.action, masks.chunk_ids, config.aggregation, dtype, masks.sequences, config.norm_length
    )


def policy_gradient_denominator(masks: TermMasks, config: ObjectiveConfig) -> jax.Array:
    """The aggregation's denominator (rows or action tokens with actions: masks only)."""
    return action_aggregation(masks, config)[1]


register_term(ObjectiveTerm("rl", "rl_weight", policy_gradient_term, policy_gradient_denominator, always=True))
