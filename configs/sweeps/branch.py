"""Chunk values by branching against IPA's discounted chunk returns: credit_branch (each chunk's Monte Carlo advantage
from continuations at its boundary) paired with credit_chunk, 3 seeds; the claim: branch credit is higher."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("credit_chunk", "credit_branch"), seeds=(0, 1, 2), reference="credit_chunk")
