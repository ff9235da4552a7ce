"""SGLangEngine: an asyncio HTTP client of a pool of SGLang servers (native API; docs/sglang.md).

* `/generate` with `input_ids`, an explicit `max_new_tokens`, `return_logprob`; tokens and log-probs read from
  `meta_info.output_token_logprobs` (the matched stop token is kept); only sampling keys SGLang knows are sent.
* Routing: least in-flight requests, sticky per session id (multi-turn episodes reuse the server's prefix cache).
* Failures: connection errors, timeouts and 5xx are retried with exponential backoff on another server; a server
  with `down_after_failures` consecutive failures is marked down and probed every `probe_interval_s` until it
  answers again; before it takes requests it is brought to the pool's weights and resumed (it may have missed a
  `/continue_generation` while away), then must pass `/health_generate`. While no server is up, requests wait
  for one for up to `outage_budget_s`. 4xx are not retried: they raise `SGLangHTTPError` naming the URL.
* Weight sync: hold new submissions (retries included) -> with `partial="finish"`, wait until none of this client's
  requests is on a server (they finish on the old weights) -> per server `/pause_generation` (in-flight requests
  come back aborted: with "abort_resume" this client's own) -> `/update_weights_from_disk {model_path,
  weight_version}` -> version read back from `/model_info` -> `/continue_generation` (for every server that
  acknowledged the pause, in a finally path: a cancelled sync leaves no server paused). A server failing any step is
  marked down and skipped; the sync succeeds once `min_sync_servers` servers serve the new version, else it retries
  with backoff within `outage_budget_s` and then raises `PoolUnavailable`. Aborted partial generations are
  resubmitted as prompt + partial output with the remaining budget, so callers see one result per prompt (each
  token with the version that sampled it, `GenerationResult.token_versions`); only `abort()` surfaces "abort".
* Weight push (`push_weights(model, version)`, the learner's side): the model is written as an HF folder
  <weights_dir>/v<version> in `weight_dtype` (bfloat16 by default: what the servers serve, half of float32's bytes),
  synced as above, and the older folders but the newest `keep_weight_folders` are deleted; or, with
  `weight_sync="distributed"`, taken to host arrays in `weight_dtype` and sent without a disk as below (the
  host copy is kept until the next push: a server that comes back is resynced from it).
* Disk-free weight sync (`update_weights_from_tensors`): the same steps with the load replaced by SGLang's
  distributed update: each server's `/server_info` (its SGLang release, tp/pp/dp sizes: pp and dp must be 1),
  `/init_weights_update_group` (this client is rank 0 of a named torch.distributed group, kept until the servers
  change), on servers of SGLang >= 0.5.21 `/begin_weight_update`, per bucket `/update_weights_from_distributed` while
  the bucket is broadcast (the version on the last bucket only), then `/end_weight_update` (also after a failed
  transfer); a server failing mid-transfer is marked down and the transfer restarts on the others
  (ipa_jax/engines/weight_transfer.py). The disk path needs no session (0.5.23's scheduler checks none).
* `api_key`: sent as `Authorization: Bearer <key>` (SGLang's and the dev server's `--api-key`); `admin_api_key`
  (`--admin-api-key`), when given, instead on the routes SGLang serves at its admin level (ADMIN_ROUTES: pause,
  continue, abort and the weight updates), which then take only that key.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import socket
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np

from ipa_jax.engines.base import (
    Engine,
    EngineError,
    GenerationResult,
    PartialCounts,
    PrefixCounts,
    SamplingParams,
    check_generate_args,
    check_partial,
)
from ipa_jax.engines.weight_transfer import (
    BACKENDS,
    DTYPES,
    WeightSender,
    buckets,
    default_backend,
    host_store,
    import_torch,
    in_daemon_thread,
)

log = logging.getLogger(__name__)

# How push_weights reaches the servers: an HF folder they load from disk, or SGLang's distributed update.
WEIGHT_SYNCS = ("disk", "distributed")

# The sampling keys this client sends; every one is in SGLang's SamplingParams (0.5.5 .. 0.5.23 schema).
SENT_SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop",
    "no_stop_trim",
    "sampling_seed",
)

# From this SGLang release on, /update_weights_from_distributed is refused outside a weight-update session
# (/begin_weight_update ... /end_weight_update; docs/sglang.md, SGLang versions).
WEIGHT_UPDATE_SESSION_RELEASE = (0, 5, 21)
# SGLang's answers (its scheduler's weight updater) to a begin while a session is open (one left by a client that
# stopped mid-sync: ended, then begun again) and to an end without one (a server restarted since: nothing to end).
SESSION_ALREADY_OPEN = "a weight-update session is already open"
NO_SESSION_OPEN = "no weight-update session is open"
# The routes this client and the dev server use that SGLang tags @auth_level(ADMIN_OPTIONAL): with --admin-api-key
# they take that key only (even where --api-key is set too); the others take --api-key.
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/begin_weight_update",
        "/continue_generation",
        "/destroy_weights_update_group",
        "/end_weight_update",
        "/flush_cache",
        "/get_weights_by_name",
        "/init_weights_update_group",
        "/pause_generation",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
    }
)


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


def parse_release(version: str) -> tuple[int, int, int]:
    """An SGLang version string ("0.5.23", "0.5.5.post3", "0.5.21rc1") -> (major, minor, patch); ValueError
    otherwise."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"not an SGLang version: {version!r}")
    return int(match[1]), int(match[2]), int(match[3])


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What a distributed weight update needs to know of a server: its SGLang release and parallel sizes."""

    release: tuple[int, int, int]
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    @property
    def needs_session(self) -> bool:
        return self.release >= WEIGHT_UPDATE_SESSION_RELEASE

    def distributed_update_problem(self) -> str | None:
        """Why SGLang's distributed update cannot reach this server, or None."""
        fix = "start it with --pp-size 1 --dp-size 1, or use weight_sync='disk'"
        if self.pp_size != 1:
            return (
                f"pp_size={self.pp_size}: every pipeline stage would join the weight-update group as rank_offset + "
                f"its tp_rank, so the stages' ranks collide; {fix}"
            )
        if self.dp_size != 1:  # SGLang's TokenizerManager asserts it (an HTTP 500)
            return f"dp_size={self.dp_size}: SGLang's distributed weight update needs dp_size 1; {fix}"
        return None


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
    if params.sampling_seed is not None:  # lockstep rollouts (SGLang samples with it on --sampling-backend pytorch)
        sp["sampling_seed"] = int(params.sampling_seed)
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


