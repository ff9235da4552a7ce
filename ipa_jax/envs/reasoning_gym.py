"""reasoning-gym's procedural generators as a task source: any of its datasets, scored by its own `score_answer`.

    make_env("reasoning_gym", dataset="chain_sum", config={"min_terms": 3}, tools=["python"])

A task is one instance of the generator (`create_dataset(dataset, seed=seed, size=size, **config)[index]`): its
question is the prompt, and its data names the generator, config, seed and index, so any process regenerates the
instance to score it (`make_env(task.env)` needs no arguments). Train and eval come from the same pool of `size`
instances, split by a hash of the question: the same question is never in both. With `tools` the policy may run
code in a sandbox before answering (QuestionEnv); the scripted expert answers with the instance's reference answer.

reasoning-gym is an optional extra (pip install -e '.[reasoning-gym]'), imported when the environment is made.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from collections.abc import Sequence
from typing import Any

from ipa_jax.envs.base import Task
from ipa_jax.envs.dataset import QuestionEnv
from ipa_jax.envs.tool_calls import ToolCall

INSTALL_HINT = "pip install -e '.[reasoning-gym]'"


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"ReasoningGymEnv needs the reasoning-gym package, an optional extra: {INSTALL_HINT}") from e
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def _generator(dataset: str, config_json: str, seed: int, size: int) -> Any:
    reasoning_gym = _reasoning_gym()
    known = sorted(reasoning_gym.factory.DATASETS)
    if dataset not in known:
        close = difflib.get_close_matches(dataset, known, n=3)
        raise ValueError(f"reasoning-gym has no dataset {dataset!r}" + (f"; did you mean {close}?" if close else ""))
    try:
        return reasoning_gym.create_dataset(dataset, seed=seed, size=size, **json.loads(config_json))
    except (TypeError, AssertionError) as e:  # an unknown config field, a failed validate()
        raise ValueError(f"reasoning-gym {dataset!r} rejects config {config_json}: {e}") from None


@functools.lru_cache(maxsize=4096)
def _instance(dataset: str, config_json: str, seed: int, size: int, index: int) -> dict[str, Any]:
    # Cached: sampling rejects instances of the other split, and scoring regenerates the instance it sampled.
    return _generator(dataset, config_json, seed, size)[index]


def _source_key(data: dict[str, Any]) -> tuple[str, str, int, int]:
    return data["dataset"], json.dumps(data["config"], sort_keys=True), data["seed"], data["size"]


class ReasoningGymEnv(QuestionEnv):
    """Instances of one reasoning-gym dataset; the reward is the dataset's `score_answer` of the final answer.

    dataset: a reasoning-gym dataset name (reasoning_gym.factory.DATASETS), e.g. chain_sum, basic_arithmetic.
    config: the dataset's config fields (e.g. {"min_terms": 3}); JSON values, as tasks carry them. seed and size are
      the arguments below.
    size: the pool of instances (generator indices 0 .. size-1) both splits draw from.
    seed: the generator's seed (reasoning-gym's own; `tasks(split, n, seed)` then picks instances from the pool).
    tools: sandbox tools offered with every question (e.g. ["python"]); none by default: a single-turn question.
    max_turns, observation_chars, limits, backend, eval_fraction: as QuestionEnv (turns of a task with tools,
      characters of output per call, SandboxLimits fields, the sandbox backend, the share of eval questions).
    """

    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str = "chain_sum",
        config: dict[str, Any] | None = None,
        size: int = 100_000,
        seed: int = 0,
        tools: Sequence[str] = (),
        max_turns: int = 4,
        observation_chars: int = 1000,
        limits: dict[str, Any] | None = None,
        backend: str = "bubblewrap",
        eval_fraction: float = 0.2,
    ) -> None:
        super().__init__(
            tools=tools,
            max_turns=max_turns,
            observation_chars=observation_chars,
            limits=limits,
            backend=backend,
            eval_fraction=eval_fraction,
        )
        config = dict(config or {})
        if {"seed", "size"} & set(config):
            raise ValueError("give seed and size as ReasoningGymEnv arguments, not in config")
        try:
            json.dumps(config)
        except TypeError as e:
            raise ValueError(f"config must hold JSON values (tasks carry it): {e}") from None
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.source = {"dataset": dataset, "config": config, "seed": seed, "size": size}
        _generator(*_source_key(self.source))  # an unknown dataset or a bad config fails now, not in an episode

    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        data = {**self.source, "index": rng.randrange(self.source["size"])}
        instance = _instance(*_source_key(data), data["index"])
        answer = instance["answer"]
        return instance["question"], "" if answer is None else str(answer), data

    def _instance_of(self, task: Task) -> dict[str, Any]:
        instance = _instance(*_source_key(task.data), task.data["index"])
        if instance["question"] != task.prompt:
            raise ValueError(
                f"{task.task_id}: reasoning-gym regenerated another question (a different reasoning-gym "
                "version from the one that made the task?)"
            )
        return instance

    def score(self, answer: str, task: Task) -> float:
        generator = _generator(*_source_key(task.data))
        return generator.score_answer(answer=answer.strip(), entry=self._instance_of(task))

    def expert_action(self, task: Task, observations: list[str]) -> ToolCall | str:
        """The instance's reference answer straight away (no tool call)."""
        answer = self._instance_of(task)["answer"]
        if answer is None:
            raise ValueError(f"reasoning-gym {task.data['dataset']!r} gives no reference answer: no scripted expert")
        return str(answer)
