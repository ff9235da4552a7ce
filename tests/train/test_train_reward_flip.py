"""train.reward_flip_fraction, the graded positive control: which trajectories it flips (a hash of the uid, the
formula written out here), what a flip does (R -> 1 - R), and that the learner applies it in the RL phase only."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from train_helpers import make_exp, synthetic_trajectories

from ipa_jax.pipeline.build import build_learner
from ipa_jax.train import JsonlSource
from ipa_jax.train.learner import TrainConfig, flip_rewards, reward_flipped
from ipa_jax.trajectory import write_jsonl


def test_the_flipped_share_is_the_fraction_and_grows_by_supersets():
    uids = [f"calc/train/{i}#0" for i in range(20_000)]
    # The choice from its definition: sha256's first 8 bytes as a fraction of 2^64, below the fraction.
    position = np.array([int(hashlib.sha256(u.encode()).hexdigest()[:16], 16) / 2**64 for u in uids])
    for fraction in (0.0, 0.05, 0.3, 1.0):
        chosen = np.array([reward_flipped(u, fraction) for u in uids])
        np.testing.assert_array_equal(chosen, position < fraction)
        assert abs(chosen.mean() - fraction) <= 4 * np.sqrt(fraction * (1 - fraction) / len(uids)) + 1e-12
    small = {u for u in uids if reward_flipped(u, 0.05)}
    assert small <= {u for u in uids if reward_flipped(u, 0.3)}


def test_flip_rewards_swaps_success_and_failure_of_the_chosen_trajectories():
    trajs = synthetic_trajectories(64, seed=1)
    rewards = [t.reward for t in trajs]
    assert flip_rewards(trajs, 0.0) is trajs
    flipped = flip_rewards(trajs, 0.5)
    chosen = [reward_flipped(t.uid, 0.5) for t in trajs]
    assert 0 < sum(chosen) < len(trajs)
    assert [t.reward for t in flipped] == [1.0 - r if c else r for r, c in zip(rewards, chosen)]
    assert [t.uid for t in flipped] == [t.uid for t in trajs] and [t.reward for t in trajs] == rewards
    with pytest.raises(ValueError, match="train.reward_flip_fraction"):
        TrainConfig(reward_flip_fraction=float("nan"))


def test_the_learner_flips_rewards_after_the_warm_start_only(tmp_path):
    trajs = synthetic_trajectories(8, seed=0)
    write_jsonl(str(tmp_path / "data.jsonl"), trajs)
    exp = make_exp(
        f"train.data=('{tmp_path / 'data.jsonl'}',)",
        "train.batch_size=8",
        "train.steps=3",
        "train.il_warmup_steps=1",
        "train.reward_flip_fraction=1.0",
    )
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=str(tmp_path / "run"))
    seen, make_batch = [], learner.make_batch
    learner.make_batch = lambda batch: seen.append(sorted(t.reward for t in batch)) or make_batch(batch)
    learner.run()
    original = sorted(t.reward for t in trajs)
    assert seen == [original] + [sorted(1.0 - r for r in original)] * 2
