"""Expert trajectories: a successful conversation split into tool-call chunks, taken from each task's scripted
expert or loaded from a JSONL file, and replayed through the agent's own prefill to get the token row that
anchored rollouts start from."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipa_jax.chat import IM_END, ChatFormat
from ipa_jax.envs import Env, Task, ToolCallError, expert_errs, make_env, parse_tool_calls
from ipa_jax.rollout.agent import TokenRow, replay_prefill
from ipa_jax.rollout.resample.config import ResampleConfig
from ipa_jax.trajectory import Trajectory


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
        self.check_anchor(anchor)
        return [dict(m) for m in self.messages[: self.chunk_ends[anchor - 1]]] if anchor else []

    def check_anchor(self, anchor: int) -> None:
        """Raises ValueError unless `anchor` is an int in [0, K]."""
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
        raise ValueError(
            f"expert {uid!r}: the conversation must start with the task's initial messages "
            f"{[m['role'] for m in initial]} (system/user of task {task.task_id!r})"
        )
    rest = messages[len(initial) :]
    ends: list[int] = []
    i = 0
    while i < len(rest):
        msg = rest[i]
        if msg.get("role") != "assistant":
            raise ValueError(
                f"expert {uid!r}: message {len(initial) + i} has role {msg.get('role')!r} where an "
                "assistant turn is expected"
            )
        if not msg.get("tool_calls"):
            if i != len(rest) - 1:
                raise ValueError(
                    f"expert {uid!r}: message {len(initial) + i} is an answer without tool calls "
                    "but is not the last message"
                )
            break
        j = i + 1
        while j < len(rest) and rest[j].get("role") == "tool":
            j += 1
        if j - i - 1 != len(msg["tool_calls"]):
            raise ValueError(
                f"expert {uid!r}: message {len(initial) + i} has {len(msg['tool_calls'])} tool calls "
                f"but {j - i - 1} tool responses follow"
            )
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
    messages = task.initial_messages()
    row = TokenRow()
    row.extend(chat.encode(chat.render(messages, task.tools, add_generation_prompt=True)))
    lengths, spans = [len(row.tokens)], []
    start = 0
    reward = None
    try:
        env.reset(task)
        for end in expert.chunk_ends:
            replay_prefill(env, task, chat, list(expert.messages[start:end]), row, messages)
            begin = lengths[-1]
            spans.append((begin, begin + int(np.sum(row.expert[begin:]))))
            lengths.append(len(row.tokens))
            start = end
        if len(expert.messages) > start:
            reward = float(env.final_answer(str(expert.messages[-1].get("content", ""))))
    finally:
        env.close()
    return ExpertReplay(row.tokens, lengths, spans, reward)


def expert_from_trajectory(traj: Trajectory, task: Task, chat: ChatFormat) -> ExpertTrajectory:
    """Rebuilds the expert conversation from a Trajectory's chunks: each chunk's tokens are decoded and
    parsed (tool calls -> assistant `tool_calls`, tool responses by replaying the environment; the last
    chunk without calls is the answer). Raises ValueError if a chunk has a malformed call or if the
    conversation does not re-render to the trajectory's own tokens (anchored rollouts would not reproduce
    them token for token)."""
    if traj.expert_mask.any():
        raise ValueError(
            f"expert {traj.uid!r} is itself an anchored rollout (expert-masked prefix); an expert "
            "trajectory must be sampled from the start state"
        )
    env = make_env(task.env)
    try:
        messages = _replayed_conversation(traj, task, chat, env)
    finally:
        env.close()
    expert = expert_from_messages(messages, task, uid=traj.uid)
    replay = replay_expert(expert, chat)
    n = replay.prefix_lengths[-1]
    got, want = replay.tokens, traj.tokens[:n].tolist()
    if got != want:
        t = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise ValueError(
            f"expert {traj.uid!r}: the chat template does not re-render the trajectory's tokens "
            f"(first difference at position {t}); anchored rollouts would not reproduce it"
        )
    return expert


def _replayed_conversation(traj: Trajectory, task: Task, chat: ChatFormat, env: Env) -> list[dict[str, Any]]:
    """The chat messages of a trajectory's chunks, tool responses from replaying the calls in `env`."""
    env.reset(task)
    messages = task.initial_messages()
    for k in range(traj.num_chunks):
        ids = traj.tokens[traj.chunk_ids == k].tolist()
        text = chat.decode(ids)
        text = text[: -len(IM_END)] if text.endswith(IM_END) else text
        reasoning, content = chat.split_turn(text)
        thought = {"reasoning_content": reasoning} if reasoning else {}  # re-rendered as the template shows it
        parsed = parse_tool_calls(content)
        if not parsed.calls:
            if k != traj.num_chunks - 1:
                raise ValueError(f"expert {traj.uid!r}: chunk {k} has no tool call but is not the last chunk")
            messages.append({"role": "assistant", "content": content, **thought})
            break
        errors = [c for c in parsed.calls if isinstance(c, ToolCallError)]
        if errors:
            raise ValueError(f"expert {traj.uid!r}: chunk {k} has a malformed tool call ({errors[0].message})")
        messages.append(
            {
                "role": "assistant",
                "content": parsed.content,
                **thought,
                "tool_calls": [c.to_message_dict() for c in parsed.calls],
            }
        )
        for call in parsed.calls:
            messages.append({"role": "tool", "name": call.name, "content": env.step(call).observation})
    return messages


def load_experts(
    path: str | os.PathLike, chat: ChatFormat, *, tasks: Mapping[str, Task] | None = None, success_reward: float = 1.0
) -> list[ExpertTrajectory]:
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


def build_experts(
    config: ResampleConfig, tasks: Sequence[Task], chat: ChatFormat, expert_error: float = 0.0
) -> list[ExpertTrajectory]:
    """The experts named by config.experts: "scripted" -> each task's scripted expert (making its systematic
    mistake on the `expert_error` share of the tasks, `expert_errs`, as the warm start's demonstrations do); else
    `load_experts(config.experts, chat, tasks=...)` (a line's task id is looked up among `tasks`)."""
    if config.experts == "scripted":
        return [expert_from_messages(make_env(t.env).expert(t, expert_errs(t, expert_error)), t) for t in tasks]
    if not os.path.exists(config.experts):
        raise ValueError(f"ResampleConfig.experts: no file {config.experts!r} (nor 'scripted')")
    return load_experts(config.experts, chat, tasks={t.task_id: t for t in tasks}, success_reward=config.success_reward)


def _resolve_task(ref: Any, tasks: Mapping[str, Task]) -> Task:
    if isinstance(ref, dict):
        return Task.from_dict(ref)
    if isinstance(ref, str):
        if ref not in tasks:
            raise ValueError(f"task {ref!r} is not among the {len(tasks)} tasks given (pass tasks={{id: Task}})")
        return tasks[ref]
    raise ValueError("no task: give 'task' (a Task dict or a task id in tasks=) so the environment can be replayed")


def _expert_from_line(
    line: str, chat: ChatFormat, tasks: Mapping[str, Task], success_reward: float, lineno: int
) -> ExpertTrajectory:
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
