"""Ablation: trajectory credit (FlashREINFORCE): G = A_i on every action token."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "credit_trajectory"
    c.objective.credit = "trajectory"
    return c
