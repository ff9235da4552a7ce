"""DAPO's claim: dropping the groups whose rewards are all equal and drawing others in their place (dynamic
sampling) does better than training on them, with GRPO-style groups of 4 and a group-mean baseline."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("grpo_dynamic_sampling", "grpo"), seeds=(0, 1, 2, 3), claim="lower")
