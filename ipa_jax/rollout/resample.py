"""Chunk-level initialized resampling: anchored rollouts from expert prefixes, crucial forks, sequential
rollback, parallel initialization and the imitation fallback (DESIGN.md "Rollout"; issue 8).

Vocabulary. An expert trajectory has K tool-call chunks (assistant turns ending in tool calls, each with its
tool responses) and, usually, a final answer. Anchor j in [0, K] is the state after the expert's first j
chunks: the prompt, j expert turns and their observations. An anchored rollout prefills that state
(expert_mask 1, action_mask 0, the environment replayed through the expert's j calls, by
`agent.run_episode(prefill=...)`) and samples the tail with the policy. Anchor 0 is the plain start state.

A crucial fork is an anchor f whose success rate is far above the rate at the anchor before it (by at least
`fork_jump`): expert chunk f-1 is the decision the policy has not mastered.

Bookkeeping (`Resampler`: which anchors to sample, what happened there, rollback, IL targets, checkpoint
state) is pure Python; `resample_round` / `ResampleSource` do the asynchronous sampling with any Engine.

Batch semantics (`Resampler.finalize`): the expert prefix of an anchored rollout is plain context (its
expert_mask is cleared) unless it carries the imitation fallback. When every sample of a task at anchor a
fails, its fork f is the first later anchor whose success rate exceeds a's by `fork_jump`; the rollouts at f
(those of this round, or `il_samples` new ones) keep expert_mask on their prefix, so the expert's chunks up
to and including the fork chunk f-1 become NLL targets (ObjectiveConfig.il_weight against rl_weight). A
carrier also has sampled actions of its own (its tail), so one row trains both terms. When no later anchor
does better, the failing decision may be any later one, the final answer included: f = K + 1, and the
carrier is the expert's whole episode with its answer (an imitation row without sampled tail). (Imitating
only the K calls there would never teach the answer: measured on the hard task, 200 updates learned the three
calls but not to answer after them.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ipa_jax.engines.base import Engine
from ipa_jax.envs import Env, Task, ToolCallError, make_env, parse_tool_calls
from ipa_jax.rollout.agent import (IM_END, AgentConfig, ChatFormat, TokenRow, close_event_loop, expert_episode,
                                   replay_prefill, run_episode)
from ipa_jax.trajectory import Trajectory

MODES = ("none", "rollback", "parallel")
WEIGHTINGS = ("uniform", "variance")
STATE_VERSION = 1


@dataclass(frozen=True)
class ResampleConfig:
    """Where episodes start and what the batch carries.

    mode: "none" (every episode from the start state; the IL fallback still applies), "rollback" (per task
      the anchor starts at the last chunk K and moves one chunk earlier once the success rate over the last
      `window` samples at it reaches `threshold`), "parallel" (sample at several anchors at once).
    anchors: parallel anchor positions; a float in [0, 1] is a fraction of the task's K chunks
      (anchor = floor(f * K + 0.5)), an int >= 0 an absolute chunk count (capped at K).
    samples_per_anchor: episodes per task and anchor in one round (rollback/none: per task).
    threshold: rollback moves when the windowed success rate at the current anchor is >= threshold.
    window: number of recent outcomes kept per (task, anchor): rollback's window and the fork estimates.
    fork_jump: a fork is an anchor whose success rate exceeds the previous estimated anchor's by >= this.
    il_fallback: when all samples of a task at an anchor fail, add `il_samples` rollouts at the next fork
      whose expert prefix stays expert-masked (the imitation targets).
    weighting: parallel allocation of the round's budget (samples_per_anchor per kept anchor):
      "uniform", or "variance" (proportional to p(1-p), p the smoothed success rate (s+1)/(n+2): anchors
      with mixed outcomes, where the learning signal is, get more samples).
    select_top: parallel: keep only the select_top anchors of highest p(1-p) (ties: the earlier); 0 = all.
    success_reward: an episode succeeds iff its reward >= success_reward.
    experts: "scripted" (each training task's scripted expert, `env.expert(task)`) or a JSONL path of expert
      trajectories (chat or Trajectory format, see `load_experts`).
    tasks_per_round: tasks sampled per round by `ResampleSource`.
    num_tasks: the training tasks (each with its expert) the online source cycles over, tasks_per_round per
      round; 0 = 8 * tasks_per_round. Fewer tasks: more visits per task (rollback moves need `window`
      outcomes at a task's anchor); more tasks: more varied data.
    """

    mode: str = "none"
    anchors: tuple[float | int, ...] = (0.0, 0.5, 1.0)
    samples_per_anchor: int = 4
    threshold: float = 0.5
    window: int = 8
    fork_jump: float = 0.5
    il_fallback: bool = False
    il_samples: int = 1
    weighting: str = "uniform"
    select_top: int = 0
    success_reward: float = 1.0
    experts: str = "scripted"
    tasks_per_round: int = 4
    num_tasks: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, problem: str) -> ValueError:
            return ValueError(f"ResampleConfig.{field}: {problem}")

        if self.mode not in MODES:
            raise bad("mode", f"must be one of {MODES}, got {self.mode!r}")
        if self.weighting not in WEIGHTINGS:
            raise bad("weighting", f"must be one of {WEIGHTINGS}, got {self.weighting!r}")
        anchors = tuple(self.anchors)
        object.__setattr__(self, "anchors", anchors)
        if self.mode == "parallel" and not anchors:
            raise bad("anchors", "mode 'parallel' needs at least one anchor")
        for a in anchors:
            if isinstance(a, bool) or not isinstance(a, (int, float)):
                raise bad("anchors", f"entries must be floats in [0, 1] or ints >= 0, got {a!r}")
            if isinstance(a, float) and not 0.0 <= a <= 1.0:
                raise bad("anchors", f"a float anchor is a fraction of the chunks and must be in [0, 1], got {a}")
            if isinstance(a, int) and a < 0:
                raise bad("anchors", f"an int anchor is a chunk count and must be >= 0, got {a}")
        for field in ("samples_per_anchor", "window", "il_samples", "tasks_per_round"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(field, f"must be an int >= 1, got {value!r}")
        if isinstance(self.num_tasks, bool) or not isinstance(self.num_tasks, int) or \
                not (self.num_tasks == 0 or self.num_tasks >= self.tasks_per_round):
            raise bad("num_tasks", f"must be 0 (8 * tasks_per_round) or an int >= tasks_per_round="
                                   f"{self.tasks_per_round}, got {self.num_tasks!r}")
        if isinstance(self.select_top, bool) or not isinstance(self.select_top, int) or self.select_top < 0:
            raise bad("select_top", f"must be an int >= 0 (0 = all anchors), got {self.select_top!r}")
        for field in ("threshold", "fork_jump"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise bad(field, f"must be a rate in (0, 1], got {value!r}")
        if not isinstance(self.il_fallback, bool):
            raise bad("il_fallback", f"must be a bool, got {self.il_fallback!r}")
        if not isinstance(self.success_reward, (int, float)) or not math.isfinite(self.success_reward):
            raise bad("success_reward", f"must be a finite number, got {self.success_reward!r}")
        if not isinstance(self.experts, str) or not self.experts:
            raise bad("experts", f"must be 'scripted' or a JSONL path, got {self.experts!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResampleConfig:
        """From a (ConfigDict) mapping; an unknown key is an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ResampleConfig: unknown key(s) {unknown}; known: {sorted(names)}")
        d = dict(d)
        if "anchors" in d:
            d["anchors"] = tuple(d["anchors"])
        return cls(**d)


# ---- expert trajectories ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertTrajectory:
    """A successful conversation split into chunks. `messages`: everything after the task's initial
    messages (assistant tool-call turns with their tool responses, then optionally the final answer);
    chunk k = messages[chunk_ends[k-1]:chunk_ends[k]] (chunk_ends[-1] = 0); K = len(chunk_ends)."""

    uid: str
    task: Task
    messages: tuple[dict[str, Any], ...]
    chunk_ends: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_ends)

    @property
    def task_id(self) -> str:
        return self.task.task_id

    @property
    def has_answer(self) -> bool:
        """Whether the conversation ends with a final answer (after the K chunks)."""
        return len(self.messages) > (self.chunk_ends[-1] if self.chunk_ends else 0)

    def prefill(self, anchor: int) -> list[dict[str, Any]]:
        """The messages of the first `anchor` chunks (run_episode's prefill for anchor j)."""
        self._check_anchor(anchor)
        return [dict(m) for m in self.messages[: self.chunk_ends[anchor - 1]]] if anchor else []

    def _check_anchor(self, anchor: int) -> None:
        if isinstance(anchor, bool) or not isinstance(anchor, (int, np.integer)) or not 0 <= anchor <= self.num_chunks:
            raise ValueError(f"expert {self.uid!r}: anchor must be an int in [0, {self.num_chunks}], got {anchor!r}")


def expert_from_messages(messages: Sequence[Mapping[str, Any]], task: Task, uid: str | None = None) -> ExpertTrajectory:
    """Splits a chat conversation (as `env.expert(task)` returns it: initial messages, assistant turns with
    `tool_calls` each followed by one tool message per call, an optional final assistant answer) into chunks.
    Raises ValueError when the initial messages are not the task's or the turns do not follow that shape."""
    uid = uid or f"expert:{task.task_id}"
    messages = [dict(m) for m in messages]
    initial = task.initial_messages()
    if messages[: len(initial)] != initial:
        raise ValueError(f"expert {uid!r}: the conversation must start with the task's initial messages "
                         f"{[m['role'] for m in initial]} (system/user of task {task.task_id!r})")
    rest = messages[len(initial):]
    ends: list[int] = []
    i = 0
    while i < len(rest):
        msg = rest[i]
        if msg.get("role") != "assistant":
            raise ValueError(f"expert {uid!r}: message {len(initial) + i} has role {msg.get('role')!r} where an "
                             "assistant turn is expected")
        if not msg.get("tool_calls"):
            if i != len(rest) - 1:
                raise ValueError(f"expert {uid!r}: message {len(initial) + i} is an answer without tool calls "
                                 "but is not the last message")
            break
        j = i + 1
        while j < len(rest) and rest[j].get("role") == "tool":
            j += 1
        if j - i - 1 != len(msg["tool_calls"]):
            raise ValueError(f"expert {uid!r}: message {len(initial) + i} has {len(msg['tool_calls'])} tool calls "
                             f"but {j - i - 1} tool responses follow")
        ends.append(j)
        i = j
    return ExpertTrajectory(uid=uid, task=task, messages=tuple(rest), chunk_ends=tuple(ends))


@dataclass(frozen=True)
class ExpertReplay:
    """The expert's token row as anchored rollouts see it. tokens: prompt + the K chunks with their
    observations (= the prompt of anchor K); prefix_lengths[j]: tokens of anchor j's state (K+1 entries);
    chunk_spans[k]: (start, end) of expert turn k's own tokens (the expert-masked span of an anchored
    rollout); reward: the final answer's reward (None without a final answer)."""

    tokens: list[int]
    prefix_lengths: list[int]
    chunk_spans: list[tuple[int, int]]
    reward: float | None


def replay_expert(expert: ExpertTrajectory, chat: ChatFormat, env: Env | None = None) -> ExpertReplay:
    """Replays the expert chunk by chunk through the agent's own prefill (`replay_prefill`) in a fresh
    environment, then scores its final answer. Raises ValueError if a replayed observation differs."""
    env = env if env is not None else make_env(expert.task.env)
    task = expert.task
    env.reset(task)
    messages = task.initial_messages()
    row = TokenRow()
    row.extend(chat.encode(chat.render(messages, task.tools, add_generation_prompt=True)))
    lengths, spans = [len(row.tokens)], []
    start = 0
    for end in expert.chunk_ends:
        replay_prefill(env, task, chat, list(expert.messages[start:end]), row, messages)
        begin = lengths[-1]
        spans.append((begin, begin + int(np.sum(row.expert[begin:]))))
        lengths.append(len(row.tokens))
        start = end
    reward = None
    if len(expert.messages) > start:
        reward = float(env.final_answer(str(expert.messages[-1].get("content", ""))))
    return ExpertReplay(row.tokens, lengths, spans, reward)


def expert_from_trajectory(traj: Trajectory, task: Task, chat: ChatFormat) -> ExpertTrajectory:
    """Rebuilds the expert conversation from a Trajectory's chunks: each chunk's tokens are decoded and
    parsed (tool calls -> assistant `tool_calls`, tool responses by replaying the environment; the last
    chunk without calls is the answer). Raises ValueError if a chunk has a malformed call or if the
    conversation does not re-render to the trajectory's own tokens (anchored rollouts would not reproduce
    them token for token)."""
    if traj.expert_mask.any():
        raise ValueError(f"expert {traj.uid!r} is itself an anchored rollout (expert-masked prefix); an expert "
                         "trajectory must be sampled from the start state")
    env = make_env(task.env)
    env.reset(task)
    messages = task.initial_messages()
    for k in range(traj.num_chunks):
        ids = traj.tokens[traj.chunk_ids == k].tolist()
        text = chat.decode(ids)
        text = text[: -len(IM_END)] if text.endswith(IM_END) else text
        parsed = parse_tool_calls(text)
        if not parsed.calls:
            if k != traj.num_chunks - 1:
                raise ValueError(f"expert {traj.uid!r}: chunk {k} has no tool call but is not the last chunk")
            messages.append({"role": "assistant", "content": text})
            break
        errors = [c for c in parsed.calls if isinstance(c, ToolCallError)]
        if errors:
            raise ValueError(f"expert {traj.uid!r}: chunk {k} has a malformed tool call ({errors[0].message})")
        messages.append({"role": "assistant", "content": parsed.content,
                         "tool_calls": [c.to_message_dict() for c in parsed.calls]})
        for call in parsed.calls:
            messages.append({"role": "tool", "name": call.name, "content": env.step(call).observation})
    expert = expert_from_messages(messages, task, uid=traj.uid)
    replay = replay_expert(expert, chat)
    n = replay.prefix_lengths[-1]
    got, want = replay.tokens, traj.tokens[:n].tolist()
    if got != want:
        t = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise ValueError(f"expert {traj.uid!r}: the chat template does not re-render the trajectory's tokens "
                         f"(first difference at position {t}); anchored rollouts would not reproduce it")
    return expert


def load_experts(path: str | os.PathLike, chat: ChatFormat, *, tasks: Mapping[str, Task] | None = None,
                 success_reward: float = 1.0) -> list[ExpertTrajectory]:
    """Expert trajectories from a JSONL file of either format (per line):
    chat: {"messages": [...], "tools": [...]?, "task": {Task dict} | "task_id"?, "task_id": str?};
    Trajectory (to_json): the task is info["task"] (a Task dict) or tasks[info["task_id"]] (the source task id
    info["resample"]["task_id"] for an anchored rollout, which is then rejected as an expert).
    Each expert is replayed in its environment and must reach reward >= success_reward (when it has a
    final answer). Raises ValueError naming the file and line for any problem."""
    tasks = tasks or {}
    out: list[ExpertTrajectory] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_expert_from_line(line, chat, tasks, success_reward, lineno))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    return out


