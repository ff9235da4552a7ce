"""Ablation (FlashREINFORCE): flash_reinforce.py without the sequence trust region (every trajectory admitted)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_reinforce.py"))
    c.train.name = "flash_tr_off"
    c.objective.trust_region_level = "none"
    return c
