"""A small deterministic Engine for HTTP/client tests, and helpers to run dev servers in threads.

FakeEngine's next token is a pure function of (context, weight offset), so an interrupted and resubmitted
generation (prompt + partial output) continues exactly as an uninterrupted one would: tests can check that
abort-resume and retries neither lose nor duplicate tokens.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

from ipa_jax.engines.base import Engine, GenerationResult, SamplingParams, broadcast_params, check_prompts
from ipa_jax.engines.devserver import DevServer

VOCAB = 97
ROUTED_LAYOUT = (2, 3)  # (layers, experts per token) of the fake routed experts


def next_token(context: list[int], offset: int) -> int:
    return (sum(context) * 31 + len(context) + 7 + offset) % VOCAB


def token_logprob(token: int) -> float:
    return -0.01 - 0.1 * (token % 5)


def expected_tokens(prompt: list[int], n: int, offset: int = 0, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """What FakeEngine generates for prompt, uninterrupted."""
    ctx = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = next_token(ctx, offset)
        out.append(t)
        ctx.append(t)
        if t in stop_ids:
            break
    return out


def fake_routed(num_tokens: int) -> np.ndarray:
    return (np.arange((num_tokens - 1) * 6, dtype=np.int32) % 5).reshape(num_tokens - 1, *ROUTED_LAYOUT)


def write_fake_weights(path: str, offset: int) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "fake_weights.json"), "w") as f:
        json.dump({"offset": offset}, f)
    return path


class FakeEngine(Engine):
    """Engine semantics of EmbeddedEngine (pause holds in place, abort ends with partial output) on a toy model
    that sleeps `step_s` per token. A weight update takes `update_delay_s`; `poisoned` makes every log-prob
    positive (every trajectory sampled from it is invalid)."""

    def __init__(
        self,
        step_s: float = 0.0,
        offset: int = 0,
        weight_version: int = 0,
        update_delay_s: float = 0.0,
        poisoned: bool = False,
    ):
        self.step_s = step_s
        self.update_delay_s = update_delay_s
        self.poisoned = poisoned
        self.offset = offset
        self._version = weight_version
        self._paused = False
        self._resumed: asyncio.Event | None = None
        self._active: dict[str, dict] = {}
        self.started: list[str] = []  # request ids in the order they started
        self.finished: list[str] = []  # request ids that returned (any reason)
        self.closed = False

    @property
    def weight_version(self) -> int:
        return self._version

    def generated(self) -> list[int]:
        """Tokens generated so far by each request in flight (read from any thread)."""
        return [len(state["tokens"]) for state in list(self._active.values())]

    def _event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    async def _one(self, prompt: list[int], p: SamplingParams, rid: str) -> GenerationResult:
        tokens: list[int] = []
        state = {"aborted": False, "tokens": tokens}
        self._active[rid] = state
        self.started.append(rid)
        try:
            while True:
                if not state["aborted"]:
                    await self._event().wait()  # held here while paused
                if state["aborted"]:
                    routed = fake_routed(len(prompt) + len(tokens)) if p.return_routed_experts and tokens else None
                    logprobs = [self._logprob(t) for t in tokens]
                    return GenerationResult(tokens, logprobs, "abort", None, self._version, routed)
                if len(tokens) >= p.max_new_tokens:
                    reason, matched = "length", None
                    break
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                if self._paused or state["aborted"]:
                    continue
                t = next_token(prompt + tokens, self.offset)
                tokens.append(t)
                if t in p.stop_token_ids:
                    reason, matched = "stop", t
                    break
            routed = fake_routed(len(prompt) + len(tokens)) if p.return_routed_experts else None
            return GenerationResult(tokens, [self._logprob(t) for t in tokens], reason, matched, self._version, routed)
        finally:
            del self._active[rid]
            self.finished.append(rid)

    async def generate(self, prompts, params, session_ids=None, request_ids=None):
        prompts = check_prompts(prompts)
        plist = broadcast_params(params, len(prompts))
        if any(p.stop for p in plist):
            raise ValueError("stop strings need a tokenizer; FakeEngine has none")
        rids = request_ids or [f"fake-{id(prompts)}-{i}" for i in range(len(prompts))]
        return list(await asyncio.gather(*(self._one(pr, p, r) for pr, p, r in zip(prompts, plist, rids))))

    def _logprob(self, token: int) -> float:
        return token_logprob(token) + (1.0 if self.poisoned else 0.0)

    async def update_weights(self, path: str, version: int) -> None:
        """Reads the offset of `write_fake_weights`; any other folder (a learner's HF weights, which this toy model
        cannot run) only changes the version."""
        await asyncio.sleep(self.update_delay_s)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no weights folder {path}")
        fake = os.path.join(path, "fake_weights.json")
        if os.path.exists(fake):
            with open(fake) as f:
                self.offset = json.load(f)["offset"]
        self._version = version

    async def pause(self) -> None:
        self._paused = True
        self._event().clear()

    async def resume(self) -> None:
        self._paused = False
        self._event().set()

    async def abort(self, request_ids=None) -> None:
        for rid, state in self._active.items():
            if request_ids is None or any(rid.startswith(p) for p in request_ids):
                state["aborted"] = True
        # wake requests held by a pause so they can return their partial output (set+clear wakes all waiters)
        ev = self._event()
        if not ev.is_set():
            ev.set()
            ev.clear()

    async def health(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True


def start_fake_server(port: int = 0, **engine_kw) -> DevServer:
    """A dev server around a new FakeEngine, running in a background thread."""
    return DevServer(FakeEngine(**engine_kw), port=port, enable_return_routed_experts=True).serve_in_thread()
