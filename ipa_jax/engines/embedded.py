"""EmbeddedEngine: batched, jitted prefill + decode with a KV cache on the ipa_jax Qwen3 model.

Requests queue up; a worker takes up to `max_batch` at a time and decodes them as one batch in a worker thread
(the event loop stays free for HTTP and control calls):

* prefill (`_admit`): the newly admitted requests only, right-padded prompts [n, P] (per-row lengths), written
  into the rows they are admitted to of a position-addressed cache; the last real position of each prompt gives
  its first sampled token. A multi-turn agent sends one request per turn, so admissions are frequent and small:
  prefilling the whole batch each time would cost B / n times more.
* prefix cache (`prefix_cache=True`): a row's cache outlives its request (and the batch: an idle engine keeps its
  last batch's rows). A request is admitted into the free row whose cache holds the longest prefix of its context
  computed with the weights now served, and only the rest is prefilled: the next turn of a multi-turn episode
  prefills its new tokens (the tool's output and the next generation prompt) instead of the whole conversation.
  Requests with the longest reusable prefixes pick first, then rows freed longest ago (or holding nothing
  reusable) are given out. Serving new weights makes every cached row unusable (whatever their version number).
* decode: a jitted `lax.while_loop` of up to `decode_chunk` [B, 1] steps at per-row positions; finished rows
  stop writing. Between chunks the host applies aborts, stop strings and pauses, returns finished rows to their
  callers, admits queued requests that fit the batch's shapes into the free rows (continuous batching), and
  picks up new weights.
* weight updates (`set_params_from_model`, `update_weights`) take effect between decode chunks and never leave a
  row decoding on a KV cache computed with other weights. With `partial="finish"` the rows running at the update
  finish on the old weights (nothing new is admitted meanwhile) and the new weights are served after them; with
  `partial="abort_resume"` (and on a paused engine) they are interrupted: their tokens and log-probs so far are
  kept and each continues as a new segment, prompt + tokens so far prefilled with the new weights (the remaining
  budget), returned to its caller as one result whose `token_versions` say which weights sampled each token.
* The KV cache grows with the batch's longest row: its slots double (from MIN_CACHE_SLOTS up to max_len) before
  an admission or a decode chunk would write past them, so a decode step attends over about the positions in use,
  not the whole max_len (agentic configs set max_len to the longest episode; most turns run far shorter).
* Shapes are bucketed (batch, prompt lengths and cache slots to powers of two, admissions to powers of four) so
  compiles are bounded; compiled functions are module-level and shared by every engine with
  the same model structure.

Each row has its own temperature / top-p / top-k, stop token ids and max_new_tokens; the returned log-probs are
those of the distribution actually sampled from (see sampling.py). Each row samples with its own key, token j of a
request from fold_in(its key, j): a request with a `sampling_seed` has the key of that seed, so it samples the same
tokens whatever else is batched with it (the model's numbers themselves can differ in the last bits with the batch's
shapes, e.g. its cache slots; `ipa_jax.rollout.lockstep` batches the same requests together every time). A request
without one takes the next key of the engine's seeded stream at its admission: requests sent one at a time sample the
same tokens in every run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
from ipa_jax.engines.sampling import sample_tokens
from ipa_jax.models import KVCache, Qwen3ForCausalLM, extend_kv_cache, from_pretrained, init_kv_cache
from ipa_jax.models.hf_io import iter_hf_tensors, merge_hf_tensors

RUNNING, STOP, LENGTH, ABORT = 0, 1, 2, 3
_FINISH_NAMES = {STOP: "stop", LENGTH: "length", ABORT: "abort"}
MIN_LEN_BUCKET = 16
MIN_CACHE_SLOTS = 64  # a new batch's KV cache slots (fewer when max_len is smaller); they double as rows grow


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def bucket4(n: int) -> int:
    """Smallest power of four >= n (>= 1)."""
    k = 1
    while k < n:
        k *= 4
    return k


class RowParams(NamedTuple):
    """Per-row sampling controls: temperature/top_p float32[B], top_k/max_new int32[B], stop_ids int32[B, S]
    (-1 padded)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    stop_ids: jax.Array
    max_new: jax.Array


class DecodeState(NamedTuple):
    """Decode loop carry. `last` is the newest sampled token of each row, to be fed at position `pos`; outputs
    tokens/logprobs [B, M] hold n_gen entries per row; routed [B, M, L, k] (or None) row j = experts used
    when feeding output token j; finish: RUNNING/STOP/LENGTH/ABORT; row_keys: a key per row (output token j of a
    row is sampled with fold_in(its key, j))."""

    cache: KVCache
    last: jax.Array
    pos: jax.Array
    n_gen: jax.Array
    done: jax.Array
    finish: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    routed: jax.Array | None
    row_keys: jax.Array


