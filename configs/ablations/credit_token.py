"""Ablation: token credit: G_{i,t} = gamma^(n-1-j) A_i per action token (the baseline IPA argues against)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "credit_token"
    c.objective.credit = "token"
    return c
