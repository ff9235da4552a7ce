"""Ablation (staleness): the learner trains on trajectories sampled by the policy 8 updates old
(lockstep: every batch from the weights of 8 updates before, queue.max_policy_lag = 8),
no trust region. Compare with lag8_tr.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "lag8"
    c.queue.max_policy_lag = 8
    return c
