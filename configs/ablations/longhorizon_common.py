"""The base of the long-horizon ablations: configs/longhorizon_tiny.py (the kv_chain task: six chained `get` calls,
failures from one turn to the whole 9-turn budget) with held-out evaluations during training, as common.py is for
the quickstart. Each longhorizon_*.py changes ONE thing from here, as its namesake does from common.py.

    python experiments/ablate.py --seeds=0,1 --out=ablations/longhorizon --configs=configs/ablations/\
longhorizon_credit_chunk.py,configs/ablations/longhorizon_credit_token.py,configs/ablations/longhorizon_agg_token_mean.py

On the quickstart's task every success has nearly the same length and three chunks; here a success has seven
chunks, so how credit is spread over them (chunk vs token) and how long episodes are weighed (sample- vs token-mean)
have room to matter.
"""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).parent.parent / "longhorizon_tiny.py")
    c.train.name = "longhorizon_base"
    c.train.eval_every = 40  # held-out success at the end of the warm start, then every 40 RL steps
    return c
