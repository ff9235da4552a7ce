"""Ablation: negatives-only truncation off: negatives weighted by the untruncated ratio rho."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "trunc_neg_off"
    c.objective.is_clip_max = float("inf")
    return c
