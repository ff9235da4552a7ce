"""The Qwen3 chat templates: hand-written expected renderings, and byte-for-byte agreement with Qwen's own
templates on generated conversations (when the reference files are present on this machine)."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from ipa_jax.chat import CHAT_TEMPLATES, QWEN3_HYBRID_TEMPLATE, QWEN3_THINKING_2507_TEMPLATE, render

# Test data beside the repository (the real Qwen3 templates, not part of it): ../shared/reference/qwen3.
REFERENCE_DIR = (Path(__file__).resolve().parents[2] / "../shared/reference/qwen3").resolve()
VARIANTS = ("hybrid", "thinking_2507")
N_CONVERSATIONS = 240

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville (température en °C).",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Nom de la ville, p. ex. « Zürich »"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the archive.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {
                        "dates": {
                            "type": "object",
                            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                        },
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "limit": {"type": "integer", "minimum": 1, "default": 10},
            },
            "required": ["query"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "计算一个算术表达式 🧮",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
EMAIL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "description": 'Send an e-mail "as is" (no \\ escaping).',
        "parameters": {
            "type": "object",
            "properties": {
                "to": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "address": {"type": "string"}},
                    },
                },
                "body": {"type": "string"},
            },
        },
    },
}
TOOL_POOL = [WEATHER, SEARCH, CALC, EMAIL]

# Text pieces with the characters a template could mishandle: non-ASCII, quotes, braces, backslashes, tags.
WORDS = [
    "the",
    "answer",
    "is",
    "42",
    "Grüße",
    "日本語",
    "naïve",
    "🙂",
    '{"k": [1, 2]}',
    "back\\slash",
    'say "hi"',
    "a < b > c",
    "tab\there",
    "<tool_call>",
    "line\nbreak",
]

# The ways reasoning is written inline in an assistant's content.
INLINE_THINK = [
    "<think>\n{r}\n</think>\n\n{a}",
    "<think>{r}</think>{a}",
    "{r}\n</think>\n\n{a}",
    "\n\n<think>\n\n{r}\n\n</think>\n\n\n{a}",
    "<think>\n\n</think>\n\n{a}",
    "pre<think>{r}</think>mid</think>\n{a}",
    "<think>x<think>{r}\n</think>{a}",
]
PARTS = [{"type": "text", "text": "content as a list of parts"}]  # not a string: rendered as ''
REASONING_CONTENT = ["", "\n", "Let me think.", "\nstep 1\nstep 2\n\n", "\n\nunicode: ∑ 日本\n"]


def _text(rng, max_words=6):
    """A few words, sometimes with newlines around them (the templates strip some of those)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
    return rng.choice(["", "", "\n", "\n\n"]) + text + rng.choice(["", "", "\n", "\n\n"])


def _args(rng, depth=0):
    """Call arguments: nested objects, lists, unicode, integers, floats, booleans and nulls."""
    leaves = [
        lambda: _text(rng, 2),
        lambda: rng.randint(-5, 10**6),
        lambda: round(rng.uniform(-1, 1), 3),
        lambda: rng.random() < 0.5,
        lambda: None,
    ]
    args = {}
    for key in rng.sample(["city", "query", "n", "ratio", "ok", "opt", "ключ", "filters", "items"], rng.randint(0, 4)):
        if depth < 2 and key in ("filters", "items"):
            args[key] = _args(rng, depth + 1) if key == "filters" else [_args(rng, depth + 1), rng.choice(leaves)()]
        else:
            args[key] = rng.choice(leaves)()
    return args


def _tool_call(rng, tools):
    name = rng.choice(tools)["function"]["name"] if tools else rng.choice(["lookup", "fetch"])
    args = _args(rng)
    if rng.random() < 0.4:  # as a JSON string, written the ways clients write it
        args = json.dumps(args, ensure_ascii=rng.random() < 0.5, separators=rng.choice([None, (",", ":")]))
    call = {"name": name, "arguments": args}
    return {"type": "function", "function": call} if rng.random() < 0.7 else call


def _assistant(rng, tools, with_calls):
    message = {"role": "assistant"}
    style = rng.choice(["plain", "reasoning_content", "inline", "reasoning_alias", "both"])
    answer = rng.choice([_text(rng), _text(rng), "", "\n"]) if with_calls else _text(rng)
    if style in ("reasoning_content", "both"):  # with both, the inline tags stay in the content
        message["reasoning_content"] = rng.choice(REASONING_CONTENT)
    elif style == "reasoning_alias":  # transformers copies `reasoning` / `thinking` into `reasoning_content`
        message[rng.choice(["reasoning", "thinking"])] = rng.choice(REASONING_CONTENT[2:])
    if style in ("inline", "both"):
        answer = rng.choice(INLINE_THINK).replace("{r}", _text(rng, 3)).replace("{a}", answer)
    message["content"] = answer
    if rng.random() < 0.1:  # no string content at all
        message["content"] = rng.choice([None, PARTS])
    if with_calls:
        message["tool_calls"] = [_tool_call(rng, tools) for _ in range(rng.choice([1, 1, 2, 3]))]
    elif rng.random() < 0.1:
        message["tool_calls"] = rng.choice([None, []])
    return message


