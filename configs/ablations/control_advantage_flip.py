"""Positive control (gross): credit_chunk.py with every advantage negated (objective.advantage_sign = -1), so the RL
phase pushes the policy away from its successes: a table that cannot find it significantly worse than credit_chunk
cannot detect anything."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("credit_chunk.py"))
    c.train.name = "control_advantage_flip"
    c.objective.advantage_sign = -1
    return c
