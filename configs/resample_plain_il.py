"""configs/resample_plain.py with the IL fallback: where every sample at an anchor fails, the expert's chunks
up to the fork become imitation targets (lambda_IL = objective.il_weight, lambda_RL = objective.rl_weight)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("resample_plain.py"))
    c.train.name = "resample_plain_il"
    c.resample.il_fallback = True
    c.resample.il_whole_episode = True  # mode "none" sees no fork: whole expert episodes, as in the published results
    c.objective.il_weight = 0.5
    return c
