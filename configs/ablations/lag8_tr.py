"""Ablation (staleness): lag8.py (policy lag forced to 8) with the sequence trust region on (delta 3e-3),
which should reject the trajectories that drifted too far from the current policy."""

from configs.ablations.lag8 import get_config as lag_config


def get_config():
    c = lag_config()
    c.train.name = "lag8_tr"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 3e-3
    return c