def build_experts(config: ResampleConfig, tasks: Sequence[Task], chat: ChatFormat) -> list[ExpertTrajectory]:
    """The experts named by config.experts: "scripted" -> each task's scripted expert; else
    `load_experts(config.experts, chat, tasks=...)` (a line's task id is looked up among `tasks`)."""
    if config.experts == "scripted":
        return [expert_from_messages(make_env(t.env).expert(t), t) for t in tasks]
    if not os.path.exists(config.experts):
        raise ValueError(f"ResampleConfig.experts: no file {config.experts!r} (nor 'scripted')")
    return load_experts(config.experts, chat, tasks={t.task_id: t for t in tasks},
                        success_reward=config.success_reward)


def _resolve_task(ref: Any, tasks: Mapping[str, Task]) -> Task:
    if isinstance(ref, dict):
        return Task.from_dict(ref)
    if isinstance(ref, str):
        if ref not in tasks:
            raise ValueError(f"task {ref!r} is not among the {len(tasks)} tasks given (pass tasks={{id: Task}})")
        return tasks[ref]
    raise ValueError("no task: give 'task' (a Task dict or a task id in tasks=) so the environment can be replayed")


def _expert_from_line(line: str, chat: ChatFormat, tasks: Mapping[str, Task], success_reward: float,
                      lineno: int) -> ExpertTrajectory:
    d = json.loads(line)
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    if "messages" in d:
        task = _resolve_task(d.get("task", d.get("task_id")), tasks)
        if "tools" in d and d["tools"] != task.tools:
            raise ValueError(f"'tools' differ from the tool specs of task {task.task_id!r}")
        expert = expert_from_messages(d["messages"], task, uid=str(d.get("uid", f"expert:{task.task_id}:{lineno}")))
        reward = replay_expert(expert, chat).reward
    elif "tokens" in d:
        traj = Trajectory.from_json(line)
        task_id = traj.info.get("resample", {}).get("task_id", traj.info.get("task_id"))  # anchored: the source
        task = _resolve_task(traj.info.get("task", task_id), tasks)
        expert = expert_from_trajectory(traj, task, chat)
        reward = replay_expert(expert, chat).reward
    else:
        raise ValueError("a line must have 'messages' (chat format) or 'tokens' (Trajectory JSON)")
    if reward is not None and reward < success_reward:
        raise ValueError(f"expert {expert.uid!r} does not solve task {task.task_id!r} (reward {reward})")
    return expert


