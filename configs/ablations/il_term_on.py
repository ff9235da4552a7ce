"""Ablation (IL term): il_term_off.py plus hybrid IL + RL: where every sample of a task fails, the expert's chunks
become imitation targets, L = lambda_RL L_RL + 0.5 NLL(expert tokens) (resample.il_fallback, objective.il_weight)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("il_term_off.py"))
    c.train.name = "il_term_on"
    c.resample.il_fallback = True
    c.resample.il_whole_episode = True  # mode "none" sees no fork: whole expert episodes, as in the published results
    c.objective.il_weight = 0.5
    return c
