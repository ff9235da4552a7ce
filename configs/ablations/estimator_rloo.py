"""Ablation (baselines): RLOO on the group base of grpo.py (4 samples per task): the leave-one-out baseline
A_i = R_i - mean of the other 3 rewards, REINFORCE over the whole trajectory, on policy (objective preset "rloo")."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("grpo.py"))
    c.train.name = "estimator_rloo"
    c.objective.preset = "rloo"
    c.objective.baseline = "rloo"  # grpo.py sets its group mean explicitly
    return c
