"""Ablation: no imitation warm start (train.il_warmup_steps = 0): RL from the random-init policy."""

from configs.ablations.common import get_config as common_config


def get_config():
    c = common_config()
    c.train.name = "il_warmup_off"
    c.train.il_warmup_steps = 0
    return c
