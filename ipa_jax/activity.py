"""Where a run's wall time goes: an `ActivityClock` measures, for each kind of activity (a learner step, a weight
sync, a generation request, a tool call, ...), the wall time during which at least one of that kind was in
progress, on any thread, and the time two kinds overlapped.

    clock = ActivityClock()
    with clock.active("generation"):      # any number at once, from any thread
        ...
    clock.busy_s("generation")             # wall time with a generation in progress
    clock.busy_s("generation", "learner_step")   # ... while a learner step also was
    clock.busy_s("generation", without=("tools",))   # ... while no tool call was
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class ActivityClock:
    """Thread-safe. Time is split by the set of kinds in progress; busy_s sums the sets that hold the kinds asked."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._lock = threading.Lock()
        self._running: collections.Counter[str] = collections.Counter()
        self._by_set: collections.defaultdict[frozenset[str], float] = collections.defaultdict(float)
        self._since = now()

    def _advance(self) -> None:
        now = self._now()
        if self._running:
            self._by_set[frozenset(self._running)] += now - self._since
        self._since = now

    @contextlib.contextmanager
    def active(self, kind: str) -> Iterator[None]:
        """One activity of `kind` in progress for the block's duration."""
        with self._lock:
            self._advance()
            self._running[kind] += 1
        try:
            yield
        finally:
            with self._lock:
                self._advance()
                self._running[kind] -= 1
                if not self._running[kind]:
                    del self._running[kind]

    def busy_s(self, *kinds: str, without: tuple[str, ...] = ()) -> float:
        """Seconds during which every one of `kinds` was in progress and none of `without` (an activity still
        running counts to now)."""
        with self._lock:
            self._advance()
            return sum(
                s for active, s in self._by_set.items() if active.issuperset(kinds) and active.isdisjoint(without)
            )
