"""Ablation: negatives-only truncation on (TOPR): negatives weighted by min(rho, 1), positives plain. On
common_negatives.py (batch-mean baseline, so negatives exist)."""

from configs.ablations.common_negatives import get_config as negatives_config


def get_config():
    c = negatives_config()
    c.train.name = "trunc_neg_on"
    c.objective.is_apply_to = "negatives"
    c.objective.is_clip_max = 1.0
    return c
