"""Question-answer tasks read from a JSONL file, optionally solved with sandbox tools; the base of such environments.

A dataset file holds one task per line, a JSON object such as

    {"id": "apples-1", "prompt": "Anna has 3 bags of 14 apples. How many apples has she?", "answer": "42",
     "grader": "numeric", "tools": ["python"], "split": "train", "system": "Answer with a number only."}

(on one line). Its keys:

    prompt    required: the user message.
    answer    required: the reference the grader compares the final answer with (a string).
    grader    optional (default: the environment's `grader`, "exact"): how the final answer is scored,
                exact     1 if equal to the reference after normalisation (case, spacing and a trailing period ignored)
                numeric   1 if both are numbers equal within a relative tolerance of 1e-6
                contains  1 if the normalised answer contains the normalised reference
                regex     1 if the reference, a Python regular expression, matches the whole stripped answer
                "package.module:function"   any importable f(answer_text, reference, task_dict) -> float in [0, 1];
                          task_dict is the line's object, so a line may carry extra keys for its grader.
    tools     optional (default: the environment's `tools`): the task's sandbox tools, of bash, python, read_file and
              write_file; [] for none.
    id        optional: a name unique in the file, used in task ids (default: file name:line number).
    split     optional: "train" or "eval" (default: by a hash of the prompt, so the same prompt is never in both).
    system    optional: a system prompt.
    solution  optional: the scripted expert's answer where the reference is not itself an answer (a regex, a custom
              grader's reference); default: the reference.

Other keys are kept (custom graders read them). A malformed line is a ValueError naming file:line.

An episode: the policy may call the task's tools, each call running in a sandbox created at `reset`, then answers in
a turn without a tool call; the grader scores that answer and the sandbox is deleted. A task without tools is a
single turn (no sandbox). The scripted expert answers with the solution straight away, without calling a tool.

`QuestionEnv` holds the episode logic shared with the other question -> answer environments (reasoning_gym.py).
"""

from __future__ import annotations

import abc
import functools
import importlib
import json
import math
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ipa_jax.envs.base import SPLITS, StepResult, Task, normalize_answer
from ipa_jax.envs.sandbox import SandboxLimits, shared_backend
from ipa_jax.envs.sandbox.episode import SandboxedEnv
from ipa_jax.envs.sandbox.tools import TOOL_NAMES, run_tool, tool_specs
from ipa_jax.envs.tool_calls import ToolCall

BUILTIN_GRADERS = ("exact", "numeric", "contains", "regex")
NUMERIC_REL_TOL = 1e-6
STRING_KEYS = ("answer", "system", "solution")


def sandbox_tool_specs(names: Sequence[str]) -> list[dict[str, Any]]:
    """The specs of sandbox tools `names` ([] for none); ValueError for a name that is not a sandbox tool."""
    return tool_specs(tuple(names)) if names else []


class QuestionEnv(SandboxedEnv):
    """A question answered in a final turn, after optional calls to sandbox tools. Subclasses make the tasks and
    implement `score`; the reward is that score of the final answer's text.

    A task's tools are its `Task.tools`, so an environment made without arguments (`make_env(task.env)`) plays any
    task of its kind: with tools, `reset` creates a sandbox the calls run in, deleted by the final answer or `close`,
    and the environment is `blocking`; without, the episode is one pure-Python turn.

    tools: sandbox tools (of bash, python, read_file, write_file) of the tasks this environment makes.
    max_turns: assistant turns of a task with tools, the final answer included (a task without tools has one).
    observation_chars: stdout / stderr characters shown to the policy per call.
    limits: SandboxLimits fields (CPU, memory, processes, wall-clock timeout per command, ...); None: the defaults.
    backend: the sandbox backend (ipa_jax.envs.sandbox.register_backend).
    eval_fraction: the share of questions in the eval split.
    """

    def __init__(
        self,
        tools: Sequence[str] = (),
        max_turns: int = 4,
        observation_chars: int = 1000,
        limits: dict[str, Any] | None = None,
        backend: str = "bubblewrap",
        eval_fraction: float = 0.2,
    ) -> None:
        super().__init__()
        self.tool_names = tuple(tools)
        self.default_tools = sandbox_tool_specs(self.tool_names)
        if max_turns < 1 or observation_chars < 1:
            raise ValueError(f"max_turns and observation_chars must be >= 1, got {max_turns}, {observation_chars}")
        if not 0.0 <= eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
        self.turns_with_tools, self.observation_chars = max_turns, observation_chars
        self.limits = SandboxLimits(**(limits or {}))
        self.backend_name = backend
        self.eval_fraction = eval_fraction

    # ---- to implement -------------------------------------------------------------------------------
    @abc.abstractmethod
    def score(self, answer: str, task: Task) -> float:
        """The reward of final answer `answer` to `task`, in [0, 1]."""

    # ---- tasks --------------------------------------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]]:
        """The episode's tools, or before any episode those of the tasks this environment makes."""
        return self.task.tools if self.task is not None else self.default_tools

    @property
    def blocking(self) -> bool:  # sandboxed commands wait on I/O; a question without tools is pure Python
        return bool(self.tools)

    def turn_budget(self, tool_names: Sequence[str]) -> int:
        return self.turns_with_tools if tool_names else 1

    def max_turns_for(self, data: dict[str, Any]) -> int:
        return self.turn_budget(self.tool_names)

    def _split_of(self, prompt: str, data: dict[str, Any]) -> str:
        # By the question alone: the same question is never in both splits, whatever else its task carries.
        return super()._split_of(prompt, {})

    # ---- episode ------------------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        self.close()  # a previous episode's sandbox
        prompt = super().reset(task)
        names = [spec["function"]["name"] for spec in task.tools]
        if names:
            sandbox_tool_specs(names)  # only sandbox tools can run here
            self.create_sandbox(shared_backend(self.backend_name, self.limits).create)
        return prompt

    def _execute(self, call: ToolCall) -> StepResult:
        return run_tool(self.sandbox, call, max_chars=self.observation_chars)

    def final_answer(self, text: str) -> float:
        """Score the answer's text (the sandbox is deleted first: only the text is graded) and end the episode."""
        if self.task is None:
            raise ValueError("final_answer: call reset(task) first")
        self.close()
        reward = float(self.score(text, self.task))
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"{self.name}: the score of {self.task.task_id} is {reward}, not in [0, 1]")
        return reward

    # ---- expert -------------------------------------------------------------------------------------
    def expert_action(self, task: Task, observations: list[str]) -> ToolCall | str:
        """The reference answer straight away (no tool call)."""
        return task.answer