# ---- anchored rollouts --------------------------------------------------------------------------------


async def run_anchored(engine: Engine, chat: ChatFormat, expert: ExpertTrajectory, anchor: int,
                       config: AgentConfig = AgentConfig(), *, env: Env | None = None,
                       uid: str | None = None) -> Trajectory | None:
    """One episode from the state after the expert's first `anchor` chunks (None if the engine aborted).

    The prefix has expert_mask 1 and action_mask 0; the tail's chunk ids start at 0. info["resample"] =
    {task_id, anchor, num_expert_chunks, expert_uid, il_target: False}; info["task_id"] becomes
    "<task_id>@<anchor>" for anchor > 0: an anchored start state is its own group for group baselines."""
    expert._check_anchor(anchor)
    task = expert.task
    uid = uid or f"{task.task_id}@{anchor}#{uuid.uuid4().hex[:12]}"
    traj = await run_episode(engine, chat, task, config, env=env, uid=uid, prefill=expert.prefill(anchor) or None)
    if traj is None:
        return None
    traj.info["resample"] = {"task_id": task.task_id, "anchor": int(anchor), "num_expert_chunks": expert.num_chunks,
                             "expert_uid": expert.uid, "il_target": False}
    if anchor:
        traj.info["task_id"] = f"{task.task_id}@{anchor}"
    return traj


