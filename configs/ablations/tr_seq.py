"""Ablation: sequence trust region on: admit a trajectory iff its mean Bernoulli-KL proxy <= 3e-3."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "tr_seq"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 3e-3
    return c
