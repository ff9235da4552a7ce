"""Ablation: token credit: G_{i,t} = gamma^(n-1-j) A_i per action token (the baseline IPA argues against)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "credit_token"
    c.objective.credit = "token"
    return c