class RequestKeys(NamedTuple):
    """The sampling keys of n admitted requests: seeded[j] -> the key of seed (high, low) = seeds[j] (its
    SamplingParams.sampling_seed), else the j-th key split from `stream` (the engine's stream); either folded with
    offsets[j], the tokens the request generated in earlier segments (a request a weight update interrupted)."""

    seeded: jax.Array  # bool[n]
    seeds: jax.Array  # uint32[n, 2]
    offsets: jax.Array  # int32[n]
    stream: jax.Array  # a key

    def resolve(self) -> jax.Array:
        """The key array [n]."""
        seeded = jax.vmap(lambda hi, lo: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), hi), lo))(
            self.seeds[:, 0], self.seeds[:, 1]
        )
        drawn = jax.random.split(self.stream, self.seeded.shape[0])
        chosen = jnp.where(self.seeded[:, None], jax.random.key_data(seeded), jax.random.key_data(drawn))
        return jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(chosen), self.offsets)


def _token_keys(row_keys: jax.Array, index) -> jax.Array:
    """The keys that sample output token `index` (an int or int32[B]) of each row: fold_in(row key, index)."""
    return jax.vmap(jax.random.fold_in)(row_keys, jnp.broadcast_to(index, row_keys.shape))


def _record(st: DecodeState, tok: jax.Array, lp: jax.Array, rp: RowParams) -> DecodeState:
    """Append the sampled token of every unfinished row; finish rows on a stop token or max_new."""
    b, m = st.tokens.shape
    active = ~st.done
    rows = jnp.arange(b)
    idx = jnp.where(active, st.n_gen, m)  # out of range -> dropped
    n_gen = st.n_gen + active.astype(jnp.int32)
    hit_stop = active & jnp.any(tok[:, None] == rp.stop_ids, axis=-1)
    hit_len = active & ~hit_stop & (n_gen >= rp.max_new)
    return st._replace(
        tokens=st.tokens.at[rows, idx].set(tok, mode="drop"),
        logprobs=st.logprobs.at[rows, idx].set(lp, mode="drop"),
        n_gen=n_gen,
        finish=jnp.where(hit_stop, STOP, jnp.where(hit_len, LENGTH, st.finish)),
        done=st.done | hit_stop | hit_len,
        last=jnp.where(active, tok, st.last),
        pos=jnp.where(active, st.pos + 1, st.pos),
    )


def empty_state(config, batch: int, cache_len: int, with_routed: bool, key: jax.Array, dtype) -> DecodeState:
    """A DecodeState with every row finished (free) and an empty cache of min(MIN_CACHE_SLOTS, cache_len) slots
    (`EmbeddedEngine` extends it as rows grow); output buffers have cache_len columns."""
    routed = None
    if with_routed:
        routed = jnp.zeros((batch, cache_len, config.num_hidden_layers, config.num_experts_per_tok), jnp.int32)
    return DecodeState(
        cache=init_kv_cache(config, batch, min(MIN_CACHE_SLOTS, cache_len), dtype),
        last=jnp.zeros((batch,), jnp.int32),
        pos=jnp.zeros((batch,), jnp.int32),
        n_gen=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        finish=jnp.full((batch,), LENGTH, jnp.int32),
        tokens=jnp.zeros((batch, cache_len), jnp.int32),
        logprobs=jnp.zeros((batch, cache_len), jnp.float32),
        routed=routed,
        row_keys=jax.random.split(key, batch),
    )


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _admit(graphdef, params, st: DecodeState, prompts, lengths, starts, rows, rp: RowParams, keys: RequestKeys):
    """Prefill new requests into the rows `rows` and sample their first token; only those rows are computed,
    the others (running or free) are untouched. `keys`: each request's sampling key (`RequestKeys`).

    prompts int32[n, P]: each request's context from position starts[j] on, right-padded (its first starts[j]
    tokens are already in the row's cache: a reused prefix; 0 = none); lengths int32[n]: the real tokens of each
    prompts row; rows int32[n] (the batch row of each prompt; entries >= B are padding and dropped)
    -> (DecodeState, routed experts of the prompts' tokens int32[n, P, L, k] or None).
    """
    model = nnx.merge(graphdef, params)
    b = st.tokens.shape[0]
    n, p = prompts.shape
    real = rows < b
    # The admitted rows' cache keeps the reused prefix and forgets the rest of its previous request; the new
    # tokens are written after the prefix and attend to it; the rows are scattered back.
    sub_cache = jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), st.cache)
    sub_cache = sub_cache._replace(valid=jnp.arange(sub_cache.max_len)[None, :] < starts[:, None])
    offsets = jnp.arange(p, dtype=jnp.int32)[None, :]
    mask = (offsets < lengths[:, None]) & real[:, None]
    hidden, aux = model.hidden_states(prompts, starts[:, None] + offsets, mask, cache=sub_cache)
    logits = hidden[jnp.arange(n), lengths - 1] @ model.lm_head_weight()
    sub_rp = jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), rp)
    row_keys = keys.resolve()
    tok, lp = sample_tokens(_token_keys(row_keys, 0), logits, sub_rp.temperature, sub_rp.top_p, sub_rp.top_k)

    def scatter(full, new):
        return full.at[rows].set(new, mode="drop")

    admit = scatter(jnp.zeros(b, bool), real)
    fresh = st._replace(
        cache=jax.tree.map(scatter, st.cache, aux["cache"]),
        row_keys=scatter(st.row_keys, row_keys),
        pos=scatter(st.pos, starts + lengths - 1),
        n_gen=jnp.where(admit, 0, st.n_gen),
        done=~admit,  # only admitted rows take the first token
        finish=jnp.where(admit, RUNNING, st.finish),
    )
    rec = _record(fresh, scatter(st.last, tok), scatter(jnp.zeros(b, lp.dtype), lp), rp)
    rec = rec._replace(done=jnp.where(admit, rec.done, st.done), finish=jnp.where(admit, rec.finish, st.finish))
    return rec, (aux["routed_experts"] if st.routed is not None else None)


