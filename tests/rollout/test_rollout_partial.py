"""Partial rollouts across weight updates (rollout.partial): the agent loop records a chunk continued after an update
at the newest version that sampled it, the queue's staleness bound applies to the oldest chunk, trajectory JSON keeps
the versions (and reads files without them), and the config key is validated and documented."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
from rollout_fakes import ScriptedEngine, append_only_chat, expert_script, fake_logprob

from ipa_jax.engines.base import PARTIAL_MODES
from ipa_jax.envs import make_env
from ipa_jax.pipeline.config import ConfigError, RolloutConfig, field_help, load_config, validate
from ipa_jax.rollout.agent import run_episode
from ipa_jax.rollout.queue import TrajectoryQueue
from ipa_jax.trajectory import Trajectory

TINY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "offline_tiny.py"
)


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


def episode(chat, task, uid: str, updates_mid_call: set[int]) -> tuple[Trajectory, ScriptedEngine]:
    """The expert's three-turn episode from an engine at version 4 whose turns `updates_mid_call` a weight update
    interrupts (each one moves the engine one version on)."""
    engine = ScriptedEngine(chat, expert_script(chat, [task]))
    engine.version = 4
    engine.updates_mid_call = updates_mid_call
    traj = asyncio.run(run_episode(engine, chat, task, uid=uid))
    return traj, engine


def test_an_episode_crossing_an_update_records_per_chunk_versions_and_is_bounded_by_its_oldest_chunk(chat):
    task = make_env("lookup").tasks("train", 1, 3)[0]
    # Turn 1 crosses the update 4 -> 5; turn 2 runs on 5.
    middle, engine = episode(chat, task, "middle", {1})
    assert middle.num_chunks == 3 and middle.reward == 1.0
    assert middle.chunk_versions.tolist() == [4, 5, 5] and middle.policy_version == 4
    assert middle.info["resumed_chunks"] == [[1, 4]]
    # The behaviour log-probs are the sampler's for every token, those sampled before the update included.
    lps = [lp for _, _, call_lps in engine.calls["middle"] for lp in call_lps]
    np.testing.assert_array_equal(middle.behavior_logprobs[middle.action_mask], np.asarray(lps, np.float32))
    assert lps == [fake_logprob(t) for t in middle.tokens[middle.action_mask]]
    middle.validate(max_version=5)
    # Turn 0 crosses it: every chunk is at 5 (a resumed chunk counts as its newest version).
    first, _ = episode(chat, task, "first", {0})
    assert first.chunk_versions.tolist() == [5, 5, 5] and first.policy_version == 5
    assert first.info["resumed_chunks"] == [[0, 4]]
    # Without an update: one version throughout.
    plain, _ = episode(chat, task, "plain", set())
    assert plain.chunk_versions.tolist() == [4, 4, 4] and plain.info["resumed_chunks"] == []

    q = TrajectoryQueue(capacity=8, max_policy_lag=1, initial_version=6)
    assert not q.put(middle)  # oldest chunk 4: lag 2
    assert q.put(first)  # oldest chunk 5: lag 1
    assert not q.put(plain)
    # The bound reads the chunks, not a policy_version that disagrees with them.
    relabelled = Trajectory.from_json(middle.to_json())
    relabelled.uid, relabelled.policy_version = "relabelled", 6
    assert not q.put(relabelled)
    stats = q.stats()
    assert stats["admitted"] == 1 and stats["dropped_stale"] == 3
    q.set_version(7)  # the waiting one is now 2 versions behind its oldest chunk: evicted
    assert len(q) == 0 and q.stats()["evicted"] == 1


def test_trajectory_json_keeps_the_versions_and_reads_lines_without_them(chat):
    task = make_env("lookup").tasks("train", 1, 3)[0]
    traj, _ = episode(chat, task, "json", {1})
    back = Trajectory.from_json(traj.to_json())
    back.validate(max_version=5)
    assert back.chunk_versions.dtype == np.int32 and back.chunk_versions.tolist() == [4, 5, 5]
    assert back.policy_version == 4 and back.info["resumed_chunks"] == [[1, 4]]
    np.testing.assert_array_equal(back.behavior_logprobs, traj.behavior_logprobs)
    # A line written before chunk versions and resumed chunks were recorded: the queue bounds its policy_version.
    record = json.loads(traj.to_json())
    del record["chunk_versions"], record["info"]["resumed_chunks"]
    record["uid"], record["policy_version"] = "older", 3
    older = Trajectory.from_json(json.dumps(record))
    older.validate()
    assert older.chunk_versions is None and "resumed_chunks" not in older.info
    assert not TrajectoryQueue(max_policy_lag=1, initial_version=5).put(older)  # lag 2 by policy_version
    assert TrajectoryQueue(max_policy_lag=2, initial_version=5).put(older)


def test_rollout_partial_is_validated_and_documented():
    assert validate(load_config(TINY)).rollout.partial == "finish" == RolloutConfig().partial
    for mode in PARTIAL_MODES:
        assert validate(load_config(TINY, [f"rollout.partial='{mode}'"])).rollout.partial == mode
    with pytest.raises(ConfigError, match=r"rollout\.partial.*'finish', 'abort_resume'.*'resume'") as error:
        validate(load_config(TINY, ["rollout.partial='resume'"]))
    assert error.value.key == "rollout.partial"
    assert "abort_resume" in field_help(RolloutConfig)["partial"]
