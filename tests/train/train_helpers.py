"""Helpers for learner tests: synthetic multi-turn trajectories, the tiny offline config with overrides, tree
comparisons. Synthetic trajectories: prompt, then chunks of policy tokens separated by tool observations, a
learnable token rule (next = 3 * prev + 1 mod V), optional expert (imitation) tokens."""

import math
import os

import jax
import numpy as np

from ipa_jax.models import MeshConfig
from ipa_jax.pipeline import ExperimentConfig, RunFolder, load_config, validate
from ipa_jax.trajectory import Trajectory, build_chunk_ids, pad_batch, write_jsonl


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


def offline_learner_run(tmp_path, mesh, tag, trajectories, *overrides):
    """A FlashREINFORCE learner run (batch 16, 2 microbatches) on `trajectories` (written to tmp_path/data.jsonl
    by the first run, read by the later ones) with overrides: (its metrics, initial params, final params)."""
    from ipa_jax.pipeline.build import build_learner
    from ipa_jax.train import JsonlSource

    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_jsonl(data, trajectories)
    exp = make_exp(
        f"train.data=('{data}',)",
        "train.batch_size=16",
        "train.microbatches=2",
        "checkpoint.every=0",
        "logging.tensorboard=False",
        "optimizer.eps=1e-4",
        "objective.preset=flash_reinforce",
        *overrides,
    )
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=str(tmp_path / tag), mesh=mesh)
    params0 = tree_copy(learner.state.params)
    state = learner.run()
    return RunFolder(tmp_path / tag).read_metrics(), params0, tree_copy(state.params)


# Packed layouts against one trajectory per row: a sharded mesh of 2-way data x 2-way fsdp x 2-way tensor (rows
# over 4 devices), with 2 microbatches, and the objectives whose per-trajectory terms the layouts must keep.
PACKED_MESH = MeshConfig(data=2, fsdp=2, expert=1, tensor=2)
SEQUENCE_LEVEL = (
    "objective.preset=custom",
    "objective.baseline=group_mean",
    "objective.credit=token",
    "objective.gamma=0.8",
    "objective.is_level=sequence",
    "objective.is_apply_to=all",
    "objective.mismatch_level=sequence",
    "objective.mismatch_range=(0.0, 1.5)",
    "objective.trust_region_level=sequence",
    "objective.trust_region_delta=5e-4",
    "objective.negative_token_fraction=0.5",
    "objective.old_logprobs=recompute",
    "objective.row_denominator=kept",
    "objective.il_weight=0.5",
    "rollout.group_size=4",
)
PACKED_OBJECTIVES = {
    "ipa": ("objective.preset=ipa",),
    "flash_reinforce": (
        "objective.preset=flash_reinforce",
        "objective.trust_region_delta=5e-4",
        "objective.negative_token_fraction=0.5",
    ),
    "sequence_level": SEQUENCE_LEVEL,
}
# Sums over trajectories and tokens that both layouts must agree on exactly (counts) or closely (sums).
PACKED_COUNTS = ("n_action", "n_keep", "n_chunks", "n_trajectories", "admitted", "n_il_rows", "max_chunks")
PACKED_SUMS = ("rl_num", "il_num", "sum_kl", "sum_is_ratio", "sum_abs_log_ratio", "n_il_greedy_rows")


def graded(trajs: list[Trajectory]) -> list[Trajectory]:
    """The trajectories with graded rewards (failures, negatives and both signs of the advantage) and every third
    one's sampler drifted (the trust region rejects, the mismatch range masks it)."""
    for i, tr in enumerate(trajs):
        tr.reward = float(i % 4) / 3
        if i % 3 == 0:
            tr.behavior_logprobs = np.where(tr.action_mask, tr.behavior_logprobs - 0.5, 0).astype(np.float32)
    return trajs


def assert_same_loss_and_gradients(step, state, want_batch, got_batch) -> tuple[dict, dict]:
    """The train step's loss, gradients, counts and sums on two layouts of one batch agree; their stats."""
    from ipa_jax.train.step import batch_gradients

    grads_fn = jax.jit(lambda state, batch: batch_gradients(state, batch, None, options=step.options)[:3])
    loss, grads, stats = jax.device_get(grads_fn(state, step.put_batch(want_batch)))
    got_loss, got_grads, got_stats = jax.device_get(grads_fn(state, step.put_batch(got_batch)))
    assert abs(float(loss)) > 1e-4
    assert math.isclose(float(got_loss), float(loss), rel_tol=1e-5, abs_tol=1e-7)
    assert max_rel_diff(got_grads, grads) < 1e-4
    for key in PACKED_COUNTS:
        assert float(got_stats[key]) == float(stats[key]), key
    for key in PACKED_SUMS:
        assert math.isclose(float(got_stats[key]), float(stats[key]), rel_tol=1e-4, abs_tol=1e-6), key
    return stats, got_stats
