"""Ablation (terminal easy tier): chunk credit (IPA), the base's own: each command's chunk credited
G_{i,k} = gamma^(K_i-1-k) A_i."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("terminal_common.py"))
    c.train.name = "terminal_credit_chunk"
    c.objective.credit = "chunk"
    return c
