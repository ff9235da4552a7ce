"""Chunk-level initialized resampling on the hard task: the common base (plain RL from the start state).

The comparison (issue 8): plain RL, sequential rollback, parallel initialization, each with and without the
IL fallback, the same number of updates, held-out success from the start state (no prefill). Start from the
quickstart's policy (its run exports it to runs/quickstart/hf):

    python experiments/train.py --config=configs/quickstart.py
    python experiments/ablate.py --seeds=0 --out=runs/ablations/resample --configs=configs/resample_plain.py,\
configs/resample_plain_il.py,configs/resample_rollback.py,configs/resample_rollback_il.py,\
configs/resample_parallel.py,configs/resample_parallel_il.py

The hard task: the quickstart's calculator with three operations instead of two, so three chained calls, each
copying the previous result. The quickstart's policy has only seen two calls then an answer, so from the start
state it almost never succeeds (it answers after the second call); from an expert prefix with two or three
calls made, the tail is one call and/or one answer away. (With four operations, 40 updates left every config
at 0-3%: README, "Initialized resampling".)
"""

from configs.quickstart import get_config as quickstart_config

QUICKSTART_RUN = "runs/quickstart"


def get_config():
    c = quickstart_config()
    c.model.path = f"{QUICKSTART_RUN}/hf"
    c.model.tokenizer = f"{QUICKSTART_RUN}/tokenizer"
    c.env.kwargs.ops = 3
    c.rollout.max_turns = 5  # three calls, the answer, one spare turn
    c.train.name = "resample_plain"
    c.train.il_warmup_steps = 0  # the quickstart's policy is the start
    c.train.steps = 80
    c.train.eval_every = 10
    c.train.eval_episodes = 64
    c.resample.mode = "none"  # every episode from the start state
    c.resample.samples_per_anchor = 4
    c.resample.tasks_per_round = 4
    c.resample.window = 8
    c.resample.il_fallback = False
    return c
