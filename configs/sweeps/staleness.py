"""FlashREINFORCE's claim: the sequence trust region keeps stale updates stable."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("lag4", "lag4_tr", "lag8", "lag8_tr"), seeds=(0, 1, 2))
