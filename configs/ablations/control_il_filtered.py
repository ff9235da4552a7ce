"""Control: filtered imitation. control_il_continue_matched.py imitating only the expert episodes that succeed
(rollout.expert_successes_only): with env.expert_error > 0 the mistaken demonstrations are left out, the reward
used as a filter instead of a gradient weight. Identical to control_il_continue_matched.py at expert_error 0. The
warm start is the same (it imitates every demonstration)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("control_il_continue_matched.py"))
    c.train.name = "control_il_filtered"
    c.rollout.expert_successes_only = True
    return c