def weights_folder(weights_dir: str, version: int) -> str:
    """Where `SGLangEngine.push_weights` writes the weights of `version`: <weights_dir>/v<8 digits>."""
    return os.path.join(weights_dir, f"v{version:08d}")


def prune_weight_folders(weights_dir: str, keep: int, current: int) -> None:
    """Deletes the v* folders of `weights_dir` but `current` and the `keep - 1` newest older ones (a version newer
    than `current` is what a killed run synced after its last checkpoint)."""
    versions = sorted(
        (int(m.group(1)) for d in os.listdir(weights_dir) if (m := re.fullmatch(r"v(\d+)", d))), reverse=True
    )
    kept = [current] + [v for v in versions if v < current][: keep - 1]
    for version in set(versions) - set(kept):
        shutil.rmtree(weights_folder(weights_dir, version), ignore_errors=True)


@dataclasses.dataclass(eq=False)  # hashed by identity: one object per server
class _Server:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    down: bool = False
    served: int = 0
    probe_task: asyncio.Task | None = None
    session_open: bool = False  # a weight-update session was begun and not (yet known to be) ended


@dataclasses.dataclass
class _Request:
    rid: str
    aborted: bool = False
    submission: str | None = None  # rid of the submission in flight ("<rid>-<n>")


class _Transient(Exception):
    """A failure worth retrying on another server."""


class PoolUnavailable(EngineError):
    """Fewer servers than needed were up for longer than the outage budget."""


def _unreachable(e: BaseException) -> bool:
    """A failure of the server rather than an answer from it: no connection, a timeout, a 5xx."""
    return not isinstance(e, SGLangHTTPError) or e.status is None or e.status >= 500


@dataclasses.dataclass(frozen=True)
class _FromDisk:
    """Weights of a sync: a checkpoint folder the servers read."""

    path: str

    def __str__(self) -> str:
        return self.path


@dataclasses.dataclass(frozen=True)
class _FromTensors:
    """Weights of a sync: (HF name, array) pairs pushed over a weight-update group."""

    tensors: Callable[[], Iterable[tuple[str, Any]]]
    dtype: str
    bucket_bytes: int

    def __str__(self) -> str:
        return f"pushed in {self.dtype}"


@dataclasses.dataclass
class _WeightGroup:
    urls: tuple[str, ...]  # its members, in rank order
    infos: tuple[ServerInfo, ...]  # theirs, read when the group was made
    name: str
    sender: WeightSender


class _TransferFailed(Exception):
    """A weight-update group step failed; errors: per server whose call failed."""

    def __init__(self, errors: dict[_Server, BaseException]):
        super().__init__("; ".join(str(e) for e in errors.values()))
        self.errors = errors


def _local_address(url: str) -> str:
    """This host's address on the route to the server of `url` (where the servers reach the group's store)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: only the route is looked up
        return s.getsockname()[0]


def _failures(servers: list[_Server], results: list[Any], what: str) -> dict[_Server, BaseException]:
    """The servers whose gathered call failed (an exception, or an answer without success) -> why."""
    return {
        s: r if isinstance(r, BaseException) else SGLangHTTPError(s.url, 200, f"{what} failed: {r}")
        for s, r in zip(servers, results)
        if isinstance(r, BaseException) or not (isinstance(r, dict) and r.get("success", False))
    }


def _check_success(url: str, out: Any) -> None:
    """SGLang's update and session calls answer {"success": bool, "message": ...}."""
    if not (isinstance(out, dict) and out.get("success", False)):
        raise SGLangHTTPError(url, 200, f"failed: {out}")


def _close_sender(joining: asyncio.Future) -> None:
    """Done-callback of a group join given up on: closes the sender if it joined after all."""
    if not joining.cancelled() and joining.exception() is None:
        joining.result().close()


