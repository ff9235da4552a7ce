"""Ablation: no trust region (the base's IPA setting, explicit)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "tr_none"
    c.objective.trust_region_level = "none"
    return c
