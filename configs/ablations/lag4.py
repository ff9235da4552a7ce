"""Ablation (staleness): the learner trains on trajectories sampled by the policy 4 updates old
(lockstep: every batch from the weights of 4 updates before, queue.max_policy_lag = 4),
no trust region. Compare with lag4_tr.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "lag4"
    c.queue.max_policy_lag = 4
    return c
