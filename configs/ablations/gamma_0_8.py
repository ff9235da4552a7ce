"""Ablation: chunk-return discount gamma = 0.8 (the base uses IPA's 0.95)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "gamma_0_8"
    c.objective.gamma = 0.8
    return c
