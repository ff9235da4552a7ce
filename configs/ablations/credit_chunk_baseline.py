"""Ablation: credit_chunk.py with a batch-mean baseline subtracted after discounting (common_negatives.py's baseline
and RL lr 2e-4; objective.baseline_stage = "return"): A_{i,t} = G_{i,t} - b, G the discounted return of R_i, b the
batch mean of G over the scored units (chunks for chunk credit, action tokens for token credit). Failed episodes get
negative credit, and the units of one episode can differ in sign (a success's early, discounted units below b, its
last above), so the credit assignment itself is tested: with the baseline subtracted before discounting every chunk
of an episode would share the sign of R_i - b. How often a success's unit falls below b depends on gamma, the unit's
position and the success rate (the metric credit_negative_share_success logs it). At the quickstart's median
success (K = 3 chunks, n = 62 action tokens; credit_token_matched.py), with every episode of that shape and a success
rate p: chunk credit puts a success's first chunk below b = p (0.95^2 + 0.95 + 1) / 3 only when p > 0.95, and so
does the matched token discount (p > ~0.93), while token credit at gamma 0.95 (b = 0.31 p) puts the success's tokens
more than ln(0.31 p) / ln(0.95) from its end below b (at p = 0.6: 29 of 62). Compare with the other
credit_*_baseline.py arms, the same change from the same base."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("credit_chunk.py"))
    c.train.name = "credit_chunk_baseline"
    base = load_config(Path(__file__).with_name("common_negatives.py"))
    c.objective.baseline = base.objective.baseline
    c.objective.baseline_stage = "return"
    c.optimizer.lr = base.optimizer.lr
    return c
