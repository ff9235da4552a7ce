"""Ablation (learning rate of the objectives with negatives): flash_reinforce.py at an RL learning rate of 1e-4
instead of the negatives' base rate (common_negatives.py: 2e-4); preset flash_lr compares the rates."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_reinforce.py"))
    c.train.name = "flash_lr1e4"
    c.optimizer.lr = 1e-4
    return c