def _decode_impl(graphdef, params, st: DecodeState, rp: RowParams, num_steps):
    """Up to num_steps decode steps (fewer if every row finishes) -> DecodeState."""
    model = nnx.merge(graphdef, params)
    b, m = st.tokens.shape
    rows = jnp.arange(b)

    def body(carry):
        i, s = carry
        out = model(s.last[:, None], s.pos[:, None], ~s.done[:, None], cache=s.cache)
        tok, lp = sample_tokens(_token_keys(s.row_keys, s.n_gen), out.logits[:, 0], rp.temperature, rp.top_p, rp.top_k)
        routed = s.routed
        if routed is not None:  # experts used for the token just fed = output token n_gen - 1
            idx = jnp.where(s.done, m, s.n_gen - 1)
            routed = routed.at[rows, idx].set(out.aux["routed_experts"][:, 0], mode="drop")
        s = s._replace(cache=out.cache, routed=routed)
        return i + 1, _record(s, tok, lp, rp)

    def cond(carry):
        i, s = carry
        return (i < num_steps) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]


@functools.cache
def _decode_fn():
    # Donating the carry halves decode memory on accelerators; CPU cannot use donated buffers.
    donate = () if jax.default_backend() == "cpu" else ("st",)
    return jax.jit(_decode_impl, static_argnames=("graphdef",), donate_argnames=donate)


@dataclasses.dataclass
class _Request:
    """A generation request. The done_* lists hold the output of its earlier segments: what it generated before a
    weight update interrupted it (one entry per token: id, log-prob, the version that sampled it)."""

    prompt: list[int]
    params: SamplingParams
    rid: str
    future: asyncio.Future
    aborted: bool = False
    cached: int = 0  # context tokens its segments took from a row's cache
    done_tokens: list[int] = dataclasses.field(default_factory=list)
    done_logprobs: list[float] = dataclasses.field(default_factory=list)
    done_versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """What the next segment is prefilled with: the prompt and the tokens generated so far."""
        return self.prompt + self.done_tokens

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.done_tokens)

    def aborted_result(self, version: int) -> GenerationResult:
        """The result of an abort while the request waits in the queue: the tokens of its earlier segments."""
        last = self.done_versions[-1] if self.done_versions else version
        return GenerationResult(
            list(self.done_tokens),
            list(self.done_logprobs),
            "abort",
            None,
            last,
            token_versions=list(self.done_versions),
            cached_tokens=self.cached,
        )


@dataclasses.dataclass
class _Slot:
    """A batch row's request, the weight version of its current segment, and its host-side state."""

    req: _Request
    version: int
    served: int  # the engine's count of weight swaps when the segment started (which weights compute its cache)
    context: np.ndarray  # int32: the tokens the segment was prefilled with (its reused prefix included)
    checked: int = 0  # output tokens (earlier segments included) already known to be free of stop strings
    matched: str | None = None  # the stop string that ended it
    prompt_routed: np.ndarray | None = None  # [len(context), L, k]


@dataclasses.dataclass
class _RowCache:
    """What a free batch row's KV cache holds: the tokens at positions 0, 1, ... (its last request's context and
    the tokens that request fed while decoding: all but its last sampled one), which weights computed them (the
    engine's count of weight swaps then), their routed experts ([len(tokens), L, k], when the batch recorded them),
    and when the row was freed (the engine's count of freed rows then: smaller = freed longer ago)."""

    tokens: np.ndarray
    served: int
    routed: np.ndarray | None
    freed: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


def _resolve(future: asyncio.Future, result: GenerationResult) -> None:
    if not future.done():
        future.set_result(result)


def _own_copy(new: jax.Array | np.ndarray, old: jax.Array) -> jax.Array:
    """`new` in `old`'s dtype and sharding, in buffers of its own: device_put may hand back the source's buffers (to
    the same devices, or a subset of a replicated array's), which the learner's next step donates."""
    placed = jax.device_put(new.astype(old.dtype), old.sharding)
    return jnp.copy(placed) if isinstance(new, jax.Array) else placed


def _nonfinite_leaves(params: Any) -> list[str]:
    """The paths of the parameters that hold a NaN or an infinity."""
    return [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if not bool(jnp.isfinite(x).all())
    ]


