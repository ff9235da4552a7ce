"""Ablation: negatives-only truncation off: negatives weighted by the untruncated ratio rho. On
common_negatives.py (batch-mean baseline, so negatives exist)."""

from configs.ablations.common_negatives import get_config as negatives_config


def get_config():
    c = negatives_config()
    c.train.name = "trunc_neg_off"
    c.objective.is_clip_max = float("inf")
    return c
