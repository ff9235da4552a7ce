"""Ablation: negatives-only truncation on (TOPR): negatives weighted by min(rho, 1), positives plain."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "trunc_neg_on"
    c.objective.is_apply_to = "negatives"
    c.objective.is_clip_max = 1.0
    return c
