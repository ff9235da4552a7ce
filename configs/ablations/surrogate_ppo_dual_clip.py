"""Ablation (baselines): PPO's clipped surrogate with dual clip (c = 3) on the negatives' base (its batch-mean
baseline: no critic here), ratio current / old (recomputed), token mean (objective preset "ppo_dual_clip")."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "surrogate_ppo_dual_clip"
    c.objective.preset = "ppo_dual_clip"
    return c
