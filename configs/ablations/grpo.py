"""Ablation: GRPO-style group baseline: 4 samples per task (the same batch of 16 trajectories = 4 tasks x 4),
A_i = R_i - mean of its group's rewards, on the negatives' base (common_negatives.py: batch-mean baseline replaced,
its learning rate kept: the one stable once failures carry negative advantages)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "grpo"
    c.rollout.group_size = 4
    c.objective.baseline = "group_mean"
    return c
