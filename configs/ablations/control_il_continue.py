"""Control: the RL phase imitates instead. From the same warm start, the same number of updates, each on a fresh batch
of scripted-expert episodes (rollout.source "auto" resolves to "expert" once objective.rl_weight is 0), the warm
start's own objective (NLL of the expert tokens) at its learning rate (optimizer.il_lr). An RL arm that does not
beat it gains nothing that more imitation would not."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "control_il_continue"
    c.objective.rl_weight = 0.0
    c.objective.il_weight = 1.0
    c.optimizer.lr = c.optimizer.il_lr
    return c
