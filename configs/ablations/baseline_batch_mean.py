"""Ablation: batch-mean baseline A_i = R_i - mean_B(R) (at the base's RL lr;
see common_negatives.py)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "baseline_batch_mean"
    c.objective.baseline = "batch_mean"
    return c
