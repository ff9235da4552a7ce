"""The CPU quickstart: a tiny Qwen3-MoE (random init) learns a multi-turn tool task on 2 CPU cores.

    python experiments/train.py --config=configs/quickstart.py [--config.train.seed=1]

A small tokenizer is built and saved to <run_dir>/tokenizer; a short imitation warm start on scripted expert
episodes teaches the tool-call format and part of the copying (it ends on train.il_warmup_target, at most
train.il_warmup_steps); held-out success is measured right after it;
then 60 IPA updates on the policy's own rollouts (embedded engine, lockstep rollouts) and a final evaluation.
The summary (success before -> after, tool calls, steps, time, run folder) is printed and written to
runs/quickstart/summary.json.
"""

from ipa_jax.pipeline import base_config


def get_config():
    c = base_config()
    c.model.arch.update(
        dict(
            vocab_size=640,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            max_position_embeddings=512,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
        )
    )
    # head_dim 128 (Qwen3's): with QK-norm the attention logits are bounded by ~sqrt(head_dim), and copying a
    # number out of the context needs sharp attention; at head_dim 16-32 the warm start stalls before copying.
    c.mesh.data, c.mesh.fsdp = -1, 1

    # "Compute (4 - 2) + 8." through a one-operation calculator: two calls, the second copies the first's result.
    c.env.name = "calculator"
    with c.unlocked():
        c.env.kwargs.ops = 2
        c.env.kwargs.low = 2
        c.env.kwargs.high = 9

    # IPA as published: no baseline, so with 0/1 rewards only successes carry gradient (trust positives). With a
    # batch-mean baseline the failures' negative gradients raise the entropy of this tiny policy until it
    # collapses at any learning rate that learns within the budget (measured: lr 1e-3 collapses in ~40 steps,
    # 2e-4 gains ~6 points in 120).
    c.objective.preset = "ipa"

    # Two phases (ipa_jax.train.optimizer): imitation at il_lr, then RL at lr, each with a 5-step warmup.
    c.optimizer.il_lr = 3e-3
    c.optimizer.lr = 1e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 5
    c.optimizer.weight_decay = 0.0

    c.rollout.temperature = 1.0
    c.rollout.eval_temperature = 0.0
    # Qwen3's non-thinking mode: the generation prompt closes an empty think block, the tiny policy writes the turn.
    c.rollout.enable_thinking = False
    c.rollout.max_new_tokens = 32
    c.rollout.max_turns = 4
    c.rollout.max_context = 448
    c.rollout.concurrency = 16
    # Evaluations as wide as the rollouts: the two engines then share every compiled prefill and decode (at 32 rows
    # they compiled their own: 21 prefill and decode compiles instead of 14, by JAX_LOG_COMPILES=1; the same results).
    c.rollout.eval_concurrency = 16

    c.queue.max_size = 32
    c.queue.max_policy_lag = 2
    # Lockstep rollouts: the batch of RL step t from the weights of step t - 2, its episodes with seeds of (seed, step,
    # episode): the same command gives the same run on any load, and its RL phase took 0.68x async's time here
    # (async drops the episodes that come back too stale; docs/off_policy.md, bench_schedule.py).
    c.rollout.schedule = "lockstep"

    c.train.name = "quickstart"
    # The warm start stops while the copying skills are half learned, leaving RL room: once greedy decoding would
    # reproduce 30% of fresh expert episodes (measured, seeds 0-2: held-out success then 46%, 52%, and 27% for a
    # seed that hit the 360-step cap; 120 RL steps added 27, 11 and 1 points. At 20% RL added 4, 11 and -1 from 35%,
    # 51% and 30%). When copying appears depends on the seed (~130-360 imitation steps), hence a target rather than
    # a step count. Then 60 RL steps (the fixed total: steps - il_warmup_steps): on seed 0, 128 tasks, RL took it
    # from 46.1% to 64.1% in 30 steps, 70.3% in 60 and 73.4% in 120, so the second 60 were left out (half the time).
    c.train.steps = 420
    c.train.il_warmup_steps = 360
    c.train.il_warmup_target = 0.3
    c.train.batch_size = 16
    c.train.eval_episodes = 128
    # The curve in between: every 20 RL steps on the first 32 of those tasks (~2 s each; evaluations leave the run's
    # training as it is); after the warm start and at the end, all 128.
    c.train.eval_every = 20
    c.train.eval_every_episodes = 32
    # Packed rows that hold the episodes' common 167-token system prompt and tool schema once (4-5 episodes to a
    # row of 640 or 768): the same loss and gradient as one episode per row, from about half the positions.
    c.train.packing = True
    c.train.share_prefix = True
    c.train.buckets = (320, 448, 640, 768)

    c.checkpoint.every = 0  # only at the end (and on Ctrl-C)
    c.checkpoint.export_hf = True  # <run_dir>/hf: where configs/resample_*.py start from
    c.logging.peak_tflops = 0.0
    return c
