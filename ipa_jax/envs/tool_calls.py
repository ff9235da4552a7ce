"""Qwen-format tool calls: parse model text, validate against tool specs, render calls as text.

Qwen2.5 / Qwen3 (hermes style) write a call as
    <tool_call>\n{"name": "lookup", "arguments": {"name": "bob"}}\n</tool_call>
and may put several calls in one turn. The parser never raises: anything malformed becomes a
`ToolCallError` whose message the model sees as the tool response.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ipa_jax.chat_tokens import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_TAG_RE = re.compile(f"{re.escape(TOOL_CALL_OPEN)}|{re.escape(TOOL_CALL_CLOSE)}")
# Longest tool-call body echoed back inside an error message (keeps observations short).
_MAX_ECHO = 40


@dataclass(frozen=True)
class ToolCall:
    """A syntactically valid call: a tool name and a JSON object of arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_message_dict(self) -> dict[str, Any]:
        """The OpenAI/HF `tool_calls` entry the chat template renders."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}

    def to_text(self) -> str:
        """The exact text the chat template renders for this call (between the tags)."""
        return json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to make but that cannot be executed; `message` is shown to the model."""

    message: str
    raw: str = ""


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn: free text outside tool-call blocks and the calls in order."""

    content: str
    calls: list[ToolCall | ToolCallError]

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls)


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "..."


def _parse_body(body: str) -> ToolCall | ToolCallError:
    """Parse the JSON between <tool_call> and </tool_call>."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: pathologically nested input
        return ToolCallError(f"invalid JSON in tool call: {_short(body)}", body)
    if not isinstance(obj, dict):
        return ToolCallError("tool call must be a JSON object with 'name' and 'arguments'", body)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("tool call is missing a string 'name'", body)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ToolCallError(f"arguments of '{_short(name)}' are not a JSON object", body)
    if not isinstance(arguments, dict):
        return ToolCallError(f"arguments of '{_short(name)}' must be a JSON object", body)
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split an assistant turn into content and tool calls; never raises.

    Blocks are `<tool_call>BODY</tool_call>`; an unclosed block, a stray closing tag or a nested
    opening tag yields a ToolCallError. `content` is the text outside all blocks, stripped.
    """
    if not isinstance(text, str):
        return ParsedTurn("", [ToolCallError(f"turn text must be a string, got {type(text).__name__}")])
    calls: list[ToolCall | ToolCallError] = []
    content_parts: list[str] = []
    pos = 0
    open_at: int | None = None  # index just after the currently open <tool_call>
    for m in _TAG_RE.finditer(text):
        if m.group() == TOOL_CALL_OPEN:
            if open_at is not None:  # nested or unclosed: the previous block is broken
                calls.append(ToolCallError("unclosed <tool_call>", text[open_at : m.start()]))
            else:
                content_parts.append(text[pos : m.start()])
            open_at = m.end()
        else:
            if open_at is None:
                content_parts.append(text[pos : m.start()])
                calls.append(ToolCallError("</tool_call> without <tool_call>", ""))
            else:
                calls.append(_parse_body(text[open_at : m.start()]))
                open_at = None
        pos = m.end()
    if open_at is not None:
        calls.append(ToolCallError("unclosed <tool_call>", text[open_at:]))
    else:
        content_parts.append(text[pos:])
    return ParsedTurn("".join(content_parts).strip(), calls)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def _type_ok(value: Any, json_type: str) -> bool:
    if json_type not in _JSON_TYPES:
        return True  # a type we do not check (e.g. "null" or a union): the tool validates it
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False  # bool is an int subclass in Python but not a JSON number
    return isinstance(value, _JSON_TYPES[json_type])


def validate_tool_call(call: ToolCall, tools: list[dict[str, Any]]) -> str | None:
    """Check a call against OpenAI/Qwen function specs; returns an error message or None.

    Checks: known name, required arguments present, no unknown arguments, JSON types, enums.
    """
    specs = {}
    for tool in tools:
        fn = tool.get("function", tool)
        specs[fn["name"]] = fn
    if call.name not in specs:
        return f"unknown tool '{_short(call.name)}' (available: {', '.join(sorted(specs))})"
    params = specs[call.name].get("parameters", {}) or {}
    props: dict[str, Any] = params.get("properties", {}) or {}
    for req in params.get("required", []):
        if req not in call.arguments:
            return f"{call.name}: missing argument '{req}'"
    for key, value in call.arguments.items():
        if key not in props:
            return f"{call.name}: unexpected argument '{_short(str(key))}'"
        prop = props[key]
        json_type = prop.get("type")
        if isinstance(json_type, str) and not _type_ok(value, json_type):
            return f"{call.name}: argument '{key}' must be {json_type}"
        if "enum" in prop and value not in prop["enum"]:
            return f"{call.name}: argument '{key}' must be one of {prop['enum']}"
    return None


def format_tool_call(call: ToolCall) -> str:
    """The Qwen text of one call, exactly as the chat template renders it."""
    return f"{TOOL_CALL_OPEN}\n{call.to_text()}\n{TOOL_CALL_CLOSE}"
