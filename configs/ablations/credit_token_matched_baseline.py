"""Ablation: credit_token_matched.py with credit_chunk_baseline.py's change (common_negatives.py's batch-mean baseline
and RL lr 2e-4, the baseline subtracted after discounting: objective.baseline_stage = "return"): A_{i,t} = G_{i,t} - b,
b the batch mean of the discounted returns G over the action tokens, so a success's early tokens can fall below it.
Compare with the other credit_*_baseline.py arms, the same change from the same base."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("credit_token_matched.py"))
    c.train.name = "credit_token_matched_baseline"
    base = load_config(Path(__file__).with_name("common_negatives.py"))
    c.objective.baseline = base.objective.baseline
    c.objective.baseline_stage = "return"
    c.optimizer.lr = base.optimizer.lr
    return c