def whole_expert_episode(expert: ExpertTrajectory, chat: ChatFormat, env: Env | None = None) -> Trajectory:
    """The expert's whole episode, final answer included, as an imitation row (`expert_episode`: every expert
    turn expert-masked, no action token); info["resample"] as run_anchored's with anchor K + 1."""
    if not expert.has_answer:
        raise ValueError(f"expert {expert.uid!r} has no final answer: its whole episode is anchor K's prefix")
    task = expert.task
    K = expert.num_chunks
    messages = task.initial_messages() + [dict(m) for m in expert.messages]
    return expert_episode(task, messages, env if env is not None else make_env(task.env), chat,
                          uid=f"{task.task_id}@{K + 1}#{uuid.uuid4().hex[:12]}",
                          info={"task_id": f"{task.task_id}@{K + 1}",
                                "resample": {"task_id": task.task_id, "anchor": K + 1, "num_expert_chunks": K,
                                             "expert_uid": expert.uid, "il_target": True}})


# ---- fork estimation ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForkEstimate:
    """Per-task success by anchor. anchors ascending (those with samples); rates[i] = successes/samples;
    jumps[i] = rates[i] - rates[i-1] (0 for the first); forks: anchors with jump >= fork_jump; crucial_fork:
    the fork with the largest jump (ties: the earliest), None if there is no fork."""

    task_id: str
    anchors: tuple[int, ...]
    successes: tuple[int, ...]
    samples: tuple[int, ...]
    rates: tuple[float, ...]
    jumps: tuple[float, ...]
    forks: tuple[int, ...]
    crucial_fork: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def estimate_forks(task_id: str, counts: Mapping[int, tuple[int, int]], fork_jump: float) -> ForkEstimate:
    """counts: anchor -> (successes, samples). rate_j = s_j / n_j; jump_j = rate_j - rate_{previous anchor}."""
    if not 0.0 < fork_jump <= 1.0:
        raise ValueError(f"fork_jump must be in (0, 1], got {fork_jump}")
    for a, (s, n) in counts.items():
        if not 0 <= s <= n:
            raise ValueError(f"task {task_id!r}, anchor {a}: successes {s} must be in [0, samples={n}]")
    anchors = tuple(sorted(int(a) for a, (_, n) in counts.items() if n > 0))
    succ = tuple(int(counts[a][0]) for a in anchors)
    n = tuple(int(counts[a][1]) for a in anchors)
    rates = tuple(s / m for s, m in zip(succ, n))
    jumps = tuple(0.0 if i == 0 else rates[i] - rates[i - 1] for i in range(len(rates)))
    eps = 1e-9  # rates are ratios of small ints: a jump equal to the threshold must count
    forks = tuple(a for a, d in zip(anchors, jumps) if d >= fork_jump - eps)
    crucial = max(forks, key=lambda a: (jumps[anchors.index(a)], -a)) if forks else None
    return ForkEstimate(task_id, anchors, succ, n, rates, jumps, forks, crucial)


