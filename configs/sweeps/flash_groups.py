"""FlashREINFORCE's claim: one rollout per prompt with batch-centred rewards does as well as GRPO-style groups of 4
samples per task with group-mean baselines."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("flash_reinforce", "flash_grpo"), seeds=(0, 1, 2, 3), claim="lower")
