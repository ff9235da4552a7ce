"""Ablation (baselines): REINFORCE++ on the negatives' base: one sample per task, the outcome reward whitened over
the batch's action tokens, PPO's clipped surrogate, token mean (objective preset "reinforce_pp")."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "estimator_reinforce_pp"
    c.objective.preset = "reinforce_pp"
    c.objective.baseline = "none"  # the base's batch mean would be subtracted twice: the whitening centres
    return c
