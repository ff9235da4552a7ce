"""Ablation: token-mean aggregation: sum over all action tokens / sum_i T_i (long episodes weigh more)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "agg_token_mean"
    c.objective.aggregation = "token_mean"
    return c
