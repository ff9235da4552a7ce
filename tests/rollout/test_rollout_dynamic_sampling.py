"""GroupSampler (dynamic sampling): whole groups with different rewards from the queue, equal-reward groups dropped
and replaced, the draw bound, the staleness bound on waiting members, incomplete groups, timeouts, leftovers. Each
scenario's expected batch and counts are worked out by hand from the arrivals it puts in the queue."""

import logging

import numpy as np
import pytest

from ipa_jax.rollout.dynamic_sampling import DrawCounts, GroupSampler, has_reward_variance
from ipa_jax.rollout.queue import QueueClosed, TrajectoryQueue
from ipa_jax.trajectory import Trajectory


def member(task: str, index: int, reward: float, version: int = 0) -> Trajectory:
    """Sample `index` of `task` (one group per task) with `reward`, sampled by weights `version`."""
    return Trajectory(
        uid=f"{task}#{index}",
        tokens=np.array([1, 2, 3, 4]),
        action_mask=np.array([False, False, True, True]),
        behavior_logprobs=np.array([0.0, 0.0, -0.5, -0.25]),
        chunk_ids=np.array([-1, -1, 0, 0]),
        expert_mask=np.zeros(4, bool),
        reward=reward,
        policy_version=version,
        info={"task_id": task},
    )


def put_all(queue: TrajectoryQueue, arrivals: list[tuple[str, int, float]], version: int = 0) -> None:
    for task, index, reward in arrivals:
        assert queue.put(member(task, index, reward, version))


def uids(trajs: list[Trajectory]) -> list[str]:
    return [t.uid for t in trajs]


def test_reward_variance_is_any_difference_in_the_group():
    assert has_reward_variance([member("a", 0, 0.0), member("a", 1, 1.0)])
    assert has_reward_variance([member("a", 0, 0.5), member("a", 1, 0.5), member("a", 2, 0.25)])
    assert not has_reward_variance([member("a", 0, 1.0), member("a", 1, 1.0)])


def test_interleaved_groups_equal_rewards_dropped_and_refilled():
    queue = TrajectoryQueue(capacity=32)
    # A: 0/1 kept; B: 0/0 dropped; C: 1/1 dropped; D: 1/0 kept; E: never needed (stays in the queue).
    put_all(
        queue,
        [("A", 0, 0), ("B", 0, 0), ("A", 1, 1), ("C", 0, 1), ("B", 1, 0), ("D", 0, 1), ("C", 1, 1), ("D", 1, 0)]
        + [("E", 0, 0), ("E", 1, 1)],
    )
    sampler = GroupSampler(queue, group_size=2, max_batches=4)
    assert uids(sampler.take(4, timeout=5)) == ["A#0", "A#1", "D#0", "D#1"]
    assert sampler.last == DrawCounts(groups_drawn=4, groups_dropped=2, episodes_drawn=8, episodes_dropped=4)
    assert len(queue) == 2 and sampler.leftovers() == []
    assert sampler.metrics()["dynamic_groups_dropped"] == 2 and sampler.metrics()["dynamic_groups_drawn_total"] == 4


def test_draw_bound_fills_the_batch_with_the_last_dropped_groups(caplog):
    queue = TrajectoryQueue(capacity=32)
    put_all(queue, [("B", 0, 0), ("B", 1, 0), ("A", 0, 0), ("A", 1, 1), ("C", 0, 1), ("C", 1, 1)])
    sampler = GroupSampler(queue, group_size=2, max_batches=1)  # 1 batch of 4 = at most 2 groups drawn
    with caplog.at_level(logging.WARNING, logger="ipa_jax.rollout.dynamic_sampling"):
        out = sampler.take(4, timeout=5)
    assert uids(out) == ["A#0", "A#1", "B#0", "B#1"]  # C was never drawn
    assert sampler.last == DrawCounts(
        groups_drawn=2, groups_dropped=1, groups_filled=1, episodes_drawn=4, episodes_dropped=2, bound_hit=1
    )
    assert "queue.dynamic_sampling_max_batches" in caplog.text
    assert len(queue) == 2


def test_every_group_dropped_trains_on_the_most_recent_ones_at_the_bound():
    queue = TrajectoryQueue(capacity=32)
    put_all(queue, [(task, i, 1.0) for task in "PQRS" for i in range(2)])
    sampler = GroupSampler(queue, group_size=2, max_batches=2)
    assert uids(sampler.take(4, timeout=5)) == ["S#0", "S#1", "R#0", "R#1"]
    assert sampler.last.groups_drawn == 4 and sampler.last.groups_dropped == 4 and sampler.last.groups_filled == 2
    assert sampler.total.bound_hit == 1
    # The next batch starts its own count (and its own dropped groups).
    put_all(queue, [("T", 0, 0), ("T", 1, 1), ("U", 0, 1), ("U", 1, 0)])
    assert uids(sampler.take(4, timeout=5)) == ["T#0", "T#1", "U#0", "U#1"]
    assert sampler.last == DrawCounts(groups_drawn=2, episodes_drawn=4)
    assert sampler.total.groups_drawn == 6 and sampler.total.bound_hit == 1


