"""Ablation (staleness): lag4.py (policy lag forced to 4) with the sequence trust region on (delta 3e-3),
which should reject the trajectories that drifted too far from the current policy."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("lag4.py"))
    c.train.name = "lag4_tr"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 3e-3
    return c
