"""Ablation: importance-ratio level 'none' (rho applied as in the base: negatives only, truncated at 1)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "is_none"
    c.objective.is_level = "none"
    return c
