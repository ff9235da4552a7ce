"""The engine interface: token ids in, sampled token ids + the log-probs that sampled them out.

Two implementations sit behind it: `SGLangEngine` (HTTP client of a pool of SGLang servers) and
`EmbeddedEngine` (jitted JAX prefill + decode on the ipa_jax model). Everything is asyncio so that many
episodes run at once.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from ipa_jax.models import Qwen3ForCausalLM

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
# What a weight update does to the generation requests in flight (`rollout.partial`, docs/off_policy.md):
# "finish": they finish on the weights they started with, and the update waits for them;
# "abort_resume": they are interrupted and continued from the tokens generated so far with the new weights.
PARTIAL_MODES: tuple[str, ...] = ("finish", "abort_resume")


def check_partial(partial: str) -> str:
    if partial not in PARTIAL_MODES:
        raise ValueError(f"partial must be one of {PARTIAL_MODES}, got {partial!r}")
    return partial


class EngineError(RuntimeError):
    """A generation or control call failed (after retries, where the engine retries)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (SGLang names and semantics).

    temperature 0 means greedy. top_k -1 (or 0) means the whole vocabulary. Generation stops after a token in
    `stop_token_ids` (the token is kept), after a stop string appears in the decoded text (needs a tokenizer on
    the engine side), or after `max_new_tokens` tokens. `sampling_seed` (SGLang's name; 0 <= seed < 2**63): the
    request's tokens are drawn from keys of this seed alone, so the same request samples the same tokens whatever
    else the engine batches with it; None draws them from the engine's own stream.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    return_routed_experts: bool = False
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        # Accept lists for the tuple fields: callers build these from configs and JSON.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, np.integer)):
            raise ValueError(f"SamplingParams.max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (whole vocab), 0 or a positive int, got {self.top_k}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        seed = self.sampling_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63
        ):
            raise ValueError(f"SamplingParams.sampling_seed must be None or an int in [0, 2**63), got {seed!r}")

    @property
    def truncates_support(self) -> bool:
        """True when top-p/top-k cut the sampler's support (importance ratios then need care)."""
        return self.top_p < 1.0 or self.top_k > 0


@dataclasses.dataclass
class GenerationResult:
    """One generated continuation.

    token_ids and logprobs have the same length; logprobs[i] = log mu(token_ids[i] | prompt, token_ids[:i]) under
    the distribution actually sampled from (after temperature / top-p / top-k; at temperature 0 the model's
    own log-prob, as SGLang reports). A matched stop token is included in token_ids. `matched_stop` is the stop
    token id (int) or stop string (str) that ended generation, else None. `weight_version` is the version of
    the weights when the request finished (the newest that sampled any of its tokens). `token_versions[i]` is the
    version that sampled token_ids[i]: older than weight_version for the tokens generated before a weight update
    interrupted the request (`rollout.partial = "abort_resume"`); None is read as weight_version for every token.
    `routed_experts` is int32 [len(prompt) + len(token_ids) - 1, L, k] (row t = experts chosen when processing
    token t of prompt + output; the last sampled token is never fed) when requested, else None. `cached_tokens`: how
    many context tokens of its segments came from a prefix (KV) cache instead of a prefill (SGLang's
    meta_info.cached_tokens; 0 where the engine does not report it).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    matched_stop: int | str | None
    weight_version: int
    routed_experts: np.ndarray | None = None
    token_versions: list[int] | None = None
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"GenerationResult.logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} token_ids"
            )
        if self.token_versions is None:
            self.token_versions = [self.weight_version] * len(self.token_ids)
        if len(self.token_versions) != len(self.token_ids):
            raise ValueError(
                f"GenerationResult.token_versions has {len(self.token_versions)} entries for "
                f"{len(self.token_ids)} token_ids"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"GenerationResult.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )


def broadcast_params(params: SamplingParams | Sequence[SamplingParams], num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (a single one is shared); raises ValueError on a length mismatch."""
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"params has {len(params)} entries for {num_prompts} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params entries must be SamplingParams, got {type(p).__name__}")
    return params


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validate token-id prompts: a list of non-empty lists of non-negative ints."""
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompts[{i}] is empty")
        if min(ids) < 0:
            raise ValueError(f"prompts[{i}] has a negative token id")
        out.append(ids)
    return out


def check_generate_args(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    session_ids: Sequence[str] | None,
    request_ids: Sequence[str] | None,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The argument checks of every `Engine.generate`: returns (the prompts as lists of ints, one SamplingParams
    per prompt); raises ValueError on a bad prompt, or when params, session_ids or request_ids (where given) do
    not have one entry per prompt."""
    prompts = check_prompts(prompts)
    params_list = broadcast_params(params, len(prompts))
    for name, ids in (("session_ids", session_ids), ("request_ids", request_ids)):
        if ids is not None and len(ids) != len(prompts):
            raise ValueError(f"{name} has {len(ids)} entries for {len(prompts)} prompts")
    return prompts, params_list


