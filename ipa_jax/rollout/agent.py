"""The agent loop: one multi-turn tool-use episode -> one Trajectory, with any Engine and a `ChatFormat`.

Token bookkeeping:
  tokens = template(initial messages, add_generation_prompt)            action 0
         + turn 0's generated ids (the engine's own ids, never re-tokenized)   action 1, chunk 0
         + observation 0 = template difference of the tool messages           action 0
         + turn 1's generated ids ...                                         action 1, chunk 1
A turn is generated until `<|im_end|>` (or `<|endoftext|>`, or the token budget). The observation
tokens are the template difference: what the chat template renders after an assistant turn's `<|im_end|>`
when the tool messages follow, through the next generation prompt (the `\n` that the template puts after
`<|im_end|>` is not generated, so it starts the observation). `tokens` then equals the template's rendering of
the finished conversation, each assistant turn's text replaced by the engine's ids, whenever the template renders
earlier turns as they were generated (Qwen3 does when every turn's reasoning is non-empty; it drops an empty think
block from earlier turns, which the policy did see).

Qwen3 reasoning: a turn's text is split into reasoning and content first (`ChatFormat.split_turn`, as SGLang's
Qwen3 reasoning parser does); tool calls and the final answer are read from the content only. The reasoning
tokens stay action tokens of their chunk: they are trained and credited like the rest of the turn. Expert turns
(prefill, expert episodes) are rendered with the same template and thinking mode (`ChatFormat.assistant_turn_ids`),
so an imitation target is exactly what the policy would emit there.

Versions: each chunk records the weight version that sampled it (`chunk_versions`); a turn that a weight update
interrupted and the engine continued on the new weights (`rollout.partial = "abort_resume"`) records the newest
version that sampled any of its tokens, and `info["resumed_chunks"]` lists it as [chunk, version of its first
token]. The behaviour log-probs are those each token was sampled with, old weights or new. `policy_version` is the
oldest chunk's version (what the queue's staleness bound applies to).

An optional `prefill` (expert messages after the initial ones) starts the episode at a later state: its
assistant turns are expert-masked (imitation targets, never actions), its tool calls are replayed in the
environment, and sampling continues from there (chunk-level initialized resampling).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipa_jax.activity import ActivityClock
from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine, SamplingParams
from ipa_jax.envs import Env, Task, ToolCall, make_env, parse_tool_calls
from ipa_jax.rollout.lockstep import derive_seed, in_lockstep
from ipa_jax.trajectory import Trajectory

# Episode end states recorded in info["finish_reason"].
FINISH_REASONS = ("answer", "max_turns", "length", "context", "endoftext", "env_done")


@dataclass(frozen=True)
class AgentConfig:
    """Sampling and budgets of one episode (field names match the experiment's rollout config)."""

    max_new_tokens: int = 256  # per turn
    max_turns: int = 0  # assistant turns incl. the final answer; 0 = the task's own max_turns
    max_context: int = 2048  # tokens of the whole episode
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    return_routed_experts: bool = False
    record_messages: bool = False  # put the final conversation (assistant text as generated) in info

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"AgentConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns < 0:
            raise ValueError(f"AgentConfig.max_turns must be >= 0 (0 = the task's), got {self.max_turns}")
        if self.max_context < 2:
            raise ValueError(f"AgentConfig.max_context must be >= 2, got {self.max_context}")


@dataclass
class TokenRow:
    """The growing token row of an episode: TokenRow(), then extend(...)."""

    tokens: list[int] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    expert: list[bool] = field(default_factory=list)

    def extend(
        self,
        ids: list[int],
        *,
        action: bool = False,
        logprobs: list[float] | None = None,
        chunk: int = -1,
        expert: bool = False,
    ) -> None:
        self.tokens += ids
        self.action += [action] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.chunks += [chunk] * len(ids)
        self.expert += [expert] * len(ids)


def close_event_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Like asyncio.run's exit: cancel what is left on the loop (e.g. an engine's background task), then close."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # (an empty gather would belong to the thread's current loop, not to `loop`)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@functools.cache
def tool_executor() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for blocking environment calls (sandboxed commands): enough for every episode in flight to wait on
    one at once; a thread waiting on a subprocess costs no CPU."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="ipa-env")


def env_caller(env: Env) -> Callable[..., Awaitable[Any]]:
    """`await call(fn, *args)`: fn(*args) inline for a pure-Python env, in `tool_executor()` for a blocking one."""

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        if not env.blocking:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(tool_executor(), fn, *args)

    return call


