"""The same at policy lag 8."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("flash_lag8", "flash_lag8_tr_off"), seeds=(0, 1, 2, 3), claim="lower")
