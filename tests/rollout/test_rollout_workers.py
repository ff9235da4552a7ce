"""RolloutWorker: background asyncio loop feeding the queue; groups, backpressure, shutdown, failures."""

import collections
import itertools
import time

import pytest
from rollout_fakes import ScriptedEngine, append_only_chat, expert_script

from ipa_jax.envs import make_env
from ipa_jax.rollout import QueueClosed, RolloutWorker, TrajectoryQueue
from ipa_jax.trajectory import pad_batch


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


@pytest.fixture(scope="module")
def tasks():
    return make_env("calculator").tasks("train", 12, 0)


def test_runs_all_tasks_concurrently_into_the_queue(chat, tasks):
    engine = ScriptedEngine(chat, expert_script(chat, tasks), delay=0.005)
    q = TrajectoryQueue(capacity=64)
    worker = RolloutWorker(engine, chat, tasks, q, concurrency=4, group_size=2).start()
    worker.join(timeout=30)
    trajs = q.drain()
    assert len(trajs) == 24 and all(t.reward == 1.0 for t in trajs)
    assert engine.max_in_flight == 4
    counts = collections.Counter(t.info["task_id"] for t in trajs)
    assert set(counts.values()) == {2} and len(counts) == 12
    batch = pad_batch(trajs)
    assert len(set(batch.group_ids.tolist())) == 12
    s = worker.stats()
    assert s["finished"] == s["admitted"] == 24 and s["success_rate"] == 1.0
    assert s["episodes_per_s"] > 0 and s["generated_tokens_per_s"] > 0
    assert s["generated_tokens"] == sum(int(t.action_mask.sum()) for t in trajs)


def test_backpressure_and_stop_keep_every_finished_trajectory(chat, tasks):
    engine = ScriptedEngine(chat, expert_script(chat, tasks), delay=0.002)
    q = TrajectoryQueue(capacity=2)
    worker = RolloutWorker(engine, chat, itertools.cycle(tasks), q, concurrency=3).start()
    time.sleep(0.5)
    assert len(q) == 2 and worker.running  # producers blocked on the bound
    worker.stop(timeout=30)
    assert not worker.running
    s = worker.stats()
    assert s["finished"] == len(q) + len(worker.leftovers) == s["admitted"] + s["leftovers"]
    assert len(worker.leftovers) >= 1


def test_learner_loop_with_weight_updates_and_abort_on_stop(chat, tasks):
    engine = ScriptedEngine(chat, expert_script(chat, tasks), delay=0.003)
    q = TrajectoryQueue(capacity=8, max_policy_lag=1)
    worker = RolloutWorker(engine, chat, itertools.cycle(tasks), q, concurrency=4).start()
    taken = []
    for version in range(1, 6):
        batch = q.take(4, timeout=30)
        taken += batch
        assert all(version - 1 - t.policy_version <= 1 for t in batch)
        q.set_version(version)
        worker.call(engine.update_weights, "unused", version, timeout=10)  # runs on the worker's loop
    worker.stop(abort_in_flight=True, timeout=30)
    q.close()
    rest = q.drain()
    s, qs = worker.stats(), q.stats()
    assert s["finished"] == s["admitted"] + s["dropped"] + s["leftovers"]
    assert qs["admitted"] == len(taken) + len(rest) + qs["evicted"]
    assert max(t.policy_version for t in taken) >= 3  # weight versions reached the trajectories
    assert len({t.uid for t in taken + rest}) == len(taken) + len(rest)
    with pytest.raises(RuntimeError, match="not running"):
        worker.call(engine.health)


def test_consecutive_failures_stop_the_worker(chat, tasks):
    def broken(prompt, i):
        raise RuntimeError("engine down")

    q = TrajectoryQueue(capacity=4)
    worker = RolloutWorker(
        ScriptedEngine(chat, broken), chat, itertools.cycle(tasks), q, concurrency=2, max_consecutive_failures=3
    ).start()
    worker.join(timeout=30)
    assert worker.stats()["failed"] >= 3
    with pytest.raises(RuntimeError, match="failed episodes") as info:
        worker.check()
    assert "engine down" in str(info.value.__cause__)


def test_closed_queue_sends_trajectories_to_leftovers(chat, tasks):
    q = TrajectoryQueue(capacity=4)
    q.close()
    worker = RolloutWorker(ScriptedEngine(chat, expert_script(chat, tasks)), chat, tasks[:3], q).start()
    worker.join(timeout=30)
    assert len(worker.leftovers) == 3 and worker.stats()["admitted"] == 0
    with pytest.raises(QueueClosed):
        q.take(1)
