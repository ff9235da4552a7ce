"""Ablation: importance-ratio level 'token' (rho on negatives only, truncated at 1, as in IPA;
on common_negatives.py: batch-mean baseline, so negatives exist)."""

from configs.ablations.common_negatives import get_config as negatives_config


def get_config():
    c = negatives_config()
    c.train.name = "is_token"
    c.objective.is_level = "token"
    return c
