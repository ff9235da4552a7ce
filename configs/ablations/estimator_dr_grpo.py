"""Ablation (baselines): Dr.GRPO against estimator_grpo.py: no std normalisation and no per-trajectory length
normalisation, token sums over a constant (objective preset "dr_grpo"), here the episode's token budget
(rollout.max_context of the quickstart, 448)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("estimator_grpo.py"))
    c.train.name = "estimator_dr_grpo"
    c.objective.preset = "dr_grpo"
    c.objective.norm_length = c.rollout.max_context
    return c