def _tool_message(call: Any, observation: str) -> dict[str, Any]:
    return {"role": "tool", "name": call.name if isinstance(call, ToolCall) else "error", "content": observation}


def replay_prefill(
    env: Env, task: Task, chat: ChatFormat, prefill: list[dict[str, Any]], row: TokenRow, messages: list[dict[str, Any]]
) -> int:
    """Append the expert's turns (expert-masked) and tool responses; replay the calls in `env`.
    Returns the number of assistant turns consumed. Raises ValueError when the environment's
    observations differ from the prefilled tool messages."""
    turns = 0
    i = 0
    while i < len(prefill):
        msg = prefill[i]
        if msg.get("role") != "assistant" or not msg.get("tool_calls"):
            raise ValueError(
                f"prefill[{i}]: expected an assistant message with tool_calls, got role {msg.get('role')!r}"
            )
        tool_msgs = []
        j = i + 1
        while j < len(prefill) and prefill[j].get("role") == "tool":
            tool_msgs.append(prefill[j])
            j += 1
        if len(tool_msgs) != len(msg["tool_calls"]):
            raise ValueError(f"prefill[{i}]: {len(msg['tool_calls'])} tool calls but {len(tool_msgs)} tool messages")
        row.extend(chat.assistant_turn_ids(messages, msg, task.tools), expert=True)
        for call_dict, tool_msg in zip(msg["tool_calls"], tool_msgs):
            fn = call_dict.get("function", call_dict)
            args = fn["arguments"]
            call = ToolCall(fn["name"], json.loads(args) if isinstance(args, str) else args)
            result = env.step(call)
            if result.observation != tool_msg.get("content"):
                raise ValueError(
                    f"prefill: replaying {call.name} gave {result.observation!r}, "
                    f"the prefill says {tool_msg.get('content')!r}"
                )
        messages.append(msg)
        row.extend(chat.observation_ids(tool_msgs, task.tools))
        messages.extend(tool_msgs)
        turns += 1
        i = j
    return turns


def expert_episode(
    task: Task, messages: list[dict[str, Any]], env: Env, chat: ChatFormat, uid: str, info: dict[str, Any] | None = None
) -> Trajectory:
    """An expert's whole conversation (`messages`: the task's initial messages, assistant tool-call turns each
    with its tool responses, the final answer) as a Trajectory: every assistant turn expert-masked (the IL
    targets, the final answer's `<|im_end|>` included), observations as template differences, no action token
    (a pure imitation row). The calls are replayed in `env`; the reward is the answer's score. `info` entries
    are added to the trajectory's info. The environment is closed at the end."""
    initial = task.initial_messages()
    turns, answer = messages[len(initial) : -1], messages[-1]
    if answer.get("role") != "assistant" or answer.get("tool_calls"):
        raise ValueError(f"expert of {task.task_id}: the last message must be the final answer")
    history = list(initial)
    row = TokenRow()
    row.extend(chat.encode(chat.render(history, task.tools, add_generation_prompt=True)))
    try:
        env.reset(task)
        replay_prefill(env, task, chat, turns, row, history)
        row.extend(chat.assistant_turn_ids(history, answer, task.tools), expert=True)
        reward = env.final_answer(answer["content"])
    finally:
        env.close()
    return Trajectory(
        uid=uid,
        tokens=np.asarray(row.tokens, np.int32),
        action_mask=np.asarray(row.action, bool),
        behavior_logprobs=np.asarray(row.logprobs, np.float32),
        chunk_ids=np.asarray(row.chunks, np.int32),
        expert_mask=np.asarray(row.expert, bool),
        reward=float(reward),
        policy_version=0,
        chunk_versions=np.zeros(0, np.int32),
        routed_experts=None,
        info={
            "task_id": task.task_id,
            "env": task.env,
            "finish_reason": "answer",
            "expert": True,
            "num_turns": len(turns) // 2 + 1,
            "num_tool_calls": env.num_tool_calls,
            "num_tool_errors": env.num_tool_errors,
            "generated_tokens": 0,
            "length": len(row.tokens),
            **(info or {}),
        },
    )


