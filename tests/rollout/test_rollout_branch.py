"""Chunk values by branching (rollout/branch.py): the value and advantage formulas against float64 references,
continuations from an episode's chunk boundaries with scripted engines and a tiny model in the embedded engine,
and the rollout worker's branched fraction and extra-rollout counts."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from rollout_fakes import RecordingEngine, ScriptedEngine, append_only_chat, expert_script

from ipa_jax.envs import make_env
from ipa_jax.rollout import RolloutWorker, TrajectoryQueue
from ipa_jax.rollout.agent import AgentConfig, run_episode
from ipa_jax.rollout.branch import (
    Branching,
    branch_advantages,
    branch_episode,
    branch_values,
    continuation_uid,
    is_branched,
)
from ipa_jax.trajectory import Trajectory, pad_batch

AGENT = AgentConfig(max_new_tokens=48, max_context=512)


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


@pytest.fixture(scope="module")
def tasks():
    return make_env("calculator").tasks("train", 4, 0)


def chunk_starts(traj: Trajectory) -> list[int]:
    return [int(np.argmax(traj.chunk_ids == k)) for k in range(traj.num_chunks)]


def expert_episode_of(chat, task) -> Trajectory:
    """An episode of `task` sampled from its start state by a policy that plays the scripted expert."""
    engine = ScriptedEngine(chat, expert_script(chat, [task]))
    return asyncio.run(run_episode(engine, chat, task, AGENT, uid=f"{task.task_id}#episode"))


def test_values_and_advantages_match_float64_reference():
    rng = np.random.default_rng(0)
    for K, n in ((1, 1), (3, 4), (5, 2)):
        rewards = rng.choice([0.0, 1.0, 0.5, -1.0], size=(K, n))
        R = float(rng.choice([0.0, 1.0]))
        values = branch_values(rewards)
        expected = [sum(float(r) for r in rewards[k]) / n for k in range(K)]
        np.testing.assert_allclose(values, expected, rtol=0, atol=1e-15)
        adv = branch_advantages(values, R)
        ref = [(expected[k + 1] if k + 1 < K else R) - expected[k] for k in range(K)]
        assert adv.dtype == np.float64
        np.testing.assert_allclose(adv, ref, rtol=0, atol=1e-15)
        assert math.isclose(adv.sum(), R - expected[0], abs_tol=1e-12)  # the advantages telescope
    with pytest.raises(ValueError, match=r"\[K, n\]"):
        branch_values(np.zeros((3, 0)))
    with pytest.raises(ValueError, match=r"\[K\]"):
        branch_advantages(np.zeros(0), 1.0)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25, 0.3, 0.01])
def test_the_fraction_of_episodes_branched_is_exact(fraction):
    chosen = [is_branched(i, fraction) for i in range(200)]
    for m in range(201):
        assert sum(chosen[:m]) == math.floor(m * fraction + 1e-12)


def test_branching_config_errors():
    for samples, fraction in ((0, 1.0), (2.5, 1.0), (2, 0.0), (2, 1.5)):
        with pytest.raises(ValueError, match="Branching"):
            Branching(samples, fraction)


def test_continuations_start_from_each_chunk_boundary(chat, tasks):
    # Continuations answer "wrong" at the second tool call: from s_0 and s_1 they fail, from s_2 (only the answer
    # left) they succeed. The episode itself succeeds, so V = (0, 0, 1) and A = (0, 1, 0): the credit goes to
    # chunk 1, the decision the continuations get wrong.
    task = tasks[0]
    traj = expert_episode_of(chat, task)
    assert traj.num_chunks == 3 and traj.reward == 1.0
    play = expert_script(chat, [task])

    def script(prompt, call_index):
        turn = chat.decode(prompt).count("<|im_start|>assistant\n") - 1
        return "wrong" if turn == 1 else play(prompt, call_index)

    engine = ScriptedEngine(chat, script)
    outcome = asyncio.run(branch_episode(engine, chat, task, traj, 2, AGENT))
    np.testing.assert_array_equal(outcome.values, [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(outcome.chunk_advantages, np.asarray([0.0, 1.0, 0.0], np.float32))
    assert outcome.chunk_advantages.dtype == np.float32
    assert outcome.continuations == 6
    # Each continuation's first prompt is the episode's state before its chunk, token for token.
    starts = chunk_starts(traj)
    for k in range(3):
        for j in range(2):
            first_prompt = engine.calls[continuation_uid(traj.uid, k, j)][0][0]
            assert first_prompt == traj.tokens[: starts[k]].tolist()
    generated = sum(len(ids) for calls in engine.calls.values() for _, ids, _ in calls)
    assert outcome.generated_tokens == generated


def test_an_episode_whose_states_cannot_be_replayed_is_not_branched(chat, tasks):
    # A malformed tool call in chunk 0: the states after it cannot be rebuilt from parsed calls, so no value is
    # estimated and nothing is sampled.
    task = tasks[1]
    play = expert_script(chat, [task])

    def script(prompt, call_index):
        turn = chat.decode(prompt).count("<|im_start|>assistant\n") - 1
        return "<tool_call>\n{not json\n</tool_call>" if turn == 0 else play(prompt, call_index)

    traj = asyncio.run(run_episode(ScriptedEngine(chat, script), chat, task, AGENT, uid="broken"))
    assert traj.num_chunks >= 2
    engine = ScriptedEngine(chat, play)
    outcome = asyncio.run(branch_episode(engine, chat, task, traj, 2, AGENT))
    assert outcome.chunk_advantages is None and outcome.skipped == "unreplayable"
    assert "chunk 0 has a malformed tool call" in outcome.detail
    assert outcome.continuations == 0 and not engine.calls


def test_an_aborted_continuation_leaves_the_episode_unbranched(chat, tasks):
    task = tasks[2]
    traj = expert_episode_of(chat, task)
    engine = ScriptedEngine(chat, expert_script(chat, [task]))
    engine.abort_sessions.add(continuation_uid(traj.uid, 1, 0))
    outcome = asyncio.run(branch_episode(engine, chat, task, traj, 2, AGENT))
    assert outcome.chunk_advantages is None and outcome.skipped == "aborted"
    assert outcome.continuations == 3 * 2 - 1


def test_worker_branches_a_fraction_and_counts_the_extra_rollouts(chat, tasks):
    engine = ScriptedEngine(chat, expert_script(chat, tasks))
    q = TrajectoryQueue(capacity=64)
    worker = RolloutWorker(
        engine, chat, tasks, q, AGENT, concurrency=2, branch=Branching(samples=2, fraction=0.5)
    ).start()
    worker.join(timeout=60)
    trajs = q.drain()
    assert len(trajs) == 4
    branched = [t for t in trajs if t.chunk_advantages is not None]
    assert len(branched) == 2
    for t in branched:  # the expert always succeeds: V(k) = 1 everywhere, every advantage 0
        np.testing.assert_array_equal(t.chunk_advantages, np.zeros(t.num_chunks, np.float32))
        assert t.info["branch_values"] == [1.0] * t.num_chunks
        again = Trajectory.from_json(t.to_json())
        np.testing.assert_array_equal(again.chunk_advantages, t.chunk_advantages)
    s = worker.stats()
    assert s["branched"] == 2 and s["branch_skipped"] == s["branch_unreplayable"] == s["branch_aborted"] == 0
    assert s["branch_episodes"] == sum(2 * t.num_chunks for t in branched)
    continuation_tokens = sum(
        len(ids) for sid, calls in engine.calls.items() if "~branch" in sid for _, ids, _ in calls
    )
    assert s["branch_generated_tokens"] == continuation_tokens > 0
    assert s["generated_tokens"] == sum(int(t.action_mask.sum()) for t in trajs)  # the episodes' own only
    batch = pad_batch(trajs)
    for i, t in enumerate(trajs):
        if t.chunk_advantages is None:
            assert not batch.branch_mask[i].any()
        else:
            np.testing.assert_array_equal(batch.branch_mask[i, : t.length], t.action_mask)


def test_embedded_engine_continuations_reproduce_the_states(chat, tasks):
    # A tiny random dense Qwen3 in the EmbeddedEngine samples the continuations of an expert-played episode:
    # every continuation is asked to continue exactly the episode's state before its chunk, and the values and
    # advantages follow from the continuations' own rewards.
    from tiny_models import tiny_qwen3_config

    from ipa_jax.engines import EmbeddedEngine
    from ipa_jax.models import init_model

    task = tasks[3]
    traj = expert_episode_of(chat, task)
    model = init_model(tiny_qwen3_config(moe=False, vocab_size=len(chat.tokenizer)))
    engine = RecordingEngine(EmbeddedEngine(model, seed=0, max_len=512, max_batch=8, batch_buckets=(8,)))
    config = AgentConfig(max_new_tokens=8, max_context=512)

    async def branch():
        try:
            return await branch_episode(engine, chat, task, traj, 2, config)
        finally:
            await engine.close()

    outcome = asyncio.run(branch())
    K = traj.num_chunks
    assert outcome.continuations == 2 * K
    starts = chunk_starts(traj)
    for k in range(K):
        for j in range(2):
            calls = engine.calls[continuation_uid(traj.uid, k, j)]
            assert calls[0][0] == traj.tokens[: starts[k]].tolist()
    assert outcome.generated_tokens == sum(len(ids) for calls in engine.calls.values() for _, ids, _ in calls)
    assert outcome.values.shape == (K,) and ((0 <= outcome.values) & (outcome.values <= 1)).all()
    np.testing.assert_allclose(
        outcome.chunk_advantages, np.append(outcome.values[1:], traj.reward) - outcome.values, rtol=1e-6
    )
