"""The base of the configs with negative advantages (IPA's negative branch: is_*.py, trunc_neg_*.py; GRPO-style groups:
grpo.py; FlashREINFORCE: flash_*.py): common.py with a batch-mean baseline (failures get A < 0), at the RL learning
rate fixed for them all. At the common 1e-3 the failures' negative gradients collapse this tiny policy within ~40
updates; `--preset=flash_lr` compares 4e-4 with 1e-4 and 2e-4 on FlashREINFORCE's objective (README, Results)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "ablation_negatives_base"
    c.objective.baseline = "batch_mean"
    c.optimizer.lr = 4e-4
    return c
