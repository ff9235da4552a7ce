"""Terminal tasks as an environment: the agent works in a sandbox with shell tools, the task's tests give the reward.

Tasks come from the built-in suite (`tiers`, `families`: procedurally generated instances, train and eval split by
content so they never share one) or from a folder of Terminal-Bench / Harbor task folders (`tasks_dir`; its
`train/` and `eval/` subfolders are the splits when present, else a task is in eval iff the hash of its name falls
in `eval_fraction`).

An episode: `reset` creates a sandbox whose workspace holds the task's files; every tool call runs in it; the turn
without a tool call ends the episode (its text is not graded): the task's tests run in the same sandbox and give
the reward; the sandbox is deleted. The scripted expert runs the reference solution, one `bash` call per step,
then says `DONE_MESSAGE`.
"""

from __future__ import annotations

import functools
import os
import random
import time
from typing import Any

from ipa_jax.envs.base import SPLITS, StepResult, Task, ToolError
from ipa_jax.envs.sandbox import SandboxLimits, shared_backend
from ipa_jax.envs.sandbox.episode import SandboxedEnv
from ipa_jax.envs.sandbox.tools import run_tool, tool_specs
from ipa_jax.envs.terminal.grader import grade
from ipa_jax.envs.terminal.spec import TerminalSpec, load_task_folder
from ipa_jax.envs.terminal.suite import FAMILIES, TIERS
from ipa_jax.envs.tool_calls import ToolCall

DONE_MESSAGE = "Done."


