"""Ablation: branch credit: every token of chunk k gets A_k = V(k+1) - V(k), the Monte Carlo values V of the states
at the episode's chunk boundaries from objective.branch_samples continuations each (rollout/branch.py), in place of
the discounted chunk return gamma^(K_i-1-k) A_i. Costs branch_samples x K_i extra episodes per episode."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "credit_branch"
    c.objective.credit = "branch"
    c.rollout.schedule = "async"  # not lockstep: its continuations are sampled beside the episodes in flight
    return c
