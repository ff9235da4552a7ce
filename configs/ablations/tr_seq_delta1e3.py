"""Ablation: sequence trust region, tighter delta = 1e-3 (FlashREINFORCE 7B tool / ALFWorld)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "tr_seq_delta1e3"
    c.objective.trust_region_level = "sequence"
    c.objective.trust_region_delta = 1e-3
    return c
