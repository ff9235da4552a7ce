"""Ablation: no trust region (the base's IPA setting, explicit)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "tr_none"
    c.objective.trust_region_level = "none"
    return c