def forks_by_anchor(estimates: Sequence[ForkEstimate]) -> list[dict[str, Any]]:
    """Per anchor (ascending): the tasks estimated there, their mean success rate, and how many tasks have
    their crucial fork there."""
    anchors = sorted({a for e in estimates for a in e.anchors})
    out = []
    for a in anchors:
        rates = [e.rates[e.anchors.index(a)] for e in estimates if a in e.anchors]
        out.append({"anchor": a, "tasks": len(rates), "success": float(np.mean(rates)),
                    "crucial_forks": sum(e.crucial_fork == a for e in estimates)})
    return out


async def probe_forks(engine: Engine, chat: ChatFormat, experts: Sequence[ExpertTrajectory], samples: int,
                      fork_jump: float, config: AgentConfig = AgentConfig(), *, anchors: Sequence[int] | None = None,
                      success_reward: float = 1.0, concurrency: int = 8) -> list[ForkEstimate]:
    """Samples `samples` episodes at each anchor (default every anchor 0..K) of each expert; one
    ForkEstimate per expert."""
    if samples < 1 or concurrency < 1:
        raise ValueError(f"samples and concurrency must be >= 1, got {samples} and {concurrency}")
    sem = asyncio.Semaphore(concurrency)

    async def one(expert: ExpertTrajectory, a: int) -> Trajectory | None:
        async with sem:
            return await run_anchored(engine, chat, expert, a, config)

    jobs = [(e, a) for e in experts for a in (anchors if anchors is not None else range(e.num_chunks + 1))
            for _ in range(samples)]
    results = await asyncio.gather(*(one(e, a) for e, a in jobs))
    counts: dict[str, dict[int, list[int]]] = {e.task_id: {} for e in experts}
    for (e, a), traj in zip(jobs, results):
        if traj is not None:
            c = counts[e.task_id].setdefault(a, [0, 0])
            c[0] += traj.reward >= success_reward
            c[1] += 1
    return [estimate_forks(e.task_id, {a: (s, n) for a, (s, n) in counts[e.task_id].items()}, fork_jump)
            for e in experts]


