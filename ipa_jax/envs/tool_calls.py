"""Qwen-format assistant turns: parse tool calls, validate them, render calls as text.

Qwen2.5 / Qwen3 (hermes style) write a call as
    <tool_call>\\n{"name": "lookup", "arguments": {"name": "bob"}}\\n</tool_call>
one block per call, several per turn possible, and Qwen3 may reason in `<think>...</think>` before the content.
`ipa_jax.chat.split_reasoning` runs first and `parse_tool_calls` reads the content only, as the serving stacks do,
so a reasoning block that mentions `<tool_call>` yields no call and the final answer excludes the reasoning.

`parse_tool_calls` never raises, whatever the string. The rules follow SGLang (`Qwen25Detector.detect_and_parse`
with `BaseFormatDetector.parse_base_json`) and vLLM (`Hermes2ProToolParser.extract_tool_calls`) where they agree.
Where they differ, or where both would hurt RL, the choice and the reason:

- Every `<tool_call>` is one attempted call: a ToolCall, or a ToolCallError whose message the policy sees as the
  tool response and that `Env.step` counts. SGLang silently drops a block it cannot use (malformed JSON, unclosed,
  unknown or missing name) and vLLM drops the whole turn's calls when any block fails; both can turn a failed call
  attempt into a "final answer", hiding the error from the policy and from the error count.
- A block ends at the next `</tool_call>`; an unclosed block (a later `<tool_call>` or the end of the turn comes
  first) is an error even if its JSON is complete. SGLang ignores it and vLLM executes it when its JSON parses;
  the error teaches the closing tag that SGLang (the serving engine) needs.
- The newlines inside the tags are optional (as in vLLM; SGLang only recognises `<tool_call>\\n` and
  `\\n</tool_call>`): a block without them is still an attempted call, not an answer.
- The JSON must be an object with a non-empty string "name" and an object of arguments under "arguments" or,
  as SGLang also accepts, "parameters" (vLLM requires "arguments"; both keys at once is an error, as SGLang's
  streaming parser asserts). Missing arguments are `{}` (SGLang; vLLM fails). Arguments given as a JSON-encoded
  string are decoded (vLLM; SGLang forwards the string itself). A list of calls in one block is an error (SGLang
  accepts it; the Qwen template writes one object per block). Unknown tool names are parsed: `Env.step` answers
  them with an "unknown tool" error (vLLM forwards them, SGLang drops them).
- Values the serving stacks forward but that cannot be used safely are errors: NaN / Infinity (literal, or a
  float overflow like `1e999`), integer literals over 4300 digits (Python's default int/str limit; enforced here
  whatever the interpreter's setting), nesting deeper than 64 levels (json's own limit is a RecursionError at
  ~1000), and lone surrogates (`"\\ud800"`: json accepts them, but UTF-8 encoding and tokenization fail later).
  So nothing that reaches an observation, a chat message or the tokenizer holds a lone surrogate; error messages
  that quote the model's text are sanitized too (ToolCallError does it on construction).
- A stray `</tool_call>` (not closing a block) is an error too, so a final answer never holds a tool-call tag;
  both stacks read `Rome.</tool_call>` as the answer and ignore a stray tag after a call.
- `ParsedTurn.content` is SGLang's normal_text: the text before the first tool-call tag, stripped (the part the
  chat template renders before a message's tool calls); text between and after blocks is dropped, as by both
  stacks. A turn without tags is all content, stripped (both stacks keep the whitespace; the final answer is
  normalized anyway).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ipa_jax.chat.tokens import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# Longest piece of model text echoed back inside an error message (keeps observations short).
_MAX_ECHO = 40
# Deepest nesting accepted in a call object ({"arguments": {...}} is depth 2); deeper is an error, never a
# RecursionError later (repr, json.dumps, tools).
_MAX_DEPTH = 64
# Longest integer literal (digits): Python's default int/str conversion limit, fixed here so that the result
# does not depend on sys.set_int_max_str_digits (and parsing stays linear-time).
_MAX_INT_DIGITS = 4300
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _clean(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes, so that it always encodes to UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(text: str) -> str:
    text = text.strip()
    return _clean(text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "...")


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
    """A call the model tried to make but that cannot be executed; `message` is shown to the model.

    `message` is sanitized on construction (lone surrogates escaped), so an error observation always encodes;
    `raw` keeps the model's text of the block as it was.
    """

    message: str
    raw: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", _clean(str(self.message)))


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn's content (text before the first tool-call tag, stripped) and its calls in order."""

    content: str
    calls: list[ToolCall | ToolCallError]

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls)


