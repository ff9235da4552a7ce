"""Ablation (FlashREINFORCE, staleness): flash_reinforce.py on trajectories sampled by the policy 4 updates old
(lockstep: every batch from the weights of 4 updates before, queue.max_policy_lag = 4),
its sequence trust region on. Compare with flash_lag4_tr_off.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_reinforce.py"))
    c.train.name = "flash_lag4"
    c.queue.max_policy_lag = 4
    return c
