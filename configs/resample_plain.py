"""Chunk-level initialized resampling on the hard task: the common base (plain RL from the start state).

The comparison: plain RL, sequential rollback, parallel initialization, each with and without the
IL fallback, the same number of updates, held-out success from the start state (no prefill), beside an
imitation-only reference (configs/resample_il_only.py). Start from the quickstart's policy (its run exports it
to runs/quickstart/hf):

    python experiments/train.py --config=configs/quickstart.py
    python experiments/ablate.py --seeds=0 --out=runs/ablations/resample --configs=configs/resample_il_only.py,\
configs/resample_plain.py,configs/resample_plain_il.py,configs/resample_rollback.py,\
configs/resample_rollback_il.py,configs/resample_parallel.py,configs/resample_parallel_il.py

The hard task: the quickstart's calculator with three operations instead of two, so three chained calls, each
copying the previous result. Where the quickstart's policy fails (`python experiments/forks.py
--config=configs/resample_plain.py`): from the start state and after one or two expert calls it almost never
succeeds (its first call on the unseen "((a op b) op c) op d" prompt is malformed), after all three it answers
right ~20% of the time: the decisive chunks are the calls themselves, so until imitation has taught them there
is nothing for RL to reinforce.
"""

from pathlib import Path

from ipa_jax.pipeline import load_config

QUICKSTART_RUN = "runs/quickstart"


def get_config():
    c = load_config(Path(__file__).with_name("quickstart.py"))
    c.model.path = f"{QUICKSTART_RUN}/hf"
    c.model.tokenizer = f"{QUICKSTART_RUN}/tokenizer"
    c.env.kwargs.ops = 3
    c.rollout.max_turns = 5  # three calls, the answer, one spare turn
    c.train.name = "resample_plain"
    c.train.il_warmup_steps = 0  # the quickstart's policy is the start
    c.train.steps = 200
    c.train.eval_every = 25
    c.train.eval_episodes = 64
    # The quickstart's imitation rate: until a task is solved at some anchor, imitation (the IL fallback) is
    # the only signal, and at the quickstart's RL rate (1e-3) 60 updates of it left greedy success at 0-3%.
    c.optimizer.lr = 3e-3
    c.resample.mode = "none"  # every episode from the start state
    c.resample.samples_per_anchor = 4
    c.resample.tasks_per_round = 4
    # 128 training tasks (each visited ~5 times in 200 updates): the IL fallback imitates these tasks' experts
    # only, so more tasks give more varied imitation data (the IL-only reference sees a fresh task in every
    # row); a window of one visit's 4 samples lets rollback move once per visit.
    c.resample.num_tasks = 128
    c.resample.window = 4
    c.resample.il_fallback = False
    c.resample.il_samples = 4  # with the fallback: 4 expert carriers per failed task, as many as its samples
    return c
