"""Ablation (FlashREINFORCE): flash_reinforce.py with token-mean aggregation in place of the sample mean (long
trajectories, failed ones included, weigh in proportion to their length)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_reinforce.py"))
    c.train.name = "flash_token_mean"
    c.objective.aggregation = "token_mean"
    return c
