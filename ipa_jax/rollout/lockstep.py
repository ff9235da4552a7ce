"""Lockstep episodes: a set of episodes advances turn by turn, so what they sample depends on the weights, their tasks
and their seeds alone, never on thread timing or on what else the machine is doing (rollout.schedule = "lockstep").

The episodes run concurrently as usual (`run_episode` and friends, unchanged), each on its own view of a
`TurnBarrier` instead of the engine: a view's generate call waits until every episode still playing has made its
own, then all of them go to the engine as ONE generate call, in the episodes' order. The engine therefore sees the
same requests together every time, and each request carries a `sampling_seed` derived from the episode's
(`derive_seed`), so its tokens are drawn from its own keys (the embedded engine's per-row keys; SGLang's
sampling_seed). An episode that finishes (or fails) leaves the barrier, releasing the turn the others wait on.

What it costs: a turn waits for the slowest episode's turn (the engine's rows fill again at the next turn instead
of at once), and every episode of the set holds its environment until it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np

from ipa_jax.engines.base import Engine, GenerationResult, SamplingParams

T = TypeVar("T")
SEED_BITS = 63  # SamplingParams.sampling_seed's range: [0, 2**63)


def derive_seed(*words: int) -> int:
    """A seed in [0, 2**63) from non-negative integer words (NumPy's SeedSequence hash: words that differ anywhere
    give unrelated seeds), e.g. (train seed, rollout seed, step, episode index)."""
    high, low = np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint32)
    return ((int(high) << 32) | int(low)) & ((1 << SEED_BITS) - 1)


class TurnBarrier:
    """Gathers one generate call of each of `members` episodes and sends them to `engine` together, in member order
    (`view(i)` is member i's engine; `leave()` when a member is done)."""

    def __init__(self, engine: Engine, members: int):
        self.engine = engine
        self.live = members
        self._waiting: dict[int, tuple[list[int], SamplingParams, str | None, str | None, asyncio.Future]] = {}
        self._sends: set[asyncio.Task] = set()

    def view(self, member: int) -> BarrierView:
        return BarrierView(self, member)

    def leave(self) -> None:
        self.live -= 1
        self._release()

    async def request(
        self, member: int, prompt: list[int], params: SamplingParams, session_id: str | None, request_id: str | None
    ) -> GenerationResult:
        if member in self._waiting:
            raise RuntimeError(f"lockstep member {member} made a second generate call in one turn")
        future = asyncio.get_running_loop().create_future()
        self._waiting[member] = (prompt, params, session_id, request_id, future)
        self._release()
        return await future

    def _release(self) -> None:
        """Every member still playing waits: send their calls as one."""
        if not self._waiting or len(self._waiting) < self.live:
            return
        turn = [self._waiting[m] for m in sorted(self._waiting)]
        self._waiting = {}
        task = asyncio.ensure_future(self._send(turn))
        self._sends.add(task)  # held until done (the loop keeps only weak references to tasks)
        task.add_done_callback(self._sends.discard)

    async def _send(self, turn: list[tuple]) -> None:
        prompts, params, sessions, requests, futures = (list(x) for x in zip(*turn))
        try:
            results = await self.engine.generate(
                prompts,
                params,
                session_ids=None if None in sessions else sessions,
                request_ids=None if None in requests else requests,
            )
        except BaseException as e:  # noqa: BLE001 - every member of the turn gets the error
            for future in futures:
                if not future.done():
                    future.set_exception(e)
            return
        for future, result in zip(futures, results):
            if not future.done():
                future.set_result(result)


class BarrierView:
    """One member's engine: `generate` of one prompt through its TurnBarrier (what the agent loop calls)."""

    def __init__(self, barrier: TurnBarrier, member: int):
        self.barrier, self.member = barrier, member

    @property
    def weight_version(self) -> int:
        return self.barrier.engine.weight_version

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        session_ids: list[str] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[GenerationResult]:
        if len(prompts) != 1:
            raise ValueError(f"a lockstep episode sends one prompt per turn, got {len(prompts)}")
        (p,) = [params] if isinstance(params, SamplingParams) else params
        result = await self.barrier.request(
            self.member,
            list(prompts[0]),
            p,
            session_ids[0] if session_ids else None,
            request_ids[0] if request_ids else None,
        )
        return [result]


async def in_lockstep(engine: Engine, plays: Sequence[Callable[[Engine], Awaitable[T]]]) -> list[T | BaseException]:
    """Runs every `play(engine_view)` at once, their generate calls in lockstep (`TurnBarrier`); returns each play's
    result, or the exception it raised, in order (one failed episode does not stop the others)."""
    barrier = TurnBarrier(engine, len(plays))

    async def one(member: int, play: Callable[[Engine], Awaitable[T]]) -> T:
        try:
            return await play(barrier.view(member))
        finally:
            barrier.leave()

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(plays)), return_exceptions=True))
