"""FlashREINFORCE's claim: sample-mean beats token-mean aggregation."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("agg_sample_mean", "agg_token_mean", "agg_chunk_mean"), seeds=(0, 1, 2), claim="lower")