class _NumberTooLarge(ValueError):
    pass


def _parse_int(literal: str) -> int:
    """json's integer conversion, bounded to _MAX_INT_DIGITS digits whatever the interpreter's limit."""
    if len(literal.lstrip("-")) > _MAX_INT_DIGITS:
        raise _NumberTooLarge
    try:
        return int(literal)
    except ValueError:  # the interpreter's own limit, if set lower (sys.set_int_max_str_digits)
        raise _NumberTooLarge from None


def _value_problem(value: Any) -> str | None:
    """Why a decoded call object cannot be used (too deep, a lone surrogate, a non-finite number), or None.

    Iterative, so any depth is safe to inspect.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return f"tool call nested deeper than {_MAX_DEPTH} levels"
        if isinstance(item, str):
            if _SURROGATE_RE.search(item):
                return "invalid unicode (lone surrogate) in tool call"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "non-finite number (NaN or Infinity) in tool call"
        elif isinstance(item, dict):
            stack.extend((x, depth + 1) for kv in item.items() for x in kv)
        elif isinstance(item, list):
            stack.extend((x, depth + 1) for x in item)
    return None


def _decode(body: str) -> tuple[Any, str | None]:
    """(value, None) for usable JSON text, else (None, the error message)."""
    try:
        value = json.loads(body, parse_int=_parse_int)
    except _NumberTooLarge:
        return None, f"number too large (over {_MAX_INT_DIGITS} digits) in tool call"
    except RecursionError:
        return None, f"tool call nested deeper than {_MAX_DEPTH} levels"
    except json.JSONDecodeError as e:
        return None, f"invalid JSON in tool call ({e.msg}): {_short(body)}"
    return value, _value_problem(value)


def _parse_body(body: str) -> ToolCall | ToolCallError:
    """Parse the JSON between <tool_call> and </tool_call>."""
    obj, problem = _decode(body)
    if problem is not None:
        return ToolCallError(problem, body)
    if not isinstance(obj, dict):
        return ToolCallError(
            f"tool call must be a JSON object with 'name' and 'arguments', got "
            f"{type(obj).__name__ if obj is not None else 'null'}",
            body,
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("tool call is missing a string 'name'", body)
    if "arguments" in obj and "parameters" in obj:
        return ToolCallError(f"tool call '{_short(name)}' has both 'arguments' and 'parameters'", body)
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON-encoded string
        arguments, problem = _decode(arguments)
        if problem is not None:
            return ToolCallError(f"arguments of '{_short(name)}' are not a JSON object: {problem}", body)
    if not isinstance(arguments, dict):
        return ToolCallError(f"arguments of '{_short(name)}' must be a JSON object", body)
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split an assistant turn's content into text and tool calls; never raises (rules: module docstring).

    Each `<tool_call>` starts one block, ended by the first `</tool_call>` before the next `<tool_call>`; each
    block gives a ToolCall or a ToolCallError, and so does each other `</tool_call>`, in text order. `content`
    is the text before the first tag, stripped (all the text when there is none). Pass the content of
    `ipa_jax.chat.split_reasoning`, not the raw turn.
    """
    if not isinstance(text, str):
        return ParsedTurn("", [ToolCallError(f"turn text must be a string, got {type(text).__name__}")])
    tags = [at for at in (text.find(TOOL_CALL_OPEN), text.find(TOOL_CALL_CLOSE)) if at >= 0]
    if not tags:
        return ParsedTurn(text.strip(), [])
    stray = ToolCallError(f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}")
    head, *blocks = text.split(TOOL_CALL_OPEN)
    calls: list[ToolCall | ToolCallError] = [stray] * head.count(TOOL_CALL_CLOSE)
    for block in blocks:
        body, closed, after = block.partition(TOOL_CALL_CLOSE)  # text after the block is not content
        calls.append(_parse_body(body) if closed else ToolCallError("unclosed <tool_call> (no </tool_call>)", body))
        calls += [stray] * after.count(TOOL_CALL_CLOSE)
    return ParsedTurn(text[: min(tags)].strip(), calls)


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
    """Check a call against OpenAI/Qwen function specs; returns an error message or None; never raises on any
    call (a ToolCall built in code gets the parser's value checks too: depth, lone surrogates, NaN/Infinity).

    Checks: known name, required arguments present, no unknown arguments, JSON types, enums.
    """
    if not isinstance(call.name, str) or not isinstance(call.arguments, dict):
        return "tool call must have a string name and an object of arguments"
    problem = _value_problem({"name": call.name, "arguments": call.arguments})
    if problem is not None:
        return problem
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
