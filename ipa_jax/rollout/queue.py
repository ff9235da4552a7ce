"""The trajectory queue between rollout workers (producers, any thread) and the learner (consumer).

Bounded and thread-safe. Admission by policy lag: a trajectory is admitted while `current_version - v <=
max_policy_lag`, v the version of its oldest chunk (`sampling_version`; a chunk continued across a weight update
counts as the newest version that sampled it); when the learner advances the version (`set_version`),
trajectories already waiting that became too stale are evicted. Every admitted trajectory is delivered
exactly once (by `take` or, at shutdown, by `drain`); a uid is admitted at most once. Drops (stale,
duplicate, invalid: `Trajectory.validate`, with versions ahead of the queue's and rewards outside
`reward_range` invalid too) are counted, logged at most every `DROP_LOG_INTERVAL_S` seconds with their
reasons (stale ones at debug level: expected under the lag bound, the learner's progress line counts them), and,
if `on_drop` is given, handed to it (e.g. to write them out).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ipa_jax.trajectory import DropLog, Trajectory

log = logging.getLogger(__name__)

DROP_REASONS = ("stale", "duplicate", "invalid")
DROP_LOG_INTERVAL_S = 30.0
_DROP_DETAIL = {"stale": "policy lag above max_policy_lag", "duplicate": "uid already admitted"}


def sampling_version(traj: Trajectory) -> int:
    """The version the staleness bound applies to: the oldest of the trajectory's chunk versions (its
    policy_version when they are not recorded)."""
    cv = traj.chunk_versions
    return int(cv.min()) if cv is not None and cv.size else int(traj.policy_version)


class QueueClosed(Exception):
    """put() after close(), or take() that can no longer be satisfied because the queue is closed."""


class TrajectoryQueue:
    """Bounded FIFO of finished trajectories with lag-based admission. See the module docstring."""

    def __init__(
        self,
        capacity: int = 256,
        max_policy_lag: int | None = None,
        *,
        vocab_size: int | None = None,
        reward_range: tuple[float, float] | None = None,
        initial_version: int = 0,
        rate_window_s: float = 60.0,
        on_drop: Callable[[Trajectory, str], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0 or None, got {max_policy_lag}")
        if rate_window_s <= 0:
            raise ValueError(f"rate_window_s must be > 0, got {rate_window_s}")
        self.capacity = capacity
        self.max_policy_lag = max_policy_lag
        self.vocab_size = vocab_size
        self.reward_range = reward_range
        self.on_drop = on_drop
        self._drop_log = DropLog(log, "trajectory queue", DROP_LOG_INTERVAL_S)
        # Stale drops are the policy-lag bound at work, not a fault: counted in stats() (the learner's progress line
        # shows them) and logged at debug level only.
        self._stale_log = DropLog(log, "trajectory queue", DROP_LOG_INTERVAL_S, level=logging.DEBUG)
        self._version = initial_version
        self._items: collections.deque[Trajectory] = collections.deque()
        self._seen: set[str] = set()  # every uid ever admitted (~100 bytes each)
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self._rate_window_s = rate_window_s
        self._start = time.monotonic()
        self._put_times: collections.deque[float] = collections.deque()
        self._take_times: collections.deque[float] = collections.deque()
        # offered = admitted + dropped at put; admitted = taken + drained + evicted (stale after admission) + depth
        self._counts = {"offered": 0, "admitted": 0, "taken": 0, "drained": 0, "evicted": 0}
        self._drops = dict.fromkeys(DROP_REASONS, 0)
        self._last_invalid = ""
        self._lag_sum = 0
        self._lag_max = 0
        self._last_take_lags: list[int] = []
        self._consumer_wait_s = 0.0
        self._producer_wait_s = 0.0

    # ---- versions -------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def _lag(self, traj: Trajectory) -> int:
        return self._version - sampling_version(traj)  # >= 0: a version ahead of the queue's is invalid

    def _is_stale(self, traj: Trajectory) -> bool:
        return self.max_policy_lag is not None and self._lag(traj) > self.max_policy_lag

    def set_version(self, version: int) -> None:
        """The learner's current weight version (non-decreasing); evicts waiting trajectories now too stale."""
        dropped: list[Trajectory] = []
        with self._lock:
            if version < self._version:
                raise ValueError(f"version must not decrease: {version} < {self._version}")
            self._version = version
            if self.max_policy_lag is not None:
                keep = collections.deque()
                for traj in self._items:
                    (dropped if self._is_stale(traj) else keep).append(traj)
                self._items = keep
                self._drops["stale"] += len(dropped)
                self._counts["evicted"] += len(dropped)
                if dropped:
                    self._not_full.notify_all()
        self._report_drops(dropped, "stale")

    # ---- producers ------------------------------------------------------------------------------------
    def put(self, traj: Trajectory, timeout: float | None = None) -> bool:
        """Offer a finished trajectory. Returns True if admitted, False if dropped (invalid, duplicate uid,
        or policy lag above max_policy_lag). Blocks while the queue is full; raises queue.Full after
        `timeout` seconds (the trajectory is then not admitted and may be offered again) and QueueClosed
        after close()."""
        problem = self._invalid_reason(traj)
        with self._lock:
            if self._closed:
                raise QueueClosed("put() on a closed TrajectoryQueue")
            if problem is not None:
                reason = "invalid"
                self._last_invalid = problem
            else:
                reason = self._rejection(traj)  # checked before blocking: a doomed trajectory never waits
                if not reason:
                    self._wait_for_space(timeout)
                    reason = self._rejection(traj)  # the version may have advanced meanwhile
            self._counts["offered"] += 1  # counted once decided (a timed-out attempt may be offered again)
            if not reason:
                self._seen.add(traj.uid)
                self._items.append(traj)
                self._counts["admitted"] += 1
                self._put_times.append(time.monotonic())
                self._not_empty.notify_all()
                return True
            self._drops[reason] += 1
        self._report_drops([traj], reason, problem)
        return False

    def _rejection(self, traj: Trajectory) -> str:
        """'duplicate', 'stale' or '' (admissible); called with the lock held."""
        return "duplicate" if traj.uid in self._seen else "stale" if self._is_stale(traj) else ""

    def _invalid_reason(self, traj: Any) -> str | None:
        if not isinstance(traj, Trajectory):
            return f"not a Trajectory: {type(traj).__name__}"
        try:
            # Not ahead of the learner: the engines serve versions the learner has already set here.
            traj.validate(self.vocab_size, reward_range=self.reward_range, max_version=self._version)
        except ValueError as e:
            return str(e)
        return None

    def _wait_for_space(self, timeout: float | None) -> None:
        """Called with the lock held; returns when there is room, else raises queue.Full / QueueClosed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        t0 = time.monotonic()
        try:
            while len(self._items) >= self.capacity and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise queue.Full(f"TrajectoryQueue full ({self.capacity}) for {timeout}s")
                self._not_full.wait(remaining)
        finally:
            self._producer_wait_s += time.monotonic() - t0
        if self._closed:
            raise QueueClosed("TrajectoryQueue closed while waiting for space")

    # ---- consumer -------------------------------------------------------------------------------------
    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """The next `n` admitted trajectories in arrival order. Blocks until `n` are available; raises
        TimeoutError after `timeout` seconds and QueueClosed once closed with fewer than `n` left (nothing
        is consumed in either case; `drain()` returns the rest)."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"n must be in [1, capacity={self.capacity}], got {n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            t0 = time.monotonic()
            try:
                while len(self._items) < n:
                    if self._closed:
                        raise QueueClosed(f"TrajectoryQueue closed with {len(self._items)} < {n} trajectories left")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"only {len(self._items)} of {n} trajectories after {timeout}s")
                    self._not_empty.wait(remaining)
            finally:
                self._consumer_wait_s += time.monotonic() - t0
            out = [self._items.popleft() for _ in range(n)]
            lags = [self._lag(t) for t in out]
            self._lag_sum += sum(lags)
            self._lag_max = max([self._lag_max, *lags])
            self._last_take_lags = lags
            self._counts["taken"] += n
            now = time.monotonic()
            self._take_times.extend([now] * n)
            self._not_full.notify_all()
            return out

    # ---- shutdown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """No more puts; wakes every waiting producer and consumer."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def drain(self) -> list[Trajectory]:
        """Remove and return every trajectory still waiting (e.g. to write them out on shutdown)."""
        with self._lock:
            out = list(self._items)
            self._items.clear()
            self._counts["drained"] += len(out)
            self._not_full.notify_all()
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    # ---- reporting ------------------------------------------------------------------------------------
    def _report_drops(self, trajs: list[Trajectory], reason: str, problem: str | None = None) -> None:
        drop_log = self._stale_log if reason == "stale" else self._drop_log
        for traj in trajs:
            drop_log.add(reason, problem or f"trajectory {traj.uid!r}: {_DROP_DETAIL[reason]}")
            if self.on_drop is not None:
                self.on_drop(traj, reason)

    def _rate(self, times: collections.deque[float], now: float) -> float:
        while times and times[0] < now - self._rate_window_s:
            times.popleft()
        return len(times) / min(self._rate_window_s, max(now - self._start, 1e-9))

    def stats(self) -> dict[str, Any]:
        """Flat dict of numbers: depth, versions, lags, drops, counts, throughput (per s), wait times."""
        with self._lock:
            now = time.monotonic()
            depth_lags = [self._lag(t) for t in self._items]
            taken = self._counts["taken"]
            return {
                "depth": len(self._items),
                "capacity": self.capacity,
                "version": self._version,
                "closed": self._closed,
                **self._counts,
                **{f"dropped_{r}": c for r, c in self._drops.items()},
                "dropped_total": sum(self._drops.values()),
                "admitted_fraction": self._counts["admitted"] / max(self._counts["offered"], 1),
                "lag_taken_mean": self._lag_sum / taken if taken else 0.0,
                "lag_taken_max": self._lag_max,
                "lag_last_take_mean": sum(self._last_take_lags) / max(len(self._last_take_lags), 1),
                "lag_depth_max": max(depth_lags, default=0),
                "put_per_s": self._rate(self._put_times, now),
                "take_per_s": self._rate(self._take_times, now),
                "consumer_wait_s": self._consumer_wait_s,
                "producer_wait_s": self._producer_wait_s,
                "uptime_s": now - self._start,
                "last_invalid": self._last_invalid,
            }