class SGLangEngine(Engine):
    """Client of one or more SGLang servers (base URLs like "http://host:30000").

    Use it from one event loop (its HTTP session and events belong to the loop that first uses it; other loops
    reach it through `ipa_jax.engines.threads.OnLoop`). routed_experts_layout=(num_moe_layers, experts_per_token)
    is needed to reshape routed experts. The timeouts bound what a hung server costs (docs/sglang.md). partial: what a
    weight sync does to this client's requests in flight, "finish" or "abort_resume" (the module docstring).
    weights_dir, keep_weight_folders, weight_dtype: where and how `push_weights` writes the weights folders.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 120.0,
        max_attempts: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        down_after_failures: int = 3,
        probe_interval_s: float = 5.0,
        min_sync_servers: int = 1,
        outage_budget_s: float = 600.0,
        max_resubmits: int = 100,
        max_sticky_sessions: int = 100_000,
        routed_experts_layout: tuple[int, int] | None = None,
        weight_version: int = 0,
        partial: str = "finish",
        weight_sync_backend: str | None = None,
        weight_sync_address: str | None = None,
        weights_dir: str | os.PathLike | None = None,
        keep_weight_folders: int = 2,
        weight_dtype: str = "bfloat16",
        weight_sync: str = "disk",
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
        if not 1 <= min_sync_servers <= len(urls):
            raise ValueError(f"min_sync_servers must be in [1, {len(urls)}] (the pool), got {min_sync_servers}")
        for name, value in (
            ("request_timeout_s", request_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("control_timeout_s", control_timeout_s),
            ("probe_interval_s", probe_interval_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if weight_sync_backend not in (None, *BACKENDS):
            raise ValueError(
                f"weight_sync_backend must be one of {BACKENDS} (None: by device), got {weight_sync_backend!r}"
            )
        if outage_budget_s < 0:
            raise ValueError(f"outage_budget_s must be >= 0, got {outage_budget_s}")
        if keep_weight_folders < 1:
            raise ValueError(f"keep_weight_folders must be >= 1, got {keep_weight_folders}")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}")
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
        self.min_sync_servers = min_sync_servers
        self.outage_budget_s = outage_budget_s
        self._api_key, self._admin_api_key = api_key, admin_api_key
        self.max_resubmits = max_resubmits
        self.max_sticky_sessions = max_sticky_sessions
        self.routed_experts_layout = routed_experts_layout
        self._weight_version = weight_version
        self.partial = check_partial(partial)
        # The servers may run in another directory: they get absolute paths.
        self.weights_dir = None if weights_dir is None else os.path.abspath(weights_dir)
        self.keep_weight_folders = keep_weight_folders
        self.weight_dtype = weight_dtype
        self.weight_sync = weight_sync
        self._counts = PartialCounts()
        self._prefix: PrefixCounts | None = None  # from meta_info, once a server reports cached_tokens
        self._posting = 0  # /generate calls on a server now
        # the last synced weights (a checkpoint, or tensors to push again): servers that come back are brought to them
        self._weight_source: _FromDisk | _FromTensors | None = None
        self.weight_sync_backend = weight_sync_backend
        self.weight_sync_address = weight_sync_address
        self._group: _WeightGroup | None = None  # the weight-update group of update_weights_from_tensors
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._active: dict[str, _Request] = {}
        self._rr = 0
        self._warned_truncation = False
        self._session: aiohttp.ClientSession | None = None
        self._gate: asyncio.Event | None = None  # set = submissions allowed
        self._none_posting: asyncio.Event | None = None  # set = no /generate call of this client on a server
        self._sync_lock: asyncio.Lock | None = None
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def partial_counts(self) -> PartialCounts:
        return dataclasses.replace(self._counts)

    def prefix_counts(self) -> PrefixCounts | None:
        """Counted from the responses' meta_info.prompt_tokens and cached_tokens; None until a server reports them."""
        return None if self._prefix is None else dataclasses.replace(self._prefix)

    def _count_prefix(self, meta: dict[str, Any]) -> int:
        """Adds a response's prompt and cached tokens to the PrefixCounts; returns its cached tokens (0 when absent:
        an older server, or a request aborted before it ran)."""
        if not isinstance(meta.get("prompt_tokens"), int) or not isinstance(meta.get("cached_tokens"), int):
            return 0
        self._prefix = self._prefix or PrefixCounts()
        self._prefix.prefilled += meta["prompt_tokens"] - meta["cached_tokens"]
        self._prefix.reused += meta["cached_tokens"]
        return meta["cached_tokens"]

    def _http(self) -> aiohttp.ClientSession:
        if self._closed and self._session is None:  # close() still uses its session (the weight group's teardown)
            raise EngineError("SGLangEngine is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._gate = asyncio.Event()
            self._gate.set()
            self._none_posting = asyncio.Event()
            self._none_posting.set()
            self._sync_lock = asyncio.Lock()
        return self._session

    def _auth(self, path: str) -> dict[str, str] | None:
        """The Authorization header of a call to `path`: SGLang asks routes of its admin level for the admin key
        when it has one, the others for the API key."""
        key = self._admin_api_key if path in ADMIN_ROUTES and self._admin_api_key else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else None

    async def _control(
        self, server: _Server, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None
    ) -> Any:
        """One control call; returns the parsed JSON (or text). Raises SGLangHTTPError naming the URL."""
        url = server.url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._http().request(method, url, json=body, headers=self._auth(path), timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise SGLangHTTPError(url, resp.status, _error_message(text))
                if resp.content_type != "application/json":
                    return text
                try:
                    return json.loads(text)
                except ValueError:
                    raise SGLangHTTPError(url, resp.status, f"response is not JSON: {text[:200]!r}") from None
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
        if server.consecutive_failures >= self.down_after_failures:
            self._mark_down(server, f"{server.consecutive_failures} failures in a row, the last: {error}")

    def _mark_down(self, server: _Server, why: str) -> None:
        """No more requests to `server` until its probe brings it back (`_bring_back`)."""
        if not server.down:
            server.down = True
            log.warning("%s marked down (%s); probing it every %gs", server.url, why, self.probe_interval_s)
        if server.probe_task is None or server.probe_task.done():
            server.probe_task = asyncio.get_running_loop().create_task(self._probe_until_up(server))

    async def _probe_until_up(self, server: _Server) -> None:
        while not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self._bring_back(server)
            except SGLangHTTPError as e:
                log.info("probe of %s failed: %s", server.url, e)
                continue
            log.warning("%s is back up, at weight version %d", server.url, self._weight_version)
            return

    async def _bring_back(self, server: _Server) -> None:
        """Route to a returning server again once it serves the pool's weights, generates, and is not paused: it
        may have missed the /continue_generation of a sync while it was dead or hung."""
        await self._read_version(server)  # alive? (before the lock: a hung server must not hold up a sync)
        assert self._sync_lock is not None
        async with self._sync_lock:  # no sync in between: it must not miss one again
            if server.session_open:  # left by a transfer it failed: its weights are to be finished or replaced
                await self._end_session(server)
            if self._weight_source is not None and await self._read_version(server) != self._weight_version:
                took: list[_Server] = []
                await self._load([server], self._weight_source, self._weight_version, took)
                if not took:
                    raise SGLangHTTPError(server.url, None, f"resync to version {self._weight_version} failed")
            await self._control(server, "POST", "/continue_generation", {})
            await self._control(server, "GET", "/health_generate")
            server.consecutive_failures = 0
            server.down = False

    async def _wait_for_a_server(self) -> None:
        """Returns once some server is up; raises PoolUnavailable after outage_budget_s without one."""
        start = time.monotonic()
        while all(s.down for s in self.servers):
            if time.monotonic() - start > self.outage_budget_s:
                raise PoolUnavailable(
                    f"no server up for {self.outage_budget_s:g}s (outage budget): {[s.url for s in self.servers]}"
                )
            await asyncio.sleep(min(self.probe_interval_s, 1.0))

    async def health(self) -> bool:
        """True iff at least one server answers /health_generate."""

        async def ok(server: _Server) -> bool:
            try:
                await self._control(server, "GET", "/health_generate", timeout_s=min(30.0, self.control_timeout_s))
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
        assert self._gate is not None and self._none_posting is not None
        while len(errors) < self.max_attempts:
            if errors:
                await asyncio.sleep(min(self.backoff_s * 2 ** (len(errors) - 1), self.max_backoff_s))
            while not self._gate.is_set():  # a weight sync holds every post, retries too
                await self._gate.wait()
            server = self._pick(session_id, tried)
            if server is None:  # every server is down: wait for a probe to bring one back (not an attempt)
                await self._wait_for_a_server()
                continue
            url = server.url + "/generate"
            server.in_flight += 1
            self._posting += 1
            self._none_posting.clear()
            try:
                async with session.post(url, json=payload, headers=self._auth("/generate")) as resp:
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
                self._posting -= 1
                if not self._posting:
                    self._none_posting.set()
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
            raise SGLangHTTPError(
                url,
                200,
                "routed experts requested but meta_info has none "
                "(is the server started with --enable-return-routed-experts?)",
            )
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        layers, topk = self.routed_experts_layout
        if flat.size != (num_tokens - 1) * layers * topk:
            raise SGLangHTTPError(
                url, 200, f"routed_experts has {flat.size} ints, expected ({num_tokens} - 1) * {layers} * {topk}"
            )
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
        versions: list[int] = []  # the version that sampled each token
        version = self._weight_version
        cached = 0  # context tokens the server took from its prefix cache, over the submissions
        interrupted = False  # the last submission came back aborted by a pause (a weight sync)

        def result(reason: str, matched: int | str | None = None, routed: np.ndarray | None = None):
            return GenerationResult(tokens, logprobs, reason, matched, version, routed, versions, cached)

        try:
            for submission in range(self.max_resubmits + 1):
                remaining = params.max_new_tokens - len(tokens)
                if remaining <= 0 and submission:
                    return result("length")
                assert self._gate is not None
                await self._gate.wait()
                if req.aborted:
                    return result("abort")
                self._counts.resumed += interrupted
                interrupted = False
                posted_version = self._weight_version
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
                cached += self._count_prefix(meta)
                finish = meta.get("finish_reason") or {}
                kind = finish.get("type") if isinstance(finish, dict) else None
                pairs = meta.get("output_token_logprobs")
                if pairs is None:
                    if kind != "abort":
                        raise SGLangHTTPError(server.url, 200, "meta_info lacks output_token_logprobs")
                    pairs = []
                version = (
                    parse_weight_version(meta["weight_version"], server.url)
                    if "weight_version" in meta
                    else posted_version
                )
                tokens += [int(x[1]) for x in pairs]
                logprobs += [float(x[0]) for x in pairs]
                versions += [version] * len(pairs)
                routed = None
                if params.return_routed_experts and pairs:
                    routed = self._decode_routed(meta, len(prompt) + len(tokens), server.url)
                if kind == "abort":
                    if req.aborted:
                        return result("abort", None, routed)
                    # interrupted by a pause (a weight sync) or another client's abort: resubmit the rest
                    self._counts.interrupted += 1
                    interrupted = True
                    continue
                if kind == "stop":
                    return result("stop", finish.get("matched"), routed)
                if kind == "length":
                    return result("length", None, routed)
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
        calls = [
            self._control(s, "POST", "/abort_request", {"rid": r})
            for s in self.servers
            if not s.down
            for r in submissions
        ]
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, Exception):
                log.warning("abort_request failed: %s", r)

    # ------------------------------------------------------------------ weights and pausing
    async def _get_info(self, server: _Server, path: str) -> Any:
        """GET `path` (/model_info or /server_info, SGLang >= 0.5.6), else its older name /get_<...> (still served,
        deprecated, by 0.5.23)."""
        try:
            return await self._control(server, "GET", path)
        except SGLangHTTPError as e:
            if e.status != 404:
                raise
            return await self._control(server, "GET", "/get_" + path.removeprefix("/"))

    async def _read_version(self, server: _Server) -> int:
        """Weight version from the server's model info."""
        info = await self._get_info(server, "/model_info")
        if not isinstance(info, dict) or "weight_version" not in info:
            raise SGLangHTTPError(server.url, 200, f"model info lacks weight_version: {str(info)[:200]}")
        return parse_weight_version(info["weight_version"], server.url)

    async def update_weights(self, path: str, version: int) -> None:
        """Serve `path` as `version`: pause -> update_weights_from_disk -> continue on every server that is up, after
        this client's requests on the servers finish with partial="finish", interrupting them with "abort_resume".

        A server failing any step is marked down (its probe brings it to the pool's weights when it is back). Done
        once min_sync_servers servers serve `version`; with fewer, the sync is retried with backoff (probes bring
        servers back meanwhile) and PoolUnavailable is raised after outage_budget_s. When servers answer that they
        cannot load the weights and none took them, EngineError is raised at once (waiting would not help)."""
        await self._sync(_FromDisk(path), version)

    async def update_weights_from_tensors(
        self,
        tensors: Mapping[str, Any] | Callable[[], Iterable[tuple[str, Any]]],
        version: int,
        *,
        dtype: str = "bfloat16",
        bucket_bytes: int = 512 * 1024**2,
    ) -> None:
        """Serve `tensors` (Hugging Face names -> JAX or NumPy arrays in HF layout) as `version` without a
        checkpoint: like update_weights, with the load step replaced by SGLang's distributed update (module
        docstring). The tensors are cast to `dtype` and sent in buckets of at most `bucket_bytes`.

        `tensors` may be a zero-argument callable yielding (name, array) pairs (e.g. over
        `ipa_jax.models.hf_io.iter_hf_tensors`), so that the whole model is never held twice: it is called again when
        a server failed mid-transfer (the transfer restarts on the others) and when a server that missed a sync
        comes back (it is resynced from it), so it must yield the weights of the pool's version until the next
        sync. Needs torch (`ipa_jax[weight-sync]`)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        import_torch()  # fail before pausing the pool
        source = (lambda: tensors.items()) if isinstance(tensors, Mapping) else tensors
        await self._sync(_FromTensors(source, dtype, bucket_bytes), version)

    async def _sync(self, source: _FromDisk | _FromTensors, version: int) -> None:
        """Retries `_sync_once` within the outage budget until min_sync_servers servers serve `version`."""
        self._http()
        deadline = time.monotonic() + self.outage_budget_s
        for attempt in itertools.count():
            took, rejections = await self._sync_once(source, version)
            if len(took) >= self.min_sync_servers:
                return
            if rejections and not took:
                raise EngineError(f"weight update to version {version} failed: " + "; ".join(rejections))
            wait = min(self.backoff_s * 2**attempt, self.max_backoff_s)
            left = deadline - time.monotonic()
            down = [s.url for s in self.servers if s.down]
            if wait > left:
                raise PoolUnavailable(
                    f"weight update to version {version}: {len(took)} server(s) took it, {self.min_sync_servers} "
                    f"needed, for {self.outage_budget_s:g}s (outage budget); down: {down}"
                )
            log.warning(
                "weight update to version %d: %d server(s) took it, %d needed (down: %s); retrying in %.1fs, "
                "%.0fs of the outage budget left",
                version,
                len(took),
                self.min_sync_servers,
                down,
                wait,
                left,
            )
            await asyncio.sleep(wait)

    @property
    def push_dtype(self) -> str:
        return self.weight_dtype

    async def push_weights(self, model, version: int) -> None:
        """weight_sync "disk": writes `model` as an HF folder <weights_dir>/v<version> (in weight_dtype), has the pool
        load it (`update_weights`), then deletes the older folders but the newest keep_weight_folders. "distributed":
        `update_weights_from_tensors` from a host copy of `model` in weight_dtype."""
        from ipa_jax.models.hf_io import iter_hf_tensors, save_pretrained

        if self.weight_sync == "distributed":  # a host copy: the learner's buffers may be donated once this returns
            tensors = await asyncio.to_thread(lambda: dict(iter_hf_tensors(model, self.weight_dtype)))
            await self.update_weights_from_tensors(tensors, version, dtype=self.weight_dtype)
            return
        if self.weights_dir is None:
            raise EngineError("SGLangEngine.push_weights needs a weights_dir to write the weights folder into")
        path = weights_folder(self.weights_dir, version)
        await asyncio.to_thread(save_pretrained, model, path, dtype=self.weight_dtype)
        await self.update_weights(path, version)
        prune_weight_folders(self.weights_dir, keep=self.keep_weight_folders, current=version)

    async def _sync_once(self, source: _FromDisk | _FromTensors, version: int) -> tuple[list[_Server], list[str]]:
        """One pass over the servers that are up: (the servers now serving `version`, the errors of those that
        answered that they cannot load it). The pool adopts `version` once enough servers took it; otherwise the
        ones that did are marked down (their probes bring them back to the pool's version). Cancelling it resumes
        every server that acknowledged the pause and marks the others down: none is left paused (a server marked
        down is resumed by its probe)."""
        assert self._gate is not None and self._sync_lock is not None and self._none_posting is not None
        async with self._sync_lock:
            self._gate.clear()
            start = time.perf_counter()
            paused: list[_Server] = []  # acknowledged the pause: resumed whatever happens next
            took: list[_Server] = []  # serve `version` now
            rejections: list[str] = []
            try:
                if self.partial == "finish":  # this client's requests finish on the weights they started with
                    await self._none_posting.wait()
                targets = [s for s in self.servers if not s.down]
                rejections = await self._on_each(
                    targets,
                    lambda s: self._control(s, "POST", "/pause_generation", {}),
                    f"pause for version {version}",
                    paused,
                )
                rejections += await self._load([s for s in paused if not s.down], source, version, took)
            finally:
                try:
                    if len(took) >= self.min_sync_servers:
                        self._weight_version, self._weight_source = version, source
                        self._counts.updates += 1
                        log.info(
                            "weights %s (version %d) on %d servers in %.2fs",
                            source,
                            version,
                            len(took),
                            time.perf_counter() - start,
                        )
                    else:
                        for s in took:
                            self._mark_down(s, f"serves version {version}, which too few servers took")
                        took.clear()
                    # a server marked down meanwhile is resumed by its probe: no second timeout on a hung one here
                    await asyncio.shield(self._continue([s for s in paused if not s.down]))
                finally:
                    self._gate.set()
            return took, rejections

    async def _on_each(
        self, servers: list[_Server], call: Callable[[_Server], Awaitable[Any]], what: str, done: list[_Server]
    ) -> list[str]:
        """`call` on every server at once; those it succeeds on are appended to `done` as they finish, the others
        are marked down (their state is unknown: their probes resync them), cancellation included. Returns the
        errors of the servers that answered (not unreachable)."""

        async def one(server: _Server) -> None:
            try:
                await call(server)
                done.append(server)
            except (Exception, asyncio.CancelledError) as e:
                self._mark_down(server, f"{what}: {str(e) or type(e).__name__}")
                raise

        results = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
        return [str(r) for r in results if isinstance(r, BaseException) and not _unreachable(r)]

    async def _load(
        self, servers: list[_Server], source: _FromDisk | _FromTensors, version: int, took: list[_Server]
    ) -> list[str]:
        """Loads `source` as `version` on `servers` and checks the version they report; the servers that serve it
        are appended to `took`, the others marked down. Returns the errors of those that answered they cannot."""
        what = f"weight update to version {version}"
        if isinstance(source, _FromDisk):
            return await self._on_each(servers, lambda s: self._update_from_disk(s, source.path, version), what, took)
        try:
            servers, rejections = await self._push_tensors(servers, source, version)
        except asyncio.CancelledError:  # the servers hold part of the buckets: their probes resync them
            for s in servers:
                self._mark_down(s, f"{what}: cancelled during the transfer")
            await asyncio.shield(self._drop_group())
            raise
        return rejections + await self._on_each(servers, lambda s: self._check_version(s, version), what, took)

    async def _check_version(self, server: _Server, version: int) -> None:
        got = await self._read_version(server)
        if got != version:
            raise SGLangHTTPError(server.url, 200, f"weight_version is {got} after updating to {version}")

    async def _update_from_disk(self, server: _Server, path: str, version: int) -> None:
        out = await self._control(
            server, "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}
        )
        _check_success(server.url + "/update_weights_from_disk", out)
        await self._check_version(server, version)

    # ------------------------------------------------------------------ distributed weight updates
    async def _push_tensors(
        self, servers: list[_Server], source: _FromTensors, version: int
    ) -> tuple[list[_Server], list[str]]:
        """Broadcasts `source` to `servers` over a weight-update group -> (the servers that received every bucket,
        the errors of those that answered they cannot). When a transfer fails, the servers that did not answer (a
        dropped connection, a timeout) are marked down, else those that answered with an error, and the transfer
        restarts on the others in a new group."""
        servers, rejections = list(servers), []
        while servers:
            try:
                await self._broadcast(servers, source, version)
                return servers, rejections
            except _TransferFailed as failure:
                unreachable = [s for s, e in failure.errors.items() if _unreachable(e)]
                failed = unreachable or list(failure.errors)
                rejections += [str(failure.errors[s]) for s in failed if s not in unreachable]
                for s in failed:
                    self._mark_down(s, f"weight transfer to version {version}: {failure.errors[s]}")
                await self._drop_group()  # the servers marked down are not waited for
                servers = [s for s in servers if s not in failed]
                if servers:
                    log.warning(
                        "weight transfer to version %d failed on %s; restarting it on %s",
                        version,
                        [s.url for s in failed],
                        [s.url for s in servers],
                    )
        return [], rejections

    async def _broadcast(self, servers: list[_Server], source: _FromTensors, version: int) -> None:
        """`source` to `servers` over their weight-update group, inside a weight-update session on the servers whose
        release needs one. Raises _TransferFailed naming the servers whose calls failed. The sessions are ended
        whatever happens on every server that answers (one that did not keeps its session: `_bring_back` ends it)."""
        group = await self._group_for(servers)
        in_session = [s for s, info in zip(servers, group.infos) if info.needs_session]
        try:
            await self._on_all(in_session, self._begin_session)
            await self._send_buckets(group, servers, source, version)
        except _TransferFailed as failure:
            unanswered = {s for s, e in failure.errors.items() if _unreachable(e)}
            try:
                ending = [s for s in in_session if s.session_open and s not in unanswered]
                await asyncio.shield(self._on_all(ending, self._end_session))
            except _TransferFailed as e:
                log.warning("ending weight-update sessions after a failed transfer: %s", e)
            raise
        await self._on_all(in_session, self._end_session)

    async def _send_buckets(self, group: _WeightGroup, servers: list[_Server], source: _FromTensors, version: int):
        """Every bucket of `source`: /update_weights_from_distributed on each server while the bucket is broadcast.
        Only the last call carries weight_version and flush_cache: a server reports the new version only once it
        holds every bucket. Raises _TransferFailed naming the servers whose calls failed."""
        pending = None
        for bucket in itertools.chain(buckets(source.tensors(), source.bucket_bytes, source.dtype), [None]):
            if pending is not None:
                body = pending.request(group.name)
                if bucket is None:
                    body.update(flush_cache=True, weight_version=str(version))
                else:
                    body["flush_cache"] = False
                calls = [
                    asyncio.ensure_future(self._control(s, "POST", "/update_weights_from_distributed", body))
                    for s in servers
                ]
                send_error = None
                try:
                    await in_daemon_thread(group.sender.broadcast, pending)
                except Exception as e:  # noqa: BLE001 - a rank failed: the servers' answers say which
                    send_error = str(e)  # not the exception: its traceback holds the group, which must be freed
                except asyncio.CancelledError:
                    for call in calls:
                        call.cancel()
                    raise
                if send_error is not None:  # free our side of the group: ranks still receiving fail at once
                    await in_daemon_thread(group.sender.close)
                errors = _failures(servers, await asyncio.gather(*calls, return_exceptions=True), "update")
                if send_error is not None and not errors:
                    errors = {s: SGLangHTTPError(s.url, None, f"broadcast failed: {send_error}") for s in servers}
                if errors:
                    raise _TransferFailed(errors)
            pending = bucket

    async def _on_all(self, servers: list[_Server], call: Callable[[_Server], Awaitable[Any]]) -> None:
        """`call` on every server at once; raises _TransferFailed naming the servers it failed on."""
        results = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
        errors = {s: r for s, r in zip(servers, results) if isinstance(r, BaseException)}
        if errors:
            raise _TransferFailed(errors)

    async def _begin_session(self, server: _Server) -> None:
        """/begin_weight_update; a session left open (by a client stopped during a sync) is ended first."""
        server.session_open = True  # also if the answer is lost: ending a session that is not open is harmless
        try:
            out = await self._control(server, "POST", "/begin_weight_update", {"selector": "all"})
        except SGLangHTTPError as e:
            if e.status != 400 or SESSION_ALREADY_OPEN not in e.message:
                raise
            log.warning("%s had a weight-update session open (a client stopped during a sync?): ending it", server.url)
            await self._end_session(server)
            server.session_open = True
            out = await self._control(server, "POST", "/begin_weight_update", {"selector": "all"})
        _check_success(server.url + "/begin_weight_update", out)

    async def _end_session(self, server: _Server) -> None:
        """/end_weight_update (it also finishes the loaded weights, e.g. quantised ones); none being open (the
        server restarted since) is no error."""
        try:
            _check_success(
                server.url + "/end_weight_update", await self._control(server, "POST", "/end_weight_update", {})
            )
        except SGLangHTTPError as e:
            if e.status != 400 or NO_SESSION_OPEN not in e.message:
                raise
        server.session_open = False

    async def _group_for(self, servers: list[_Server]) -> _WeightGroup:
        """The weight-update group of exactly `servers` (this client as rank 0): kept between syncs, made anew when
        the servers change. Each server joins with rank_offset = 1 + the ranks before it (its tp_size ranks)."""
        urls = tuple(s.url for s in servers)
        if self._group is not None and self._group.urls == urls:
            return self._group
        await self._drop_group()
        results = await asyncio.gather(*(self._server_info(s) for s in servers), return_exceptions=True)
        errors = {s: r for s, r in zip(servers, results) if isinstance(r, BaseException)}
        for s, info in zip(servers, results):
            if isinstance(info, ServerInfo) and (problem := info.distributed_update_problem()):
                errors[s] = SGLangHTTPError(s.url, 200, problem)
        if errors:
            raise _TransferFailed(errors)
        infos = tuple(results)
        backend = self.weight_sync_backend or default_backend()
        address = self.weight_sync_address or _local_address(servers[0].url)
        store = host_store(address, self.control_timeout_s)
        name = f"ipa_jax_weights_{uuid.uuid4().hex[:12]}"
        world = 1 + sum(info.tp_size for info in infos)
        offsets = [1 + sum(info.tp_size for info in infos[:i]) for i in range(len(servers))]
        joining = in_daemon_thread(
            lambda: WeightSender(
                backend=backend, store=store, world_size=world, group_name=name, timeout_s=self.control_timeout_s
            )
        )
        calls = [
            self._control(
                s,
                "POST",
                "/init_weights_update_group",
                {
                    "master_address": address,
                    "master_port": store.port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": name,
                    "backend": backend,
                },
            )
            for s, offset in zip(servers, offsets)
        ]
        errors = _failures(servers, await asyncio.gather(*calls, return_exceptions=True), "init")
        if errors:  # the rendezvous cannot complete: the trainer's side gives up after control_timeout_s
            joining.add_done_callback(_close_sender)
            raise _TransferFailed(errors)
        try:
            sender = await joining
        except Exception as e:  # noqa: BLE001 - a server said it joined, the rendezvous says otherwise
            raise _TransferFailed({s: SGLangHTTPError(s.url, None, f"group init failed: {e}") for s in servers}) from e
        self._group = _WeightGroup(urls, infos, name, sender)
        return self._group

    async def _server_info(self, server: _Server) -> ServerInfo:
        """The server's SGLang release and parallel sizes, from its server info (its ServerArgs and `version`)."""
        info = await self._get_info(server, "/server_info")
        url = server.url + "/server_info"
        if not isinstance(info, dict):
            raise SGLangHTTPError(url, 200, f"server info is not an object: {str(info)[:200]}")
        try:
            release = parse_release(info.get("version"))
        except ValueError as e:
            raise SGLangHTTPError(url, 200, f"`version`: {e}") from None
        sizes = {key: info.get(key, 1) for key in ("tp_size", "pp_size", "dp_size")}
        for key, size in sizes.items():
            if not (isinstance(size, int) and size >= 1):
                raise SGLangHTTPError(url, 200, f"`{key}` must be an integer >= 1, got {size!r}")
        return ServerInfo(release, **sizes)

    async def _drop_group(self) -> None:
        """Leaves the weight-update group (this side first: ranks blocked in it fail at once) and asks its servers
        that are up to destroy theirs; failures are logged."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            await in_daemon_thread(group.sender.close)
        except Exception as e:  # noqa: BLE001 - a broken group: nothing left to close
            log.info("closing weight-update group %s: %s", group.name, e)
        members = [self._by_url[u] for u in group.urls if not self._by_url[u].down]
        results = await asyncio.gather(
            *(self._control(s, "POST", "/destroy_weights_update_group", {"group_name": group.name}) for s in members),
            return_exceptions=True,
        )
        for s, r in zip(members, results):
            if isinstance(r, Exception):
                log.info("destroy_weights_update_group on %s: %s", s.url, r)

    async def _continue(self, servers: list[_Server]) -> None:
        """/continue_generation on `servers`; a server that fails it is marked down (its probe resumes it)."""
        results = await asyncio.gather(
            *(self._control(s, "POST", "/continue_generation", {}) for s in servers), return_exceptions=True
        )
        for s, r in zip(servers, results):
            if isinstance(r, Exception):
                self._mark_down(s, f"continue_generation failed: {r}")

    async def pause(self) -> None:
        """Hold new submissions and /pause_generation every server that is up (in-flight requests are resubmitted
        later); a server that fails it is marked down."""
        self._http()
        assert self._gate is not None
        self._gate.clear()
        up = [s for s in self.servers if not s.down]
        results = await asyncio.gather(
            *(self._control(s, "POST", "/pause_generation", {}) for s in up), return_exceptions=True
        )
        for s, r in zip(up, results):
            if isinstance(r, Exception):
                self._mark_down(s, f"pause_generation failed: {r}")

    async def resume(self) -> None:
        self._http()
        assert self._gate is not None
        await self._continue([s for s in self.servers if not s.down])
        self._gate.set()

    async def close(self) -> None:
        self._closed = True
        for s in self.servers:
            if s.probe_task is not None:
                s.probe_task.cancel()
        if self._sync_lock is not None:  # a cancelled sync may still be resuming servers in its finally path
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sync_lock.acquire(), self.control_timeout_s)
                self._sync_lock.release()
        if self._group is not None:
            await self._drop_group()
        if self._session is not None:
            await self._session.close()
            self._session = None
