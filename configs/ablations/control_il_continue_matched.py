"""Control: imitation continued with everything else IPA's. control_il_continue.py at IPA's RL learning rate
(optimizer.lr, not the warm start's il_lr) and aggregation (the imitation term as a sample mean, each imitated episode
weighing alike, as IPA's sample_mean weighs each sampled one): from the same warm start, the same number of updates
with the same optimizer, it differs from credit_chunk.py in its data alone (fresh expert episodes instead of the
policy's own, rewarded ones)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "control_il_continue_matched"
    c.objective.rl_weight = 0.0
    c.objective.il_weight = 1.0
    c.objective.il_aggregation = "sample_mean"
    return c
