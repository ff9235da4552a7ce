"""Ablation (FlashREINFORCE, staleness): flash_lag8.py (policy lag forced to 8) without the sequence trust
region: every stale trajectory updates the policy."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_lag8.py"))
    c.train.name = "flash_lag8_tr_off"
    c.objective.trust_region_level = "none"
    return c
