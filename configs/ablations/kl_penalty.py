"""Ablation (reference KL, reward penalty): common.py with each trajectory's reward lowered by beta times its
summed KL to the frozen reference policy before the advantages, R_i - 0.01 * sum_t k1(b_t, ref_t) (the PPO-RLHF
reward of Ziegler et al. 2019; k1 of the behaviour vs the reference log-probs). The reference is the policy when
RL begins (model.reference = "rl_start"). Compare with common.py and kl_loss.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "kl_penalty"
    c.model.reference = "rl_start"
    c.objective.kl_penalty = 0.01
    c.objective.kl_penalty_estimator = "k1"
    return c
