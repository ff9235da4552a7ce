"""An SGLang-compatible HTTP server in front of any Engine (the embedded JAX engine from the CLI).

It speaks the subset of SGLang's native API the trainer uses (docs/sglang.md), with
SGLang's request/response shapes, so `SGLangEngine` is tested over real HTTP on a CPU machine and several dev
servers stand in for a pool:

  POST/PUT /generate            single or batch `input_ids` (or `text` with a tokenizer), sampling_params
  POST /update_weights_from_disk  {"model_path", "weight_version"?, "abort_all_requests"?, ...}
  POST /pause_generation        {"mode": "abort" (default) | "retract" | "in_place"} (body optional); abort answers
                                once the requests in flight have returned aborted with their partial output
  POST /continue_generation
  POST /abort_request           {"rid": prefix} | {"abort_all": true}
  GET|POST /flush_cache         400 while requests run
  GET /get_model_info, /model_info, /health, /health_generate
  GET /server_info, /get_server_info   {"version": --sglang-version, "tp_size": 1, "pp_size": 1, "dp_size": 1, ...}
  POST /init_weights_update_group       {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                        "backend": "gloo"}: joins the trainer's group (rank = rank_offset; tp 1)
  POST /begin_weight_update, /end_weight_update  {"selector"?} / {}: the weight-update session (SGLang >= 0.5.21)
  POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "flush_cache"?,
                                        "weight_version"?}: receives the tensors broadcast from rank 0, in order;
                                        from 0.5.21 on, refused (400) outside a session
  POST /destroy_weights_update_group    {"group_name"}
  GET|POST /get_weights_by_name         {"name", "truncate_size": 100}: the tensor's first truncate_size rows (HF
                                        layout, float32, as nested lists)

Sampling keys SGLang knows but the dev server does not implement are accepted only at their default value
(anything else is a 400 naming the key); unknown keys are a 400 in SGLang 0.5.23's schema-error shape. Like
SGLang's `--api-key` and `--admin-api-key`, `api_key` makes every route but /health* answer 401 unless the request
carries `Authorization: Bearer <key>`, and `admin_api_key` does so for the routes of SGLang's admin level
(ADMIN_ROUTES), which then take that key only. Weight versions are free-form strings, as in SGLang; the embedded
engine refuses checkpoints with non-finite values (400, old weights kept).

It behaves like the SGLang release `sglang_version` (default: SGLANG_RELEASE), which /server_info reports: from 0.5.21
on with the weight-update session. A distributed update it refuses once it could join the broadcast (a group and a
list of tensors it can receive) still receives the tensors and discards them, so the trainer is never left waiting.

The weight-group routes need an engine that takes Hugging Face tensors (EmbeddedEngine) and torch
(`ipa_jax[weight-sync]`); they speak gloo only. Each update call's tensors are loaded as they arrive (SGLang's
`load_weights` per call); a parameter split over calls (experts, stacked layers) is loaded once complete, and a call
with weight_version must complete every parameter it touches. A collective waits at most --dist-timeout seconds.

    python -m ipa_jax.engines.devserver --model PATH --port P [--host H] [--weight-version 0] [--api-key KEY]
        [--admin-api-key KEY] [--sglang-version 0.5.23]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from aiohttp import web

from ipa_jax.engines.base import Engine, GenerationResult, SamplingParams
from ipa_jax.engines.sglang import (
    ADMIN_ROUTES,
    NO_SESSION_OPEN,
    SESSION_ALREADY_OPEN,
    WEIGHT_UPDATE_SESSION_RELEASE,
    parse_release,
)
from ipa_jax.host_memory import keep_freed_host_memory

log = logging.getLogger(__name__)

# Sampling keys the dev server implements (value -> SamplingParams or response formatting).
_SUPPORTED_SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "sampling_seed",
)
# Keys SGLang knows that the dev server accepts only at SGLang's default (0.5.5 SamplingParams + 0.5.23 schema).
_DEFAULT_ONLY_SAMPLING_KEYS: dict[str, Any] = {
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
KNOWN_SAMPLING_KEYS: tuple[str, ...] = _SUPPORTED_SAMPLING_KEYS + tuple(_DEFAULT_ONLY_SAMPLING_KEYS)
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the request omits it.
PAUSE_MODES = ("abort", "retract", "in_place")
SGLANG_RELEASE = "0.5.23"  # the release whose behaviour the dev server has by default
SESSION_SELECTORS = ("target", "draft", "all")
OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"


class RequestError(ValueError):
    """A bad request. schema=True: body/schema error (SGLang's RequestValidationError shape), else a ValueError
    raised while serving (SGLang's `{"error": {"message"}}` shape). Both are HTTP 400."""

    def __init__(self, message: str, *, schema: bool):
        super().__init__(message)
        self.schema = schema


def error_response(message: str, *, schema: bool, status: int = 400) -> web.Response:
    """SGLang's two error bodies (docs/sglang.md)."""
    if schema:
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": status}
    else:
        body = {"error": {"message": message}}
    return web.json_response(body, status=status)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_sampling_params(
    raw: Any, *, eos_token_ids: Sequence[int], return_routed_experts: bool
) -> tuple[SamplingParams, dict[str, Any]]:
    """SGLang sampling_params dict -> (SamplingParams, text-formatting options). Raises RequestError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}", schema=True)
    for key in raw:
        if key not in KNOWN_SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in KNOWN_SAMPLING_KEYS)
            raise RequestError(f"unknown field `{key}`, expected one of {expected}", schema=True)
    for key, default in _DEFAULT_ONLY_SAMPLING_KEYS.items():
        if key in raw and raw[key] != default:
            raise RequestError(
                f"sampling_params.{key}={raw[key]!r} is not supported by the dev server (only {default!r})",
                schema=False,
            )
    max_new_tokens = raw.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    if not _is_int(max_new_tokens):
        raise RequestError(f"sampling_params.max_new_tokens must be an integer, got {max_new_tokens!r}", schema=True)
    for key in ("temperature", "top_p"):
        if key in raw and not _is_number(raw[key]):
            raise RequestError(f"sampling_params.{key} must be a number, got {raw[key]!r}", schema=True)
    seed = raw.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"sampling_params.sampling_seed must be an integer, got {seed!r}", schema=True)
    if "top_k" in raw and not _is_int(raw["top_k"]):
        raise RequestError(f"sampling_params.top_k must be an integer, got {raw['top_k']!r}", schema=True)
    top_k = raw.get("top_k", -1)
    if top_k < -1 or top_k == 0:  # SGLang's own check (SamplingParams.verify)
        raise RequestError(f"top_k must be -1 (disable), or at least 1, got {top_k}.", schema=False)
    stop = raw.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}", schema=True)
    stop_ids = raw.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) for t in stop_ids):
        raise RequestError(f"sampling_params.stop_token_ids must be a list of ints, got {stop_ids!r}", schema=True)
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if key in raw and not isinstance(raw[key], bool):
            raise RequestError(f"sampling_params.{key} must be a boolean, got {raw[key]!r}", schema=True)
    # SGLang stops on the model's EOS ids in addition to stop_token_ids unless ignore_eos.
    all_stop_ids = tuple(stop_ids) + (() if raw.get("ignore_eos", False) else tuple(eos_token_ids))
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=top_k,
            stop_token_ids=tuple(dict.fromkeys(all_stop_ids)),
            stop=tuple(stop),
            return_routed_experts=return_routed_experts,
            sampling_seed=seed,
        )
    except ValueError as e:
        raise RequestError(str(e), schema=False) from e
    text_options = {
        "skip_special_tokens": raw.get("skip_special_tokens", True),
        "spaces_between_special_tokens": raw.get("spaces_between_special_tokens", True),
        "no_stop_trim": raw.get("no_stop_trim", False),
    }
    return params, text_options


def optional_string(body: dict[str, Any], key: str) -> str | None:
    """A field SGLang types Optional[str] (weight_version): a string or null; raises RequestError."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{key}: Input should be a valid string, got {value!r}", schema=True)
    return value


class WeightVersions:
    """SGLang's weight versions are free-form strings, the engine's integers: a version of decimal digits (what
    ipa_jax sends) is that integer, any other gets one of its own above the learner's int32 steps."""

    def __init__(self, initial: int):
        self._names = {initial: str(initial)}
        self._next_own = 2**31

    def engine_version(self, name: str) -> int:
        if name.isascii() and name.isdigit() and int(name) < 2**31:
            version = int(name)
        else:
            version, self._next_own = self._next_own, self._next_own + 1
        self._names[version] = name
        return version

    def name(self, engine_version: int) -> str:
        return self._names.get(engine_version, str(engine_version))


def _per_item(value: Any, n: int, name: str, *, batch: bool) -> list[Any]:
    """A scalar or (for a batch) a list of n values -> list of n values."""
    if batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n}", schema=True)
        return value
    return [value] * n


