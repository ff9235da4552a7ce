"""Chunk vs token credit, 2 seeds: a sweep that finishes on 2 CPU cores in < 1 h."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(configs=("credit_chunk", "credit_token"), seeds=(0, 1), claim="lower")
