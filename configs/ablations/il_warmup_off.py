"""Ablation: no imitation warm start (train.il_warmup_steps = 0): RL from the random-init policy."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "il_warmup_off"
    c.train.il_warmup_steps = 0
    return c
