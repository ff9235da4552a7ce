r"""Jinja chat templates of the Qwen3 chat format, written for this repository, and `render` to apply them.

Qwen3 speaks ChatML: every turn is `<|im_start|>{role}\n{text}<|im_end|>\n`. There is no default system prompt.
The format, message by message:

- System: a system message at position 0 opens the chat. With tools, its content, a blank line and a "# Tools"
  section (each tool spec as one line of JSON inside `<tools></tools>`, then the expected call format) make up
  the one system turn. A system message anywhere else is an ordinary turn.
- User: the content as is. A user message whose content starts with `<tool_response>` and ends with
  `</tool_response>` carries a tool result, so it is not a *real query*.
- Tool: a user turn `<tool_response>\n{content}\n</tool_response>`; consecutive tool messages share one user
  turn, their blocks separated by `\n`.
- Assistant: the reasoning is `reasoning_content` when that is a string (the content is then left alone), or
  else, when the content has a `</think>`, the text between the last `<think>` before the first `</think>` and
  that `</think>`, with the answer being what follows the last `</think>`. Only the turns after the last real
  user query (the current agentic episode) show it, as `<think>\n{reasoning}\n</think>\n\n{answer}` with
  newlines trimmed on both sides of the reasoning and before the answer: the final message always (even
  with empty reasoning), earlier ones only when their reasoning is non-empty. Every other turn drops it.
- Tool calls follow the answer, `\n`-separated (and separated by `\n` from a non-empty answer), each one
  `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`: ARGS is a string argument as is, else its
  JSON. A call is `{"type": "function", "function": {"name", "arguments"}}` or just `{"name", "arguments"}`.
- Content that is not a string (None, a list of parts) renders as the empty string.

Two variants differ only in the generation prompt (`add_generation_prompt=True`):

- "hybrid", the original Qwen3 releases (Qwen3-0.6B ... Qwen3-235B-A22B), which think on request:
  `<|im_start|>assistant\n`, followed by an empty `<think>\n\n</think>\n\n` when `enable_thinking=False`.
- "thinking_2507", Qwen3-*-Thinking-2507, which always think: `<|im_start|>assistant\n<think>\n`, so the
  model's output starts inside its reasoning and closes it with `</think>`; `enable_thinking` is ignored.

The rendering is not append-only: a new real user query drops the reasoning of every earlier assistant turn,
and within an episode an earlier turn with empty reasoning loses its empty `<think>` block.
"""

from __future__ import annotations

from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

# Every tag strips the whitespace before it (`{%-`, `{{-`), so the indentation below never reaches the output.
_TOOL_CALL_MACRO = r"""
{%- macro tool_call(call) %}
    {%- set fn = call.function or call %}
    {{- '<tool_call>\n{"name": "' }}{{- fn.name }}{{- '", "arguments": ' }}
    {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
    {{- '}\n</tool_call>' }}
{%- endmacro %}
"""

_ASSISTANT_MACRO = r"""
{%- macro assistant_turn(message, in_episode, is_final) %}
    {%- set answer = message.content if message.content is string else '' %}
    {%- set reasoning = '' %}
    {%- if message.reasoning_content is string %}
        {%- set reasoning = message.reasoning_content %}
    {%- elif '</think>' in answer %}
        {%- set reasoning = answer.partition('</think>')[0].rpartition('<think>')[2].strip('\n') %}
        {%- set answer = answer.rpartition('</think>')[2].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\n' }}
    {%- if in_episode and (is_final or reasoning) %}
        {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + answer.lstrip('\n') }}
    {%- else %}
        {{- answer }}
    {%- endif %}
    {%- for call in message.tool_calls or [] %}
        {#- The separator test reads the answer before its lstrip above, like Qwen's own template. #}
        {{- '\n' if answer or not loop.first else '' }}{{- tool_call(call) }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endmacro %}
"""

_TOOLS_MACRO = r"""
{%- macro tools_section(tools) %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n' }}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
{%- endmacro %}
"""

# `+` (not `~`) on the system content: a first system message without string content is an error, as in Qwen's.
_SYSTEM_TURN = r"""
{%- set opens_with_system = messages[0].role == 'system' %}
{%- if tools or opens_with_system %}
    {{- '<|im_start|>system\n' }}
    {%- if opens_with_system %}
        {{- messages[0].content + ('\n\n' if tools else '') }}
    {%- endif %}
    {%- if tools %}
        {{- tools_section(tools) }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
"""

# Without a real query the index stays at the last message, so no assistant turn shows its reasoning.
_LAST_QUERY = r"""
{%- set episode = namespace(start=messages | length - 1) %}
{%- for message in messages %}
    {%- if message.role == 'user' and message.content is string and not (
            message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set episode.start = loop.index0 %}
    {%- endif %}
{%- endfor %}
"""

_MESSAGES = r"""
{%- for message in messages %}
    {%- set text = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- assistant_turn(message, loop.index0 > episode.start, loop.last) }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"""

_HYBRID_PROMPT = r"""
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

_THINKING_2507_PROMPT = r"""
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %}
"""

_CONVERSATION = _TOOL_CALL_MACRO + _ASSISTANT_MACRO + _TOOLS_MACRO + _SYSTEM_TURN + _LAST_QUERY + _MESSAGES

QWEN3_HYBRID_TEMPLATE = (_CONVERSATION + _HYBRID_PROMPT).strip()
QWEN3_THINKING_2507_TEMPLATE = (_CONVERSATION + _THINKING_2507_PROMPT).strip()
CHAT_TEMPLATES = {"hybrid": QWEN3_HYBRID_TEMPLATE, "thinking_2507": QWEN3_THINKING_2507_TEMPLATE}


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    variant: str = "hybrid",
    add_generation_prompt: bool = False,
    enable_thinking: bool | None = None,
) -> str:
    """One conversation rendered as text with the Qwen3 template `variant` (a key of `CHAT_TEMPLATES`).

    Uses transformers' own Jinja environment, the one `tokenizer.apply_chat_template` uses, so the text is the
    same as from a tokenizer carrying this template. `enable_thinking=None` leaves it undefined in the template.
    """
    if variant not in CHAT_TEMPLATES:
        raise ValueError(f"unknown Qwen3 template variant {variant!r}; expected one of {sorted(CHAT_TEMPLATES)}")
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=CHAT_TEMPLATES[variant],
        add_generation_prompt=add_generation_prompt,
        **extra,
    )
    return rendered[0]
