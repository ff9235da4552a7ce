"""Ablation: sequence trust region on: admit a trajectory iff its mean Bernoulli-KL proxy <= 3e-3."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "tr_seq"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 3e-3
    return c
