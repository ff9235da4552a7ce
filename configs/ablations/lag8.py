"""Ablation (staleness): the learner trains on trajectories sampled by the policy 8 updates old
(queue.forced_lag = 8), no trust region. Compare with lag8_tr.py."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "lag8"
    c.queue.max_policy_lag += 8  # the base's admission slack on top of the forced lag
    c.queue.forced_lag = 8
    return c
