"""Ablation: chunk-return discount gamma = 0.8 (the base uses IPA's 0.95)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "gamma_0_8"
    c.objective.gamma = 0.8
    return c