# ---- graders --------------------------------------------------------------------------------------------


@functools.cache
def grader_function(spec: str) -> Callable[[str, str, dict[str, Any]], float]:
    """The function named by "package.module:function"; ValueError when it cannot be imported."""
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import grader {spec!r}: {e}") from None
    if not callable(function):
        raise ValueError(f"grader {spec!r} is not callable")
    return function


def _as_number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def grade(grader: str, answer: str, reference: str, task_dict: dict[str, Any]) -> float:
    """The score of `answer` against `reference` by `grader` (one of BUILTIN_GRADERS or "module:function")."""
    if grader == "exact":
        return float(normalize_answer(answer) == normalize_answer(reference))
    if grader == "numeric":
        value = _as_number(answer)
        return float(value is not None and math.isclose(value, float(reference), rel_tol=NUMERIC_REL_TOL))
    if grader == "contains":
        return float(normalize_answer(reference) in normalize_answer(answer))
    if grader == "regex":
        return float(re.fullmatch(reference, answer.strip()) is not None)
    return float(grader_function(grader)(answer, reference, task_dict))


# ---- the JSONL file -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetLine:
    """One validated task of a dataset file."""

    key: str  # its id, or file name:line number
    prompt: str
    answer: str
    grader: str
    tools: tuple[str, ...]
    split: str | None  # None: by content hash
    system: str | None
    solution: str
    record: dict[str, Any]  # the line's object as read (custom graders get it)


def check_grader(grader: Any) -> None:
    """ValueError unless `grader` is a built-in grader or an importable "module:function"."""
    if not isinstance(grader, str) or (grader not in BUILTIN_GRADERS and ":" not in grader):
        raise ValueError(f"grader must be one of {', '.join(BUILTIN_GRADERS)} or 'module:function', got {grader!r}")
    if ":" in grader:
        grader_function(grader)


def _check_reference(grader: str, answer: str) -> None:
    if grader == "numeric" and _as_number(answer) is None:
        raise ValueError(f"the numeric grader needs a number as answer, got {answer!r}")
    if grader == "regex":
        try:
            re.compile(answer)
        except re.error as e:
            raise ValueError(f"answer is not a valid regular expression (regex grader): {e}") from None


