"""Sampling with an engine: `resample_round` runs one planned round of anchored episodes concurrently and
returns the finalized batch; `ResampleSource` serves such rounds to the learner synchronously."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine
from ipa_jax.envs import Env, Task
from ipa_jax.rollout.agent import AgentConfig, close_event_loop
from ipa_jax.rollout.lockstep import derive_seed, in_lockstep
from ipa_jax.rollout.resample.anchored import run_anchored, whole_expert_episode
from ipa_jax.rollout.resample.resampler import Planned, Resampler
from ipa_jax.trajectory import Trajectory


async def resample_round(
    resampler: Resampler,
    engine: Engine,
    chat: ChatFormat,
    task_ids: Sequence[str],
    config: AgentConfig = AgentConfig(),
    *,
    concurrency: int = 8,
    env_factory: Callable[[Task], Env] | None = None,
    lockstep_seed: int | None = None,
) -> list[Trajectory]:
    """One round: plan -> sample concurrently -> record outcomes (in plan order) -> IL targets where a
    group failed (carriers sampled at forks this round did not visit) -> finalize masks. Returned task by
    task (in `task_ids` order; within a task, planned episodes then carriers). Aborted episodes are dropped
    (and not recorded). `lockstep_seed`: the planned episodes, then the carriers, each set at once in lockstep
    (`ipa_jax.rollout.lockstep`), the i-th of the round with seed derive_seed(lockstep_seed, i) and a uid of its
    place in the round."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sem = asyncio.Semaphore(concurrency)
    sampled = 0  # episodes of the round so far (lockstep: each one's seed and uid)

    async def one(p: Planned, index: int, engine: Engine) -> Trajectory | None:
        expert = resampler.expert(p.task_id)
        env = env_factory(expert.task) if env_factory is not None else None
        if resampler.is_whole_expert(p.task_id, p.anchor):
            return whole_expert_episode(expert, chat, env)
        if lockstep_seed is not None:
            seed, uid = derive_seed(lockstep_seed, index), f"{p.task_id}@{p.anchor}#{index}"
            return await run_anchored(engine, chat, expert, p.anchor, config, env=env, uid=uid, seed=seed)
        async with sem:
            return await run_anchored(engine, chat, expert, p.anchor, config, env=env)

    async def sample(plan: list[Planned]) -> list[tuple[Planned, Trajectory]]:
        nonlocal sampled
        plays = [functools.partial(one, p, sampled + i) for i, p in enumerate(plan)]
        sampled += len(plan)
        if lockstep_seed is None:
            trajs = await asyncio.gather(*(play(engine) for play in plays))
        else:
            trajs = await in_lockstep(engine, plays)
            for outcome in trajs:
                if isinstance(outcome, BaseException):
                    raise outcome
        done = [(p, t) for p, t in zip(plan, trajs) if t is not None]
        for p, t in done:
            if not resampler.is_whole_expert(p.task_id, p.anchor):  # the policy's own outcomes only
                resampler.record(p.task_id, p.anchor, t.reward)
        return done

    results = await sample(resampler.plan(task_ids))
    il_groups, carriers = resampler.il_targets([(p, t.reward) for p, t in results])
    results += await sample(carriers)
    # Task-major order (a task's carriers right after its own episodes): a round longer than a batch then
    # splits into batches that each carry imitation rows, instead of a batch of failures (no gradient without
    # a baseline) followed by one of carriers.
    order = {t: i for i, t in enumerate(task_ids)}
    results.sort(key=lambda pt: order[pt[0].task_id])
    return resampler.finalize(results, il_groups)


class ResampleSource:
    """A learner trajectory source (next_trajectories / state_dict / load_state_dict) that samples rounds
    of `resample_round` synchronously on its own event loop, config.tasks_per_round tasks (cycling over the
    experts in order) per round; surplus trajectories wait for the next call (they are not checkpointed).
    `lockstep_seed`: every round in lockstep, round r with the seed derive_seed(lockstep_seed, r)."""

    def __init__(
        self,
        resampler: Resampler,
        engine: Engine,
        chat: ChatFormat,
        config: AgentConfig = AgentConfig(),
        *,
        concurrency: int = 8,
        lockstep_seed: int | None = None,
    ):
        self.resampler, self.engine, self.chat, self.config = resampler, engine, chat, config
        self.tasks_per_round, self.concurrency = resampler.config.tasks_per_round, concurrency
        self.lockstep_seed = lockstep_seed
        self._order = list(resampler.experts)
        self._cursor = 0
        self._rounds = 0
        self._buffer: list[Trajectory] = []
        self._loop = asyncio.new_event_loop()

    def _next_tasks(self) -> list[str]:
        out = [self._order[(self._cursor + i) % len(self._order)] for i in range(self.tasks_per_round)]
        self._cursor = (self._cursor + self.tasks_per_round) % len(self._order)
        return out

    def next_trajectories(self, n: int) -> list[Trajectory]:
        while len(self._buffer) < n:
            seed = None if self.lockstep_seed is None else derive_seed(self.lockstep_seed, self._rounds)
            self._rounds += 1
            self._buffer += self._loop.run_until_complete(
                resample_round(
                    self.resampler,
                    self.engine,
                    self.chat,
                    self._next_tasks(),
                    self.config,
                    concurrency=self.concurrency,
                    lockstep_seed=seed,
                )
            )
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def run(self, coro: Any) -> Any:
        """Runs an engine coroutine (e.g. a weight update) on this source's loop."""
        return self._loop.run_until_complete(coro)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self._cursor, "rounds": self._rounds, "resampler": self.resampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._cursor = int(state["cursor"]) % len(self._order)
        self._rounds = int(state.get("rounds", 0))  # a checkpoint from before rounds were counted: from 0
        self.resampler.load_state_dict(state["resampler"])

    def close(self) -> None:
        close_event_loop(self._loop)  # cancels the engine's worker task, which lives on this loop
