"""Agent tools in the Qwen / OpenAI function format, executed in an episode's sandbox.

    bash(command)              run a command in the workspace (a fresh shell each call: files persist, cd does not)
    python(code)               run a Python 3 program (stdlib only) in the workspace
    read_file(path)            a file's text
    write_file(path, content)  create or overwrite a file (parent folders are created)

Every tool runs inside the sandbox, file tools included, so paths and links resolve in the sandbox's view and
never on the host. An observation is the exit code, then stdout and stderr when not empty, each cut to
`max_chars` characters with a marker saying how much was left out; a failed command (non-zero exit, timeout,
output flood) is an error observation.
"""

from __future__ import annotations

import shlex
from typing import Any

from ipa_jax.envs.base import StepResult, ToolError
from ipa_jax.envs.sandbox.base import CommandResult, Sandbox, SandboxError
from ipa_jax.envs.tool_calls import ToolCall


def _spec(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


TOOL_SPECS: dict[str, dict[str, Any]] = {
    "bash": _spec(
        "bash",
        "Run a bash command in the workspace. Each call starts a new shell in the workspace "
        "folder: files persist between calls, the current folder and variables do not.",
        command="The command.",
    ),
    "python": _spec(
        "python", "Run a Python 3 program (standard library only) in the workspace.", code="The program's source."
    ),
    "read_file": _spec("read_file", "Read a text file.", path="Its path (relative to the workspace or absolute)."),
    "write_file": _spec(
        "write_file",
        "Create or overwrite a text file.",
        path="Its path (relative to the workspace or absolute).",
        content="The file's text.",
    ),
}
TOOL_NAMES = tuple(TOOL_SPECS)


def tool_specs(names: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """The function specs of `names` (a subset of TOOL_NAMES), in that order."""
    unknown = [n for n in names if n not in TOOL_SPECS]
    if unknown or not names:
        raise ValueError(f"tools must be a non-empty subset of {TOOL_NAMES}, got {list(names)}")
    return [TOOL_SPECS[n] for n in names]


def truncate(text: str, max_chars: int, total_bytes: int | None = None) -> str:
    """`text` cut to `max_chars` characters, with a marker saying how much was left out."""
    dropped = len(text) - max_chars if len(text) > max_chars else 0
    if total_bytes is not None and total_bytes > len(text.encode("utf-8", "replace")):
        dropped += total_bytes - len(text.encode("utf-8", "replace"))
    if not dropped:
        return text
    return f"{text[:max_chars]}\n[... {dropped} more characters truncated]"


def format_observation(result: CommandResult, max_chars: int) -> str:
    """exit code, then stdout / stderr when not empty, each truncated; what a timeout or a flood did."""
    status = f"exit code: {result.exit_code}"
    if result.timed_out:
        status += f" (killed: timed out after {result.duration_s:.0f} s)"
    elif result.output_limited:
        status += " (killed: too much output)"
    if result.full:
        status += f" (no space left: {', '.join(result.full)} is full)"
    parts = [status]
    if result.stdout or result.stdout_bytes:
        parts.append("stdout:\n" + truncate(result.stdout, max_chars, result.stdout_bytes))
    if result.stderr or result.stderr_bytes:
        parts.append("stderr:\n" + truncate(result.stderr, max_chars, result.stderr_bytes))
    return "\n".join(parts)


def run_tool(
    sandbox: Sandbox | None, call: ToolCall, *, max_chars: int = 2000, timeout_s: float | None = None
) -> StepResult:
    """Execute a validated call of one of TOOL_SPECS in `sandbox`; a failed command is an error observation. Raises
    ToolError (an error observation too, through Env.step) when the sandbox is closed (None) or fails."""
    if sandbox is None:
        raise ToolError("the episode's sandbox is closed")
    try:
        return _run_tool(sandbox, call, max_chars, timeout_s)
    except SandboxError as e:
        raise ToolError(f"sandbox failure: {e}") from None


def _run_tool(sandbox: Sandbox, call: ToolCall, max_chars: int, timeout_s: float | None) -> StepResult:
    args = call.arguments
    if call.name == "bash":
        result = sandbox.run(str(args["command"]), timeout_s=timeout_s)
    elif call.name == "python":
        result = sandbox.run("exec python3 -", stdin=str(args["code"]).encode(), timeout_s=timeout_s)
    elif call.name == "read_file":
        result = sandbox.run(f"cat -- {shlex.quote(str(args['path']))}", timeout_s=timeout_s)
        if result.ok:  # the file's text as it is, without the exit code
            return StepResult(truncate(result.stdout, max_chars, result.stdout_bytes))
    elif call.name == "write_file":
        path = shlex.quote(str(args["path"]))
        result = sandbox.run(
            f'mkdir -p -- "$(dirname -- {path})" && cat > {path}',
            stdin=str(args["content"]).encode(),
            timeout_s=timeout_s,
        )
        if result.ok:
            return StepResult(f"wrote {len(str(args['content']))} characters to {args['path']}")
    else:
        raise ValueError(f"unknown tool {call.name!r}")
    return StepResult(format_observation(result, max_chars), error=not result.ok)
