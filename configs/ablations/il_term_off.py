"""Ablation (IL term, reference): rollouts through the resampling source in plain mode (every episode from the
start state, resample.mode = "none"), no imitation fallback. Compare with il_term_on.py.

With the plain rollout queue the RL batches hold no expert tokens, so the IL term has nothing to act on; it
acts where the IL fallback adds expert-prefixed episodes (tasks on which every sample failed)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "il_term_off"
    c.rollout.source = "resample"
    c.resample.mode = "none"
    c.resample.il_fallback = False
    c.objective.il_weight = 0.0
    return c
