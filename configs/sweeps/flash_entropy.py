"""FlashREINFORCE's entropy filter: failures keep their 50% highest-entropy tokens (q = 0.5) against all of them."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("flash_reinforce", "flash_entropy_q05"), seeds=(0, 1, 2, 3), claim="lower")
