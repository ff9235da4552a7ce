"""Ablation (long horizon): credit_token_matched.py on the long-horizon base, matched to its successes' counts.
g = gamma^((K-1)/(n-(m+1)/2)) (credit_token_matched.py derives it) = 0.95^(6/106) = 0.99710 at K = 7 chunks, n = 116
action tokens, m = 19 in chunk 0 (every success of the base's kv_chain: six calls of 19 tokens, a 2-token answer)."""

from pathlib import Path

from ipa_jax.objectives.credit import matched_token_gamma
from ipa_jax.pipeline import load_config, validate

CHUNKS, ACTION_TOKENS, FIRST_CHUNK_TOKENS = 7, 116, 19


def get_config():
    c = load_config(Path(__file__).with_name("longhorizon_common.py"))
    chunk_gamma = validate(c).objective.gamma  # the base's (the ipa preset's 0.95)
    c.train.name = "longhorizon_credit_token_matched"
    c.objective.credit = "token"
    c.objective.gamma = matched_token_gamma(chunk_gamma, CHUNKS, ACTION_TOKENS, FIRST_CHUNK_TOKENS)
    return c
