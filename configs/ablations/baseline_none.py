"""Ablation: no baseline, A_i = R_i (IPA as published and the base's setting, explicit;
with 0/1 rewards no advantage is negative)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "baseline_none"
    c.objective.baseline = "none"
    return c
