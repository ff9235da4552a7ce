"""Helpers for learner tests: synthetic multi-turn trajectories, the tiny offline config with overrides, tree
comparisons. Synthetic trajectories: prompt, then chunks of policy tokens separated by tool observations, a
learnable token rule (next = 3 * prev + 1 mod V), optional expert (imitation) tokens."""

import os

import jax
import numpy as np

from ipa_jax.pipeline import ExperimentConfig, load_config, validate
from ipa_jax.trajectory import Trajectory, build_chunk_ids, pad_batch


def synthetic_trajectories(
    n: int,
    *,
    vocab_size: int = 128,
    seed: int = 0,
    min_len: int = 12,
    max_len: int = 30,
    expert_every: int = 3,
    num_layers_k: tuple[int, int] | None = None,
    num_tasks: int | None = None,
) -> list[Trajectory]:
    """n valid trajectories of ragged lengths. Behaviour log-probs are near log(1/V) (what a fresh random model
    assigns), so importance ratios start close to 1. num_layers_k=(L, k) adds routed_experts."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        tokens = np.zeros(length, np.int64)
        tokens[0] = rng.integers(vocab_size)
        for t in range(1, length):
            tokens[t] = (3 * tokens[t - 1] + 1) % vocab_size
        action = np.zeros(length, bool)
        # prompt of 3, then alternate 4-6 action tokens and 2 observation tokens
        t, ends = 3, []
        while t < length:
            span = int(rng.integers(4, 7))
            stop = min(t + span, length)
            action[t:stop] = True
            ends.append(stop - 1)
            t = stop + 2
        expert = np.zeros(length, bool)
        if expert_every and i % expert_every == 0:
            expert[1:3] = True  # the prompt continuation as an imitation target
        behavior = np.where(action, -np.log(vocab_size) + rng.normal(0, 0.05, length), 0.0)
        behavior = np.minimum(behavior, -1e-3) * action
        routed = None
        if num_layers_k is not None:
            layers, k = num_layers_k  # k distinct experts of 4 per token and layer
            routed = np.argsort(rng.random((length, layers, 4)), axis=-1)[..., :k]
        task = i % num_tasks if num_tasks else i
        out.append(
            Trajectory(
                uid=f"traj-{seed}-{i}",
                tokens=tokens,
                action_mask=action,
                behavior_logprobs=behavior,
                chunk_ids=build_chunk_ids(action, ends),
                expert_mask=expert,
                reward=float(rng.random() < 0.7),
                policy_version=0,
                routed_experts=routed,
                info={"task_id": f"task-{task}"},
            )
        )
    return out


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CONFIG = os.path.join(REPO, "configs", "offline_tiny.py")
MOE_ARCH = ("model.arch.num_experts=4", "model.arch.num_experts_per_tok=2", "model.arch.moe_intermediate_size=16")


def make_exp(*overrides: str) -> ExperimentConfig:
    return validate(load_config(TINY_CONFIG, overrides))


def make_batch(n: int = 8, seed: int = 0, **kw):
    return pad_batch(synthetic_trajectories(n, seed=seed, **kw), (32, 64))


def tree_copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def max_rel_diff(a, b) -> float:
    """max over leaves of ||a - b|| / ||b||."""
    diffs = jax.tree.map(
        lambda x, y: float(
            np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
            / max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)
        ),
        a,
        b,
    )
    return max(jax.tree.leaves(diffs))