async def run_episode(
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    config: AgentConfig = AgentConfig(),
    *,
    env: Env | None = None,
    uid: str | None = None,
    prefill: list[dict[str, Any]] | None = None,
    clock: ActivityClock | None = None,
    seed: int | None = None,
) -> Trajectory | None:
    """Play one episode of `task` with `engine`; returns its Trajectory, or None if the engine aborted it
    (or generated no token at all).

    `env`: a fresh environment for this episode (default `make_env(task.env)`). `prefill`: expert messages
    (assistant tool-call turns and their tool responses) to start from; they count against the turn budget.
    Raises ValueError when the prompt (with the prefill) leaves no room in `config.max_context`. The environment
    is closed at the end, also when the episode is cancelled (its sandbox and processes are released).
    `clock`: where the episode's generation requests and its environment's work (reset, tool calls, the answer's check)
    count as "generation" and "tools" activity (`ipa_jax.activity`). `seed`: turn t samples with sampling_seed
    derive_seed(seed, t) (lockstep rollouts: its tokens then depend on its seed, not on what it is batched with);
    None: the engine's own draws.
    """
    env = env if env is not None else make_env(task.env)
    try:
        return await _play(
            engine,
            chat,
            task,
            config,
            env,
            uid or f"{task.task_id}#{uuid.uuid4().hex[:12]}",
            prefill,
            clock or ActivityClock(),
            seed,
        )
    finally:
        # Off the loop for a blocking env (removing a sandbox's folder takes a while); a second cancellation during
        # the await leaves the close running in its thread.
        await env_caller(env)(env.close)


async def _play(
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    config: AgentConfig,
    env: Env,
    uid: str,
    prefill: list[dict[str, Any]] | None,
    clock: ActivityClock,
    seed: int | None,
) -> Trajectory | None:
    t_start = time.perf_counter()
    call_env = env_caller(env)
    with clock.active("tools"):  # a sandbox's setup
        await call_env(env.reset, task)
    messages = task.initial_messages()
    row = TokenRow()
    row.extend(chat.encode(chat.render(messages, task.tools, add_generation_prompt=True)))
    turns_used = await call_env(replay_prefill, env, task, chat, prefill, row, messages) if prefill else 0
    prefill_calls, prefill_errors = env.num_tool_calls, env.num_tool_errors
    if len(row.tokens) >= config.max_context:
        raise ValueError(
            f"max_context={config.max_context} leaves no room: the prompt has {len(row.tokens)} tokens "
            f"(task {task.task_id})"
        )
    max_turns = min(task.max_turns, config.max_turns) if config.max_turns else task.max_turns
    if turns_used >= max_turns:
        raise ValueError(f"prefill uses {turns_used} turns, leaving none of max_turns={max_turns} to sample")
    reward, finish = 0.0, "max_turns"
    chunk_versions: list[int] = []
    resumed_chunks: list[list[int]] = []  # [chunk, version of its first token] of turns continued after an update
    routed: np.ndarray | None = None
    gen_tokens = 0
    engine_s = 0.0
    for turn in range(turns_used, max_turns):
        # >= 1: the prompt and every appended observation leave room for at least one token.
        budget = min(config.max_new_tokens, config.max_context - len(row.tokens))
        params = SamplingParams(
            max_new_tokens=budget,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            stop_token_ids=chat.stop_token_ids,
            return_routed_experts=config.return_routed_experts,
            sampling_seed=None if seed is None else derive_seed(seed, turn),
        )
        t0 = time.perf_counter()
        with clock.active("generation"):
            (res,) = await engine.generate([list(row.tokens)], params, session_ids=[uid], request_ids=[uid])
        engine_s += time.perf_counter() - t0
        if res.finish_reason == "abort":
            return None
        ids = [int(t) for t in res.token_ids]
        if not ids:  # the engine generated nothing: the episode cannot go on
            if not chunk_versions:
                return None  # no action token at all: not a trajectory
            finish = "length"
            break
        chunk = len(chunk_versions)
        row.extend(ids, action=True, logprobs=[float(x) for x in res.logprobs], chunk=chunk)
        chunk_versions.append(int(max(res.token_versions)))  # a resumed turn: the newest version that sampled it
        if min(res.token_versions) != chunk_versions[-1]:
            resumed_chunks.append([chunk, int(res.token_versions[0])])
        gen_tokens += len(ids)
        if res.routed_experts is not None:
            routed = np.asarray(res.routed_experts)
        stopped = res.finish_reason == "stop" and ids[-1] in chat.stop_token_ids
        text = chat.decode(ids[:-1] if stopped else ids)
        messages.append({"role": "assistant", "content": text})
        if not stopped:
            finish = "length"
            break
        parsed = parse_tool_calls(chat.split_turn(text)[1])  # reasoning first: calls and answer are in the content
        if not parsed.calls:
            with clock.active("tools"):
                reward, finish = await call_env(env.final_answer, parsed.content), "answer"
            break
        if ids[-1] != chat.im_end_id:
            finish = "endoftext"  # a tool-call turn ended by <|endoftext|>: the conversation is over
            break
        if turn == max_turns - 1:
            break  # tool calls on the last allowed turn: no room left to answer ("max_turns")
        tool_msgs, done_result = [], None
        for call in parsed.calls:
            with clock.active("tools"):
                result = await call_env(env.step, call)
            tool_msgs.append(_tool_message(call, result.observation))
            if result.done:
                done_result = result
                break
        if done_result is not None:
            reward, finish = float(done_result.reward or 0.0), "env_done"
            break
        obs = chat.observation_ids(tool_msgs, task.tools)
        if len(row.tokens) + len(obs) >= config.max_context:
            finish = "context"
            break
        row.extend(obs)
        messages.extend(tool_msgs)

    info: dict[str, Any] = {
        "task_id": task.task_id,
        "env": task.env,
        "finish_reason": finish,
        "num_turns": len(chunk_versions),
        "resumed_chunks": resumed_chunks,
        "num_prefill_turns": turns_used,
        "num_tool_calls": env.num_tool_calls - prefill_calls,  # the policy's own (executed) calls
        "num_tool_errors": env.num_tool_errors - prefill_errors,
        "generated_tokens": gen_tokens,
        "episode_s": time.perf_counter() - t_start,
        "engine_s": engine_s,
    }
    if config.record_messages:
        info["messages"] = messages
    routed_rows = None
    if routed is not None:
        # The last generate call covered tokens[:-1] (its last sampled token was never fed); the final
        # token's row is never used by the loss, so it repeats the previous row.
        if routed.shape[0] != len(row.tokens) - 1:
            raise ValueError(
                f"engine returned routed_experts for {routed.shape[0]} tokens, expected {len(row.tokens) - 1}"
            )
        routed_rows = np.concatenate([routed, routed[-1:]], axis=0).astype(np.int32)
    return Trajectory(
        uid=uid,
        tokens=np.asarray(row.tokens, np.int32),
        action_mask=np.asarray(row.action, bool),
        behavior_logprobs=np.asarray(row.logprobs, np.float32),
        chunk_ids=np.asarray(row.chunks, np.int32),
        expert_mask=np.asarray(row.expert, bool),
        reward=float(reward),
        policy_version=min(chunk_versions),
        chunk_versions=np.asarray(chunk_versions, np.int32),
        routed_experts=routed_rows,
        info=info,
    )


