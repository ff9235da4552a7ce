"""IPA's negative branch (batch-mean baseline): its chunk-level ratio on negatives, truncated at 1, against no ratio,
token- and sequence-level ratios, and no truncation."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("is_chunk", "is_none", "is_token", "is_sequence", "trunc_neg_off"), seeds=(0, 1, 2, 3), claim="lower"
    )
