"""Ablation (baselines): GRPO as published on the group base of grpo.py (4 samples per task): the group mean and
std normalisation, A_i = (R_i - mean) / (std + eps) for every token, PPO's clipped surrogate of current / old
(recomputed) log-probs, each trajectory's token mean (objective preset "grpo", docs/objectives.md)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("grpo.py"))
    c.train.name = "estimator_grpo"
    c.objective.preset = "grpo"
    return c
