"""Ablation (long horizon): FlashREINFORCE's objective (flash_reinforce.py: batch-centred rewards, detached token
ratio, sequence trust region 3e-3, sample-mean aggregation, no IL) on the long-horizon base, at the RL learning rate
of the configs with negatives (common_negatives.py). Here failures range from one turn to the whole 9-turn budget,
so failed episodes of very different lengths carry negative advantages: the situation sample-mean aggregation is
meant for. Compare with longhorizon_flash_token_mean.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config
from ipa_jax.pipeline.config import OBJECTIVE_FIELDS


def get_config():
    c = load_config(Path(__file__).with_name("longhorizon_common.py"))
    c.train.name = "longhorizon_flash_reinforce"
    c.optimizer.lr = load_config(Path(__file__).with_name("common_negatives.py")).optimizer.lr
    c.objective.preset = "flash_reinforce"
    for name in OBJECTIVE_FIELDS:  # drop the base's per-field overrides: the preset's values apply
        c.objective[name] = None
    return c
