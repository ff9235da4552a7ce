"""Ablation: batch-mean baseline A_i = R_i - mean_B(R) (at the base's RL lr;
see common_negatives.py)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "baseline_batch_mean"
    c.objective.baseline = "batch_mean"
    return c
