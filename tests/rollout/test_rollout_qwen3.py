"""Episodes in Qwen3's chat format: the tokenizer's own template drives the agent loop (hybrid and thinking-2507
variants), thinking on and off, reasoning split off before tool calls and the answer are parsed, expert rows in
the same format, and model text that cannot become a valid call."""

from __future__ import annotations

import asyncio
import copy

import pytest
from rollout_fakes import ScriptedEngine, expert_turn_texts

from ipa_jax.chat import CHAT_TEMPLATES, ChatFormat
from ipa_jax.envs import make_env
from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer
from ipa_jax.rollout.agent import AgentConfig, expert_episode, run_episode
from ipa_jax.rollout.resample import expert_from_trajectory, replay_expert

THINK_PROMPT_TAIL = {"hybrid": "<|im_start|>assistant\n", "thinking_2507": "<|im_start|>assistant\n<think>\n"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_corpus_tokenizer()


def chat_for(tokenizer, variant: str, enable_thinking: bool | None = None) -> ChatFormat:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATES[variant]  # a checkpoint's own template: the agent loop renders with it
    return ChatFormat(tokenizer, enable_thinking=enable_thinking)


def thinking_script(chat: ChatFormat, env, task, variant: str):
    """A model that reasons before every turn, in the variant's shape (the 2507 prompt already opened <think>)."""
    turns = expert_turn_texts(env, task)

    def script(prompt, call_index):
        reasoning = f"Step {call_index}: what does the task need next?"
        opened = "" if variant == "thinking_2507" else "<think>\n"
        return f"{opened}{reasoning}\n</think>\n\n{turns[call_index]}"

    return script


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("variant", ["hybrid", "thinking_2507"])
def test_thinking_episode_scores_and_equals_the_templates_rendering(tokenizer, variant):
    chat = chat_for(tokenizer, variant)
    assert chat.reasoning_forced == (variant == "thinking_2507")
    env = make_env("calculator")
    for task in env.tasks("eval", 3, 0):
        engine = ScriptedEngine(chat, thinking_script(chat, make_env("calculator"), task, variant))
        traj = run(run_episode(engine, chat, task, AgentConfig(record_messages=True), uid="e"))
        assert traj.reward == 1.0 and traj.info["finish_reason"] == "answer" and traj.info["num_tool_errors"] == 0
        assert chat.decode(engine.calls["e"][0][0]).endswith(THINK_PROMPT_TAIL[variant])
        # The token row is the template's rendering of the finished conversation (reasoning and all).
        rendered = chat.encode(chat.render(traj.info["messages"], task.tools))
        assert traj.tokens.tolist() == rendered[:-1]  # the template's newline after the last <|im_end|>
        # Reasoning tokens are action tokens of their turn's chunk.
        first = chat.decode(traj.tokens[traj.chunk_ids == 0].tolist())
        assert "Step 0: what does the task need next?\n</think>\n\n<tool_call>" in first


def test_non_thinking_prompt_closes_an_empty_think_block_and_answers_parse_the_same(tokenizer):
    chat = chat_for(tokenizer, "hybrid", enable_thinking=False)
    env = make_env("calculator")
    task = env.tasks("eval", 1, 0)[0]
    turns = expert_turn_texts(make_env("calculator"), task)
    engine = ScriptedEngine(chat, lambda prompt, k: turns[k])
    traj = run(run_episode(engine, chat, task, AgentConfig(), uid="n"))
    assert traj.reward == 1.0 and traj.info["num_tool_calls"] == 2
    for prompt, _, _ in engine.calls["n"]:
        assert chat.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_that_mentions_tags_is_not_parsed_as_calls(tokenizer):
    chat = chat_for(tokenizer, "hybrid")
    env = make_env("calculator")
    task = env.tasks("eval", 1, 0)[0]
    turns = expert_turn_texts(make_env("calculator"), task)
    musing = 'Should I write <tool_call> {"name": or </tool_call> first? The answer is not 0.'

    def script(prompt, k):
        return f"<think>\n{musing}\n</think>\n\n{turns[k]}"

    engine = ScriptedEngine(chat, script)
    traj = run(run_episode(engine, chat, task, AgentConfig(), uid="m"))
    assert traj.reward == 1.0 and traj.info["num_tool_calls"] == 2 and traj.info["num_tool_errors"] == 0


@pytest.mark.parametrize(
    "variant, enable_thinking, target_head",
    [
        ("hybrid", None, "<think>\n\n</think>\n\n<tool_call>"),
        ("hybrid", False, "<tool_call>"),
        ("thinking_2507", None, "\n</think>\n\n<tool_call>"),
    ],
)
def test_expert_rows_are_what_the_policy_would_emit_in_its_mode(tokenizer, variant, enable_thinking, target_head):
    """Imitation targets: each expert turn as the template renders it after its generation prompt, so the
    policy imitates exactly the text it would have to generate in this template and mode."""
    chat = chat_for(tokenizer, variant, enable_thinking)
    env = make_env("calculator")
    task = env.tasks("train", 1, 0)[0]
    traj = expert_episode(task, env.expert(task), make_env("calculator"), chat, uid="x")
    targets = []
    start = None
    for t, flag in enumerate(list(traj.expert_mask) + [False]):
        if flag and start is None:
            start = t
        elif not flag and start is not None:
            targets.append(chat.decode(traj.tokens[start:t].tolist()))
            start = None
    assert len(targets) == 3 and all(t.endswith("<|im_end|>") for t in targets)
    assert targets[0].startswith(target_head) and targets[1].startswith(target_head)
    assert targets[2].endswith(task.answer + "<|im_end|>")
    # Each target follows its generation prompt exactly as a sampled turn would.
    first = int(traj.expert_mask.argmax())
    prompt = chat.render(task.initial_messages(), task.tools, add_generation_prompt=True)
    assert traj.tokens[:first].tolist() == chat.encode(prompt)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "calc\\ud800", "arguments": {"a": 1, "op": "+", "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "calc", "arguments": {"a": "\\udfff", "op": "+", "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "calc", "arguments": {"a": 1e999, "op": "+", "b": 2}}\n</tool_call>',
        "<tool_call>\n" + "[" * 50_000 + "]" * 50_000 + "\n</tool_call>",
    ],
)
def test_hostile_calls_become_counted_errors_not_exceptions(tokenizer, text):
    chat = chat_for(tokenizer, "hybrid", enable_thinking=False)
    task = make_env("calculator").tasks("eval", 1, 0)[0]
    engine = ScriptedEngine(chat, lambda prompt, k: text if k == 0 else task.answer)
    traj = run(run_episode(engine, chat, task, AgentConfig(max_new_tokens=150_000, max_context=200_000), uid="h"))
    assert traj.info["num_tool_errors"] == 1 and traj.reward == 1.0  # the error was an observation; then answered


@pytest.mark.parametrize("variant", ["hybrid", "thinking_2507"])
def test_a_thinking_trajectory_loads_as_an_expert_that_replays_its_tokens(tokenizer, variant):
    """Resampling from a sampled Qwen3 trajectory: its reasoning is kept (reasoning_content), so anchored rollouts
    reproduce the expert's own tokens."""
    chat = chat_for(tokenizer, variant)
    task = make_env("calculator").tasks("train", 1, 0)[0]
    engine = ScriptedEngine(chat, thinking_script(chat, make_env("calculator"), task, variant))
    traj = run(run_episode(engine, chat, task, AgentConfig(), uid="t"))
    expert = expert_from_trajectory(traj, task, chat)
    assert expert.num_chunks == 2
    assert expert.messages[0]["reasoning_content"].strip() == "Step 0: what does the task need next?"
    replay = replay_expert(expert, chat)
    assert replay.tokens == traj.tokens[: replay.prefix_lengths[-1]].tolist()
