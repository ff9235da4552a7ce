"""Pilot arm (docs/statistics.md, common random numbers): credit_token.py with the episode keys of another rollout seed
(rollout.seed_offset, as control_aa.py). Its difference from credit_chunk shares the warm start and the tasks but
not the keys; credit_token's shares all three: the spread of the two over seeds is what shared keys save."""

from pathlib import Path

from ipa_jax.pipeline import load_config

AA_SEED_OFFSET = 1_000  # control_aa.py's


def get_config():
    c = load_config(Path(__file__).with_name("credit_token.py"))
    c.train.name = "credit_token_other_keys"
    c.rollout.seed_offset = AA_SEED_OFFSET
    return c
