"""Ablation: no discount, gamma = 1.0 (every chunk gets the full advantage)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "gamma_1_0"
    c.objective.gamma = 1.0
    return c
