"""Ablation (off-policy correction): offpolicy_lag0.py on trajectories of the policy 4 updates old (lockstep lag 4)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("offpolicy_lag0.py"))
    c.train.name = "offpolicy_lag4"
    c.queue.max_policy_lag = 4
    return c
