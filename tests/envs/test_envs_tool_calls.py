"""Qwen tool-call parser: well-formed calls, every malformed shape, and fuzzing (it must never raise)."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipa_jax.envs import (
    ToolCall,
    ToolCallError,
    format_tool_call,
    list_envs,
    make_env,
    parse_tool_calls,
    validate_tool_call,
)
from ipa_jax.envs.lookup import LOOKUP_TOOL


def test_single_call_qwen_format():
    text = '<tool_call>\n{"name": "lookup", "arguments": {"name": "bob"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == ""
    assert parsed.calls == [ToolCall("lookup", {"name": "bob"})]


def test_content_and_several_calls_in_order():
    text = (
        "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]


def test_plain_answer_has_no_calls():
    parsed = parse_tool_calls("  rome \n")
    assert parsed.content == "rome" and parsed.calls == [] and not parsed.has_tool_calls


def test_arguments_as_json_string_openai_style():
    text = '<tool_call>{"name": "lookup", "arguments": "{\\"name\\": \\"bob\\"}"}</tool_call>'
    assert parse_tool_calls(text).calls == [ToolCall("lookup", {"name": "bob"})]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('<tool_call>\n{"name": "lookup", "arguments": {"name": "bob"}\n</tool_call>', "invalid JSON"),
        ("<tool_call>\n[1, 2]\n</tool_call>", "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "missing a string 'name'"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "missing a string 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "not a JSON object"),
        ('<tool_call>\n{"name": "lookup", "arguments": {"name": "bob"}}', "unclosed"),
        ("</tool_call>", "without <tool_call>"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "invalid JSON"),  # deep nesting: RecursionError
    ],
)
def test_malformed_calls_become_errors(text, fragment):
    parsed = parse_tool_calls(text)
    assert len(parsed.calls) == 1
    err = parsed.calls[0]
    assert isinstance(err, ToolCallError) and fragment in err.message


def test_nested_open_tag_breaks_the_outer_block_only():
    text = '<tool_call>{"name": <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    calls = parse_tool_calls(text).calls
    assert isinstance(calls[0], ToolCallError) and "unclosed" in calls[0].message
    assert calls[1] == ToolCall("f", {})


def test_format_round_trips_through_parser():
    call = ToolCall("calc", {"a": 12, "op": "*", "b": -3})
    assert parse_tool_calls(format_tool_call(call)).calls == [call]


@pytest.mark.parametrize(
    "call, fragment",
    [
        (ToolCall("search", {"name": "x"}), "unknown tool 'search'"),
        (ToolCall("lookup", {}), "missing argument 'name'"),
        (ToolCall("lookup", {"name": "x", "extra": 1}), "unexpected argument 'extra'"),
        (ToolCall("lookup", {"name": 3}), "must be string"),
    ],
)
def test_validation_against_specs(call, fragment):
    assert fragment in validate_tool_call(call, [LOOKUP_TOOL])


def test_validation_types_and_enum():
    spec = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "m": {"enum": ["a", "b"]}},
            },
        },
    }
    assert validate_tool_call(ToolCall("f", {"n": 1, "x": 2.5, "m": "a"}), [spec]) is None
    assert "must be integer" in validate_tool_call(ToolCall("f", {"n": 1.5}), [spec])
    assert "must be integer" in validate_tool_call(ToolCall("f", {"n": True}), [spec])  # bool is not a number
    assert "must be one of" in validate_tool_call(ToolCall("f", {"m": "c"}), [spec])


_PIECES = ["<tool_call>", "</tool_call>", "\n", "{", "}", "[", "]", '"', ":", ",", "name", "arguments", "lookup",
           "calc", "a", "op", "b", "1", "-", " ", "null", "true", "\\", "é", "\x00"]


def _fuzz_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def test_fuzz_parser_and_env_step_never_raise():
    """Random strings over a tag/JSON-heavy alphabet: parse, then step every env with each call."""
    envs = {name: make_env(name) for name in list_envs()}
    tasks = {name: env.tasks("train", 1, 0)[0] for name, env in envs.items()}
    n_errors = 0
    for text in _fuzz_texts(3000, seed=0):
        parsed = parse_tool_calls(text)
        for name, env in envs.items():
            env.reset(tasks[name])
            for call in parsed.calls:
                result = env.step(call)
                assert isinstance(result.observation, str) and len(result.observation) < 200
                n_errors += result.error
            assert env.num_tool_calls == len(parsed.calls)
    assert n_errors > 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text())
def test_hypothesis_arbitrary_text(text):
    parsed = parse_tool_calls(text)
    assert isinstance(parsed.content, str)
    for call in parsed.calls:
        assert isinstance(call, (ToolCall, ToolCallError))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda c: st.lists(c) | st.dictionaries(st.text(), c), max_leaves=10))
def test_hypothesis_arbitrary_json_bodies(value):
    env = make_env("calculator")
    env.reset(env.tasks("train", 1, 0)[0])
    body = json.dumps({"name": "calc", "arguments": value}, ensure_ascii=False)
    calls = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>").calls
    results = [env.step(call) for call in calls]
    if "tool_call>" in body:  # a tag inside a JSON string splits the block (as in Qwen's own parsers)
        return
    assert len(results) == 1
    if not isinstance(value, dict) or set(value) != {"a", "op", "b"}:
        assert results[0].error
