"""Ablation (long horizon): longhorizon_flash_reinforce.py with token-mean aggregation in place of the sample mean
(a failure that wanders through the whole budget weighs up to ~5x one that answers at once)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("longhorizon_flash_reinforce.py"))
    c.train.name = "longhorizon_flash_token_mean"
    c.objective.aggregation = "token_mean"
    return c
