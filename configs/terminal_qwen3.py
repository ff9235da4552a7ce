"""Terminal tasks at real scale: a Qwen3 checkpoint, SGLang rollout servers, the whole built-in suite.

    # on each rollout host (CUDA GPU):
    python experiments/launch_sglang.py --model_path=/ckpt/Qwen3-8B --ports=30000,30001
    # on the learner:
    python experiments/train.py --config=configs/terminal_qwen3.py --config.model.path=/ckpt/Qwen3-8B \
        --config.rollout.sglang_urls='("http://rollout-0:30000","http://rollout-0:30001")'

The policy reasons (Qwen3's thinking mode) and has the four sandbox tools; episodes run 64 at a time, their
commands in bubblewrap sandboxes on the learner host (rollout servers only generate). No imitation warm start: a
Qwen3 checkpoint already calls tools; chunk-level initialized resampling from the reference solutions' states
(rollback mode) gives the hard tier's failed tasks a path to reward. Your own tasks: env.kwargs.tasks_dir.
"""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("base.py"))
    c.model.path = "/ckpt/Qwen3-8B"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.mesh.data, c.mesh.fsdp = 1, -1

    c.env.name = "terminal"
    with c.unlocked():
        c.env.kwargs = dict(
            tiers=("easy", "medium", "hard"),
            tools=("bash", "python", "read_file", "write_file"),
            extra_turns=8,
            observation_chars=4000,
            limits=dict(timeout_s=60.0, cpu_s=60, memory_mb=4096, max_processes=64),
        )

    c.objective.preset = "ipa"
    c.optimizer.lr = 1e-6
    c.optimizer.il_lr = 1e-6

    c.rollout.engine = "sglang"
    c.rollout.sglang_urls = ("http://localhost:30000",)
    c.rollout.enable_thinking = True
    c.rollout.max_new_tokens = 4096
    c.rollout.max_turns = 24
    c.rollout.max_context = 32768
    c.rollout.concurrency = 64

    c.resample.mode = "rollback"

    c.train.name = "terminal_qwen3"
    c.train.steps = 500
    c.train.il_warmup_steps = 0
    c.train.batch_size = 64
    c.train.microbatches = 8
    c.train.eval_every = 50
    c.train.eval_episodes = 128
    c.train.buckets = (8192, 16384, 32768)
    c.checkpoint.every = 50
    c.checkpoint.export_hf = True
    return c
