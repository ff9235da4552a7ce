"""The reference KL against the policy at RL's start, as GRPO's loss term (k3, 0.04) or the PPO-RLHF reward
penalty (k1, 0.01), against IPA without it. Claim: a KL anchor slows the RL phase's gain (arm - reference lower)."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("credit_chunk", "kl_loss", "kl_penalty"), seeds=(0, 1, 2), claim="lower")