def _tool_results(rng):
    """One step's tool results: tool messages (some wrapped-looking, some without text), or a wrapped user turn."""
    if rng.random() < 0.15:
        return [{"role": "user", "content": f"<tool_response>\n{_text(rng)}\n</tool_response>"}]
    results = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        content = rng.choice([_text(rng), _text(rng), "<tool_response>nested</tool_response>", None, "", PARTS])
        results.append({"role": "tool", "content": content})
    return results


def _conversation(rng):
    """(messages, tools, render options) for one random conversation."""
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.5 else []
    tools = rng.sample(TOOL_POOL, rng.randint(1, 3)) if rng.random() < 0.6 else rng.choice([None, None, []])
    for _ in range(rng.randint(1, 3)):
        query = rng.choice([_text(rng)] * 8 + [None, PARTS, "<tool_response>\nlate result\n</tool_response>"])
        messages.append({"role": "user", "content": query})
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            messages.append(_assistant(rng, tools, with_calls=True))
            messages += _tool_results(rng)
        if rng.random() < 0.8:
            messages.append(_assistant(rng, tools, with_calls=False))
        if rng.random() < 0.1:
            messages.append({"role": "system", "content": rng.choice([_text(rng), None])})
    if rng.random() < 0.3:  # end anywhere: after a user turn, a tool result, an assistant turn
        messages = messages[: rng.randint(1, len(messages))]
    options = {"add_generation_prompt": rng.random() < 0.5}
    enable_thinking = rng.choice([None, True, False])
    if enable_thinking is not None:
        options["enable_thinking"] = enable_thinking
    return messages, tools, options


def generate_conversations(n=N_CONVERSATIONS, seed=0):
    """`n` random conversations, the same ones on every call."""
    rng = random.Random(seed)
    return [_conversation(rng) for _ in range(n)]


def _is_real_query(message):
    content = message.get("content")
    return (
        message["role"] == "user"
        and isinstance(content, str)
        and not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))
    )


def conversation_shapes(messages, tools, options):
    """The shapes of one conversation, as labels (to check that the generator covers them all)."""
    shapes = {
        "system first" if messages[0]["role"] == "system" else "no system",
        f"ends with {messages[-1]['role']}",
        "tools" if tools else f"tools={tools!r}",
        "generation prompt" if options["add_generation_prompt"] else "no generation prompt",
        f"enable_thinking={options.get('enable_thinking', 'unset')}",
    }
    queries = sum(_is_real_query(m) for m in messages)
    shapes.add({0: "no real query", 1: "one real query"}.get(queries, "several real queries"))
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            shapes.add(f"non-string {message['role']} content")
        if message["role"] == "system" and i > 0:
            shapes.add("system in the middle")
        if message["role"] == "user" and isinstance(content, str) and not _is_real_query(message):
            shapes.add("tool_response-wrapped user message")
        if message["role"] == "tool":
            if i > 0 and messages[i - 1]["role"] == "tool":
                shapes.add("consecutive tool messages")
            if isinstance(content, str) and content.startswith("<tool_response>"):
                shapes.add("tool content looks wrapped")
        if message["role"] != "assistant":
            continue
        if "reasoning_content" in message:
            shapes.add("reasoning_content" if message["reasoning_content"].strip() else "empty reasoning_content")
            if isinstance(content, str) and "</think>" in content:
                shapes.add("reasoning_content and inline <think>")
        elif "reasoning" in message or "thinking" in message:
            shapes.add("reasoning under another name")
        elif isinstance(content, str) and "</think>" in content:
            shapes.add("inline <think>" if "<think>" in content else "inline </think> only")
        else:
            shapes.add("no reasoning")
        calls = message.get("tool_calls") or []
        if calls:
            shapes.add("several calls in a turn" if len(calls) > 1 else "one call in a turn")
            shapes.add(
                {"": "empty content before calls", "\n": "newline-only content before calls"}.get(
                    content if isinstance(content, str) else "", "content before calls"
                )
            )
        for call in calls:
            shapes.add("call with function wrapper" if "function" in call else "call without wrapper")
            args = call.get("function", call)["arguments"]
            shapes.add("arguments as JSON string" if isinstance(args, str) else "arguments as object")
            if isinstance(args, dict) and any(isinstance(v, (dict, list)) for v in args.values()):
                shapes.add("nested arguments")
    return shapes


CONVERSATIONS = generate_conversations()


