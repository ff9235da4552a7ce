"""Environment protocol: a task, a stateful episode (reset -> step* -> final_answer), a scripted expert.

An episode: `reset(task)` returns the user instructions; the policy calls tools (`step`, one call at a
time, each returning an observation); a turn without a tool call is the final answer, scored by
`final_answer(text)` with a verifiable terminal reward in [0, 1]. One Env instance runs one episode at a
time; create one per concurrent episode (`make_env(task.env)`), and `close()` it after the episode (environments
holding a sandbox or a process release it there).

`blocking = True` marks environments whose calls wait on I/O (a sandboxed command, a grader): the agent loop then
runs `reset`, `step` and `final_answer` in a thread pool, so one episode's command never stalls the others or the
engine. Pure-Python environments answer in microseconds and run inline.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ipa_jax.envs.tool_calls import ToolCall, ToolCallError, validate_tool_call

SPLITS = ("train", "eval")
TASK_BLOCK = 256  # distinct tasks task_stream draws at a time: a split must hold at least this many to stream


class TaskSpaceTooSmall(ValueError):
    """`tasks(split, n)` found fewer than n distinct tasks of the split."""

    def __init__(self, env: str, split: str, needed: int, found: int, draws: int):
        self.split, self.needed, self.found, self.draws = split, needed, found, draws
        super().__init__(
            f"{env}: could not draw {needed} distinct {split} tasks (task space too small: {found} "
            f"distinct in {draws} draws)"
        )


@dataclass
class Task:
    """One problem instance; JSON-serialisable. `data` holds the hidden state the tools read."""

    task_id: str
    env: str
    prompt: str  # the user message (instructions)
    tools: list[dict[str, Any]]  # OpenAI/Qwen function specs
    answer: str
    data: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # assistant turns, the final answer included
    system: str | None = None  # None: the chat template's default system prompt

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(**d)

    def initial_messages(self) -> list[dict[str, Any]]:
        """The conversation before the first assistant turn."""
        msgs: list[dict[str, Any]] = []
        if self.system is not None:
            msgs.append({"role": "system", "content": self.system})
        msgs.append({"role": "user", "content": self.prompt})
        return msgs


@dataclass(frozen=True)
class StepResult:
    """What one tool call returns. `done` ends the episode early with `reward` (None -> 0)."""

    observation: str
    done: bool = False
    reward: float | None = None
    error: bool = False  # the call failed (parse, unknown tool, bad arguments, tool-level error)


class ToolError(Exception):
    """Raised by a tool implementation; its message becomes the observation."""


def normalize_answer(text: str) -> str:
    """Case- and whitespace-insensitive form of a final answer; a trailing period is ignored."""
    return " ".join(text.strip().rstrip(".").split()).lower()


def content_hash(*parts: Any) -> int:
    """Stable (process-independent) hash of JSON-serialisable parts."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big")


