"""IPA's claim: chunk-level credit beats token-level (and trajectory-level)."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("credit_chunk", "credit_token", "credit_trajectory"), seeds=(0, 1, 2), claim="lower")