async def run_episodes(
    engine: Engine,
    chat: ChatFormat,
    tasks: list[Task],
    config: AgentConfig = AgentConfig(),
    *,
    concurrency: int = 8,
    env_factory: Callable[[Task], Env] | None = None,
    lockstep_seed: int | None = None,
) -> list[Trajectory | None]:
    """Run one episode per task, at most `concurrency` at a time; results in task order (None = aborted).
    `lockstep_seed`: all of them at once in lockstep (`ipa_jax.rollout.lockstep`), episode i with the seed
    derive_seed(lockstep_seed, i) and the uid <task id>#<i>."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if lockstep_seed is not None:
        plays = [
            functools.partial(
                _lockstep_play, chat, task, config, env_factory, f"{task.task_id}#{i}", derive_seed(lockstep_seed, i)
            )
            for i, task in enumerate(tasks)
        ]
        results = await in_lockstep(engine, plays)
        for outcome in results:
            if isinstance(outcome, BaseException):
                raise outcome
        return results
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> Trajectory | None:
        async with sem:
            env = env_factory(task) if env_factory is not None else None
            return await run_episode(engine, chat, task, config, env=env)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


async def _lockstep_play(
    chat: ChatFormat,
    task: Task,
    config: AgentConfig,
    env_factory: Callable[[Task], Env] | None,
    uid: str,
    seed: int,
    engine: Engine,
) -> Trajectory | None:
    env = env_factory(task) if env_factory is not None else None
    return await run_episode(engine, chat, task, config, env=env, uid=uid, seed=seed)
