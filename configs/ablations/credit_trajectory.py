"""Ablation: trajectory credit (FlashREINFORCE): G = A_i on every action token."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "credit_trajectory"
    c.objective.credit = "trajectory"
    return c
