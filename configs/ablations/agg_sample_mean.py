"""Ablation: sample-mean aggregation: (1/B) sum_i (1/T_i) sum_t (every trajectory weighs 1/B)."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "agg_sample_mean"
    c.objective.aggregation = "sample_mean"
    return c
