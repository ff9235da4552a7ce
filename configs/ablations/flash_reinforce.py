"""Ablation: the FlashREINFORCE objective preset (batch baseline, trajectory credit, detached token ratio, sequence
trust region 3e-3, sample mean, no IL) in place of IPA's, on the negatives' base (common_negatives.py and its RL
learning rate, 2e-4: see `--preset=flash_lr`). The base of FlashREINFORCE's own ablations (flash_*.py), each of which
changes one of its parts."""

from pathlib import Path

from ipa_jax.pipeline import load_config
from ipa_jax.pipeline.config import OBJECTIVE_FIELDS


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "flash_reinforce"
    c.objective.preset = "flash_reinforce"
    for name in OBJECTIVE_FIELDS:  # drop the base's per-field overrides: the preset's values apply
        c.objective[name] = None
    return c
