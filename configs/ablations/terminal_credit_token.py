"""Ablation (terminal easy tier): token credit: G_{i,t} = gamma^(n-1-j) A_i per action token."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("terminal_common.py"))
    c.train.name = "terminal_credit_token"
    c.objective.credit = "token"
    return c
