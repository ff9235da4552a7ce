"""Ablation: negatives-only truncation off: negatives weighted by the untruncated ratio rho. On
common_negatives.py (batch-mean baseline, so negatives exist)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "trunc_neg_off"
    c.objective.is_clip_max = float("inf")
    return c
