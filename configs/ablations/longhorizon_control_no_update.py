"""Control (long horizon): control_no_update.py on the long-horizon base: the RL phase runs, the weights stay (an
optimizer.lr of 1e-30 moves no float32 weight), so its evaluations are evaluation noise and drift alone."""

from pathlib import Path

from ipa_jax.pipeline import load_config

NO_UPDATE_LR = 1e-30


def get_config():
    c = load_config(Path(__file__).with_name("longhorizon_common.py"))
    c.train.name = "longhorizon_control_no_update"
    c.optimizer.lr = NO_UPDATE_LR
    return c
