"""Ablation: no discount, gamma = 1.0 (every chunk gets the full advantage)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "gamma_1_0"
    c.objective.gamma = 1.0
    return c