# ---- bookkeeping ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One episode to sample: the task, the anchor, and whether it carries the imitation fallback."""

    task_id: str
    anchor: int
    il_target: bool = False


class Resampler:
    """Which anchors to sample, the outcomes seen there, rollback anchors and IL targets; no engine.

    Outcomes are kept per (task, anchor) as the last `window` successes (bools). Rollback keeps per task its
    current anchor (starting at K) and the outcomes seen at it since it got there; results for any other
    anchor (e.g. episodes started before the move, still in flight) never count towards a move.
    """

    def __init__(self, config: ResampleConfig, experts: Sequence[ExpertTrajectory]):
        self.config = config
        self.experts: dict[str, ExpertTrajectory] = {}
        for e in experts:
            if e.task_id in self.experts:
                raise ValueError(f"two experts for task {e.task_id!r}: {self.experts[e.task_id].uid!r} and {e.uid!r}")
            self.experts[e.task_id] = e
        self._outcomes: dict[str, dict[int, deque[bool]]] = {t: {} for t in self.experts}
        self._anchor = {t: e.num_chunks for t, e in self.experts.items()}
        self._window: dict[str, deque[bool]] = {t: deque(maxlen=config.window) for t in self.experts}
        self._moves = {t: 0 for t in self.experts}
        self.totals = {"episodes": 0, "successes": 0, "il_groups": 0, "moves": 0}

    def expert(self, task_id: str) -> ExpertTrajectory:
        if task_id not in self.experts:
            raise ValueError(f"no expert trajectory for task {task_id!r}")
        return self.experts[task_id]

    # ---- planning ----
    def rollback_anchor(self, task_id: str) -> int:
        """The task's current rollback anchor (K at the start, moving towards 0)."""
        self.expert(task_id)
        return self._anchor[task_id]

    def parallel_anchors(self, task_id: str) -> list[int]:
        """config.anchors resolved for this task's K (fractions rounded half up, ints capped), ascending."""
        K = self.expert(task_id).num_chunks
        out = {min(a, K) if isinstance(a, int) else int(math.floor(a * K + 0.5)) for a in self.config.anchors}
        return sorted(out)

    def success_rate(self, task_id: str, anchor: int) -> float | None:
        """Success rate over the recent outcomes at (task, anchor); None if none were seen."""
        self.expert(task_id)
        seen = self._outcomes[task_id].get(anchor)
        return sum(seen) / len(seen) if seen else None

    def _smoothed(self, task_id: str, anchor: int) -> float:
        # p = (s + 1) / (n + 2): the posterior mean under a uniform prior, never exactly 0 or 1.
        seen = self._outcomes[task_id].get(anchor, ())
        return (sum(seen) + 1) / (len(seen) + 2)

    def allocation(self, task_id: str) -> dict[int, int]:
        """anchor -> number of episodes this round (parallel mode)."""
        anchors = self.parallel_anchors(task_id)
        weight = {a: self._smoothed(task_id, a) * (1 - self._smoothed(task_id, a)) for a in anchors}
        if self.config.select_top:
            anchors = sorted(sorted(anchors, key=lambda a: (-weight[a], a))[: self.config.select_top])
        n = self.config.samples_per_anchor
        if self.config.weighting == "uniform":
            return {a: n for a in anchors}
        # Largest-remainder apportionment of budget = n * #anchors proportionally to p(1-p).
        budget = n * len(anchors)
        total = sum(weight[a] for a in anchors)
        quota = {a: budget * weight[a] / total for a in anchors}
        alloc = {a: int(math.floor(q)) for a, q in quota.items()}
        for a in sorted(anchors, key=lambda a: (-(quota[a] - alloc[a]), a))[: budget - sum(alloc.values())]:
            alloc[a] += 1
        return alloc

    def plan(self, task_ids: Iterable[str]) -> list[Planned]:
        """The episodes of one round for these tasks, grouped by task, anchors ascending."""
        out: list[Planned] = []
        n = self.config.samples_per_anchor
        for t in task_ids:
            self.expert(t)
            if self.config.mode == "none":
                out += [Planned(t, 0)] * n
            elif self.config.mode == "rollback":
                out += [Planned(t, self._anchor[t])] * n
            else:
                for a, m in self.allocation(t).items():
                    out += [Planned(t, a)] * m
        return out

    # ---- outcomes ----
    def is_success(self, reward: float) -> bool:
        return reward >= self.config.success_reward

    def record(self, task_id: str, anchor: int, reward: float) -> bool:
        """Adds one outcome; returns True if it moved the task's rollback anchor (one chunk earlier)."""
        self.expert(task_id)._check_anchor(anchor)
        ok = self.is_success(reward)
        self._outcomes[task_id].setdefault(anchor, deque(maxlen=self.config.window)).append(ok)
        self.totals["episodes"] += 1
        self.totals["successes"] += ok
        if self.config.mode != "rollback" or anchor != self._anchor[task_id]:
            return False
        window = self._window[task_id]
        window.append(ok)
        if len(window) == self.config.window and sum(window) / len(window) >= self.config.threshold \
                and self._anchor[task_id] > 0:
            self._anchor[task_id] -= 1
            window.clear()
            self._moves[task_id] += 1
            self.totals["moves"] += 1
            return True
        return False

    def fork_estimate(self, task_id: str) -> ForkEstimate:
        """Crucial forks of a task from the recent outcomes per anchor."""
        self.expert(task_id)
        counts = {a: (sum(seen), len(seen)) for a, seen in self._outcomes[task_id].items()}
        return estimate_forks(task_id, counts, self.config.fork_jump)

    def fork_report(self) -> dict[str, Any]:
        """JSON for the run folder's forks.json: {"anchors": forks_by_anchor(...), "tasks": [ForkEstimate dicts]}
        from the recent outcomes of every task."""
        estimates = [self.fork_estimate(t) for t in self.experts]
        return {"anchors": forks_by_anchor(estimates), "tasks": [e.to_dict() for e in estimates]}

    def il_anchor(self, task_id: str, anchor: int) -> int:
        """The fork after a failing anchor: the first later anchor whose recent success rate exceeds the
        rate at `anchor` by >= fork_jump; its prefix (the expert's chunks up to and including the fork chunk)
        is the imitation target. If none does, what fails may be any later decision, the final answer
        included: K + 1, the whole expert episode (K when the expert has no final answer)."""
        expert = self.expert(task_id)
        K = expert.num_chunks
        base = self.success_rate(task_id, anchor) or 0.0
        for b in range(anchor + 1, K + 1):
            rate = self.success_rate(task_id, b)
            if rate is not None and rate - base >= self.config.fork_jump - 1e-9:
                return b
        return K + 1 if expert.has_answer else K

    def il_targets(self, results: Sequence[tuple[Planned, float]]) -> tuple[set[tuple[str, int]], list[Planned]]:
        """The imitation fallback for one round's outcomes [(planned, reward)]. For each group (task, a) whose
        samples all failed, its fork f = il_anchor(task, a). Returns the forks (task, f) sampled this round,
        whose trajectories keep their expert prefix as IL targets, and carriers for the others: `il_samples`
        new episodes at f, or for f = K + 1 the whole expert episode once (nothing left to sample). Nothing
        when the fallback is off."""
        if not self.config.il_fallback:
            return set(), []
        solved: dict[tuple[str, int], bool] = {}
        for p, reward in results:
            key = (p.task_id, p.anchor)
            solved[key] = solved.get(key, False) or self.is_success(reward)
        forks = set()
        for (t, a), ok in solved.items():
            if not ok:
                self.totals["il_groups"] += 1
                forks.add((t, self.il_anchor(t, a)))
        forks = {(t, f) for t, f in forks if f > 0}  # anchor 0 has no expert prefix to imitate
        sampled = forks & solved.keys()
        carriers = [Planned(t, f, il_target=True) for t, f in sorted(forks - sampled)
                    for _ in range(1 if self.is_whole_expert(t, f) else self.config.il_samples)]
        return sampled, carriers

    def is_whole_expert(self, task_id: str, anchor: int) -> bool:
        """Anchor K + 1: the expert's whole episode, its final answer included (an IL row, nothing sampled)."""
        return anchor == self.expert(task_id).num_chunks + 1

    def finalize(self, results: Sequence[tuple[Planned, Trajectory]],
                 il_groups: set[tuple[str, int]] = frozenset()) -> list[Trajectory]:
        """The batch: expert_mask kept on IL carriers and on the trajectories of the (task, anchor) groups in
        `il_groups` (from `il_targets`), cleared elsewhere, so the expert prefix is plain context."""
        out = []
        for p, traj in results:
            keep = p.il_target or (p.task_id, p.anchor) in il_groups
            info = dict(traj.info)
            info["resample"] = {**info.get("resample", {}), "il_target": bool(keep)}
            mask = traj.expert_mask if keep else np.zeros_like(traj.expert_mask)
            out.append(dataclasses.replace(traj, expert_mask=mask, info=info))
        return out

    # ---- reporting and checkpoints ----
    def metrics(self) -> dict[str, float]:
        anchors = [self._anchor[t] / max(e.num_chunks, 1) for t, e in self.experts.items()]
        return {
            "resample/episodes": float(self.totals["episodes"]),
            "resample/success_rate": self.totals["successes"] / max(self.totals["episodes"], 1),
            "resample/il_groups": float(self.totals["il_groups"]),
            "resample/rollback_moves": float(self.totals["moves"]),
            "resample/rollback_anchor_frac": float(np.mean(anchors)) if anchors else 0.0,
            "resample/tasks_at_start": float(sum(a == 0 for a in self._anchor.values())),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (for the checkpoint's host JSON)."""
        return {
            "version": STATE_VERSION,
            "mode": self.config.mode,
            "totals": dict(self.totals),
            "tasks": {
                t: {
                    "num_chunks": e.num_chunks,
                    "anchor": self._anchor[t],
                    "window": [int(x) for x in self._window[t]],
                    "moves": self._moves[t],
                    "outcomes": {str(a): [int(x) for x in seen] for a, seen in sorted(self._outcomes[t].items())},
                }
                for t, e in self.experts.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict()`'s output. Raises ValueError if it was taken with another mode, a task has
        no expert here or its expert has a different number of chunks."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"resample state: version {state.get('version')!r}, expected {STATE_VERSION}")
        if state.get("mode") != self.config.mode:
            raise ValueError(f"resample state: taken with mode {state.get('mode')!r}, config has {self.config.mode!r}")
        W = self.config.window
        for t, s in state["tasks"].items():
            if t not in self.experts:
                raise ValueError(f"resample state: task {t!r} has no expert trajectory here")
            K = self.experts[t].num_chunks
            if int(s["num_chunks"]) != K:
                raise ValueError(f"resample state: task {t!r} had {s['num_chunks']} expert chunks, its expert has {K}")
            if not 0 <= int(s["anchor"]) <= K:
                raise ValueError(f"resample state: task {t!r} anchor {s['anchor']} outside [0, {K}]")
            self._anchor[t] = int(s["anchor"])
            self._window[t] = deque((bool(x) for x in s["window"]), maxlen=W)
            self._moves[t] = int(s["moves"])
            self._outcomes[t] = {int(a): deque((bool(x) for x in seen), maxlen=W) for a, seen in s["outcomes"].items()}
        self.totals = {k: int(v) for k, v in state["totals"].items()}


# ---- sampling ---------------------------------------------------------------------------------------------


async def resample_round(resampler: Resampler, engine: Engine, chat: ChatFormat, task_ids: Sequence[str],
                         config: AgentConfig = AgentConfig(), *, concurrency: int = 8,
                         env_factory: Callable[[Task], Env] | None = None) -> list[Trajectory]:
    """One round: plan -> sample concurrently -> record outcomes (in plan order) -> IL targets where a
    group failed (carriers sampled at forks this round did not visit) -> finalize masks. Returned task by
    task (in `task_ids` order; within a task, planned episodes then carriers). Aborted episodes are dropped
    (and not recorded)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sem = asyncio.Semaphore(concurrency)

    async def one(p: Planned) -> Trajectory | None:
        expert = resampler.expert(p.task_id)
        env = env_factory(expert.task) if env_factory is not None else None
        if resampler.is_whole_expert(p.task_id, p.anchor):
            return whole_expert_episode(expert, chat, env)
        async with sem:
            return await run_anchored(engine, chat, expert, p.anchor, config, env=env)

    async def sample(plan: list[Planned]) -> list[tuple[Planned, Trajectory]]:
        trajs = await asyncio.gather(*(one(p) for p in plan))
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
    experts in order) per round; surplus trajectories wait for the next call (they are not checkpointed)."""

    def __init__(self, resampler: Resampler, engine: Engine, chat: ChatFormat, config: AgentConfig = AgentConfig(),
                 *, concurrency: int = 8):
        self.resampler, self.engine, self.chat, self.config = resampler, engine, chat, config
        self.tasks_per_round, self.concurrency = resampler.config.tasks_per_round, concurrency
        self._order = list(resampler.experts)
        self._cursor = 0
        self._buffer: list[Trajectory] = []
        self._loop = asyncio.new_event_loop()

    def _next_tasks(self) -> list[str]:
        out = [self._order[(self._cursor + i) % len(self._order)] for i in range(self.tasks_per_round)]
        self._cursor = (self._cursor + self.tasks_per_round) % len(self._order)
        return out

    def next_trajectories(self, n: int) -> list[Trajectory]:
        while len(self._buffer) < n:
            self._buffer += self._loop.run_until_complete(resample_round(
                self.resampler, self.engine, self.chat, self._next_tasks(), self.config, concurrency=self.concurrency))
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def run(self, coro: Any) -> Any:
        """Runs an engine coroutine (e.g. a weight update) on this source's loop."""
        return self._loop.run_until_complete(coro)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self._cursor, "resampler": self.resampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._cursor = int(state["cursor"]) % len(self._order)
        self.resampler.load_state_dict(state["resampler"])

    def close(self) -> None:
        close_event_loop(self._loop)  # cancels the engine's worker task, which lives on this loop
