"""The imitation term "il" (weight il_weight): NLL of the expert tokens, averaged as il_aggregation says:
token_mean -sum_{t in expert} l_t / #expert, or sample_mean -(1/N) sum_i (1/n_i) sum_{t in expert_i} l_t."""

from __future__ import annotations

import jax

from ipa_jax.objectives import imitation as nll
from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.terms.registry import ObjectiveTerm, TermBatch, TermMasks, register_term


def imitation(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """(numerator, denominator) of the expert tokens' NLL at config.il_aggregation. [B, T] -> scalars."""
    if config.il_aggregation == "token_mean":
        return nll.imitation_term(batch.log_probs, batch.masks.expert)
    return nll.imitation_sample_mean(batch.log_probs, batch.masks.expert, batch.masks.sequences)


def imitation_denominator(masks: TermMasks, config: ObjectiveConfig) -> jax.Array:
    return nll.imitation_denominator(masks.expert, config.il_aggregation, masks.sequences)


register_term(ObjectiveTerm("il", "il_weight", imitation, imitation_denominator, always=True))
