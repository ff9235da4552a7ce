"""Chunk-level initialized resampling on the hard task: the common base (plain RL from the start state).

The comparison (issue 8): plain RL, sequential rollback, parallel initialization, each with and without the
IL fallback, the same number of updates, held-out success from the start state (no prefill):

    for c in plain plain_il rollback rollback_il parallel parallel_il; do
        python experiments/train.py --config=configs/resample_$c.py; done

`lookup_hard`: five chained lookups, so a cold-start policy almost never gets every hop right while an
expert prefix makes the tail reachable. Needs the `resample` section (ipa_jax.rollout.resample.ResampleConfig
fields) in ipa_jax.config.base_config and online training in experiments/train.py.
"""

from configs.base import get_config as base_config


def get_config():
    c = base_config()
    c.env.name = "lookup_hard"
    c.rollout.max_new_tokens = 64
    c.rollout.max_turns = 8
    c.rollout.max_context = 1024
    c.train.name = "resample_plain"
    c.train.steps = 200
    c.train.batch_size = 16
    c.train.eval_every = 20
    c.train.eval_episodes = 64
    c.objective.preset = "ipa"
    c.resample.mode = "none"  # every episode from the start state
    c.resample.samples_per_anchor = 4
    c.resample.tasks_per_round = 4
    c.resample.window = 8
    c.resample.il_fallback = False
    return c
