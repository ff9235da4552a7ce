"""The tiny Qwen-style tokenizer: special tokens, round trips, determinism, save/load, the chat template."""

import hashlib
import json
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from ipa_jax.chat import QWEN3_HYBRID_TEMPLATE, QWEN_TOKENS, build_tokenizer, template
from ipa_jax.envs import BUILTIN_ENVS, ToolCall, format_tool_call, make_env
from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer, expert_corpus


@pytest.fixture(scope="module")
def tok():
    return build_corpus_tokenizer()


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_build_is_fast_and_small():
    corpus = expert_corpus()
    t0 = time.perf_counter()
    tok = build_tokenizer(corpus)
    assert time.perf_counter() - t0 < 2.0
    assert 265 < len(tok) <= 1024
    small = build_tokenizer(corpus, vocab_size=300)
    assert len(small) == 300
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(corpus, vocab_size=100)
    with pytest.raises(ValueError, match="corpus"):
        build_tokenizer(["ok", 3])


def test_special_tokens_are_single_ids(tok):
    for i, (t, _) in enumerate(QWEN_TOKENS):
        assert _encode(tok, t) == [i]
        assert tok.convert_ids_to_tokens(i) == t
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    ids = _encode(tok, "<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>")
    # Like Qwen: the tool tags survive skip_special_tokens, the chat markers do not.
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"


def test_round_trip_on_task_text_and_arbitrary_text(tok):
    texts = ["", " ", "12345 -678 3.25e-3", '{"name": "lookup", "arguments": {"name": "bob"}}', "naïve 東京 🙂 \t\r\n"]
    for name in BUILTIN_ENVS:  # the procedural pure-Python ones (others need files or extras)
        env = make_env(name)
        for task in env.tasks("eval", 20, 5):
            messages = env.expert(task)
            texts.append(template.render(messages, tools=task.tools))
            texts += [m["content"] for m in messages]
    for text in texts:
        assert tok.decode(_encode(tok, text)) == text


def test_digits_are_split_and_names_are_whole_tokens(tok):
    assert tok.convert_ids_to_tokens(_encode(tok, "1234")) == ["1", "2", "3", "4"]
    # A name in a call's arguments and in a JSON observation is the same single token.
    call = _encode(tok, format_tool_call(ToolCall("lookup", {"name": "quinn"})))
    obs = _encode(tok, '{"friend": "quinn", "city": "oslo"}')
    (quinn,) = _encode(tok, "quinn")
    assert quinn in call and quinn in obs


def test_deterministic_across_processes(tok):
    code = (
        "from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer; "
        "print(build_corpus_tokenizer().backend_tokenizer.to_str())"
    )
    digests = set()
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        digests.add(hashlib.sha256(out.stdout.strip().encode()).hexdigest())
    digests.add(hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest())
    assert len(digests) == 1


def test_save_and_load_with_auto_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    env = make_env("lookup")
    task = env.tasks("train", 1, 0)[0]
    messages = env.expert(task)
    for t in (tok, loaded):
        rendered = t.apply_chat_template(messages, tools=task.tools, tokenize=False)
        assert rendered == template.render(messages, task.tools)
    text = template.render(messages, task.tools)
    assert _encode(loaded, text) == _encode(tok, text)
    assert len(loaded) == len(tok)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert loaded.decode(_encode(loaded, text)) == text


TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
    }
]


def test_chat_template_is_qwen3s(tok):
    """Expected text written out by hand from Qwen3's format: no default system prompt, the tools block as the
    system turn, the final assistant turn (after the last user query) with its think block, empty here."""
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"type": "function", "function": {"name": "g", "arguments": '{"y": 2}'}},
            ],
        },
        {"role": "tool", "name": "f", "content": "r1"},
        {"role": "tool", "name": "g", "content": "r2"},
        {"role": "assistant", "content": "done"},
    ]
    expected = (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0])
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nq<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"y": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\ndone<|im_end|>\n"
    )
    assert tok.chat_template == QWEN3_HYBRID_TEMPLATE
    assert tok.apply_chat_template(messages, tools=TOOLS, tokenize=False) == expected
    assert tok.apply_chat_template(messages[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_without_tools_and_custom_system(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == expected
    assert tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False).startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert tok.apply_chat_template(msgs[1:], tokenize=False) == "<|im_start|>user\nq<|im_end|>\n"  # no default


def test_rendered_tool_call_equals_parser_format(tok):
    call = ToolCall("calc", {"a": 3, "op": "+", "b": 4})
    text = template.render(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call.to_message_dict()]}]
    )
    assert f"<|im_start|>assistant\n<think>\n\n</think>\n\n{format_tool_call(call)}<|im_end|>\n" in text


@pytest.mark.parametrize("name", ["lookup", "calculator", "lookup_hard"])
def test_template_is_append_only_at_assistant_turns(tok, name):
    """Rendering the history before each assistant turn (with the generation prompt) is a prefix of the
    full rendering: the property that lets the agent loop append tokens instead of re-rendering."""
    env = make_env(name)
    task = env.tasks("train", 1, 1)[0]
    messages = env.expert(task)
    full = template.render(messages, task.tools)
    full_ids = _encode(tok, full)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            prefix = template.render(messages[:k], task.tools, add_generation_prompt=True)
            assert full.startswith(prefix)
            assert full_ids[: len(_encode(tok, prefix))] == _encode(tok, prefix)


def test_easy_episodes_are_short(tok):
    for name in ("lookup", "calculator"):
        env = make_env(name)
        lengths = [len(_encode(tok, template.render(env.expert(t), t.tools))) for t in env.tasks("eval", 50, 0)]
        assert max(lengths) <= 300, (name, max(lengths))
