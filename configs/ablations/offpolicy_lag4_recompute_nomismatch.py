"""Ablation (off-policy correction): offpolicy_lag4_recompute.py without the mismatch correction.

objective.mismatch_level = "none": stale samples with no off-policy correction at all."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("offpolicy_lag4_recompute.py"))
    c.train.name = "offpolicy_lag4_recompute_nomismatch"
    c.objective.mismatch_level = "none"
    return c
