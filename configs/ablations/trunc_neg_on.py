"""Ablation: negatives-only truncation on (TOPR): negatives weighted by min(rho, 1), positives plain. On
common_negatives.py (batch-mean baseline, so negatives exist)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "trunc_neg_on"
    c.objective.is_apply_to = "negatives"
    c.objective.is_clip_max = 1.0
    return c
