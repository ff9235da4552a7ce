"""Ablation (long horizon): token-mean aggregation: sum over all action tokens / sum_i T_i (long episodes weigh
more; here failures range from one turn to the whole budget)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("longhorizon_common.py"))
    c.train.name = "longhorizon_agg_token_mean"
    c.objective.aggregation = "token_mean"
    return c
