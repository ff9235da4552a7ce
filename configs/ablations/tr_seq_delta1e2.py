"""Ablation: sequence trust region, looser delta = 1e-2."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "tr_seq_delta1e2"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 1e-2
    return c
