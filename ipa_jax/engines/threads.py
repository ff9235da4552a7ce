"""Engines across threads: `LoopThread`, an event loop running in a daemon thread, and `OnLoop`, an Engine whose
calls run on such a loop.

An asyncio engine belongs to the loop that first uses it. The online pipeline keeps one SGLang client of the server
pool on a LoopThread and gives the rollout worker (which runs its own loop) an `OnLoop` view of it: the pool's
health, probes and weight version are then one state, and probes go on while the learner computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ipa_jax.engines.base import Engine, GenerationResult, PartialCounts, PrefixCounts, SamplingParams

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run(coro)` from any other thread."""

    def __init__(self, name: str = "engine-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """`await coro` on the loop and return its result. An interruption of the caller (Ctrl-C) cancels the
        coroutine there, so its cleanup (e.g. a weight sync resuming the servers it paused) runs."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancels what is left on the loop, stops it and joins the thread."""

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class OnLoop(Engine):
    """`engine` (owned by `thread`) used from another event loop: each call runs on the engine's loop. Closing the
    view leaves the engine open (its owner closes it)."""

    def __init__(self, engine: Engine, thread: LoopThread):
        self.engine, self.thread = engine, thread

    async def _on_engine_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self.thread.submit(coro))  # cancelling this cancels the call there

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def partial_counts(self) -> PartialCounts:
        return self.engine.partial_counts()

    def prefix_counts(self) -> PrefixCounts | None:
        return self.engine.prefix_counts()

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        session_ids: list[str] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[GenerationResult]:
        return await self._on_engine_loop(self.engine.generate(prompts, params, session_ids, request_ids))

    async def update_weights(self, path: str, version: int) -> None:
        await self._on_engine_loop(self.engine.update_weights(path, version))

    @property
    def push_dtype(self) -> str | None:
        return self.engine.push_dtype

    async def push_weights(self, model, version: int) -> None:
        await self._on_engine_loop(self.engine.push_weights(model, version))

    async def pause(self) -> None:
        await self._on_engine_loop(self.engine.pause())

    async def resume(self) -> None:
        await self._on_engine_loop(self.engine.resume())

    async def abort(self, request_ids: list[str] | None = None) -> None:
        await self._on_engine_loop(self.engine.abort(request_ids))

    async def health(self) -> bool:
        return await self._on_engine_loop(self.engine.health())

    async def close(self) -> None:
        pass