class EmbeddedEngine(Engine):
    """The Engine interface on an in-process ipa_jax model.

    model: a Qwen3ForCausalLM (its config and dtype are kept; weights can be swapped for ones of the same
    structure). max_len: longest prompt + max_new_tokens. tokenizer: needed only for stop strings.
    batch_buckets: the padded batch sizes to compile for (default: powers of two). partial: what a weight update
    does to the requests running ("finish" or "abort_resume", see the module docstring). prefix_cache: reuse the
    cached prefix of a request's context (module docstring; prefix_counts() counts the context tokens prefilled and
    those taken from the cache instead). Use from one event loop.
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        *,
        seed: int = 0,
        max_len: int = 2048,
        max_batch: int = 32,
        decode_chunk: int = 16,
        tokenizer: Any = None,
        weight_version: int = 0,
        batch_wait_s: float = 0.002,
        batch_buckets: tuple[int, ...] | None = None,
        partial: str = "finish",
        prefix_cache: bool = True,
    ):
        if max_len < 2 or max_batch < 1 or decode_chunk < 1:
            raise ValueError(
                f"need max_len >= 2, max_batch >= 1, decode_chunk >= 1 (got {max_len}, {max_batch}, {decode_chunk})"
            )
        if batch_buckets is not None and (not batch_buckets or max(batch_buckets) < max_batch):
            raise ValueError(f"batch_buckets {batch_buckets} must include a size >= max_batch {max_batch}")
        self.config = model.config
        self.dtype = model.dtype
        self._mesh, self._rules = model.mesh, model.rules  # where update_weights places a checkpoint's weights
        self._graphdef, params = nnx.split(model)
        self._current: tuple[Any, int] = (params, weight_version)  # swapped atomically, never during a decode chunk
        self.partial = check_partial(partial)
        # Weights waiting for the running batch to reach a chunk boundary (`_swap`), and whoever waits for them.
        self._staged: tuple[Any, int] | None = None
        self._swap_waiters: list[concurrent.futures.Future] = []
        self._served = 0  # weight swaps so far: a row's cache is reusable only under the weights that computed it
        self._swap_lock = threading.Lock()  # _current, _staged, _batch_active: set from any thread
        self._batch_active = False
        self._counts = PartialCounts()
        self.max_len = max_len
        self.max_batch = max_batch
        self.decode_chunk = decode_chunk
        self.tokenizer = tokenizer
        self.batch_wait_s = batch_wait_s
        self.batch_buckets = None if batch_buckets is None else tuple(sorted(batch_buckets))
        self._key = jax.random.key(seed)
        self._queue: list[_Request] = []
        self._queue_lock = threading.Lock()  # the queue is taken from by the decode thread too
        self._running: list[_Request] = []  # admitted, not yet returned
        self._paused = False
        self._hold = threading.Event()  # set = decode may step (cleared by pause)
        self._hold.set()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedded-engine")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._resumed: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False
        self.num_batches = 0  # prefill calls (a batch, or requests admitted into finished rows)
        self.prefix_cache = prefix_cache
        self._prefix = PrefixCounts()
        # The rows' caches of the running batch (None: a running row, or nothing reusable) and how many rows have
        # been freed; between batches the last batch's state and caches, kept for the next (prefix_cache).
        self._caches: list[_RowCache | None] = []
        self._freed = 0
        self._kept: tuple[DecodeState, list[_RowCache | None]] | None = None

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self._current[1]

    def _check_params(self, params: Any, source: str) -> None:
        old = self._current[0]
        if jax.tree.structure(params) != jax.tree.structure(old):
            raise ValueError(f"{source}: parameter tree differs from the engine's model")
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(old)):
            if a.shape != b.shape:
                raise ValueError(f"{source}: parameter shape {a.shape} != engine's {b.shape}")

    def partial_counts(self) -> PartialCounts:
        return dataclasses.replace(self._counts)

    def prefix_counts(self) -> PrefixCounts:
        return dataclasses.replace(self._prefix)

    def set_params_from_model(self, model_or_state: Qwen3ForCausalLM | nnx.State, version: int) -> None:
        """Serve the learner's weights (an nnx model or its nnx.State: device arrays this process addresses, or host
        arrays) as `version`, without waiting: at once when nothing runs, else between decode chunks as `partial`
        says (module docstring). The weights are copied (a jitted train step may donate the learner's buffers) into
        the engine's own placement (its model's shardings, whatever the learner's mesh) in its parameter dtypes (the
        compiled decode stays valid)."""
        params = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
        self._check_params(params, "set_params_from_model")
        self._swap(jax.tree.map(_own_copy, params, self._current[0]), int(version))

    async def push_weights(self, model: Qwen3ForCausalLM, version: int) -> None:
        self.set_params_from_model(model, version)

    def _swap(self, params: Any, version: int) -> concurrent.futures.Future:
        """Serve `params` as `version`: at once when no batch runs, else staged for the batch loop's next chunk
        boundary (`_swap_at_boundary`; a newer staging replaces an older one). The future is done once served."""
        served: concurrent.futures.Future = concurrent.futures.Future()
        with self._swap_lock:
            self._staged = (params, version)
            self._swap_waiters.append(served)
            if not self._batch_active:
                self._serve_staged()
        return served

    def _serve_staged(self) -> None:
        """Called with _swap_lock held."""
        if self._staged is None:
            return
        self._current, self._staged = self._staged, None
        self._served += 1
        self._counts.updates += 1
        for waiter in self._swap_waiters:
            waiter.set_result(None)
        self._swap_waiters = []

    async def update_weights(self, path: str, version: int) -> None:
        """Reload HF safetensors from `path` and return once they are served: with `partial="finish"` after the
        running requests finish on the old weights (nothing new is admitted meanwhile: SGLang's semantics of an
        update without a pause), with "abort_resume" or while paused at the next chunk boundary, the running
        requests interrupted and continued on the new weights. A checkpoint with non-finite values is refused
        (ValueError; the old weights stay): every sample from it would be invalid."""
        self._setup()
        # The engine's computation paths and sharding: only the checkpoint's architecture may differ (and is refused).
        model = await asyncio.to_thread(
            from_pretrained,
            path,
            dtype=self.dtype,
            mesh=self._mesh,
            sharding_rules=self._rules,
            **self.config.learner_side(),
        )
        graphdef, params = nnx.split(model)
        if graphdef != self._graphdef:
            raise ValueError(f"checkpoint {path} has a different architecture than the engine's model")
        self._check_params(params, f"checkpoint {path}")
        nonfinite = await asyncio.to_thread(_nonfinite_leaves, params)
        if nonfinite:
            raise ValueError(f"checkpoint {path} has non-finite values in {', '.join(nonfinite[:5])}")
        await asyncio.wrap_future(self._swap(params, int(version)))

    async def update_weights_from_hf_tensors(
        self, tensors: Mapping[str, np.ndarray], version: int | None
    ) -> dict[str, np.ndarray]:
        """Serve the newest weights with every parameter whose HF tensors are all in `tensors` replaced (SGLang's
        `load_weights` of one `/update_weights_from_distributed` call), as `version` (None: the version stays), like
        update_weights. Returns the tensors of parameters only partly given (the caller keeps them for the next
        call); with a version, every given parameter must be complete. Refuses non-finite values (ValueError)."""
        self._setup()
        nonfinite = [k for k, v in tensors.items() if not np.isfinite(np.asarray(v, dtype=np.float32)).all()]
        if nonfinite:
            raise ValueError(f"tensors with non-finite values: {', '.join(sorted(nonfinite)[:5])}")
        with self._swap_lock:  # on top of weights staged by an earlier call
            base, current_version = self._staged or self._current
        params, used = await asyncio.to_thread(merge_hf_tensors, base, tensors)
        leftover = {k: v for k, v in tensors.items() if k not in used}
        if version is not None and leftover:
            raise ValueError(
                f"weights of version {version} are incomplete: parameters lack tensors, given only "
                f"{sorted(leftover)[:5]} of them"
            )
        if used or version is not None:
            await asyncio.wrap_future(self._swap(params, current_version if version is None else int(version)))
        return leftover

    def hf_tensor(self, name: str) -> np.ndarray:
        """The served value of one HF tensor (HF layout, the engine's dtype)."""
        model = nnx.merge(self._graphdef, self._current[0])
        for key, value in iter_hf_tensors(model):
            if key == name:
                return value
        raise KeyError(name)

    # ------------------------------------------------------------------ async front
    def _setup(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise EngineError("EmbeddedEngine is closed")
        if self._loop is None:
            self._loop = loop
            self._wake = asyncio.Event()
            self._resumed = asyncio.Event()
            if not self._paused:
                self._resumed.set()
            self._worker = loop.create_task(self._work())
        elif self._loop is not loop:
            raise EngineError("EmbeddedEngine is bound to another event loop")

    def _validate(self, prompt: list[int], p: SamplingParams, i: int) -> None:
        if len(prompt) + p.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompts[{i}]: {len(prompt)} prompt tokens + max_new_tokens {p.max_new_tokens} "
                f"exceed the engine's max_len {self.max_len}"
            )
        if max(prompt) >= self.config.vocab_size:
            raise ValueError(f"prompts[{i}] has a token id >= vocab_size {self.config.vocab_size}")
        if p.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: EmbeddedEngine(..., tokenizer=...)")
        if p.return_routed_experts and not self.config.is_moe:
            raise ValueError("return_routed_experts needs a MoE model")

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        session_ids: list[str] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[GenerationResult]:
        prompts, plist = check_generate_args(prompts, params, session_ids, request_ids)
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            self._validate(prompt, p, i)
        self._setup()
        assert self._loop is not None and self._wake is not None
        reqs = [
            _Request(prompt, p, request_ids[i] if request_ids else uuid.uuid4().hex, self._loop.create_future())
            for i, (prompt, p) in enumerate(zip(prompts, plist))
        ]
        for r in reqs:
            if r.params.max_new_tokens == 0:
                r.future.set_result(GenerationResult([], [], "length", None, self.weight_version))
        with self._queue_lock:  # all at once: the batch loop takes none of them before the others
            self._queue.extend(r for r in reqs if r.params.max_new_tokens)
        self._wake.set()
        return list(await asyncio.gather(*(r.future for r in reqs)))

    def _take(self, n: int, fits=lambda r: True) -> list[_Request]:
        """Remove and return up to n queued requests for which fits(request) holds, in arrival order."""
        with self._queue_lock:
            taken, keep = [], []
            for r in self._queue:
                (taken if len(taken) < n and fits(r) else keep).append(r)
            self._queue = keep
        return taken

    async def _work(self) -> None:
        assert self._wake is not None and self._resumed is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.batch_wait_s)  # let concurrent callers join the batch
            while self._queue:
                await self._resumed.wait()
                first = self._take(self.max_batch)
                if not first:
                    continue
                try:
                    await loop.run_in_executor(self._executor, self._run, first)
                except Exception as e:  # noqa: BLE001 - handed to every caller still waiting
                    for r in first + self._running:
                        if not r.future.done():
                            r.future.set_exception(e)
                finally:
                    self._running = []

    async def pause(self) -> None:
        """Hold running requests in place between decode chunks; queued and new ones wait for resume(). Weights
        served while paused interrupt the held requests: they continue on the new weights after resume()."""
        self._setup()
        assert self._resumed is not None
        self._paused = True
        self._resumed.clear()
        self._hold.clear()

    async def resume(self) -> None:
        self._setup()
        assert self._resumed is not None
        self._paused = False
        self._hold.set()
        self._resumed.set()

    async def abort(self, request_ids: list[str] | None = None) -> None:
        """Queued matches return at once (no tokens); running ones at the next chunk boundary with their partial
        output. Matching is by id prefix (SGLang's rule); None aborts everything."""

        def match(r: _Request) -> bool:
            return request_ids is None or any(r.rid.startswith(p) for p in request_ids)

        for r in self._take(len(self._queue), match):
            _resolve(r.future, r.aborted_result(self.weight_version))
        for r in list(self._running):
            if match(r):
                r.aborted = True

    async def health(self) -> bool:
        return not self._closed and (self._worker is None or not self._worker.done())

    async def close(self) -> None:
        if self._closed:
            return
        await self.abort(None)
        self._closed = True
        self._hold.set()
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ the batch (worker thread)
    def _run(self, first: list[_Request]) -> None:
        """Decode `first` as one batch; rows that finish return their result at once and take queued requests
        that fit the batch's shapes (continuous batching at decode-chunk boundaries). Runs in the worker thread."""
        with self._swap_lock:
            self._batch_active = True
        try:
            self._run_batch(first)
        finally:
            with self._swap_lock:  # no row runs any more: weights staged meanwhile are served now
                self._serve_staged()
                self._batch_active = False

    def _run_batch(self, first: list[_Request]) -> None:
        # Full width whatever arrived first: requests arriving later join this batch.
        b = (
            bucket(self.max_batch)
            if self.batch_buckets is None
            else next(x for x in self.batch_buckets if x >= self.max_batch)
        )
        # The cache spans the engine's whole context: a multi-turn agent's next, longer turn joins the running
        # batch instead of waiting for every row to finish.
        cache_len = self.max_len
        num_stop = bucket(max(len(r.params.stop_token_ids) for r in first))
        with_routed = any(r.params.return_routed_experts for r in first)

        def fits(r: _Request) -> bool:
            return (
                len(r.prompt) + r.params.max_new_tokens <= cache_len
                and len(r.params.stop_token_ids) <= num_stop
                and (with_routed or not r.params.return_routed_experts)
            )

        st = self._batch_state(b, cache_len, with_routed)
        host_rp = RowParams(
            temperature=np.ones(b, np.float32),
            top_p=np.ones(b, np.float32),
            top_k=np.full(b, -1, np.int32),
            stop_ids=np.full((b, num_stop), -1, np.int32),
            max_new=np.ones(b, np.int32),
        )
        slots: list[_Slot | None] = [None] * b
        decode = _decode_fn()
        pending = first
        while True:
            if pending:
                st, rp = self._admit(st, slots, pending, host_rp)
            st = self._host_checks(st, slots)
            done = np.asarray(st.done)
            finished = [i for i, slot in enumerate(slots) if slot is not None and done[i]]
            if finished:
                self._deliver(st, slots, finished)
            st = self._swap_at_boundary(st, slots)
            if all(slot is None for slot in slots):
                # Every row free: the batch ends, and what was queued meanwhile starts the next one. A request then
                # meets the same batch state (the kept one, or a fresh one) whether it was queued just before or
                # just after the last row finished.
                if self.prefix_cache:
                    self._kept = (st, self._caches)
                return
            running = self._hold.is_set() and not self._closed
            free = slots.count(None)
            # Staged weights wait for the running rows (finish): admit nothing that would start on the old ones.
            pending = self._take(free, fits) if running and free and self._staged is None else []
            if pending:
                continue
            if not running:  # paused in place; aborts still apply
                self._hold.wait(0.01)
                continue
            params, _ = self._current
            # A row writes at pos, pos + 1, ... for the chunk's steps or the tokens left to it, whichever is fewer.
            rows = [i for i, slot in enumerate(slots) if slot is not None]
            left = np.minimum(host_rp.max_new[rows] - np.asarray(st.n_gen)[rows], self.decode_chunk)
            st = self._with_slots(st, int(np.max(np.asarray(st.pos)[rows] + left)))
            st = decode(self._graphdef, params, st, rp, jnp.int32(self.decode_chunk))

    def _batch_state(self, b: int, cache_len: int, with_routed: bool) -> DecodeState:
        """A batch's state with every row free: the previous batch's (its rows' caches kept) when it has the same
        shapes, else an empty one."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[0].tokens.shape == (b, cache_len) and (kept[0].routed is not None) == with_routed:
            self._caches = kept[1]
            return kept[0]
        self._caches = [None] * b
        return empty_state(self.config, b, cache_len, with_routed, self._key, self.dtype)

    def _with_slots(self, st: DecodeState, needed: int) -> DecodeState:
        """st with a KV cache of at least min(needed, max_len) slots: doubled until it has (a write past the slots
        would be dropped)."""
        slots = st.cache.max_len
        while slots < min(needed, self.max_len):
            slots = min(2 * slots, self.max_len)
        return st if slots == st.cache.max_len else st._replace(cache=extend_kv_cache(st.cache, slots))

    def _place(self, slots: list[_Slot | None], reqs: list[_Request]) -> tuple[list[int], list[int]]:
        """A free row for each request, and how many of its context tokens that row's cache holds (computed with
        the weights now served; at most all but the last, whose logits sample the first token): the longest
        reusable prefixes first, then rows freed longest ago or holding nothing reusable (module docstring)."""
        free = [i for i, slot in enumerate(slots) if slot is None]
        usable = {
            i: c for i in free if self.prefix_cache and (c := self._caches[i]) is not None and c.served == self._served
        }
        if not usable:  # nothing to reuse (cache off, or the first admission after a swap): rows in order
            return free[: len(reqs)], [0] * len(reqs)
        contexts = [np.asarray(r.context, np.int32) for r in reqs]
        reuse = np.zeros((len(reqs), len(free)), np.int64)
        for col, i in enumerate(free):
            if i in usable:
                for j, ctx in enumerate(contexts):
                    reuse[j, col] = min(common_prefix(usable[i].tokens, ctx), len(ctx) - 1)
        age = [usable[i].freed if i in usable else -1 for i in free]
        pairs = sorted((-reuse[j, col], age[col], j, col) for j in range(len(reqs)) for col in range(len(free)))
        rows, starts = [-1] * len(reqs), [0] * len(reqs)
        taken: set[int] = set()
        for neg_reuse, _, j, col in pairs:
            if rows[j] < 0 and col not in taken:
                rows[j], starts[j] = free[col], int(-neg_reuse)
                taken.add(col)
        return rows, starts

    def _swap_at_boundary(self, st: DecodeState, slots: list[_Slot | None]) -> DecodeState:
        """Serve staged weights between decode chunks. Running rows keep the old weights until they finish
        (partial="finish"), or are interrupted and requeued to continue on the new ones (partial="abort_resume",
        or a paused engine, whose update must not wait for held rows)."""
        if self._staged is None:
            return st
        running = [i for i, slot in enumerate(slots) if slot is not None]
        if running and self.partial == "finish" and not self._paused:
            return st
        if running:
            st = self._interrupt(st, slots, running)
        with self._swap_lock:
            self._serve_staged()
        return st

    def _interrupt(self, st: DecodeState, slots: list[_Slot | None], rows: list[int]) -> DecodeState:
        """Free `rows`: each request keeps its tokens, log-probs and versions so far and goes back to the front of
        the queue to continue with the remaining budget (one caller aborting it meanwhile gets its partial output)."""
        tokens, logprobs, n_gen = np.asarray(st.tokens), np.asarray(st.logprobs), np.asarray(st.n_gen)
        continuations = []
        for i in rows:
            slot, k = slots[i], int(n_gen[i])
            req = slot.req
            req.done_tokens += tokens[i, :k].tolist()
            req.done_logprobs += logprobs[i, :k].astype(float).tolist()
            req.done_versions += [slot.version] * k
            slots[i] = None  # its cache stays None: computed with the weights being replaced
            self._running.remove(req)
            if req.aborted or self._closed:
                self._hand_over(req, req.aborted_result(slot.version))
            else:
                continuations.append(req)
        self._counts.interrupted += len(rows)
        with self._queue_lock:
            self._queue[:0] = continuations
        return st._replace(done=st.done.at[jnp.asarray(rows)].set(True))

    def _admit(
        self, st: DecodeState, slots: list[_Slot | None], reqs: list[_Request], host_rp: RowParams
    ) -> tuple[DecodeState, RowParams]:
        """Prefill reqs (prompt + tokens of earlier segments) into free rows (host_rp updated in place) -> (state,
        device row params). The prefill batch is the admitted requests only, padded to a power of four (few
        compiles, little padding)."""
        b = len(slots)
        params, version = self._current
        rows, starts = self._place(slots, reqs)
        n = min(bucket4(len(reqs)), b)
        new = [len(r.context) - start for r, start in zip(reqs, starts)]
        prompts = np.zeros((n, bucket(max(new), MIN_LEN_BUCKET)), np.int32)
        lengths, row_ids = np.ones(n, np.int32), np.full(n, b, np.int32)  # row b = padding, dropped
        start_ids = np.zeros(n, np.int32)
        for j, (i, r) in enumerate(zip(rows, reqs)):
            p, context = r.params, np.asarray(r.context, np.int32)
            prompts[j, : new[j]], lengths[j], start_ids[j], row_ids[j] = context[starts[j] :], new[j], starts[j], i
            host_rp.temperature[i], host_rp.top_p[i], host_rp.top_k[i] = p.temperature, p.top_p, p.top_k
            host_rp.stop_ids[i] = -1
            host_rp.stop_ids[i, : len(p.stop_token_ids)] = p.stop_token_ids
            host_rp.max_new[i] = r.remaining
            slots[i] = _Slot(r, version, self._served, context, checked=len(r.done_tokens))
            r.cached += starts[j]
            self._running.append(r)
            self._counts.resumed += bool(r.done_tokens)
        rp = RowParams(*(jnp.asarray(x) for x in host_rp))
        # Requests without a seed take their keys from the engine's stream, one split per admission: one request at a
        # time samples the same tokens whether it starts a batch or joins a running one (which depends on timing).
        self._key, stream = jax.random.split(self._key)
        seeds = [r.params.sampling_seed for r in reqs] + [None] * (n - len(reqs))
        keys = RequestKeys(
            seeded=jnp.asarray([s is not None for s in seeds]),
            seeds=jnp.asarray([divmod(s or 0, 2**32) for s in seeds], jnp.uint32),
            offsets=jnp.asarray([len(r.done_tokens) for r in reqs] + [0] * (n - len(reqs)), jnp.int32),
            stream=stream,
        )
        st = self._with_slots(st, int(np.max(start_ids + lengths)))
        st, prompt_routed = _admit(
            self._graphdef,
            params,
            st,
            jnp.asarray(prompts),
            jnp.asarray(lengths),
            jnp.asarray(start_ids),
            jnp.asarray(row_ids),
            rp,
            keys,
        )
        self.num_batches += 1
        self._prefix.prefilled += sum(new)
        self._prefix.reused += sum(starts)
        if prompt_routed is not None:
            prompt_routed = np.asarray(prompt_routed)
            for j, i in enumerate(rows):
                cached = self._caches[i].routed[: starts[j]] if starts[j] else prompt_routed[j, :0]
                slots[i].prompt_routed = np.concatenate([cached, prompt_routed[j, : new[j]]], axis=0)
        for i in rows:
            self._caches[i] = None  # running: its cache is being rewritten
        return st, rp

    def _deliver(self, st: DecodeState, slots: list[_Slot | None], rows: list[int]) -> None:
        """Hand the finished rows' results (earlier segments first) to their callers and free the rows."""
        tokens, logprobs = np.asarray(st.tokens), np.asarray(st.logprobs)
        n_gen, finish = np.asarray(st.n_gen), np.asarray(st.finish)
        routed = None if st.routed is None else np.asarray(st.routed)
        for i in rows:
            slot = slots[i]
            req, k = slot.req, int(n_gen[i])
            ids = req.done_tokens + tokens[i, :k].tolist()
            reason = _FINISH_NAMES[int(finish[i])]
            matched: int | str | None = None
            if reason == "stop":
                matched = slot.matched if slot.matched is not None else ids[-1]
            # The row's cache: the context and the tokens fed while decoding (all but the last sampled one).
            fed = tokens[i, : max(k - 1, 0)]
            experts = None if routed is None else np.concatenate([slot.prompt_routed, routed[i, : len(fed)]], axis=0)
            result = GenerationResult(
                ids,
                req.done_logprobs + logprobs[i, :k].astype(float).tolist(),
                reason,
                matched,
                slot.version,
                experts if req.params.return_routed_experts else None,
                req.done_versions + [slot.version] * k,
                req.cached,
            )
            slots[i] = None
            self._freed += 1
            self._caches[i] = _RowCache(np.concatenate([slot.context, fed]), slot.served, experts, self._freed)
            self._running.remove(req)
            self._hand_over(req, result)

    def _hand_over(self, req: _Request, result: GenerationResult) -> None:
        """Resolve a request's future from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(_resolve, req.future, result)
        except RuntimeError:  # the event loop is gone (engine closed with it): nobody waits
            pass

    def _host_checks(self, st: DecodeState, slots: list[_Slot | None]) -> DecodeState:
        """Apply aborts (every row once the engine is closed) and stop strings to the carry (host side, between
        decode chunks)."""
        aborted = [i for i, slot in enumerate(slots) if slot is not None and (slot.req.aborted or self._closed)]
        with_stop = [i for i, slot in enumerate(slots) if slot is not None and slot.req.params.stop]
        if not aborted and not with_stop:
            return st
        done, finish, n_gen = (np.array(x) for x in (st.done, st.finish, st.n_gen))
        changed = False
        for i in aborted:
            if not done[i]:
                done[i], finish[i], changed = True, ABORT, True
        tokens = np.asarray(st.tokens) if with_stop else None
        for i in with_stop:
            slot, k = slots[i], int(n_gen[i])
            earlier = len(slot.req.done_tokens)
            if earlier + k <= slot.checked or finish[i] == ABORT:
                continue
            hit = self._find_stop_string(
                slot.req.done_tokens + tokens[i, :k].tolist(), slot.req.params.stop, slot.checked
            )
            slot.checked = earlier + k
            if hit is not None:
                n_gen[i], done[i], finish[i], changed = hit[0] - earlier, True, STOP, True
                slot.matched = hit[1]
        if not changed:
            return st
        return st._replace(done=jnp.asarray(done), finish=jnp.asarray(finish), n_gen=jnp.asarray(n_gen))

    def _find_stop_string(self, ids: list[int], stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
        """Shortest prefix ids[:c] (c > start) whose decoded text contains a stop string -> (c, the string)."""
        if not any(s in self.tokenizer.decode(ids) for s in stops):
            return None
        for c in range(start + 1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:c])
            for s in stops:
                if s in text:
                    return c, s
        return None
