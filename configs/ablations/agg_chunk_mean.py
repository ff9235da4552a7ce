"""Ablation: chunk-mean aggregation: (1/B) sum_i (1/K_i) sum_k mean over chunk k's tokens."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "agg_chunk_mean"
    c.objective.aggregation = "chunk_mean"
    return c
