"""Ablation: token-mean aggregation: sum over all action tokens / sum_i T_i (long episodes weigh more)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "agg_token_mean"
    c.objective.aggregation = "token_mean"
    return c