def _parse_line(record: Any, key: str, grader: str, tools: tuple[str, ...]) -> DatasetLine:
    """A line's object as a DatasetLine (`grader`, `tools`: the defaults); ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a task must be a JSON object, got {type(record).__name__}")
    if not isinstance(record.get("prompt"), str) or not record["prompt"]:
        raise ValueError("'prompt' must be a non-empty string")
    if "answer" not in record:
        raise ValueError("'answer' is missing")
    for name in STRING_KEYS:
        if name in record and not isinstance(record[name], str):
            raise ValueError(f"{name!r} must be a string, got {record[name]!r}")
    answer = record["answer"]
    grader = record.get("grader", grader)
    check_grader(grader)
    _check_reference(grader, answer)
    line_tools = record.get("tools", tools)
    if not isinstance(line_tools, list | tuple) or not all(isinstance(t, str) for t in line_tools):
        raise ValueError(f"'tools' must be a list of tool names, got {line_tools!r}")
    if set(line_tools) - set(TOOL_NAMES):
        raise ValueError(f"'tools' must be of {', '.join(TOOL_NAMES)}, got {list(line_tools)}")
    split = record.get("split")
    if split is not None and split not in SPLITS:
        raise ValueError(f"'split' must be one of {SPLITS}, got {split!r}")
    task_id = record.get("id", key)
    if not isinstance(task_id, str | int) or isinstance(task_id, bool) or task_id == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {task_id!r}")
    return DatasetLine(
        key=str(task_id),
        prompt=record["prompt"],
        answer=answer,
        grader=grader,
        tools=tuple(line_tools),
        split=split,
        system=record.get("system"),
        solution=record.get("solution", answer),
        record=record,
    )


@functools.lru_cache(maxsize=8)
def _read_dataset(path: str, modified_ns: int, grader: str, tools: tuple[str, ...]) -> tuple[DatasetLine, ...]:
    # Cached per file version: an environment is made per episode, and must not parse the file each time.
    lines: list[DatasetLine] = []
    first_line_of_id: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                line = _parse_line(json.loads(text), f"{os.path.basename(path)}:{number}", grader, tools)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if line.key in first_line_of_id:
                raise ValueError(f"{where}: id {line.key!r} is already used on line {first_line_of_id[line.key]}")
            first_line_of_id[line.key] = number
            lines.append(line)
    if not lines:
        raise ValueError(f"{path}: no task (expected one JSON object per line)")
    return tuple(lines)


def read_dataset(path: str, grader: str = "exact", tools: Sequence[str] = ()) -> tuple[DatasetLine, ...]:
    """The validated tasks of a JSONL dataset file; `grader` and `tools` are the defaults of lines naming none."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {path!r} does not exist")
    return _read_dataset(path, os.stat(path).st_mtime_ns, grader, tuple(tools))


# ---- the environment ------------------------------------------------------------------------------------


class DatasetEnv(QuestionEnv):
    """The tasks of a JSONL file (format: the module docstring), each scored by its grader.

    path: the JSONL file. Empty: an environment that only plays tasks (their data carries what scoring needs, as
      for `make_env(task.env)` in episodes) and has none of its own to list.
    tools: sandbox tools of the lines that name none (of bash, python, read_file, write_file).
    grader: the grader of the lines that name none.
    eval_fraction: the share of lines without a "split" that are eval (by a hash of the prompt).
    max_turns, observation_chars, limits, backend: as QuestionEnv (turns of a task with tools, characters of output
      per call, SandboxLimits fields, the sandbox backend).

    `tasks(split, n, seed)` lists the split's lines in a seeded order, cycling through it again when `n` exceeds the
    split's size (several samples per task).
    """

    name = "dataset"

    def __init__(
        self,
        path: str = "",
        tools: Sequence[str] = (),
        grader: str = "exact",
        eval_fraction: float = 0.2,
        max_turns: int = 4,
        observation_chars: int = 1000,
        limits: dict[str, Any] | None = None,
        backend: str = "bubblewrap",
    ) -> None:
        super().__init__(
            tools=tools,
            max_turns=max_turns,
            observation_chars=observation_chars,
            limits=limits,
            backend=backend,
            eval_fraction=eval_fraction,
        )
        check_grader(grader)
        self.path = os.path.abspath(path) if path else ""
        self.lines = read_dataset(path, grader, self.tool_names) if path else ()

    @property
    def blocking(self) -> bool:  # a custom grader may wait on I/O (a process, a judge model) too
        return super().blocking or (self.task is not None and self.task.data["grader"] not in BUILTIN_GRADERS)

    # ---- tasks --------------------------------------------------------------------------------------
    @functools.cached_property
    def _lines_by_split(self) -> dict[str, list[DatasetLine]]:
        # Computed on first use: make_env stamps the registered name, part of the content hash, after __init__.
        return {
            split: [line for line in self.lines if (line.split or self._split_of(line.prompt, {})) == split]
            for split in SPLITS
        }

    def split_lines(self, split: str) -> list[DatasetLine]:
        """The lines of `split`, in file order."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self._lines_by_split[split]

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if not self.path:
            raise ValueError("DatasetEnv: no path given, so no task to list")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        lines = self.split_lines(split)
        if not lines:
            raise ValueError(f"{self.path} has no {split} task")
        order = list(range(len(lines)))
        random.Random(f"{self.name}/{split}/{seed}").shuffle(order)
        return [self._task(lines[order[i % len(lines)]], split) for i in range(n)]

    def _task(self, line: DatasetLine, split: str) -> Task:
        return Task(
            task_id=f"{self.name}/{split}/{line.key}",
            env=self.name,
            prompt=line.prompt,
            tools=sandbox_tool_specs(line.tools),
            answer=line.answer,
            data={"grader": line.grader, "solution": line.solution, "record": line.record},
            max_turns=self.turn_budget(line.tools),
            system=line.system,
        )

    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        raise TypeError("a dataset is finite: DatasetEnv.tasks lists its lines instead of sampling")

    # ---- episode ------------------------------------------------------------------------------------
    def score(self, answer: str, task: Task) -> float:
        return grade(task.data["grader"], answer, task.answer, task.data["record"])

    def expert_action(self, task: Task, observations: list[str]) -> ToolCall | str:
        """The line's solution (default: its reference answer) straight away (no tool call)."""
        return task.data["solution"]
