"""Ablation (off-policy correction, reference): common_negatives.py restated: lag 0, behaviour ratio, mismatch mask.

No forced lag, one ratio against the behaviour log-probs (objective.old_logprobs = "behavior"), IPA's chunk mismatch
mask [0, 5]. The offpolicy_* arms cross the lag 0 / 4 (lockstep: queue.max_policy_lag), the mismatch correction on / off
(objective.mismatch_level) and the old log-probs behaviour / recompute (docs/off_policy.md). They start from
common_negatives.py: with one update per batch the recomputed old log-probs equal the current ones, so "recompute"
only removes TOPR's truncation of the negatives' ratio, and under common.py (0/1 rewards, no baseline) no row is
negative: the two would be one objective.
"""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common_negatives.py"))
    c.train.name = "offpolicy_lag0"
    c.queue.max_policy_lag = 0  # every batch from the current weights
    return c
