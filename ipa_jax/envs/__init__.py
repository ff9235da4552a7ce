"""Environments (pure Python, stdlib only): protocol, tool-call parsing, built-in multi-turn tasks, registry."""

from ipa_jax.envs.base import (
    TASK_BLOCK,
    Env,
    StepResult,
    Task,
    TaskSpaceTooSmall,
    ToolError,
    expert_errs,
    normalize_answer,
)
from ipa_jax.envs.calculator import CalculatorEnv
from ipa_jax.envs.kv_chain import KVChainEnv
from ipa_jax.envs.lookup import LookupEnv
from ipa_jax.envs.registry import BUILTIN_ENVS, list_envs, make_env, register_env
from ipa_jax.envs.tool_calls import (
    ParsedTurn,
    ToolCall,
    ToolCallError,
    format_tool_call,
    parse_tool_calls,
    validate_tool_call,
)

__all__ = [
    "BUILTIN_ENVS",
    "Env",
    "StepResult",
    "TASK_BLOCK",
    "Task",
    "TaskSpaceTooSmall",
    "ToolError",
    "expert_errs",
    "normalize_answer",
    "CalculatorEnv",
    "KVChainEnv",
    "LookupEnv",
    "list_envs",
    "make_env",
    "register_env",
    "ParsedTurn",
    "ToolCall",
    "ToolCallError",
    "format_tool_call",
    "parse_tool_calls",
    "validate_tool_call",
]
