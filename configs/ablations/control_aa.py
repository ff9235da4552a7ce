"""Control (A/A): credit_chunk.py again with other rollouts (rollout.seed_offset) from the same warm start and training
seed, so its difference from credit_chunk is run-to-run noise alone: the interval must hold 0 (about 95% of the
time), and its spread is what the table can tell apart."""

from pathlib import Path

from ipa_jax.pipeline import load_config

AA_SEED_OFFSET = 1_000  # far from the seeds a sweep uses, so no arm of another seed samples the same rollouts


def get_config():
    c = load_config(Path(__file__).with_name("credit_chunk.py"))
    c.train.name = "control_aa"
    c.rollout.seed_offset = AA_SEED_OFFSET
    return c
