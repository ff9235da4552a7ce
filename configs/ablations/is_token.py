"""Ablation: importance-ratio level 'token' (rho applied as in the base: negatives only, truncated at 1)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "is_token"
    c.objective.is_level = "token"
    return c
