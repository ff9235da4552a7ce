"""The imitation term "il" (weight il_weight): NLL of the expert tokens, -sum_{t in expert} l_t / #expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.imitation import imitation_term
from ipa_jax.objectives.terms.registry import ObjectiveTerm, TermBatch, TermMasks, register_term


def imitation(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """(-sum_{t in expert} l_t, #expert tokens). [B, T] -> scalars."""
    return imitation_term(batch.log_probs, batch.masks.expert)


def imitation_denominator(masks: TermMasks, config: ObjectiveConfig) -> jax.Array:
    return jnp.sum(masks.expert).astype(jnp.float32)


register_term(ObjectiveTerm("il", "il_weight", imitation, imitation_denominator, always=True))
