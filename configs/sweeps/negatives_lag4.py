"""The negative branch where its ratios matter: at policy lag ~1 they stay within 4e-4 of 1, so here the sampler is
4 updates behind (lockstep: every batch from the weights of 4 updates before); IPA's chunk-level ratio on negatives,
truncated at 1, against no ratio, no truncation, and token- and sequence-level ratios."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("is_chunk", "is_none", "trunc_neg_off", "is_token", "is_sequence"),
        seeds=(0, 1, 2, 3),
        overrides=(("queue.max_policy_lag", 4),),
        claim="lower",
    )
