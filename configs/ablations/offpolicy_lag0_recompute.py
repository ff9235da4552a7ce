"""Ablation (off-policy correction): offpolicy_lag0.py with recomputed old log-probs (old_logprobs "recompute").

ROLL's split: TOPR's truncation acts on current / old (1 with one update per batch), the mismatch mask on
old / behaviour."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("offpolicy_lag0.py"))
    c.train.name = "offpolicy_lag0_recompute"
    c.objective.old_logprobs = "recompute"
    return c
