"""Ablation (FlashREINFORCE): flash_reinforce.py with the failure-token entropy filter at q = 0.5 (a failed
trajectory's gradient comes from its ceil(0.5 T_i) highest-entropy tokens; q = 1 keeps them all)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_reinforce.py"))
    c.train.name = "flash_entropy_q05"
    c.objective.negative_token_fraction = 0.5
    return c