def test_generator_covers_every_shape():
    counts = Counter(shape for conversation in CONVERSATIONS for shape in conversation_shapes(*conversation))
    expected = {
        "system first",
        "no system",
        "system in the middle",
        "tools",
        "tools=None",
        "tools=[]",
        "one real query",
        "several real queries",
        "no real query",
        "tool_response-wrapped user message",
        "non-string user content",
        "non-string assistant content",
        "non-string tool content",
        "non-string system content",
        "reasoning_content",
        "empty reasoning_content",
        "reasoning under another name",
        "inline <think>",
        "inline </think> only",
        "no reasoning",
        "one call in a turn",
        "several calls in a turn",
        "content before calls",
        "empty content before calls",
        "newline-only content before calls",
        "reasoning_content and inline <think>",
        "call with function wrapper",
        "call without wrapper",
        "arguments as JSON string",
        "arguments as object",
        "nested arguments",
        "consecutive tool messages",
        "tool content looks wrapped",
        "ends with user",
        "ends with assistant",
        "ends with tool",
        "generation prompt",
        "no generation prompt",
        "enable_thinking=True",
        "enable_thinking=False",
        "enable_thinking=unset",
    }
    assert len(CONVERSATIONS) == N_CONVERSATIONS >= 200
    assert {shape: counts[shape] for shape in expected if counts[shape] < 3} == {}
    assert generate_conversations(5) == CONVERSATIONS[:5]


@pytest.fixture(scope="module")
def reference_templates():
    if not REFERENCE_DIR.is_dir():
        pytest.skip(f"Qwen3 reference templates not found at {REFERENCE_DIR}")
    return {variant: (REFERENCE_DIR / f"chat_template_{variant}.jinja").read_text("utf-8") for variant in VARIANTS}


def _render_reference(template, messages, tools, **options):
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template, **options)
    return rendered[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_qwen_reference_byte_for_byte(variant, reference_templates):
    for i, (messages, tools, options) in enumerate(CONVERSATIONS):
        ours = render(messages, tools, variant=variant, **options)
        expected = _render_reference(reference_templates[variant], messages, tools, **options)
        if ours != expected:
            at = next((k for k, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
            pytest.fail(
                f"conversation {i} differs at char {at}: ours {ours[at : at + 60]!r}, "
                f"Qwen's {expected[at : at + 60]!r}\nmessages={messages!r}"
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_fails_where_qwen_reference_fails(variant, reference_templates):
    """A first system message without string content, or a call without arguments, is an error in both."""
    broken = [
        [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
    ]
    for messages in broken:
        for tools in (None, [CALC]):
            with pytest.raises(TypeError):
                _render_reference(reference_templates[variant], messages, tools)
            with pytest.raises(TypeError):
                render(messages, tools, variant=variant)


TOOLS_SYSTEM_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calc", "description": "计算一个算术表达式 🧮", "parameters": '
    '{"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_public_names():
    assert CHAT_TEMPLATES == {"hybrid": QWEN3_HYBRID_TEMPLATE, "thinking_2507": QWEN3_THINKING_2507_TEMPLATE}
    with pytest.raises(ValueError, match="variant"):
        render([{"role": "user", "content": "hi"}], variant="instruct")


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_turn_without_tools(variant):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": "\nA greeting.\n"},
    ]
    assert render(messages, variant=variant) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nA greeting.\n</think>\n\nHi!<|im_end|>\n"
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_agentic_episode_with_tools(variant):
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3 and 4*5?"},
        {
            "role": "assistant",
            "content": "<think>\nTwo sums.\n</think>\n\nComputing.",
            "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}},
                {"name": "calc", "arguments": '{"expression": "4*5"}'},
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "20"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": {"expression": "5+20"}}]},
        {"role": "tool", "content": "25"},
    ]
    assert render(messages, [CALC], variant=variant) == (
        f"<|im_start|>system\nUse tools.\n\n{TOOLS_SYSTEM_TEXT}<|im_end|>\n"
        "<|im_start|>user\n2+3 and 4*5?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo sums.\n</think>\n\nComputing.\n"
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "4*5"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n20\n</tool_response><|im_end|>\n"
        # empty reasoning and not the final message: no <think> block
        '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expression": "5+20"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n25\n</tool_response><|im_end|>\n"
    )
    without_system = render(messages[1:2], [CALC], variant=variant)
    assert without_system.startswith(f"<|im_start|>system\n{TOOLS_SYSTEM_TEXT}<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize("variant", VARIANTS)
def test_reasoning_only_after_the_last_real_query(variant):
    first = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>old</think>A1"}]
    late = {"role": "user", "content": "<tool_response>\nlate\n</tool_response>"}  # a tool result, not a query
    final = {"role": "assistant", "content": "A2", "reasoning_content": "new"}
    assert render([*first, {"role": "user", "content": "Q2"}, final], variant=variant) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n"
    )
    assert render([*first, late, final], variant=variant) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nold\n</think>\n\nA1<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n"
    )
    # Without any real query no turn is in the episode, so even the final one drops its reasoning.
    assert render([late, final], variant=variant) == (
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("variant", "enable_thinking", "prompt"),
    [
        ("hybrid", None, "<|im_start|>assistant\n"),
        ("hybrid", True, "<|im_start|>assistant\n"),
        ("hybrid", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("thinking_2507", None, "<|im_start|>assistant\n<think>\n"),
        ("thinking_2507", False, "<|im_start|>assistant\n<think>\n"),
    ],
)
def test_generation_prompt(variant, enable_thinking, prompt):
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages, variant=variant, enable_thinking=enable_thinking) == "<|im_start|>user\nHi<|im_end|>\n"
    rendered = render(messages, variant=variant, add_generation_prompt=True, enable_thinking=enable_thinking)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n" + prompt
