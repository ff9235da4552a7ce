"""Terminal tasks on CPU: the quickstart's tiny Qwen3-MoE works in bubblewrap sandboxes on the built-in suite.

    python experiments/train.py --config=configs/terminal_tiny.py

The easy tier of the built-in suite (file and text manipulation, graded by each task's tests); the policy has
the `bash` tool. A tokenizer is built on the expert episodes (the reference solutions, run in the sandbox); an
imitation warm start on them teaches the tool-call format; then IPA on the policy's own episodes, 8 at a time
(their commands run concurrently, off the engine's event loop), and a held-out evaluation. It shows the loop
running end to end on real sandboxes; a policy this small learns little of the shell in a few minutes.
Chunk-level initialized resampling from the reference solutions' states: --config.resample.mode=rollback.
"""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("quickstart.py"))
    c.model.arch.vocab_size = 1024
    c.model.arch.max_position_embeddings = 1024

    c.env.name = "terminal"
    with c.unlocked():
        c.env.kwargs = dict(tiers=("easy",), tools=("bash",), extra_turns=2, observation_chars=200)

    c.rollout.max_new_tokens = 64
    c.rollout.max_turns = 5
    c.rollout.max_context = 1024
    c.rollout.concurrency = 8  # with 16 in flight, batches of 8 left many episodes past max_policy_lag

    c.train.name = "terminal_tiny"
    # The whole warm start (no target): 100 imitation steps teach the tool-call format and the commands' shape;
    # then 10 IPA steps.
    c.train.steps = 110
    c.train.il_warmup_steps = 100
    c.train.il_warmup_target = 0.0
    c.train.batch_size = 8
    c.train.eval_episodes = 32
    c.train.buckets = (512, 1024)
    return c
