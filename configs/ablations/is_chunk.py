"""Ablation: importance-ratio level 'chunk' (rho on negatives only, truncated at 1, as in IPA;
on common_negatives.py: batch-mean baseline, so negatives exist)."""

from configs.ablations.common_negatives import get_config as negatives_config


def get_config():
    c = negatives_config()
    c.train.name = "is_chunk"
    c.objective.is_level = "chunk"
    return c
