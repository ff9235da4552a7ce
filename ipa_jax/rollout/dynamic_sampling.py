"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.2): a batch is filled with whole groups whose
rewards differ; a group whose rewards are all equal is dropped and another one drawn from the queue.

Under a group baseline (objective.baseline = "group_mean") every advantage of such a group is 0: it adds nothing to
the gradient, only to the denominators, and a batch of them is an update of size 0. `GroupSampler` sits between
the `TrajectoryQueue` and the learner (process 0's `QueueSource`; the batch then reaches every process as before):

- members arrive from the queue one at a time and in any order; a group is the first `group_size` arrivals with
  the same key (`group_key`: the task id, the key the objective's group baseline uses) and is judged once complete;
- a complete group with equal rewards (max == min, as verl's filter compares std with 0) is dropped, one with
  different rewards is kept, and groups are drawn until the kept ones fill the batch;
- at most `max_batches` batches' worth of groups are drawn for one batch (`ceil(n / group_size)` groups each). At
  the bound the batch is filled with the last dropped groups (their advantages are 0 under a group baseline: the
  update then has fewer effective samples) rather than skipping the step: the step count, checkpoints and the
  compiled shapes stay as they are, and the batch says so in its counts (`bound_hit`) and a warning;
- the staleness bound holds for waiting members too: at every call, a group still incomplete whose oldest member is
  more than the queue's `max_policy_lag` versions behind is dropped whole (`stale_episodes`; a group can no longer
  complete from members sampled at the same time), and kept members carried over to the next batch (when the
  learner asked for a number of trajectories that is not a multiple of the group size) are dropped one by one
  when stale.

Nothing is lost: `leftovers()` are the members still waiting (QueueSource writes them to unconsumed.jsonl).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from ipa_jax.rollout.queue import TrajectoryQueue, sampling_version
from ipa_jax.trajectory import Trajectory, group_key

log = logging.getLogger(__name__)

BOUND_LOG_INTERVAL_S = 60.0


@dataclasses.dataclass
class DrawCounts:
    """What filling batches took: complete groups and their episodes drawn from the queue, dropped for equal rewards,
    trained on anyway because the draw bound was hit (`filled`), members of groups dropped as stale, and batches
    that hit the bound."""

    groups_drawn: int = 0
    groups_dropped: int = 0
    groups_filled: int = 0
    episodes_drawn: int = 0
    episodes_dropped: int = 0
    stale_episodes: int = 0
    bound_hit: int = 0

    def add(self, other: DrawCounts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def has_reward_variance(group: list[Trajectory]) -> bool:
    """Whether the group's rewards are not all equal: it carries a learning signal under a group baseline."""
    rewards = [t.reward for t in group]
    return max(rewards) != min(rewards)


class GroupSampler:
    """Whole groups with reward variance from `queue`, `group_size` members each, at most `max_batches` batches'
    worth of groups drawn per batch (see the module docstring). `last` holds the counts of the latest batch,
    `total` the sums over the run (this process's life)."""

    def __init__(self, queue: TrajectoryQueue, group_size: int, max_batches: int):
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a group of one has no reward variance), got {group_size}")
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self.queue, self.group_size, self.max_batches = queue, group_size, max_batches
        self._waiting: dict[str, list[Trajectory]] = {}  # incomplete groups by key, in order of first arrival
        self._kept: list[Trajectory] = []  # members of kept groups not yet handed out (ready for a batch)
        self._dropped: list[list[Trajectory]] = []  # this batch's equal-reward groups (filling at the bound)
        self._current = DrawCounts()  # the batch being filled (its draws span calls that time out)
        self.last = DrawCounts()
        self.total = DrawCounts()
        self._bound_logged_at = -math.inf

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """`n` trajectories of kept groups (whole groups while n is a multiple of group_size). Raises TimeoutError
        after `timeout` seconds without a full batch: the groups drawn so far stay, and the next call goes on from
        them; QueueClosed when the queue closes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._drop_stale()
        max_groups = self.max_batches * math.ceil(n / self.group_size)
        while len(self._kept) < n and self._current.groups_drawn < max_groups:
            group = self._next_group(deadline)
            self._current.groups_drawn += 1
            self._current.episodes_drawn += len(group)
            if has_reward_variance(group):
                self._kept.extend(group)
            else:
                self._current.groups_dropped += 1
                self._current.episodes_dropped += len(group)
                self._dropped.append(group)
        if len(self._kept) < n:
            self._fill_at_bound(n, max_groups)
        out, self._kept = self._kept[:n], self._kept[n:]
        self.last, self._current, self._dropped = self._current, DrawCounts(), []
        self.total.add(self.last)
        return out

    def _next_group(self, deadline: float | None) -> list[Trajectory]:
        """The next group to complete, from the queue's trajectories one at a time."""
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            (traj,) = self.queue.take(1, timeout=remaining)
            members = self._waiting.setdefault(group_key(traj), [])
            members.append(traj)
            if len(members) == self.group_size:
                return self._waiting.pop(group_key(traj))

    def _fill_at_bound(self, n: int, max_groups: int) -> None:
        """The draw bound is hit: the last dropped groups make up the batch (more groups than the bound allows were
        drawn for n trajectories, so they are enough)."""
        while len(self._kept) < n:
            self._kept.extend(self._dropped.pop())
            self._current.groups_filled += 1
        self._kept = self._kept[:n]  # a filler group's surplus is not carried into the next batch
        self._current.bound_hit = 1
        now = time.monotonic()
        if now - self._bound_logged_at >= BOUND_LOG_INTERVAL_S:
            self._bound_logged_at = now
            log.warning(
                "dynamic sampling: %d groups drawn (queue.dynamic_sampling_max_batches = %d batches' worth) left "
                "the batch short of groups with different rewards; %d groups with equal rewards fill it "
                "(%d such batches so far)",
                max_groups,
                self.max_batches,
                self._current.groups_filled,
                self.total.bound_hit + 1,
            )

    def _drop_stale(self) -> None:
        """Members now beyond the queue's staleness bound: incomplete groups whose oldest member is, whole; kept
        members carried over from the previous batch, one by one."""
        bound = self.queue.max_policy_lag
        if bound is None:
            return

        def stale(traj: Trajectory) -> bool:
            return self.queue.version - sampling_version(traj) > bound

        for key in [k for k, members in self._waiting.items() if any(map(stale, members))]:
            self._current.stale_episodes += len(self._waiting.pop(key))
        fresh = [t for t in self._kept if not stale(t)]
        self._current.stale_episodes += len(self._kept) - len(fresh)
        self._kept = fresh

    def leftovers(self) -> list[Trajectory]:
        """Every member still waiting (incomplete groups, kept members not handed out), removed from the sampler."""
        out = [t for members in self._waiting.values() for t in members] + self._kept
        self._waiting, self._kept = {}, []
        return out

    def metrics(self) -> dict[str, float]:
        """The latest batch's counts (dynamic_<count>) and the run's sums of drawn and dropped groups and of batches
        that hit the bound (dynamic_<count>_total)."""
        out = {f"dynamic_{k}": float(v) for k, v in dataclasses.asdict(self.last).items()}
        out.update(
            {
                f"dynamic_{k}_total": float(getattr(self.total, k))
                for k in ("groups_drawn", "groups_dropped", "bound_hit")
            }
        )
        return out
