"""SGLangEngine: an asyncio HTTP client of a pool of SGLang servers (native API; docs/sglang.md).

* `/generate` with `input_ids`, an explicit `max_new_tokens`, `return_logprob`; tokens and log-probs read from
  `meta_info.output_token_logprobs` (the matched stop token is kept); only sampling keys SGLang knows are sent.
* Routing: least in-flight requests, sticky per session id (multi-turn episodes reuse the server's prefix cache).
* Failures: connection errors, timeouts and 5xx are retried with exponential backoff on another server; a server
  with `down_after_failures` consecutive failures is marked down and probed on `/health_generate` until it
  answers again (it is brought to the pool's weight version before it takes requests). 4xx are not retried:
  they raise `SGLangHTTPError` naming the URL.
* Weight sync: hold new submissions -> `/pause_generation` on every server (in-flight requests come back
  aborted) -> `/update_weights_from_disk {model_path, weight_version}` -> version read back from
  `/get_model_info` -> `/continue_generation`. Aborted partial generations are resubmitted as prompt + partial
  output with the remaining budget, so callers see one result per prompt; only `abort()` surfaces "abort".
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import json
import logging
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np

from ipa_jax.engines.base import (
    Engine,
    EngineError,
    GenerationResult,
    SamplingParams,
    check_generate_args,
)

log = logging.getLogger(__name__)

# The sampling keys this client sends; every one is in SGLang's SamplingParams (0.5.5 .. 0.5.23 schema).
SENT_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop", "no_stop_trim")


class SGLangHTTPError(EngineError):
    """An SGLang server answered with an HTTP error (or an unusable body)."""

    def __init__(self, url: str, status: int | None, message: str):
        self.url, self.status, self.message = url, status, message
        where = f"HTTP {status}" if status is not None else "bad response"
        super().__init__(f"{url}: {where}: {message}")


def parse_weight_version(value: Any, url: str) -> int:
    """SGLang weight_version string -> int. "default" (SGLang's launch value, initial weights) -> 0."""
    if value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SGLangHTTPError(url, None, f"weight_version {value!r} is not an integer") from None


def to_sglang_sampling_params(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """SamplingParams -> SGLang's sampling_params dict (keys from SENT_SAMPLING_KEYS only)."""
    sp: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,  # SGLang rejects top_k == 0
        "no_stop_trim": True,  # only affects `text`; keeps it aligned with the tokens we read
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        sp["stop"] = list(params.stop)
    return sp


def _error_message(body: str) -> str:
    """The message of SGLang's error bodies ({"error": {"message"}} or {"message", ...}), else the raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    if isinstance(data, dict):
        if isinstance(data.get("error"), dict) and "message" in data["error"]:
            return str(data["error"]["message"])
        if "message" in data:
            return str(data["message"])
    return body.strip()[:500]


@dataclasses.dataclass
class _Server:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    down: bool = False
    served: int = 0
    probe_task: asyncio.Task | None = None


@dataclasses.dataclass
class _Request:
    rid: str
    aborted: bool = False
    submission: str | None = None  # rid of the submission in flight ("<rid>-<n>")


class _Transient(Exception):
    """A failure worth retrying on another server."""


class SGLangEngine(Engine):
    """Client of one or more SGLang servers (base URLs like "http://host:30000").

    Use it from one event loop (its HTTP session and events belong to the loop that first uses it).
    routed_experts_layout=(num_moe_layers, experts_per_token) is needed to reshape routed experts.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        request_timeout_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 600.0,
        max_attempts: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        down_after_failures: int = 3,
        probe_interval_s: float = 5.0,
        max_resubmits: int = 100,
        max_sticky_sessions: int = 100_000,
        routed_experts_layout: tuple[int, int] | None = None,
        weight_version: int = 0,
    ):
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL (urls is empty)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"SGLangEngine urls has duplicates: {urls}")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"SGLangEngine url {u!r} must start with http:// or https://")
        if max_attempts < 1 or down_after_failures < 1:
            raise ValueError("max_attempts and down_after_failures must be >= 1")
        self.servers = [_Server(u) for u in urls]
        self._by_url = {s.url: s for s in self.servers}
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.down_after_failures = down_after_failures
        self.probe_interval_s = probe_interval_s
        self.max_resubmits = max_resubmits
        self.max_sticky_sessions = max_sticky_sessions
        self.routed_experts_layout = routed_experts_layout
        self._weight_version = weight_version
        self._weight_path: str | None = None  # last synced checkpoint: servers that come back are brought to it
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._active: dict[str, _Request] = {}
        self._rr = 0
        self._warned_truncation = False
        self._session: aiohttp.ClientSession | None = None
        self._gate: asyncio.Event | None = None  # set = submissions allowed
        self._sync_lock: asyncio.Lock | None = None
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EngineError("SGLangEngine is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._gate = asyncio.Event()
            self._gate.set()
            self._sync_lock = asyncio.Lock()
        return self._session

    async def _control(
        self, server: _Server, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None
    ) -> Any:
        """One control call; returns the parsed JSON (or text). Raises SGLangHTTPError naming the URL."""
        url = server.url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._http().request(method, url, json=body, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise SGLangHTTPError(url, resp.status, _error_message(text))
                if resp.content_type == "application/json":
                    return json.loads(text)
                return text
        except (TimeoutError, aiohttp.ClientError) as e:
            raise SGLangHTTPError(url, None, f"{type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ routing and health
    def _pick(self, session_id: str | None, exclude: set[str]) -> _Server | None:
        up = [s for s in self.servers if not s.down]
        if session_id is not None:
            url = self._sticky.get(session_id)
            if url is not None and not self._by_url[url].down and url not in exclude:
                self._sticky.move_to_end(session_id)
                return self._by_url[url]
        candidates = [s for s in up if s.url not in exclude] or up
        if not candidates:
            return None
        self._rr += 1
        n = len(self.servers)
        # least in-flight; ties broken round-robin so idle servers share the load
        return min(candidates, key=lambda s: (s.in_flight, (self.servers.index(s) - self._rr) % n))

    def _remember(self, session_id: str | None, server: _Server) -> None:
        if session_id is None:
            return
        self._sticky[session_id] = server.url
        self._sticky.move_to_end(session_id)
        while len(self._sticky) > self.max_sticky_sessions:
            self._sticky.popitem(last=False)

    def _record_failure(self, server: _Server, error: str) -> None:
        server.consecutive_failures += 1
        if not server.down and server.consecutive_failures >= self.down_after_failures:
            server.down = True
            log.warning("%s marked down after %d failures (last: %s)", server.url, server.consecutive_failures, error)
            server.probe_task = asyncio.get_running_loop().create_task(self._probe_until_up(server))

    async def _probe_until_up(self, server: _Server) -> None:
        """Poll /health_generate; bring the server to the pool's weights; then route to it again."""
        while not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self._control(server, "GET", "/health_generate", timeout_s=max(self.probe_interval_s, 30.0))
                assert self._sync_lock is not None
                async with self._sync_lock:  # not while a weight sync runs on the others
                    if self._weight_path is not None:
                        version = await self._read_version(server)
                        if version != self._weight_version:
                            await self._update_one(server, self._weight_path, self._weight_version)
                    server.consecutive_failures = 0
                    server.down = False
                log.warning("%s is back up", server.url)
                return
            except SGLangHTTPError as e:
                log.info("probe of %s failed: %s", server.url, e)

    async def health(self) -> bool:
        """True iff at least one server answers /health_generate."""

        async def ok(server: _Server) -> bool:
            try:
                await self._control(server, "GET", "/health_generate", timeout_s=30.0)
                return True
            except SGLangHTTPError:
                return False

        return any(await asyncio.gather(*(ok(s) for s in self.servers)))

    # ------------------------------------------------------------------ generation
    async def _post_generate(self, payload: dict[str, Any], session_id: str | None) -> tuple[dict, _Server]:
        """POST /generate with routing and retries; returns (response, server)."""
        session = self._http()
        tried: set[str] = set()
        errors: list[str] = []
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            server = self._pick(session_id, tried)
            if server is None:
                errors.append("no server up")
                continue
            url = server.url + "/generate"
            server.in_flight += 1
            try:
                async with session.post(url, json=payload) as resp:
                    text = await resp.text()
                    if resp.status >= 500:
                        raise _Transient(f"HTTP {resp.status}: {_error_message(text)}")
                    if resp.status != 200:
                        raise SGLangHTTPError(url, resp.status, _error_message(text))
                    try:
                        out = await resp.json(content_type=None)
                    except ValueError as e:
                        raise SGLangHTTPError(url, resp.status, f"response is not JSON: {text[:200]!r}") from e
            except (TimeoutError, aiohttp.ClientError, _Transient) as e:
                err = f"{type(e).__name__}: {e}" if not isinstance(e, _Transient) else str(e)
                errors.append(f"{url}: {err}")
                tried.add(server.url)
                self._record_failure(server, err)
                continue
            finally:
                server.in_flight -= 1
            server.consecutive_failures = 0
            server.served += 1
            self._remember(session_id, server)
            if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
                raise SGLangHTTPError(url, 200, f"response lacks meta_info: {str(out)[:200]}")
            return out, server
        raise EngineError(f"/generate failed after {self.max_attempts} attempts: " + "; ".join(errors))

    def _warn_truncation(self, params: list[SamplingParams]) -> None:
        if not self._warned_truncation and any(p.truncates_support for p in params):
            self._warned_truncation = True
            warnings.warn(
                "top_p < 1 or top_k > 0: the sampler's support is truncated, so importance ratios against the "
                "full-vocabulary learner policy are biased (use top_p=1, top_k=-1 for RL)",
                UserWarning,
                stacklevel=3,
            )

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        session_ids: list[str] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[GenerationResult]:
        prompts, plist = check_generate_args(prompts, params, session_ids, request_ids)
        if any(p.return_routed_experts for p in plist) and self.routed_experts_layout is None:
            raise ValueError("return_routed_experts needs SGLangEngine(routed_experts_layout=(num_layers, top_k))")
        self._warn_truncation(plist)
        self._http()
        return await asyncio.gather(
            *(
                self._generate_one(
                    prompt,
                    p,
                    session_ids[i] if session_ids else None,
                    request_ids[i] if request_ids else uuid.uuid4().hex,
                )
                for i, (prompt, p) in enumerate(zip(prompts, plist))
            )
        )

    def _decode_routed(self, meta: dict[str, Any], num_tokens: int, url: str) -> np.ndarray:
        assert self.routed_experts_layout is not None
        if "routed_experts" not in meta:
            raise SGLangHTTPError(url, 200, "routed experts requested but meta_info has none "
                                  "(is the server started with --enable-return-routed-experts?)")
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        layers, topk = self.routed_experts_layout
        if flat.size != (num_tokens - 1) * layers * topk:
            raise SGLangHTTPError(url, 200, f"routed_experts has {flat.size} ints, expected "
                                  f"({num_tokens} - 1) * {layers} * {topk}")
        return flat.reshape(num_tokens - 1, layers, topk).copy()

    async def _generate_one(
        self, prompt: list[int], params: SamplingParams, session_id: str | None, rid: str
    ) -> GenerationResult:
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already in flight")
        req = _Request(rid)
        self._active[rid] = req
        tokens: list[int] = []
        logprobs: list[float] = []
        version = self._weight_version
        try:
            for submission in range(self.max_resubmits + 1):
                remaining = params.max_new_tokens - len(tokens)
                if remaining <= 0 and submission:
                    return GenerationResult(tokens, logprobs, "length", None, version)
                assert self._gate is not None
                await self._gate.wait()
                if req.aborted:
                    return GenerationResult(tokens, logprobs, "abort", None, version)
                payload: dict[str, Any] = {
                    "input_ids": prompt + tokens,
                    "sampling_params": to_sglang_sampling_params(params, remaining),
                    "return_logprob": True,
                    "rid": f"{rid}-{submission}",
                }
                if params.return_routed_experts:
                    payload["return_routed_experts"] = True
                req.submission = payload["rid"]
                try:
                    out, server = await self._post_generate(payload, session_id)
                finally:
                    req.submission = None
                meta = out["meta_info"]
                finish = meta.get("finish_reason") or {}
                kind = finish.get("type") if isinstance(finish, dict) else None
                pairs = meta.get("output_token_logprobs")
                if pairs is None:
                    if kind != "abort":
                        raise SGLangHTTPError(server.url, 200, "meta_info lacks output_token_logprobs")
                    pairs = []
                tokens += [int(x[1]) for x in pairs]
                logprobs += [float(x[0]) for x in pairs]
                if "weight_version" in meta:
                    version = parse_weight_version(meta["weight_version"], server.url)
                routed = None
                if params.return_routed_experts and pairs:
                    routed = self._decode_routed(meta, len(prompt) + len(tokens), server.url)
                if kind == "abort":
                    if req.aborted:
                        return GenerationResult(tokens, logprobs, "abort", None, version, routed)
                    continue  # interrupted by a pause or another client's abort: resubmit the rest
                if kind == "stop":
                    return GenerationResult(tokens, logprobs, "stop", finish.get("matched"), version, routed)
                if kind == "length":
                    return GenerationResult(tokens, logprobs, "length", None, version, routed)
                raise SGLangHTTPError(server.url, 200, f"unknown finish_reason {finish!r}")
            raise EngineError(f"request {rid} was aborted {self.max_resubmits + 1} times; giving up")
        finally:
            del self._active[rid]

    async def abort(self, request_ids: list[str] | None = None) -> None:
        """End in-flight requests whose id starts with one of request_ids (None: all of this client's); they
        return finish_reason "abort" with their partial output."""
        submissions = []
        for rid, req in self._active.items():
            if request_ids is None or any(rid.startswith(p) for p in request_ids):
                req.aborted = True  # also stops a resubmission that is not on a server yet
                if req.submission is not None:
                    submissions.append(req.submission)
        # Exact rids: SGLang's TokenizerManager ignores an abort whose rid it does not hold (its scheduler's
        # prefix match is not reachable over HTTP). The server holding a request is unknown during retries.
        calls = [self._control(s, "POST", "/abort_request", {"rid": r})
                 for s in self.servers if not s.down for r in submissions]
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, Exception):
                log.warning("abort_request failed: %s", r)

    # ------------------------------------------------------------------ weights and pausing
    async def _read_version(self, server: _Server) -> int:
        """Weight version from /get_model_info (all SGLang versions), /model_info as the fallback route."""
        try:
            info = await self._control(server, "GET", "/get_model_info")
        except SGLangHTTPError as e:
            if e.status != 404:
                raise
            info = await self._control(server, "GET", "/model_info")
        if not isinstance(info, dict) or "weight_version" not in info:
            raise SGLangHTTPError(server.url, 200, f"model info lacks weight_version: {str(info)[:200]}")
        return parse_weight_version(info["weight_version"], server.url)

    async def _update_one(self, server: _Server, path: str, version: int) -> None:
        out = await self._control(
            server, "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}
        )
        if not isinstance(out, dict) or not out.get("success", False):
            raise SGLangHTTPError(server.url + "/update_weights_from_disk", 200, f"update failed: {out}")
        got = await self._read_version(server)
        if got != version:
            raise SGLangHTTPError(server.url, 200, f"weight_version is {got} after updating to {version}")

    async def update_weights(self, path: str, version: int) -> None:
        """pause -> update_weights_from_disk(path, version) -> continue on every server that is up.

        A server that is unreachable is marked down and brought to (path, version) when it comes back; a server
        that answers but fails to load raises (after every server is continued)."""
        self._http()
        assert self._gate is not None and self._sync_lock is not None
        async with self._sync_lock:
            self._gate.clear()
            start = time.perf_counter()
            up = [s for s in self.servers if not s.down]
            paused: list[_Server] = []
            failures: list[str] = []
            try:
                results = await asyncio.gather(
                    *(self._control(s, "POST", "/pause_generation", {}) for s in up), return_exceptions=True
                )
                for s, r in zip(up, results):
                    if isinstance(r, SGLangHTTPError) and r.status is None:  # unreachable
                        self._mark_down(s, str(r))
                    elif isinstance(r, Exception):
                        failures.append(str(r))
                    else:
                        paused.append(s)
                results = await asyncio.gather(
                    *(self._update_one(s, path, version) for s in paused), return_exceptions=True
                )
                for s, r in zip(paused, results):
                    if isinstance(r, SGLangHTTPError) and r.status is None:
                        self._mark_down(s, str(r))
                    elif isinstance(r, Exception):
                        failures.append(str(r))
            finally:
                results = await asyncio.gather(
                    *(self._control(s, "POST", "/continue_generation", {}) for s in paused), return_exceptions=True
                )
                failures += [str(r) for r in results if isinstance(r, Exception)]
                if not failures:
                    self._weight_version, self._weight_path = version, path
                self._gate.set()
            if failures:
                raise EngineError(f"weight update to version {version} failed: " + "; ".join(failures))
            if all(s.down for s in self.servers):
                urls = [s.url for s in self.servers]
                raise EngineError(f"weight update to version {version}: no server reachable ({urls})")
            log.info("weights %s (version %d) on %d servers in %.2fs", path, version, len(paused),
                     time.perf_counter() - start)

    def _mark_down(self, server: _Server, error: str) -> None:
        server.consecutive_failures = max(server.consecutive_failures, self.down_after_failures - 1)
        self._record_failure(server, error)

    async def pause(self) -> None:
        """Hold new submissions and /pause_generation every server (in-flight requests are resubmitted later)."""
        self._http()
        assert self._gate is not None
        self._gate.clear()
        await asyncio.gather(*(self._control(s, "POST", "/pause_generation", {}) for s in self.servers if not s.down))

    async def resume(self) -> None:
        self._http()
        assert self._gate is not None
        up = [s for s in self.servers if not s.down]
        await asyncio.gather(*(self._control(s, "POST", "/continue_generation", {}) for s in up))
        self._gate.set()

    async def close(self) -> None:
        self._closed = True
        for s in self.servers:
            if s.probe_task is not None:
                s.probe_task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
