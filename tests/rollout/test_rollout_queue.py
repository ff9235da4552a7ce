"""TrajectoryQueue: exactly-once delivery under concurrency, lag admission, bounds, shutdown, stats."""

import collections
import logging
import queue
import random
import threading
import time

import numpy as np
import pytest

from ipa_jax.rollout import queue as queue_module
from ipa_jax.rollout.queue import QueueClosed, TrajectoryQueue
from ipa_jax.trajectory import Trajectory


def make_traj(uid: str, version: int = 0, bad: bool = False, token: int = 3) -> Trajectory:
    return Trajectory(
        uid=uid,
        tokens=np.array([1, 2, token, 4]),
        action_mask=np.array([bad, False, True, True]),
        behavior_logprobs=np.array([0.0, 0.0, -0.5, -0.25]),
        chunk_ids=np.array([-1, -1, 0, 0]),
        expert_mask=np.zeros(4, bool),
        reward=1.0,
        policy_version=version,
        info={"task_id": uid},
    )


def test_many_producers_one_consumer_exactly_once_and_bounded():
    capacity, n_producers, per_producer, batch = 16, 8, 150, 10
    q = TrajectoryQueue(capacity=capacity)
    max_depth = [0]
    stop = threading.Event()

    def producer(p: int) -> None:
        rng = random.Random(p)
        for i in range(per_producer):
            assert q.put(make_traj(f"p{p}-{i}"))
            if rng.random() < 0.1:  # re-send an already admitted uid: must be dropped
                assert not q.put(make_traj(f"p{p}-{rng.randrange(i + 1)}"))

    def monitor() -> None:
        while not stop.is_set():
            max_depth[0] = max(max_depth[0], len(q))
            time.sleep(0.0005)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(n_producers)]
    mon = threading.Thread(target=monitor)
    mon.start()
    for t in threads:
        t.start()
    taken = []
    total = n_producers * per_producer
    while len(taken) < total:
        got = q.take(batch, timeout=30)
        assert len(got) == batch
        taken += [t.uid for t in got]
    for t in threads:
        t.join()
    stop.set()
    mon.join()
    counts = collections.Counter(taken)
    assert len(counts) == total and set(counts.values()) == {1}
    assert counts.keys() == {f"p{p}-{i}" for p in range(n_producers) for i in range(per_producer)}
    # FIFO per producer.
    for p in range(n_producers):
        mine = [int(u.split("-")[1]) for u in taken if u.startswith(f"p{p}-")]
        assert mine == sorted(mine)
    assert max_depth[0] <= capacity
    s = q.stats()
    assert s["taken"] == s["admitted"] == total and s["depth"] == 0
    assert s["dropped_duplicate"] == s["offered"] - total > 0
    assert s["producer_wait_s"] > 0  # producers blocked on the bound
    assert s["take_per_s"] > 0 and s["put_per_s"] > 0


def test_stale_dropped_on_put_and_evicted_on_version_change():
    drops = []
    q = TrajectoryQueue(capacity=8, max_policy_lag=2, initial_version=1, on_drop=lambda t, r: drops.append((t.uid, r)))
    assert q.put(make_traj("a", version=0)) and q.put(make_traj("b", version=1))
    q.set_version(2)  # lags 2 and 1: both still admissible
    assert len(q) == 2
    q.set_version(3)  # "a" now has lag 3 > 2
    assert len(q) == 1 and drops == [("a", "stale")]
    assert not q.put(make_traj("c", version=0))  # lag 3
    assert q.put(make_traj("d", version=1))  # lag 2
    assert q.put(make_traj("e", version=3))  # lag 0
    assert not q.put(make_traj("f", version=5))  # ahead of the learner's version: invalid, never trained on
    assert "ahead of the learner's version 3" in q.stats()["last_invalid"]
    assert [t.uid for t in q.take(3)] == ["b", "d", "e"]
    s = q.stats()
    assert s["dropped_stale"] == 2 and s["dropped_invalid"] == 1 and drops[-1] == ("f", "invalid")
    assert s["lag_taken_max"] == 2 and s["lag_last_take_mean"] == pytest.approx((2 + 2 + 0) / 3)
    with pytest.raises(ValueError, match="must not decrease"):
        q.set_version(2)


