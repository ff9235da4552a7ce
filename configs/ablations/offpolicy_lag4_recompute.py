"""Ablation (off-policy correction): offpolicy_lag4.py with recomputed old log-probs (old_logprobs "recompute").

ROLL's split: the mismatch mask on old / behaviour then holds the whole 4-update staleness, TOPR's truncation acts
on current / old (1 with one update per batch)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("offpolicy_lag4.py"))
    c.train.name = "offpolicy_lag4_recompute"
    c.objective.old_logprobs = "recompute"
    return c
