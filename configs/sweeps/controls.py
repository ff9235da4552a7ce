"""The table's own checks against credit_chunk (IPA): an A/A rerun with other rollouts (its interval must hold 0), two
positive controls that must come out significantly worse (every advantage negated; a share of the rewards flipped,
a graded harm) and no update (evaluation drift alone); 4 seeds, shared warm starts."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("credit_chunk", "control_aa", "control_advantage_flip", "control_reward_flip", "control_no_update"),
        seeds=(0, 1, 2, 3),
        reference="credit_chunk",
        claim="higher",
        controls=("control_advantage_flip", "control_reward_flip"),
    )
