"""Ablation: token credit, its discount g matched so that chunk 0 gets the mean weight chunk credit gives it.
Chunk credit gives chunk 0 gamma^(K-1); token credit gives its m tokens (1/m) sum_{j<m} g^(n-1-j) ~ g^(n-(m+1)/2), so
g = gamma^((K-1)/(n-(m+1)/2)) = 0.95^(2/47) = 0.99782 at the quickstart's successes (K = 3, n = 62, m = 29: medians).

K chunks, n action tokens, m of them in chunk 0. credit_token.py (gamma 0.95) gives chunk 0 ~0.10 instead of 0.90:
this arm separates where the credit goes (per token or per chunk) from how much the early turns are discounted.
Only successes carry gradient (no baseline), hence their counts; tests/pipeline/test_pipeline_controls.py measures
them on the quickstart's expert episodes (a success writes the same turns) and checks the match with credit_returns.
"""

from pathlib import Path

from ipa_jax.objectives.credit import matched_token_gamma
from ipa_jax.pipeline import load_config, validate

CHUNKS, ACTION_TOKENS, FIRST_CHUNK_TOKENS = 3, 62, 29


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    chunk_gamma = validate(c).objective.gamma  # the base's (the ipa preset's 0.95)
    c.train.name = "credit_token_matched"
    c.objective.credit = "token"
    c.objective.gamma = matched_token_gamma(chunk_gamma, CHUNKS, ACTION_TOKENS, FIRST_CHUNK_TOKENS)
    return c
