"""FlashREINFORCE's parts on its own objective (negatives' base): without the sequence trust region, token-mean instead
of sample-mean aggregation; each paired with the full objective."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("flash_reinforce", "flash_tr_off", "flash_token_mean"), seeds=(0, 1, 2, 3), claim="lower")
