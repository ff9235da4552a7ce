"""Ablation (staleness): the learner trains on trajectories sampled by the policy 4 updates old
(queue.forced_lag = 4), no trust region. Compare with lag4_tr.py."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "lag4"
    c.queue.max_policy_lag += 4  # the base's admission slack on top of the forced lag
    c.queue.forced_lag = 4
    return c