class DevServer:
    """SGLang's HTTP contract around an Engine.

    Use `await start()` / `await stop()` inside a running loop, or `serve_in_thread()` for a server in a
    background thread with its own event loop (tests, notebooks); `kill()` drops it abruptly like a crash.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "",
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        enable_return_routed_experts: bool = False,
        health_timeout_s: float = 20.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        dist_timeout_s: float = 300.0,
        sglang_version: str = SGLANG_RELEASE,
    ):
        self.engine = engine
        self.host = host
        self.port = port
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.enable_return_routed_experts = enable_return_routed_experts
        self.health_timeout_s = health_timeout_s
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.dist_timeout_s = dist_timeout_s
        self.sglang_version = sglang_version
        self.weight_update_sessions = parse_release(sglang_version) >= WEIGHT_UPDATE_SESSION_RELEASE
        self.session_open = False
        self.versions = WeightVersions(engine.weight_version)
        self._weight_groups: dict[str, Any] = {}  # group name -> torch process group
        self._incomplete: dict[str, dict[str, np.ndarray]] = {}  # group name -> tensors of unfinished parameters
        self.num_running = 0
        self.paused = False
        self._generating: set[asyncio.Future] = set()  # engine.generate calls of the requests in flight
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ app
    @web.middleware
    async def _require_keys(self, request: web.Request, handler) -> web.StreamResponse:
        """SGLang's key check: /health* stay open (probes and load balancers); its admin-level routes take the admin
        key when there is one, every other route the API key when there is one."""
        key = self.admin_api_key if request.path in ADMIN_ROUTES and self.admin_api_key else self.api_key
        given = request.headers.get("Authorization", "")
        if request.path.startswith("/health") or key is None or hmac.compare_digest(given, f"Bearer {key}"):
            return await handler(request)
        return web.json_response({"error": "Unauthorized"}, status=401)

    def make_app(self) -> web.Application:
        middlewares = [self._require_keys] if self.api_key or self.admin_api_key else []
        app = web.Application(client_max_size=256 * 1024**2, middlewares=middlewares)
        app.router.add_route("POST", "/generate", self.handle_generate)
        app.router.add_route("PUT", "/generate", self.handle_generate)
        app.router.add_post("/update_weights_from_disk", self.handle_update_weights)
        app.router.add_post("/pause_generation", self.handle_pause)
        app.router.add_post("/continue_generation", self.handle_continue)
        app.router.add_post("/abort_request", self.handle_abort)
        app.router.add_get("/flush_cache", self.handle_flush_cache)
        app.router.add_post("/flush_cache", self.handle_flush_cache)
        app.router.add_get("/get_model_info", self.handle_model_info)
        app.router.add_get("/model_info", self.handle_model_info)
        app.router.add_get("/get_server_info", self.handle_server_info)
        app.router.add_get("/server_info", self.handle_server_info)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/health_generate", self.handle_health_generate)
        app.router.add_post("/init_weights_update_group", self.handle_init_weights_group)
        app.router.add_post("/update_weights_from_distributed", self.handle_update_weights_from_distributed)
        if self.weight_update_sessions:
            app.router.add_post("/begin_weight_update", self.handle_begin_weight_update)
            app.router.add_post("/end_weight_update", self.handle_end_weight_update)
        app.router.add_post("/destroy_weights_update_group", self.handle_destroy_weights_group)
        app.router.add_get("/get_weights_by_name", self.handle_get_weights_by_name)
        app.router.add_post("/get_weights_by_name", self.handle_get_weights_by_name)
        return app

    @staticmethod
    async def _json_body(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            if optional:
                return {}
            raise RequestError("request body is empty; expected a JSON object", schema=True)
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestError(f"JSON decode error: {e}", schema=True) from e
        except RecursionError:
            raise RequestError("JSON decode error: nested too deeply", schema=True) from None
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}", schema=True)
        return body

    # ------------------------------------------------------------------ /generate
    def _parse_generate(self, body: dict[str, Any]) -> tuple[bool, list[list[int]], list[dict[str, Any]]]:
        """-> (is_batch, prompts, per-item options)."""
        given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if len(given) != 1:
            raise RequestError("Either text, input_ids or input_embeds should be provided.", schema=False)
        if given[0] == "input_embeds":
            raise RequestError("input_embeds is not supported by the dev server", schema=False)
        if given[0] == "text":
            if self.tokenizer is None:
                raise RequestError("`text` needs a tokenizer; this dev server has none (send input_ids)", schema=False)
            text = body["text"]
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a non-empty list of strings", schema=True)
            prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise RequestError("input_ids must be a non-empty list of ints or of lists of ints", schema=True)
            batch = isinstance(ids[0], list)
            prompts = ids if batch else [ids]
            for i, p in enumerate(prompts):
                if not isinstance(p, list) or not p or not all(_is_int(t) and t >= 0 for t in p):
                    raise RequestError(f"input_ids[{i}] must be a non-empty list of non-negative ints", schema=True)
        n = len(prompts)
        sp = body.get("sampling_params")
        if isinstance(sp, list) and not batch:
            raise RequestError("sampling_params is a list but the request is not a batch", schema=True)
        sps = _per_item(sp, n, "sampling_params", batch=batch)
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(n)] if batch else [rid]
        elif isinstance(rid, list) and batch and all(isinstance(r, str) for r in rid):
            rids = _per_item(rid, n, "rid", batch=True)
        else:
            raise RequestError(f"rid must be a string (or a list of strings for a batch), got {rid!r}", schema=True)
        return_logprob = _per_item(body.get("return_logprob", False), n, "return_logprob", batch=batch)
        routed = _per_item(body.get("return_routed_experts", False), n, "return_routed_experts", batch=batch)
        for flag in return_logprob + routed:
            if not isinstance(flag, bool):
                raise RequestError(f"return_logprob/return_routed_experts must be booleans, got {flag!r}", schema=True)
        if any(routed) and not self.enable_return_routed_experts:
            raise RequestError(
                "return_routed_experts needs the server flag --enable-return-routed-experts", schema=False
            )
        for key, default in (("logprob_start_len", -1), ("top_logprobs_num", 0), ("stream", False)):
            values = _per_item(body.get(key, default), n, key, batch=batch)
            if any(v != default for v in values):
                raise RequestError(
                    f"{key}={body[key]!r} is not supported by the dev server (only {default!r})", schema=False
                )
        items = []
        for i in range(n):
            params, text_options = parse_sampling_params(
                sps[i], eos_token_ids=self.eos_token_ids, return_routed_experts=routed[i]
            )
            items.append({"rid": rids[i], "params": params, "text": text_options, "return_logprob": return_logprob[i]})
        return batch, prompts, items

    def _decode_text(self, result: GenerationResult, options: dict[str, Any]) -> str:
        ids = list(result.token_ids)
        trim = not options["no_stop_trim"]
        if trim and result.finish_reason == "stop" and isinstance(result.matched_stop, int) and ids:
            ids = ids[:-1]  # SGLang trims the matched stop token from `text` only.
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=options["skip_special_tokens"],
            spaces_between_special_tokens=options["spaces_between_special_tokens"],
        )
        if trim and result.finish_reason == "stop" and isinstance(result.matched_stop, str):
            pos = text.find(result.matched_stop)
            if pos >= 0:
                text = text[:pos]
        return text

    def _format(self, prompt: list[int], result: GenerationResult, item: dict[str, Any], latency: float) -> dict:
        meta: dict[str, Any]
        if result.finish_reason == "abort" and not result.token_ids:
            # SGLang's reduced meta_info for a request aborted before it ran.
            meta = {
                "id": item["rid"],
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "completion_tokens": 0,
            }
        else:
            if result.finish_reason == "stop":
                finish = {"type": "stop", "matched": result.matched_stop}
            elif result.finish_reason == "length":
                finish = {"type": "length", "length": item["params"].max_new_tokens}
            else:
                finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            meta = {
                "id": item["rid"],
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "weight_version": self.versions.name(result.weight_version),
                "total_retractions": 0,
                "completion_tokens": len(result.token_ids),
                "cached_tokens": result.cached_tokens,
                "e2e_latency": latency,
            }
        if item["return_logprob"]:
            meta["input_token_logprobs"] = [[None, prompt[-1], None]]
            pairs = zip(result.logprobs, result.token_ids)
            meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in pairs]
        if result.routed_experts is not None:
            routed = np.ascontiguousarray(result.routed_experts, dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode("ascii")
        out: dict[str, Any] = {"output_ids": list(result.token_ids), "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": self._decode_text(result, item["text"]), **out}
        return out

    async def handle_generate(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
        try:
            body = await self._json_body(request)
            batch, prompts, items = self._parse_generate(body)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        self.num_running += 1
        call = asyncio.ensure_future(
            self.engine.generate(prompts, [it["params"] for it in items], request_ids=[it["rid"] for it in items])
        )
        self._generating.add(call)
        try:
            results = await call
        except ValueError as e:  # e.g. prompt too long, stop strings without a tokenizer
            return error_response(str(e), schema=False)
        finally:
            self.num_running -= 1
            self._generating.discard(call)
        latency = time.perf_counter() - start
        outs = [self._format(p, r, it, latency) for p, r, it in zip(prompts, results, items)]
        return web.json_response(outs if batch else outs[0])

    # ------------------------------------------------------------------ control
    async def handle_update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            model_path = body.get("model_path")
            if not isinstance(model_path, str) or not model_path:
                raise RequestError("model_path (a non-empty string) is required", schema=True)
            version = optional_string(body, "weight_version")
            new_version = self.engine.weight_version if version is None else self.versions.engine_version(version)
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise RequestError(
                    f"load_format {body['load_format']!r} is not supported by the dev server", schema=False
                )
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        if body.get("abort_all_requests", False):
            await self.engine.abort(None)
        try:
            await self.engine.update_weights(model_path, new_version)
        except Exception as e:  # noqa: BLE001 - reported to the caller, old weights stay (SGLang's rollback).
            log.exception("weight update from %s failed", model_path)
            message = f"Failed to update weights: {e}.\nRolling back to original weights."
            return web.json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
        self.model_path = model_path
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    # ------------------------------------------------------------------ weight-update groups
    def _check_tensor_engine(self) -> None:
        if not hasattr(self.engine, "update_weights_from_hf_tensors"):
            raise RequestError(
                f"{type(self.engine).__name__} cannot load tensors (the dev server needs the "
                "embedded engine for distributed weight updates)",
                schema=False,
            )

    def _group(self, body: dict[str, Any]) -> tuple[str, Any]:
        name = body.get("group_name", "weight_update_group")
        if name not in self._weight_groups:
            raise RequestError(f"no weight update group {name!r} (POST /init_weights_update_group first)", schema=False)
        return name, self._weight_groups[name]

    async def handle_init_weights_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            self._check_tensor_engine()
            address, name = body.get("master_address"), body.get("group_name", "weight_update_group")
            port, offset, world = body.get("master_port"), body.get("rank_offset"), body.get("world_size")
            if (
                not isinstance(address, str)
                or not isinstance(name, str)
                or not all(_is_int(x) for x in (port, offset, world))
            ):
                raise RequestError(
                    "expected master_address (str), master_port, rank_offset, world_size (ints), group_name (str)",
                    schema=True,
                )
            if not 1 <= offset < world:
                raise RequestError(f"rank_offset {offset} must be in [1, world_size {world})", schema=False)
            if body.get("backend", "nccl") != "gloo":
                raise RequestError(
                    f"backend {body.get('backend', 'nccl')!r}: the dev server speaks gloo only", schema=False
                )
            if name in self._weight_groups:
                raise RequestError(f"weight update group {name!r} exists", schema=False)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        from ipa_jax.engines.weight_transfer import in_daemon_thread, init_custom_process_group

        try:
            group = await in_daemon_thread(
                lambda: init_custom_process_group(
                    backend="gloo",
                    master_address=address,
                    master_port=port,
                    world_size=world,
                    rank=offset,
                    group_name=name,
                    timeout_s=self.dist_timeout_s,
                )
            )
        except Exception as e:  # noqa: BLE001 - reported to the caller
            log.warning("init_weights_update_group %s failed: %s", name, e)
            return web.json_response({"success": False, "message": f"Failed to init process group: {e}"}, status=400)
        self._weight_groups[name] = group
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def handle_begin_weight_update(self, request: web.Request) -> web.Response:
        try:
            selector = (await self._json_body(request)).get("selector", "all")
            if selector not in SESSION_SELECTORS:
                raise RequestError(f"selector must be one of {SESSION_SELECTORS}, got {selector!r}", schema=True)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        if self.session_open:
            message = f"{SESSION_ALREADY_OPEN}; call end_weight_update() first"
            return web.json_response({"success": False, "message": message}, status=400)
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def handle_end_weight_update(self, request: web.Request) -> web.Response:
        try:
            await self._json_body(request)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        if not self.session_open:
            message = f"{NO_SESSION_OPEN}; call begin_weight_update() first"
            return web.json_response({"success": False, "message": message}, status=400)
        self.session_open = False
        return web.json_response({"success": True, "message": "Success"})

    def _tensor_specs(self, body: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
        """The (name, dtype, shape) of each tensor an update call receives; raises RequestError."""
        from ipa_jax.engines.weight_transfer import DTYPES

        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
            and all(isinstance(n, str) for n in names)
            and all(isinstance(sh, list) and all(_is_int(d) and d >= 0 for d in sh) for sh in shapes)
        ):
            raise RequestError(
                "names, dtypes, shapes must be lists of one length (str, str, list of ints)", schema=True
            )
        bad = [d for d in dtypes if d not in DTYPES]
        if bad:
            raise RequestError(f"dtypes {bad[:3]} not supported (only {DTYPES})", schema=False)
        return list(zip(names, dtypes, shapes))

    async def handle_update_weights_from_distributed(self, request: web.Request) -> web.Response:
        from ipa_jax.engines.weight_transfer import in_daemon_thread, receive, to_numpy

        try:
            body = await self._json_body(request)
            self._check_tensor_engine()
            name, group = self._group(body)
            specs = self._tensor_specs(body)
        except RequestError as e:  # nothing it could join: the trainer's broadcast fails on its group's timeout
            return error_response(str(e), schema=e.schema)
        try:
            version = optional_string(body, "weight_version")
            refusal = None
            if self.weight_update_sessions and not self.session_open:
                refusal = web.json_response({"success": False, "message": OUTSIDE_SESSION}, status=400)
        except RequestError as e:
            refusal = error_response(str(e), schema=e.schema)
        if refusal is not None:  # SGLang refuses before the broadcast; receiving first frees the trainer at once
            try:
                await in_daemon_thread(receive, group, specs)
            except Exception as e:  # noqa: BLE001 - the refusal is the answer
                log.warning("receiving a refused update: %s", e)
            return refusal
        if body.get("abort_all_requests", False):
            await self.engine.abort(None)
        try:
            received = await in_daemon_thread(receive, group, specs)
            tensors = {**self._incomplete.pop(name, {}), **{k: to_numpy(t) for k, t in received.items()}}
            engine_version = None if version is None else self.versions.engine_version(version)
            self._incomplete[name] = await self.engine.update_weights_from_hf_tensors(tensors, engine_version)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            log.warning("update_weights_from_distributed failed: %s", e)
            message = f"Failed to update parameter online: {e}"
            return web.json_response({"success": False, "message": message}, status=400)
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def handle_destroy_weights_group(self, request: web.Request) -> web.Response:
        try:
            name, _ = self._group(await self._json_body(request))
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        await self._destroy_group(name)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def _destroy_group(self, name: str) -> None:
        from ipa_jax.engines.weight_transfer import destroy_process_group, in_daemon_thread

        group = self._weight_groups.pop(name)
        self._incomplete.pop(name, None)
        try:
            await in_daemon_thread(destroy_process_group, group)
        except Exception as e:  # noqa: BLE001 - a broken group: nothing left to close
            log.info("destroying weight update group %s: %s", name, e)

    async def handle_get_weights_by_name(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            name, truncate = body.get("name"), body.get("truncate_size", 100)
            if not isinstance(name, str) or not _is_int(truncate) or truncate < 1:
                raise RequestError("expected name (str) and truncate_size (int >= 1)", schema=True)
            if not hasattr(self.engine, "hf_tensor"):
                raise RequestError(f"{type(self.engine).__name__} has no named weights", schema=False)
            try:
                value = await asyncio.to_thread(self.engine.hf_tensor, name)
            except KeyError:
                raise RequestError(f"no weight named {name!r}", schema=False) from None
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        return web.json_response(np.asarray(value[:truncate], dtype=np.float32).tolist())

    async def handle_pause(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, optional=True)
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise RequestError(f"mode must be one of {PAUSE_MODES}, got {mode!r}", schema=True)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        self.paused = True
        await self.engine.pause()  # holds running requests in place and queues new ones
        if mode == "abort":
            in_flight = list(self._generating)
            await self.engine.abort(None)  # in-flight requests return with partial output
            # SGLang answers once they have returned: a weight update that follows cannot race their last tokens.
            if in_flight:
                await asyncio.wait(in_flight)
        # "retract" (recompute later) and "in_place" (keep KV) look the same from outside: requests continue. The
        # embedded engine never decodes on a stale cache: weights updated while they are held re-prefill them.
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def handle_continue(self, request: web.Request) -> web.Response:
        try:
            await self._json_body(request, optional=True)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        await self.engine.resume()
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def handle_abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            rid, abort_all = body.get("rid"), body.get("abort_all", False)
            if not isinstance(abort_all, bool) or (not abort_all and not isinstance(rid, str)):
                raise RequestError('expected {"rid": "<prefix>"} or {"abort_all": true}', schema=True)
        except RequestError as e:
            return error_response(str(e), schema=e.schema)
        await self.engine.abort(None if abort_all else [rid])
        return web.Response(status=200)

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        if self.num_running:
            text = f"Cache not flushed because there are {self.num_running} running requests.\n"
            return web.Response(status=400, text=text)
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. ")

    async def handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": getattr(self.tokenizer, "name_or_path", None),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.versions.name(self.engine.weight_version),
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def handle_server_info(self, request: web.Request) -> web.Response:
        """The part of SGLang's server info (its ServerArgs, `version`) that clients read: one process, no
        parallelism."""
        return web.json_response(
            {
                "version": self.sglang_version,
                "model_path": self.model_path,
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
            }
        )

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.engine.health() else 503)

    async def handle_health_generate(self, request: web.Request) -> web.Response:
        if not await self.engine.health():
            return web.Response(status=503)
        if self.paused:  # a probe generation would wait for /continue_generation
            return web.Response(status=200)
        probe = SamplingParams(max_new_tokens=1, temperature=0.0)
        try:
            await asyncio.wait_for(
                self.engine.generate([[0]], probe, request_ids=[f"HEALTH_CHECK_{uuid.uuid4().hex}"]),
                timeout=self.health_timeout_s,
            )
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            log.exception("health_generate probe failed")
            return web.Response(status=503)
        return web.Response(status=200)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on host:port (port 0: a free port, stored in self.port)."""
        self._runner = web.AppRunner(self.make_app(), shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port)
        await self._site.start()
        self.port = self._runner.addresses[0][1]
        log.info("dev server listening on %s", self.url)

    async def stop(self, *, abrupt: bool = False) -> None:
        """Stop serving. abrupt=True drops open connections at once (a crash, seen from clients)."""
        if self._runner is None:
            return
        for name in list(self._weight_groups):
            await self._destroy_group(name)
        if abrupt:
            assert self._site is not None
            await self._site.stop()
            for handler in self._runner.server.connections if self._runner.server else []:
                if handler.transport is not None:
                    handler.transport.abort()
            await self.engine.abort(None)
        await self._runner.cleanup()
        await self.engine.close()
        self._runner = None

    def serve_in_thread(self) -> DevServer:
        """Start in a daemon thread with its own event loop; returns self once listening."""
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"devserver-{self.port}", daemon=True)
        self._thread.start()
        started.wait()
        if errors:
            raise errors[0]
        return self

    def _stop_thread(self, abrupt: bool) -> None:
        assert self._loop is not None and self._thread is not None, "not started with serve_in_thread()"
        asyncio.run_coroutine_threadsafe(self.stop(abrupt=abrupt), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._thread = None

    def shutdown(self) -> None:
        """Graceful stop of a serve_in_thread() server."""
        self._stop_thread(abrupt=False)

    def kill(self) -> None:
        """Abrupt stop of a serve_in_thread() server: listening socket and open connections dropped."""
        self._stop_thread(abrupt=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _read_eos_token_ids(model_path: str) -> list[int]:
    """EOS ids SGLang stops on: config.json's / generation_config.json's eos_token_id (int or list)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_path, name)
        if os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                ids += [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(ids))


def _sglang_version(value: str) -> str:
    try:
        parse_release(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", "--model-path", dest="model", required=True, help="HF folder (config.json + safetensors)"
    )
    parser.add_argument(
        "--tokenizer",
        "--tokenizer-path",
        dest="tokenizer",
        default="",
        help="tokenizer folder (default: the model folder, if it has tokenizer files)",
    )
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="token ids only, even with a tokenizer")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--max-len", type=int, default=2048, help="longest prompt + generation")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--batch-buckets", default="", help="comma-separated padded batch sizes (default: powers of 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--api-key", default="", help="require `Authorization: Bearer KEY` (SGLang's --api-key)")
    parser.add_argument(
        "--admin-api-key",
        default="",
        help="the key of the routes of SGLang's admin level: pause, weight updates, ... (SGLang's --admin-api-key)",
    )
    parser.add_argument(
        "--sglang-version",
        default=SGLANG_RELEASE,
        type=_sglang_version,
        help="the SGLang release to behave like (the weight-update session from 0.5.21 on)",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds a weight-update group's rendezvous or transfer may wait (SGLang's flag)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from ipa_jax.engines.embedded import EmbeddedEngine
    from ipa_jax.models import from_pretrained

    tokenizer = None
    tokenizer_path = args.tokenizer or args.model
    has_files = any(os.path.exists(os.path.join(tokenizer_path, f)) for f in TOKENIZER_FILES)
    if args.skip_tokenizer_init:
        pass
    elif has_files:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    elif args.tokenizer:
        parser.error(f"--tokenizer {args.tokenizer} has none of {TOKENIZER_FILES}")
    else:  # SGLang's --skip-tokenizer-init behaviour: input_ids in, output_ids out
        log.info("no tokenizer files in %s: serving input_ids only", args.model)
    engine = EmbeddedEngine(
        from_pretrained(args.model),
        seed=args.seed,
        max_len=args.max_len,
        max_batch=args.max_batch,
        batch_buckets=tuple(int(b) for b in args.batch_buckets.split(",")) if args.batch_buckets else None,
        tokenizer=tokenizer,
        weight_version=args.weight_version,
    )
    server = DevServer(
        engine,
        host=args.host,
        port=args.port,
        model_path=args.model,
        tokenizer=tokenizer,
        eos_token_ids=_read_eos_token_ids(args.model),
        enable_return_routed_experts=args.enable_return_routed_experts,
        api_key=args.api_key or None,
        admin_api_key=args.admin_api_key or None,
        sglang_version=args.sglang_version,
        dist_timeout_s=args.dist_timeout,
    )

    asyncio.run(serve_until_signal(server))


async def serve_until_signal(server: DevServer) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully (the CLI's main loop)."""
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await server.start()
    print(f"dev server ready at {server.url}", flush=True)
    await stopping.wait()
    await server.stop()


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    main()
