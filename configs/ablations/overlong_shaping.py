"""Ablation: DAPO's soft overlong punishment on the common base: episodes of more than 64 action tokens lose up to
1 reward linearly until 96 (the quickstart's 3 turns of 32 tokens), -1 beyond (objective.overlong_max_length 96,
overlong_buffer_length 32)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "overlong_shaping"
    c.objective.overlong_max_length = 96
    c.objective.overlong_buffer_length = 32
    return c
