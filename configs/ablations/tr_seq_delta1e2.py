"""Ablation: sequence trust region, looser delta = 1e-2."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "tr_seq_delta1e2"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 1e-2
    return c
