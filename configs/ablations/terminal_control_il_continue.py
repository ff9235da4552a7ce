"""Control (terminal easy tier): control_il_continue.py on the terminal base: after the same warm start, the same
number of updates on fresh reference-solution episodes (objective.rl_weight 0: rollout.source auto -> expert), the
warm start's objective at its learning rate."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("terminal_common.py"))
    c.train.name = "terminal_control_il_continue"
    c.objective.rl_weight = 0.0
    c.objective.il_weight = 1.0
    c.optimizer.lr = c.optimizer.il_lr
    return c
