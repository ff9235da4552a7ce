"""The RL learning rate of the objectives with negatives (FlashREINFORCE): the base's 2e-4 against 4e-4; how often a
seed's policy collapses, and what each rate learns (flash_lr1e4.py: 1e-4)."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("flash_reinforce", "flash_lr4e4"), seeds=(0, 1, 2, 3), claim="lower")
