"""Ablation: no baseline, A_i = R_i (IPA as published and the base's setting, explicit;
with 0/1 rewards no advantage is negative)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "baseline_none"
    c.objective.baseline = "none"
    return c
