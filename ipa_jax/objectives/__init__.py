"""Pure jnp objectives for IPA and FlashREINFORCE: every part of docs/design.md "The objective", switchable from an
ObjectiveConfig, each function jit-compatible on [B, T] arrays (float32 compute; float64 stays float64), with one
sequence per row or several in packed rows (segment ids, objectives/sequences.py)."""

from ipa_jax.objectives.advantages import compute_advantages, negative_rows
from ipa_jax.objectives.aggregation import aggregate, aggregation_weights, kept_row_scale
from ipa_jax.objectives.chunks import chunk_mean, chunk_sum, num_chunks
from ipa_jax.objectives.composed import (
    combine_terms,
    estimate_advantages,
    estimate_return_baselines,
    objective_terms,
    penalty_sequence_kl,
    policy_loss,
    term_denominators,
    term_losses,
)
from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.credit import (
    baselined_returns,
    branch_credit,
    credit_returns,
    return_baselines,
    scored_units,
)
from ipa_jax.objectives.imitation import imitation_term
from ipa_jax.objectives.masks import entropy_filter_mask, mismatch_mask, probability_difference_mask
from ipa_jax.objectives.overlong import loss_action_mask, overlong_penalty, shaped_rewards
from ipa_jax.objectives.presets import (
    PRESETS,
    dr_grpo_config,
    flash_reinforce_config,
    flash_reinforce_loss,
    grpo_config,
    ipa_config,
    ipa_loss,
    ipa_roll_config,
    ipa_seed_config,
    ppo_dual_clip_config,
    reinforce_pp_config,
    rloo_config,
)
from ipa_jax.objectives.ratios import importance_weights, level_log_ratio, level_mean
from ipa_jax.objectives.sequences import Sequences, sequences_of
from ipa_jax.objectives.surrogates import ppo_clipped_loss
from ipa_jax.objectives.trust_region import bernoulli_kl, chunk_divergence, sequence_divergence
from ipa_jax.objectives.validation import validate_objective_inputs

__all__ = [
    "ObjectiveConfig",
    "PRESETS",
    "Sequences",
    "aggregate",
    "aggregation_weights",
    "baselined_returns",
    "bernoulli_kl",
    "branch_credit",
    "chunk_divergence",
    "chunk_mean",
    "chunk_sum",
    "combine_terms",
    "compute_advantages",
    "credit_returns",
    "dr_grpo_config",
    "entropy_filter_mask",
    "estimate_advantages",
    "estimate_return_baselines",
    "flash_reinforce_config",
    "flash_reinforce_loss",
    "grpo_config",
    "imitation_term",
    "importance_weights",
    "ipa_config",
    "ipa_loss",
    "ipa_roll_config",
    "ipa_seed_config",
    "kept_row_scale",
    "level_log_ratio",
    "level_mean",
    "loss_action_mask",
    "mismatch_mask",
    "negative_rows",
    "num_chunks",
    "objective_terms",
    "overlong_penalty",
    "penalty_sequence_kl",
    "policy_loss",
    "ppo_clipped_loss",
    "ppo_dual_clip_config",
    "probability_difference_mask",
    "reinforce_pp_config",
    "return_baselines",
    "rloo_config",
    "scored_units",
    "sequence_divergence",
    "sequences_of",
    "shaped_rewards",
    "term_denominators",
    "term_losses",
    "validate_objective_inputs",
]
