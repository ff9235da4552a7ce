"""The base of the configs with negative advantages (IPA's negative branch: is_*.py, trunc_neg_*.py; GRPO-style groups:
grpo.py; FlashREINFORCE: flash_*.py): common.py with a batch-mean baseline (failures get A < 0), at the RL learning
rate fixed for them all, 2e-4. At the common 1e-3 the failures' negative gradients collapse this tiny policy within
~40 updates; at 4e-4 FlashREINFORCE's objective broke down on 2 of 4 seeds (and 2 of 10 runs of its ablations
collapsed); at 2e-4 none of the 12 runs of it and its trust-region and aggregation ablations ended below its warm
start (`--preset=flash_lr`, README: Results). Not a proof of stability: from other warm starts one seed collapsed."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "ablation_negatives_base"
    c.objective.baseline = "batch_mean"
    c.optimizer.lr = 2e-4
    return c
