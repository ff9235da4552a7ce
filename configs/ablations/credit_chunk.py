"""Ablation: chunk credit (IPA): G_{i,k} = gamma^(K_i-1-k) A_i shared by every token of chunk k."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "credit_chunk"
    c.objective.credit = "chunk"
    return c
