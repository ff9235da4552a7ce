"""Ablation: chunk-mean aggregation: (1/B) sum_i (1/K_i) sum_k mean over chunk k's tokens."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "agg_chunk_mean"
    c.objective.aggregation = "chunk_mean"
    return c
