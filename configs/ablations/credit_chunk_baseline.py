"""Ablation: credit_chunk.py with a batch-mean baseline (common_negatives.py: A_i = R_i - mean_B(R), RL lr
2e-4), so failed episodes get negative credit and the credit assignment is tested on both signs (without a baseline
only successes carry gradient). Compare with the other credit_*_baseline.py arms, the same change from the same base.
The baseline is subtracted before discounting, so the chunks of one episode still share its sign."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("credit_chunk.py"))
    c.train.name = "credit_chunk_baseline"
    base = load_config(Path(__file__).with_name("common_negatives.py"))
    c.objective.baseline = base.objective.baseline
    c.optimizer.lr = base.optimizer.lr
    return c
