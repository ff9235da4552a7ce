"""Ablation: sequence trust region, tighter delta = 1e-3 (FlashREINFORCE 7B tool / ALFWorld)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "tr_seq_delta1e3"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 1e-3
    return c