def test_concurrent_version_bumps_never_deliver_stale():
    max_lag, n_producers, per_producer = 2, 4, 200
    q = TrajectoryQueue(capacity=8, max_policy_lag=max_lag)
    done = threading.Event()

    def producer(p: int) -> None:
        rng = random.Random(p)
        for i in range(per_producer):
            # Sample with weights that are 0..4 versions behind the learner.
            q.put(make_traj(f"{p}-{i}", version=max(0, q.version - rng.randint(0, 4))))
        done.set()

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(n_producers)]
    for t in threads:
        t.start()
    taken = []
    while True:
        try:
            got = q.take(4, timeout=0.2)
        except TimeoutError:
            if all(not t.is_alive() for t in threads):
                break
            continue
        for t in got:
            assert q.version - t.policy_version <= max_lag
        taken += got
        q.set_version(q.version + 1)
    taken += q.drain()
    s = q.stats()
    assert len(taken) == len({t.uid for t in taken}) == s["taken"] + s["drained"]
    assert s["admitted"] == s["taken"] + s["drained"] + s["evicted"]
    assert s["offered"] == n_producers * per_producer == s["admitted"] + s["dropped_total"] - s["evicted"]
    assert s["evicted"] > 0 and s["dropped_stale"] > s["evicted"] and s["lag_taken_max"] <= max_lag


def test_put_blocks_when_full_then_times_out_without_admitting():
    q = TrajectoryQueue(capacity=2)
    q.put(make_traj("a"))
    q.put(make_traj("b"))
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(make_traj("c"), timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert not q.put(make_traj("a", version=0))  # a duplicate is dropped at once, even when full
    q.take(1)
    assert q.put(make_traj("c"), timeout=1)  # not marked as seen by the failed attempt
    assert [t.uid for t in q.take(2)] == ["b", "c"]
    s = q.stats()
    assert s["offered"] == 4 and s["admitted"] == 3 and s["dropped_duplicate"] == 1  # the timeout is no offer


def test_take_times_out_without_consuming():
    q = TrajectoryQueue(capacity=4)
    q.put(make_traj("a"))
    with pytest.raises(TimeoutError):
        q.take(2, timeout=0.05)
    assert len(q) == 1 and q.stats()["consumer_wait_s"] >= 0.05
    with pytest.raises(ValueError, match="capacity"):
        q.take(5)


@pytest.mark.parametrize("blocked", ["producer", "consumer"])
def test_close_wakes_blocked_waiters(blocked):
    q = TrajectoryQueue(capacity=1)
    if blocked == "producer":
        q.put(make_traj("a"))
    errors = []

    def run():
        try:
            q.put(make_traj("b")) if blocked == "producer" else q.take(1)
        except QueueClosed as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.1)
    assert t.is_alive()  # really blocked
    q.close()
    t.join(timeout=5)
    assert not t.is_alive() and len(errors) == 1
    with pytest.raises(QueueClosed):
        q.put(make_traj("c"))
    assert q.stats()["admitted"] == (1 if blocked == "producer" else 0)


def test_after_close_take_fails_without_consuming_and_drain_returns_all():
    q = TrajectoryQueue(capacity=4)
    for uid in "abc":
        q.put(make_traj(uid))
    q.close()
    assert [t.uid for t in q.take(1)] == ["a"]  # still deliverable
    with pytest.raises(QueueClosed):
        q.take(3)
    assert [t.uid for t in q.drain()] == ["b", "c"]
    assert q.stats()["drained"] == 2 and len(q) == 0


def test_invalid_trajectories_are_dropped_and_named():
    q = TrajectoryQueue(capacity=4, vocab_size=5)
    assert not q.put(make_traj("bad", bad=True))
    assert "action_mask" in q.stats()["last_invalid"] and "'bad'" in q.stats()["last_invalid"]
    assert not q.put(make_traj("big-token", token=7))
    assert "vocabulary" in q.stats()["last_invalid"]
    assert not q.put("not a trajectory")
    assert q.put(make_traj("ok"))
    s = q.stats()
    assert s["dropped_invalid"] == 3 and s["admitted"] == 1 and s["admitted_fraction"] == 0.25


def test_drops_are_logged_at_most_once_per_interval_with_their_reasons(caplog, monkeypatch):
    """A poisoned producer drops thousands of trajectories a second: one line per interval, never silence."""
    monkeypatch.setattr(queue_module, "DROP_LOG_INTERVAL_S", 0.3)
    q = TrajectoryQueue(capacity=4, vocab_size=5)
    with caplog.at_level(logging.WARNING, logger="ipa_jax.rollout.queue"):
        for i in range(500):
            assert not q.put(make_traj(f"bad-{i}", bad=True))
        time.sleep(0.35)
        assert not q.put(make_traj("big-token", token=7))
    first, second = [r.getMessage() for r in caplog.records]
    assert "dropped 1 trajectories (invalid 1)" in first and "'bad-0': field 'action_mask'" in first
    assert "dropped 500 trajectories (invalid 500)" in second and "vocabulary" in second


def test_stale_drops_are_counted_and_logged_at_debug_level_only(caplog):
    """Stale drops are the lag bound at work (the learner's progress line counts them): no WARNING lines."""
    q = TrajectoryQueue(capacity=4, max_policy_lag=0, initial_version=2)
    with caplog.at_level(logging.DEBUG, logger="ipa_jax.rollout.queue"):
        assert not q.put(make_traj("old", version=0))
    assert q.stats()["dropped_stale"] == 1
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and "(stale 1)" in record.getMessage()
