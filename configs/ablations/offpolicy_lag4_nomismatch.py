"""Ablation (off-policy correction): offpolicy_lag4.py without the mismatch correction (mismatch_level "none").

No chunk mask on the current / behaviour ratio; TOPR's truncation of the negatives' ratio stays."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("offpolicy_lag4.py"))
    c.train.name = "offpolicy_lag4_nomismatch"
    c.objective.mismatch_level = "none"
    return c
