"""Rollout workers: an asyncio loop in a background thread keeps N episodes in flight and feeds the queue.

The learner thread only sees the TrajectoryQueue (and `call` to run engine coroutines, e.g. weight
updates, on the worker's loop, where the engine's asyncio resources live). Finished trajectories that
cannot be delivered at shutdown (queue closed or full) are kept in `leftovers`, never lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from queue import Full
from typing import Any, TypeVar

from ipa_jax.activity import ActivityClock
from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine
from ipa_jax.envs import Env, Task
from ipa_jax.rollout.agent import AgentConfig, close_event_loop, run_episode
from ipa_jax.rollout.branch import SKIP_REASONS, Branching, branch_episode, is_branched
from ipa_jax.rollout.queue import QueueClosed, TrajectoryQueue
from ipa_jax.trajectory import Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutWorker:
    """Keeps `concurrency` episodes in flight on `engine`, putting each finished Trajectory into `queue`.

    tasks: any iterable of Tasks (e.g. `itertools.cycle(train_tasks)`); each task is played `group_size`
    times in a row (same task_id: one group for group baselines). The worker ends by itself when the
    tasks run out or `max_episodes` have started. After `max_consecutive_failures` episodes in a row raise,
    it stops and `check()` re-raises the last error in the caller's thread. `clock`: where the episodes'
    generation and tool time is measured (`run_episode`). `branch`: chunk values by branching (rollout/branch.py):
    the selected finished episodes get `chunk_advantages` from continuations sampled before they are delivered;
    the continuations are counted apart from the episodes (branch_* in `stats()`).
    """

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        tasks: Iterable[Task],
        queue: TrajectoryQueue,
        config: AgentConfig = AgentConfig(),
        *,
        concurrency: int = 8,
        group_size: int = 1,
        max_episodes: int | None = None,
        env_factory: Callable[[Task], Env] | None = None,
        max_consecutive_failures: int = 5,
        name: str = "rollout",
        clock: ActivityClock | None = None,
        branch: Branching | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_episodes is not None and max_episodes < 0:
            raise ValueError(f"max_episodes must be >= 0 or None, got {max_episodes}")
        self.engine, self.chat, self.queue, self.config = engine, chat, queue, config
        self.concurrency, self.group_size, self.max_episodes = concurrency, group_size, max_episodes
        self.env_factory = env_factory
        self.max_consecutive_failures = max_consecutive_failures
        self.name = name
        self.clock = clock
        self.branch = branch
        self._tasks: Iterator[Task] = itertools.chain.from_iterable(itertools.repeat(t, group_size) for t in tasks)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._in_flight: set[str] = set()
        self._started_at = 0.0
        self._finished_at: float | None = None
        self.error: BaseException | None = None
        self.leftovers: list[Trajectory] = []
        self._stats = {
            "started": 0,
            "finished": 0,
            "aborted": 0,
            "failed": 0,
            "admitted": 0,
            "dropped": 0,
            "generated_tokens": 0,
            "successes": 0,
            "branched": 0,  # episodes given chunk advantages
            "branch_skipped": 0,  # selected for branching but left without (rollout/branch.py), and why:
            **{f"branch_{reason}": 0 for reason in SKIP_REASONS},
            "branch_episodes": 0,  # continuations finished: the extra rollouts
            "branch_generated_tokens": 0,
        }
        self._finished_index = 0
        self._consecutive_failures = 0

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> RolloutWorker:
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def _thread_main(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._started_at = time.perf_counter()
        ready.set()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._finished_at = time.perf_counter()
            close_event_loop(self._loop)

    async def _main(self) -> None:
        await asyncio.gather(*(self._slot() for _ in range(self.concurrency)))

    def _next_task(self) -> Task | None:
        with self._lock:
            if self._stopping.is_set():
                return None
            if self.max_episodes is not None and self._stats["started"] >= self.max_episodes:
                return None
            task = next(self._tasks, None)
            if task is not None:
                self._stats["started"] += 1
            return task

    async def _slot(self) -> None:
        loop = asyncio.get_running_loop()
        while (task := self._next_task()) is not None:
            uid = f"{task.task_id}#{uuid.uuid4().hex[:12]}"
            with self._lock:
                self._in_flight.add(uid)
            try:
                env = self.env_factory(task) if self.env_factory is not None else None
                traj = await run_episode(self.engine, self.chat, task, self.config, env=env, uid=uid, clock=self.clock)
            except Exception as e:  # an episode failure must not kill the other episodes
                self._record_failure(e)
                continue
            finally:
                with self._lock:
                    self._in_flight.discard(uid)
            self._consecutive_failures = 0
            if traj is None:
                self._count("aborted")
                continue
            self._count("finished")
            self._count("generated_tokens", traj.info["generated_tokens"])
            self._count("successes", int(traj.reward > 0))
            if self.branch is not None and self._select_for_branching():
                await self._branch(task, traj)
            await loop.run_in_executor(None, self._deliver, traj)

    def _select_for_branching(self) -> bool:
        with self._lock:
            index, self._finished_index = self._finished_index, self._finished_index + 1
        return is_branched(index, self.branch.fraction)

    async def _branch(self, task: Task, traj: Trajectory) -> None:
        """Sets traj.chunk_advantages from continuations (`branch_episode`), or leaves it None (branch_skipped)."""
        uids = self.branch.continuation_uids(traj)
        with self._lock:
            self._in_flight.update(uids)
        try:
            outcome = await branch_episode(
                self.engine,
                self.chat,
                task,
                traj,
                self.branch.samples,
                self.config,
                env_factory=self.env_factory,
                clock=self.clock,
            )
        except Exception:  # e.g. an environment that fails to replay the prefix: deliver the episode unbranched
            log.exception("%s: branching episode %s failed", self.name, traj.uid)
            self._count("branch_skipped")
            self._count("branch_failed")
            return
        finally:
            with self._lock:
                self._in_flight.difference_update(uids)
        self._count("branch_episodes", outcome.continuations)
        self._count("branch_generated_tokens", outcome.generated_tokens)
        if outcome.chunk_advantages is None:
            log.debug("%s: episode %s not branched (%s): %s", self.name, traj.uid, outcome.skipped, outcome.detail)
            self._count("branch_skipped")
            self._count(f"branch_{outcome.skipped}")
            return
        traj.chunk_advantages = outcome.chunk_advantages
        traj.info["branch_values"] = outcome.values.tolist()
        self._count("branched")

    def _record_failure(self, e: Exception) -> None:
        log.exception("%s: episode failed", self.name)
        self._count("failed")
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.max_consecutive_failures:
            self.error = e
            self._stopping.set()

    def _deliver(self, traj: Trajectory) -> None:
        """Blocking put (in an executor thread); a trajectory that cannot be delivered is kept."""
        while True:
            try:
                admitted = self.queue.put(traj, timeout=0.1)
            except Full:
                if self._stopping.is_set():
                    break
                continue
            except QueueClosed:
                break
            self._count("admitted" if admitted else "dropped")
            return
        with self._lock:
            self.leftovers.append(traj)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def stop(self, abort_in_flight: bool = False, timeout: float | None = 60.0) -> None:
        """Start no new episode; let those in flight finish (or abort them) and deliver them; join the thread."""
        self._stopping.set()
        with self._lock:
            in_flight = list(self._in_flight)
        if abort_in_flight and in_flight:
            try:
                self.call(self.engine.abort, in_flight, timeout=timeout)
            except (RuntimeError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass  # the loop finished meanwhile
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.name}: still running after {timeout}s")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Re-raise a fatal worker error in the caller's thread."""
        if self.error is not None:
            raise RuntimeError(
                f"{self.name} stopped after {self.max_consecutive_failures} failed episodes"
            ) from self.error

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        """Run `await fn(*args)` on the worker's event loop (e.g. engine.update_weights) and return its result."""
        if self._loop is None or not self.running:
            raise RuntimeError(f"{self.name}: not running")
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result(timeout)

    # ---- reporting ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        end = self._finished_at if self._finished_at is not None else time.perf_counter()
        elapsed = max(end - self._started_at, 1e-9) if self._started_at else 0.0
        with self._lock:
            s = dict(self._stats)
            s["in_flight"] = len(self._in_flight)
            s["leftovers"] = len(self.leftovers)
        s["elapsed_s"] = elapsed
        s["episodes_per_s"] = s["finished"] / elapsed if elapsed else 0.0
        s["generated_tokens_per_s"] = s["generated_tokens"] / elapsed if elapsed else 0.0
        s["success_rate"] = s["successes"] / s["finished"] if s["finished"] else 0.0
        return s
