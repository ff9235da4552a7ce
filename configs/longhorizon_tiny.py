"""The long-horizon task on the quickstart's model and loop: the tiny Qwen3-MoE follows a chain of keys through a
key-value store (`kv_chain`, docs/environments.md).

    python experiments/train.py --config=configs/longhorizon_tiny.py [--config.train.seed=1]

'Follow "next" from "uma" to the record with a "value". Answer the value.': six `get` calls, each copying a key
out of the previous record past a distractor field ("prev", the previous key) and among four decoy records, then
the value: a success is 7 turns (451 tokens); a failure answers early, writes a broken turn after a wrong key's
error, or wanders through decoys until the 9-turn or 640-token budget. Same model, optimizer and two phases as
configs/quickstart.py: an IL warm start on scripted expert episodes ending on train.il_warmup_target, then IPA on the
policy's own rollouts, then a final evaluation.

Measured (seed 0, 2 loaded CPU cores, 30 min): the warm start ran to its cap (400 steps; copying keys appears at
~200, whole episodes from ~300) and left 50.0% held-out success (5.15 calls per episode); 80 IPA steps moved it to
46.9% (within the ~6-point noise of a difference), sampled training success 23% -> 32%. Held-out successes are all
6 calls and 451 tokens; failures 2-8 calls and 263-640 tokens.
"""

from pathlib import Path

from ml_collections import ConfigDict

from ipa_jax.pipeline import load_config

HOPS, EXTRA_TURNS = 6, 2


def get_config():
    c = load_config(Path(__file__).with_name("quickstart.py"))
    c.model.arch.max_position_embeddings = 1024  # episodes up to rollout.max_context = 640 tokens

    c.env.name = "kv_chain"
    with c.unlocked():
        c.env.kwargs = ConfigDict(dict(hops=HOPS, min_hops=0, distractors=1, decoys=4, extra_turns=EXTRA_TURNS))
    c.rollout.max_turns = HOPS + 1 + EXTRA_TURNS  # the task's own budget: hops calls, the answer, the slack
    # A success is 451 tokens, a failure that uses every turn ~560 (more with error messages); a call turn is 19 tokens.
    c.rollout.max_context = 640
    c.train.buckets = (512, 640)

    c.train.name = "longhorizon_tiny"
    # As the quickstart did: the warm start ends once greedy decoding would reproduce 35% of fresh expert episodes (the
    # mean over 10 batches; single batches reach it from ~320 steps), at most 400 steps; then 80 RL steps.
    c.train.steps = 480
    c.train.il_warmup_steps = 400
    c.train.il_warmup_target = 0.35
    return c
