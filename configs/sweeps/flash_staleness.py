"""FlashREINFORCE's claim: its sequence trust region keeps updates at policy lag 4 stable."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("flash_lag4", "flash_lag4_tr_off"), seeds=(0, 1, 2, 3), claim="lower")