def expert_errs(task: Task, share: float) -> bool:
    """Whether the expert makes its systematic mistake on `task` (env.expert_error = `share`): a fixed share of the
    tasks, chosen by a hash of the task's content independent of its split."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"expert_error share must be in [0, 1], got {share}")
    return content_hash("expert_error", task.prompt, task.data) % 10_000 < share * 10_000


class Env(abc.ABC):
    """Base class of built-in environments. Subclasses implement `tools`, `_sample`, `_execute`, `expert_action`.

    Train and eval task sets are disjoint by content: a task is in eval iff its content hash falls in the
    eval fraction, so the same problem can never be drawn by both splits, whatever the seeds.
    """

    name: str = "env"
    eval_fraction: float = 0.2
    blocking: bool = False  # calls wait on I/O: the agent loop runs them off its event loop

    def __init__(self) -> None:
        self.task: Task | None = None
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self.done = False

    # ---- to implement -------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """Function specs of this environment's tools."""

    @abc.abstractmethod
    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """Draw one problem: (prompt, answer, data)."""

    @abc.abstractmethod
    def _execute(self, call: ToolCall) -> str | StepResult:
        """Run a validated call: its observation (or a StepResult, e.g. a failed command as an error observation);
        raise ToolError for a tool-level failure."""

    @abc.abstractmethod
    def expert_action(self, task: Task, observations: list[str]) -> ToolCall | str:
        """The scripted expert's next action given the observations so far: a call, or the final answer."""

    def expert_mistake(self, task: Task, observations: list[str], action: ToolCall | str) -> ToolCall | str | None:
        """The mistaken expert's action where the scripted expert's is `action`: another action (the environment's
        systematic mistake, which must make the episode fail), or None to take `action`. Environments without one
        cannot run with env.expert_error > 0 (`has_expert_mistake`)."""
        raise NotImplementedError(f"{self.name}: no systematic expert mistake defined")

    @classmethod
    def has_expert_mistake(cls) -> bool:
        return cls.expert_mistake is not Env.expert_mistake

    def family(self, task: Task) -> str:
        """The task's family (a short identifier: the kind of problem), for demonstrations restricted to some
        families (env.expert_families) and held-out success per family; one family ("all") unless the environment
        defines them."""
        return "all"

    def max_turns_for(self, data: dict[str, Any]) -> int:
        """Turn budget of a task (assistant turns including the final answer)."""
        return 4

    # ---- tasks --------------------------------------------------------------------------------------
    def _split_of(self, prompt: str, data: dict[str, Any]) -> str:
        h = content_hash(self.name, prompt, data)
        return "eval" if (h % 10_000) < self.eval_fraction * 10_000 else "train"

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        """`n` distinct tasks of `split` ("train" | "eval"), deterministic in `seed`."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"{self.name}/{split}/{seed}")
        out: list[Task] = []
        seen: set[int] = set()
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 100 * n + 1000:
                raise TaskSpaceTooSmall(self.name, split, n, len(out), attempts - 1)
            prompt, answer, data = self._sample(rng)
            if self._split_of(prompt, data) != split:
                continue
            h = content_hash(prompt, data)
            if h in seen:
                continue
            seen.add(h)
            out.append(
                Task(
                    task_id=f"{self.name}/{split}/{seed}/{len(out)}",
                    env=self.name,
                    prompt=prompt,
                    tools=self.tools,
                    answer=answer,
                    data=data,
                    max_turns=self.max_turns_for(data),
                )
            )
        return out

    def task_stream(self, split: str = "train", seed: int = 0, block: int = TASK_BLOCK) -> Iterator[Task]:
        """An endless deterministic stream of `split` tasks: blocks of `tasks(split, block, seed + k)`."""
        for k in itertools.count():
            yield from self.tasks(split, block, seed + k)

    # ---- episode ------------------------------------------------------------------------------------
    @property
    def max_turns(self) -> int:
        if self.task is None:
            raise ValueError("max_turns: call reset(task) first")
        return self.task.max_turns

    def reset(self, task: Task) -> str:
        """Start an episode on `task`; returns the instructions (the user message)."""
        if task.env != self.name:
            raise ValueError(f"task.env is {task.env!r} but this environment is {self.name!r}")
        self.task = task
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self.done = False
        return task.prompt

    def step(self, tool_call: ToolCall | ToolCallError) -> StepResult:
        """Execute one parsed call; errors (parse, unknown tool, bad arguments, tool failure) are observations."""
        if self.task is None:
            raise ValueError("step: call reset(task) first")
        if self.done:
            raise ValueError("step: the episode is over")
        self.num_tool_calls += 1
        if isinstance(tool_call, ToolCallError):
            self.num_tool_errors += 1
            return StepResult(f"Error: {tool_call.message}", error=True)
        problem = validate_tool_call(tool_call, self.tools)
        if problem is not None:
            self.num_tool_errors += 1
            return StepResult(f"Error: {problem}", error=True)
        try:
            out = self._execute(tool_call)
        except ToolError as e:
            self.num_tool_errors += 1
            return StepResult(f"Error: {e}", error=True)
        if not isinstance(out, StepResult):
            return StepResult(out)
        self.num_tool_errors += int(out.error)
        return out

    def final_answer(self, text: str) -> float:
        """Score the final answer (exact match after normalisation) and end the episode."""
        if self.task is None:
            raise ValueError("final_answer: call reset(task) first")
        self.done = True
        return 1.0 if normalize_answer(text) == normalize_answer(self.task.answer) else 0.0

    def close(self) -> None:
        """End the episode and release what it holds (a sandbox, a process); idempotent. A closed environment takes
        no further step until the next `reset`."""
        self.done = True

    # ---- expert -------------------------------------------------------------------------------------
    def expert(self, task: Task, mistaken: bool = False) -> list[dict[str, Any]]:
        """A successful conversation as chat messages (initial messages, assistant tool calls, tool
        responses, final answer), produced by running the scripted expert against this environment; `mistaken`:
        the expert makes the environment's systematic mistake (`expert_mistake`) and fails.
        Raises RuntimeError if the expert fails (or, mistaken, succeeds: a bug in the environment)."""
        try:
            return self._expert_messages(task, mistaken)
        finally:
            self.close()

    def _expert_messages(self, task: Task, mistaken: bool) -> list[dict[str, Any]]:
        self.reset(task)
        messages = task.initial_messages()
        observations: list[str] = []
        for _ in range(task.max_turns):
            action = self.expert_action(task, observations)
            if mistaken:
                action = self.expert_mistake(task, observations, action) or action
            if isinstance(action, str):
                if self.final_answer(action) != (0.0 if mistaken else 1.0):
                    outcome = "mistaken expert answer {!r} is right" if mistaken else "expert answer {!r} is wrong"
                    raise RuntimeError(f"{self.name}: {outcome.format(action)} for {task.task_id}")
                messages.append({"role": "assistant", "content": action})
                return messages
            result = self.step(action)
            if result.error:
                raise RuntimeError(f"{self.name}: expert call failed on {task.task_id}: {result.observation}")
            observations.append(result.observation)
            messages.append({"role": "assistant", "content": "", "tool_calls": [action.to_message_dict()]})
            messages.append({"role": "tool", "name": action.name, "content": result.observation})
        raise RuntimeError(f"{self.name}: expert ran out of turns on {task.task_id}")