class TerminalEnv(SandboxedEnv):
    """Shell tasks in a sandbox, graded by their tests.

    tiers / families: which built-in families generate tasks (families: names, overriding tiers).
    tasks_dir: a folder of task folders instead of the built-in suite.
    tools: of bash, python, read_file, write_file (bash is required: the expert uses it).
    extra_turns: turns beyond the reference solution's steps + 1.
    observation_chars: stdout / stderr characters shown to the policy per call.
    backend, limits, workdir: the sandbox (limits: SandboxLimits fields).
    """

    name = "terminal"
    blocking = True

    def __init__(
        self,
        tiers: tuple[str, ...] | list[str] = ("easy",),
        families: tuple[str, ...] | list[str] = (),
        tasks_dir: str = "",
        tools: tuple[str, ...] | list[str] = ("bash",),
        extra_turns: int = 3,
        observation_chars: int = 1000,
        backend: str = "bubblewrap",
        limits: dict[str, Any] | None = None,
        workdir: str = "/app",
        eval_fraction: float = 0.2,
    ) -> None:
        super().__init__()
        unknown_tiers = sorted(set(tiers) - set(TIERS))
        unknown_families = sorted(set(families) - set(FAMILIES))
        if unknown_tiers or unknown_families:
            raise ValueError(f"unknown tiers {unknown_tiers} (known: {list(TIERS)}) or families {unknown_families}")
        self.families = sorted(families) if families else sorted(n for n, f in FAMILIES.items() if f.tier in tiers)
        if not self.families and not tasks_dir:
            raise ValueError("no task family selected: give tiers, families or tasks_dir")
        if "bash" not in tools:
            raise ValueError(f"tools must include bash (the scripted expert's tool), got {list(tools)}")
        self.tool_names = tuple(tools)
        self._tools = tool_specs(self.tool_names)
        if extra_turns < 0 or observation_chars < 1:
            raise ValueError("extra_turns must be >= 0 and observation_chars >= 1")
        self.extra_turns, self.observation_chars = extra_turns, observation_chars
        self.tasks_dir = os.path.abspath(tasks_dir) if tasks_dir else ""
        if self.tasks_dir and not os.path.isdir(self.tasks_dir):
            raise ValueError(f"tasks_dir {tasks_dir!r} is not a folder")
        self.backend_name, self.workdir = backend, workdir
        self.limits = SandboxLimits(**(limits or {}))
        self.eval_fraction = eval_fraction
        self.spec: TerminalSpec | None = None
        self.last_grade: dict[str, Any] = {}
        self.command_time_s = 0.0

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def max_turns_for(self, data: dict[str, Any]) -> int:
        return len(data["spec"]["solution"]) + 1 + self.extra_turns

    # ---- tasks --------------------------------------------------------------------------------------
    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        spec = FAMILIES[rng.choice(self.families)].make(rng)
        return spec.instruction, "", {"spec": spec.to_dict()}

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if not self.tasks_dir:
            return super().tasks(split, n, seed)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        specs = self.folder_tasks(split)
        if not specs:
            raise ValueError(f"{self.tasks_dir} has no {split} task")
        order = list(range(len(specs)))
        random.Random(f"{self.name}/{split}/{seed}").shuffle(order)
        # A finite library: n > its size repeats tasks (several samples per task), in a seeded order.
        return [self._folder_task(specs[order[i % len(specs)]], split) for i in range(n)]

    @functools.cached_property
    def _folder_specs(self) -> dict[str, list[TerminalSpec]]:
        split_dirs = {s: os.path.join(self.tasks_dir, s) for s in SPLITS}
        if all(os.path.isdir(d) for d in split_dirs.values()):
            return {
                s: [load_task_folder(os.path.join(d, t)) for t in sorted(os.listdir(d))] for s, d in split_dirs.items()
            }
        specs = [
            load_task_folder(os.path.join(self.tasks_dir, t))
            for t in sorted(os.listdir(self.tasks_dir))
            if os.path.isdir(os.path.join(self.tasks_dir, t))
        ]
        return {s: [t for t in specs if self._split_of(t.name, {}) == s] for s in SPLITS}

    def folder_tasks(self, split: str) -> list[TerminalSpec]:
        """The task folders of `split` (tasks_dir mode)."""
        return self._folder_specs[split]

    def library_tasks(self, split: str) -> list[Task]:
        """Every task folder of `split` once (tasks_dir mode)."""
        return [self._folder_task(spec, split) for spec in self.folder_tasks(split)]

    def _folder_task(self, spec: TerminalSpec, split: str) -> Task:
        data = {"spec": spec.to_dict()}
        return Task(
            task_id=f"{self.name}/{split}/{spec.name}",
            env=self.name,
            prompt=spec.instruction,
            tools=self.tools,
            answer="",
            data=data,
            max_turns=self.max_turns_for(data),
        )

    # ---- episode ------------------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        self.close()  # a previous episode's sandbox
        prompt = super().reset(task)
        self.spec = TerminalSpec.from_dict(task.data["spec"])
        backend = shared_backend(self.backend_name, self.limits, self.workdir)
        self.create_sandbox(
            backend.create,
            self.spec.files,
            source_dir=self.spec.environment_dir,
            source_files=self.spec.environment_files,
            executable=self.spec.executable,
        )
        self.command_time_s = 0.0
        return prompt

    def _execute(self, call: ToolCall) -> StepResult:
        if self.sandbox is None:
            raise ToolError("the episode's sandbox is closed")
        left = self.spec.agent_timeout_s - self.command_time_s
        if left <= 0:
            raise ToolError(f"the task's time budget ({self.spec.agent_timeout_s:.0f} s of commands) is used up")
        start = time.perf_counter()
        try:
            return run_tool(
                self.sandbox, call, max_chars=self.observation_chars, timeout_s=min(self.limits.timeout_s, left)
            )
        finally:
            self.command_time_s += time.perf_counter() - start

    def final_answer(self, text: str) -> float:
        """Run the task's tests in the episode's sandbox (the text is not graded); the sandbox is then deleted."""
        if self.task is None or self.sandbox is None:
            raise ValueError("final_answer: call reset(task) first")
        self.done = True
        try:
            reward, result = grade(self.sandbox, self.spec)
        finally:
            self.close()
        self.last_grade = {
            "reward": reward,
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "output": (result.stdout + result.stderr)[-self.observation_chars :],
        }
        return reward

    def check_task(self, task: Task) -> dict[str, float]:
        """The reward of the reference solution (a sound task gives 1.0) and of the untouched workspace (< 1.0),
        each in a fresh sandbox."""
        self.reset(task)
        for step in task.data["spec"]["solution"]:
            self.step(ToolCall("bash", {"command": step}))
        solution = self.final_answer(DONE_MESSAGE)
        self.reset(task)
        return {"solution": solution, "untouched": self.final_answer(DONE_MESSAGE)}

    # ---- expert -------------------------------------------------------------------------------------
    def expert_action(self, task: Task, observations: list[str]) -> ToolCall | str:
        steps = task.data["spec"]["solution"]
        if len(observations) < len(steps):
            return ToolCall("bash", {"command": steps[len(observations)]})
        return DONE_MESSAGE