def test_an_odd_request_carries_the_rest_of_a_kept_group_to_the_next_batch():
    queue = TrajectoryQueue(capacity=32)
    put_all(queue, [("A", 0, 0), ("A", 1, 1), ("B", 0, 1), ("B", 1, 0)])
    sampler = GroupSampler(queue, group_size=2, max_batches=4)
    assert uids(sampler.take(3, timeout=5)) == ["A#0", "A#1", "B#0"]
    assert uids(sampler.take(1, timeout=5)) == ["B#1"]  # nothing more drawn for it
    assert sampler.last == DrawCounts()


def test_waiting_members_beyond_the_staleness_bound_are_dropped_with_their_group():
    queue = TrajectoryQueue(capacity=32, max_policy_lag=1)
    sampler = GroupSampler(queue, group_size=2, max_batches=4)
    # Version 0: A's first member arrives (its group incomplete), B completes; C is kept, one member carried over.
    put_all(queue, [("A", 0, 1), ("B", 0, 0), ("B", 1, 1), ("C", 0, 0), ("C", 1, 1)])
    assert uids(sampler.take(3, timeout=5)) == ["B#0", "B#1", "C#0"]
    queue.set_version(1)  # lag 1: still admissible
    put_all(queue, [("D", 0, 1), ("D", 1, 0)], version=1)
    assert uids(sampler.take(3, timeout=5)) == ["C#1", "D#0", "D#1"]
    assert sampler.last.stale_episodes == 0
    queue.set_version(2)  # A#0 (version 0) is now 2 versions behind: A's group is dropped whole
    # A's later sample does not complete a group with the stale one; E does.
    put_all(queue, [("A", 1, 0), ("E", 0, 0), ("E", 1, 1)], version=2)
    assert uids(sampler.take(2, timeout=5)) == ["E#0", "E#1"]
    assert sampler.last.stale_episodes == 1 and uids(sampler.leftovers()) == ["A#1"]


def test_a_stale_member_carried_over_is_dropped_alone():
    queue = TrajectoryQueue(capacity=32, max_policy_lag=0)
    sampler = GroupSampler(queue, group_size=2, max_batches=4)
    put_all(queue, [("A", 0, 0), ("A", 1, 1)])
    assert uids(sampler.take(1, timeout=5)) == ["A#0"]
    queue.set_version(1)
    put_all(queue, [("B", 0, 0), ("B", 1, 1)], version=1)
    assert uids(sampler.take(2, timeout=5)) == ["B#0", "B#1"]
    assert sampler.last.stale_episodes == 1


def test_an_incomplete_group_times_out_and_the_next_call_goes_on_from_the_draws_so_far():
    queue = TrajectoryQueue(capacity=32)
    sampler = GroupSampler(queue, group_size=3, max_batches=4)
    put_all(queue, [("A", 0, 1), ("A", 1, 1), ("A", 2, 1), ("B", 0, 0), ("B", 1, 1)])
    with pytest.raises(TimeoutError):
        sampler.take(3, timeout=0.05)  # A drawn and dropped; B waits for its third member
    assert sampler.last == DrawCounts() and len(queue) == 0
    put_all(queue, [("B", 2, 1)])
    assert uids(sampler.take(3, timeout=5)) == ["B#0", "B#1", "B#2"]
    assert sampler.last == DrawCounts(groups_drawn=2, groups_dropped=1, episodes_drawn=6, episodes_dropped=3)


def test_leftovers_hold_waiting_and_kept_members_and_a_closed_queue_ends_the_wait():
    queue = TrajectoryQueue(capacity=32)
    sampler = GroupSampler(queue, group_size=2, max_batches=4)
    put_all(queue, [("A", 0, 0), ("A", 1, 1), ("B", 0, 1)])
    assert uids(sampler.take(1, timeout=5)) == ["A#0"]
    queue.close()
    with pytest.raises(QueueClosed):
        sampler.take(2, timeout=5)
    assert sorted(uids(sampler.leftovers())) == ["A#1", "B#0"] and sampler.leftovers() == []


def test_groups_of_one_and_no_draws_are_refused():
    queue = TrajectoryQueue(capacity=4)
    with pytest.raises(ValueError, match="group_size"):
        GroupSampler(queue, group_size=1, max_batches=4)
    with pytest.raises(ValueError, match="max_batches"):
        GroupSampler(queue, group_size=2, max_batches=0)