@dataclasses.dataclass
class PartialCounts:
    """What weight updates did to the generation requests in flight, counted since the engine started: `updates`
    weight updates applied, `interrupted` requests stopped by one (`rollout.partial = "abort_resume"`), `resumed`
    of those continued on the new weights (an interrupted request the caller aborts meanwhile is not)."""

    updates: int = 0
    interrupted: int = 0
    resumed: int = 0


@dataclasses.dataclass
class PrefixCounts:
    """The context tokens of the generation segments started since the engine started: `prefilled` computed by a
    prefill, `reused` taken from a prefix (KV) cache instead."""

    prefilled: int = 0
    reused: int = 0


class Engine(abc.ABC):
    """Async generation engine. Implementations: SGLangEngine, EmbeddedEngine."""

    def partial_counts(self) -> PartialCounts:
        """A snapshot of the engine's PartialCounts (zeros for an engine that does not count)."""
        return PartialCounts()

    def prefix_counts(self) -> PrefixCounts | None:
        """A snapshot of the engine's PrefixCounts; None when the engine does not report them."""
        return None

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights currently served."""

    @abc.abstractmethod
    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        session_ids: list[str] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[GenerationResult]:
        """Continue each prompt. session_ids keep a multi-turn episode on one server (prefix cache);
        request_ids name requests so `abort` can end them early (finish_reason "abort", partial output).
        Implementations validate their arguments with `check_generate_args`."""

    @abc.abstractmethod
    async def update_weights(self, path: str, version: int) -> None:
        """Load HF safetensors weights from `path` and serve them as `version`."""

    @property
    def push_dtype(self) -> str | None:
        """The dtype `push_weights` serves the weights in (a caller gathering them across processes casts them to it
        first); None: the engine casts them itself."""
        return None

    async def push_weights(self, model: Qwen3ForCausalLM, version: int) -> None:
        """Serve the learner's weights (`model`, every parameter addressable by this process: a single-process
        model, or host arrays, `ipa_jax.models.hf_io.gather_model`) as `version`; the learner's buffers may be donated
        once it returns. The embedded engine copies them into its own placement; the SGLang client writes a weights
        folder and has its servers load it."""
        raise NotImplementedError(f"{type(self).__name__} does not take pushed weights")

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop generating until resume(). Callers of generate() see no abort from a pause: in-flight requests
        are held, or interrupted and resubmitted (prompt + partial output, remaining budget) after resume()."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo pause()."""

    async def abort(self, request_ids: list[str] | None = None) -> None:
        """End the requests whose id starts with one of `request_ids` (None: all in-flight requests); they return
        finish_reason "abort" with their partial output. Optional: the dev server's /abort_request needs it."""
        raise NotImplementedError(f"{type(self).__name__} does not support abort")

    @abc.abstractmethod
    async def health(self) -> bool:
        """True iff the engine can generate."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release resources; the engine is unusable afterwards."""
