"""The base of the ablations of IPA's negative branch (is_*.py, trunc_neg_*.py): common.py with negative
advantages, i.e. a batch-mean baseline (failures get A < 0), at the RL learning rate that is stable with it (at
the common 1e-3 the failures' negative gradients collapse this tiny policy within ~40 updates)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "ablation_negatives_base"
    c.objective.baseline = "batch_mean"
    c.optimizer.lr = 2e-4
    return c
