"""The tiny online setting the pipeline tests share: the quickstart's config with a 2-layer, hidden-32 MoE, batch 8
over the 8 fake CPU devices, asynchronous rollouts, short turns and 4 held-out episodes (so compiled steps and
engines are reused); and the rows the offline runs (configs/offline_tiny.py) train on."""

import os

import numpy as np

from ipa_jax.pipeline import load_config
from ipa_jax.trajectory import Trajectory, build_chunk_ids

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.py")
TINY = {
    "model.arch": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "rollout.max_new_tokens": 16,
    "rollout.concurrency": 8,
    "train.batch_size": 8,
    "train.eval_episodes": 4,
    "queue.max_size": 8,
    "rollout.schedule": "async",  # the rollout worker and queue (the lockstep tests set their own)
    "logging.tensorboard": False,
}


def tiny_config(run_dir, **overrides):
    """The quickstart config with TINY and `overrides` applied, writing into `run_dir`."""
    return load_config(QUICKSTART, {**TINY, "train.run_dir": str(run_dir), **overrides})


def offline_rows(n: int) -> list[Trajectory]:
    """n valid rows of 24 tokens: a prompt of 4, then one chunk of 20 sampled tokens; rewards 0, 1, 0, ..."""
    rng = np.random.default_rng(0)
    action = np.arange(24) >= 4
    return [
        Trajectory(
            uid=f"t{i}",
            tokens=rng.integers(0, 128, 24),
            action_mask=action,
            behavior_logprobs=np.where(action, -4.8, 0.0),
            chunk_ids=build_chunk_ids(action, [23]),
            expert_mask=np.zeros(24, bool),
            reward=float(i % 2),
            policy_version=0,
        )
        for i in range(n)
    ]
