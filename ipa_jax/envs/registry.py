"""Environment registry: make_env(name, **kwargs), list_envs(), register_env(name, factory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ipa_jax.envs.base import Env
from ipa_jax.envs.calculator import CalculatorEnv
from ipa_jax.envs.dataset import DatasetEnv
from ipa_jax.envs.kv_chain import KVChainEnv
from ipa_jax.envs.lookup import LookupEnv
from ipa_jax.envs.reasoning_gym import ReasoningGymEnv
from ipa_jax.envs.terminal import TerminalEnv

_REGISTRY: dict[str, Callable[..., Env]] = {}


def register_env(name: str, factory: Callable[..., Env], *, overwrite: bool = False) -> None:
    """Register `factory(**kwargs) -> Env` under `name` (the name is stamped on the env and its tasks)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"env {name!r} is already registered")
    _REGISTRY[name] = factory


def make_env(name: str, **kwargs: Any) -> Env:
    """A fresh environment instance (one per concurrent episode)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown env {name!r}; registered: {', '.join(list_envs())}")
    env = _REGISTRY[name](**kwargs)
    env.name = name  # instance attribute: tasks carry the registered name, so make_env(task.env) replays them
    return env


def list_envs() -> list[str]:
    return sorted(_REGISTRY)


BUILTIN_ENVS = ("lookup", "calculator", "lookup_hard")

register_env("lookup", LookupEnv)
register_env("calculator", CalculatorEnv)
# The hard task (chunk-level initialized resampling): five lookups in a chain; a cold-start policy
# almost never gets every hop right, while the expert's prefix makes the tail reachable.
register_env("lookup_hard", lambda **kw: LookupEnv(**{"hops": 5, "num_people": 8, **kw}))
# The long-horizon task: follow a chain of `hops` keys (6 by default) through a store with distractor fields and
# decoy records; failures stop early or wander until the turn budget, successes take every hop.
register_env("kv_chain", KVChainEnv)
# Question -> answer tasks: a JSONL file of tasks (path=...), and reasoning-gym's generators (an optional extra,
# imported when the environment is made).
register_env("dataset", DatasetEnv)
register_env("reasoning_gym", ReasoningGymEnv)
# Shell tasks in bubblewrap sandboxes, graded by their tests (the built-in suite, or env.kwargs.tasks_dir).
register_env("terminal", TerminalEnv)
