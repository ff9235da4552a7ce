"""Arithmetic through a one-operation calculator: "Compute (17 + 25) * 3." needs two `calc` calls.

The tool does a single binary operation, so an expression with `ops` operators needs `ops` calls, each
after the first copying the previous result (an observation) into its arguments.

Families (`family`): the operation kinds a task uses, in the order add, sub, mul: "add", "add_mul", "add_sub_mul", ...
The expert's systematic mistake (env.expert_error): its last call applies the wrong operation, the next of + - *
(cyclically) that changes the result, and it answers that result (0 op 0, the same under every operation: the
answer off by one).
"""

from __future__ import annotations

import random
from typing import Any

from ipa_jax.envs.base import Env, ToolError
from ipa_jax.envs.tool_calls import ToolCall

OPS = ("+", "-", "*")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}
MAX_ABS_RESULT = 10**9  # keeps observations short whatever numbers a random policy sends

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Compute a op b, op is +, - or *.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "op": {"type": "string"}, "b": {"type": "integer"}},
            "required": ["a", "op", "b"],
        },
    },
}


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class CalculatorEnv(Env):
    """Left-nested expressions ((a op b) op c) ...; `ops` operators (calls), operands in [low, high]."""

    name = "calculator"

    def __init__(self, ops: int = 2, low: int = 2, high: int = 30, extra_turns: int = 1):
        super().__init__()
        if ops < 1:
            raise ValueError(f"ops must be >= 1, got {ops}")
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high, got low={low}, high={high}")
        if extra_turns < 0:
            raise ValueError(f"extra_turns must be >= 0, got {extra_turns}")
        self.ops, self.low, self.high, self.extra_turns = ops, low, high, extra_turns

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [CALC_TOOL]

    def max_turns_for(self, data: dict[str, Any]) -> int:
        return len(data["ops"]) + 1 + self.extra_turns

    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        nums = [rng.randint(self.low, self.high) for _ in range(self.ops + 1)]
        ops = [rng.choice(OPS) for _ in range(self.ops)]
        expr = str(nums[0])
        value = nums[0]
        for i, op in enumerate(ops):
            expr = f"{expr} {op} {nums[i + 1]}"
            if i < len(ops) - 1:
                expr = f"({expr})"
            value = _apply(value, op, nums[i + 1])
        return f"Compute {expr}.", str(value), {"nums": nums, "ops": ops}

    def _execute(self, call: ToolCall) -> str:
        args = call.arguments
        if args["op"] not in OPS:
            raise ToolError(f"op must be one of {' '.join(OPS)}")
        result = _apply(args["a"], args["op"], args["b"])
        if abs(result) > MAX_ABS_RESULT:
            raise ToolError("result too large")
        return str(result)

    def family(self, task) -> str:
        used = set(task.data["ops"])
        return "_".join(name for op, name in OP_NAMES.items() if op in used)

    def expert_mistake(self, task, observations: list[str], action: ToolCall | str) -> ToolCall | str | None:
        if isinstance(action, str):  # the answer copies the wrong result; 0 op 0 (same under every op) is off by one
            return str(int(action) + 1) if action == task.answer else None
        if len(observations) != len(task.data["ops"]) - 1:
            return None  # the mistake is in the last call
        a, op, b = action.arguments["a"], action.arguments["op"], action.arguments["b"]
        rotation = OPS[OPS.index(op) + 1 :] + OPS[: OPS.index(op)]
        wrong = next((w for w in rotation if _apply(a, w, b) != _apply(a, op, b)), op)
        return ToolCall("calc", {"a": a, "op": wrong, "b": b})

    def expert_action(self, task, observations: list[str]) -> ToolCall | str:
        nums, ops = task.data["nums"], task.data["ops"]
        k = len(observations)
        if k == len(ops):
            return observations[-1]
        a = nums[0] if k == 0 else int(observations[-1])  # copy the previous result, like the policy must
        return ToolCall("calc", {"a": a, "op": ops[k], "b": nums[k + 1]})
