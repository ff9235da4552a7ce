"""The common base of every ablation config: the quickstart (configs/quickstart.py) with held-out evaluations
during training, so every run has a success curve. Each ablation file changes ONE thing from here.

    python experiments/train.py --config=configs/ablations/credit_token.py
    python experiments/ablate.py --preset=credit --seeds=0,1,2 --out=ablations/credit

What the quickstart fixes and the ablations inherit: tiny Qwen3-MoE (random init), 2-hop lookup task, embedded
engine, IL warm start (train.il_warmup_steps) then IPA with a batch-mean baseline (rewards are 0/1: with IPA's
published "no baseline" every advantage is >= 0 and the negative branch -- chunk IS ratio on negatives, its
truncation -- never fires; `baseline_none.py` restores the published setting).
"""

from configs.quickstart import get_config as quickstart_config


def get_config():
    c = quickstart_config()
    c.train.name = "ablation_base"
    c.train.eval_every = 30  # held-out success every 30 steps and at the end of the warm start
    return c
