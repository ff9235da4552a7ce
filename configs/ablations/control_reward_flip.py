"""Positive control (graded): credit_chunk.py with a share of the RL phase's rewards flipped
(train.reward_flip_fraction: R -> 1 - R on the trajectories a hash of their uid picks), a harm of adjustable size:
the fraction sets how large an effect the table is asked to find (aim it at about -5 points of held-out success with
a pilot run; 0.25 is a first guess, not yet measured)."""

from pathlib import Path

from ipa_jax.pipeline import load_config

REWARD_FLIP_FRACTION = 0.25


def get_config():
    c = load_config(Path(__file__).with_name("credit_chunk.py"))
    c.train.name = "control_reward_flip"
    c.train.reward_flip_fraction = REWARD_FLIP_FRACTION
    return c
