"""Ablation: sample-mean aggregation: (1/B) sum_i (1/T_i) sum_t (every trajectory weighs 1/B)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "agg_sample_mean"
    c.objective.aggregation = "sample_mean"
    return c
