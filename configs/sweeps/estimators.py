"""The baselines papers report, on one group base (4 samples per task): IPA's objective with a group-mean baseline
(grpo.py) against GRPO, Dr.GRPO and RLOO as published (docs/objectives.md)."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("grpo", "estimator_grpo", "estimator_dr_grpo", "estimator_rloo"), seeds=(0, 1, 2))
