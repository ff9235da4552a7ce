"""Ablation: chunk credit (IPA): G_{i,k} = gamma^(K_i-1-k) A_i shared by every token of chunk k."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "credit_chunk"
    c.objective.credit = "chunk"
    return c
