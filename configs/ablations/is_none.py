"""Ablation: importance-ratio level 'none' (rho on negatives only, truncated at 1, as in IPA;
on common_negatives.py: batch-mean baseline, so negatives exist)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "is_none"
    c.objective.is_level = "none"
    return c
