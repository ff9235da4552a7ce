"""Ablation (reference KL, loss term): common.py with the KL term against the frozen reference policy,
objective.kl_weight = 0.04 with the k3 estimator (GRPO's setting: beta = 0.04, k3 in the loss). The reference is
the policy when RL begins (model.reference = "rl_start"): the IL warm start's result, as the SFT model is in GRPO.
Compare with common.py (no KL) and kl_penalty.py (the KL in the reward instead)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "kl_loss"
    c.model.reference = "rl_start"
    c.objective.kl_weight = 0.04
    c.objective.kl_estimator = "k3"
    return c
