"""Ablation (long horizon): chunk credit (IPA), the base's own: G_{i,k} = gamma^(K_i-1-k) A_i over the 7 chunks."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("longhorizon_common.py"))
    c.train.name = "longhorizon_credit_chunk"
    c.objective.credit = "chunk"
    return c
