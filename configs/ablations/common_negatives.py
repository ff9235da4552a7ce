"""The base of the configs with negative advantages (IPA's negative branch: is_*.py, trunc_neg_*.py; GRPO-style groups:
grpo.py; FlashREINFORCE: flash_*.py): common.py with a batch-mean baseline (failures get A < 0), at the RL learning
rate fixed for them all, 2e-4. At the common 1e-3 the failures' negative gradients collapse this tiny policy within
~40 updates; at 4e-4 FlashREINFORCE's objective collapsed on one seed of three, and four of its ablations' twelve
runs (greedy success to near 0); at 2e-4 none of its seeds did (`--preset=flash_lr`, README: Results)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "ablation_negatives_base"
    c.objective.baseline = "batch_mean"
    c.optimizer.lr = 2e-4
    return c
