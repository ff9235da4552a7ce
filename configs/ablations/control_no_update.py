"""Control: the RL phase samples, computes its updates and evaluates as credit_chunk.py does, but the weights do not
move, so its evaluation curve is evaluation noise and drift alone (greedy evaluations of unchanged weights differ
only by the engine's batching). optimizer.lr must be > 0: at 1e-30 an AdamW step (|direction| < ~3.2 with the
default betas) is under half an ulp of every float32 weight larger than ~1e-22 in magnitude, so none changes."""

from pathlib import Path

from ipa_jax.pipeline import load_config

NO_UPDATE_LR = 1e-30


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "control_no_update"
    c.optimizer.lr = NO_UPDATE_LR
    return c
