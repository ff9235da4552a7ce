"""Agent loop token invariants with scripted engines (expert, random, budgets, prefill, concurrency)."""

from __future__ import annotations

import asyncio
import random
import zlib

import numpy as np
import pytest
from rollout_fakes import ScriptedEngine, append_only_chat, check_token_invariants, expert_script, expert_turn_texts

from ipa_jax.envs import StepResult, Task, ToolCall, format_tool_call, make_env
from ipa_jax.envs.lookup import LookupEnv
from ipa_jax.rollout.agent import FINISH_REASONS, AgentConfig, close_event_loop, run_episode, run_episodes


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("name", ["lookup", "calculator", "lookup_hard"])
def test_expert_engine_solves_and_tokens_equal_template(chat, name):
    env = make_env(name)
    tasks = env.tasks("eval", 4, 0)
    engine = ScriptedEngine(chat, expert_script(chat, tasks))
    cfg = AgentConfig(max_context=1024, record_messages=True)
    for task in tasks:
        traj = run(run_episode(engine, chat, task, cfg))
        assert traj.reward == 1.0 and traj.info["finish_reason"] == "answer"
        full = chat.encode(chat.render(env.expert(task), task.tools))
        assert full[-1] == chat.encode("\n")[0]  # the template's newline after the last <|im_end|>
        assert traj.tokens.tolist() == full[:-1]
        check_token_invariants(chat, engine, traj, task)
        # Each chunk ends with <|im_end|>; all but the last end a tool call.
        texts = [chat.decode(traj.tokens[traj.chunk_ids == k].tolist()) for k in range(traj.num_chunks)]
        assert all(t.endswith("</tool_call><|im_end|>") for t in texts[:-1])
        assert texts[-1] == task.answer + "<|im_end|>"
        assert traj.info["num_tool_calls"] == traj.num_chunks - 1 and traj.info["num_tool_errors"] == 0
        assert traj.info["task_id"] == task.task_id and traj.info["env"] == name


def random_script(chat, seed: int):
    """Whatever a random model might say: random ids (special tokens included), near-miss tool calls, answers."""
    vocab = len(chat.tokenizer)
    pieces = [
        '<tool_call>\n{"name": "lookup", "arguments": {"name": "alice"}}\n</tool_call>',
        '<tool_call>\n{"name": "calc", "arguments": {"a": 3, "op": "*", "b": 4}}\n</tool_call>',
        '<tool_call>{"name": "lookup"',
        "</tool_call>",
        '{"a": 1}',
        "paris",
        "12",
        "<tool_call>",
    ]

    def script(prompt, call_index):
        rng = random.Random(zlib.crc32(bytes(str((seed, prompt)), "utf8")))
        r = rng.random()
        if r < 0.4:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            return ids + ([chat.im_end_id] if rng.random() < 0.5 else [])
        return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))

    return script


@pytest.mark.parametrize("name", ["lookup", "calculator"])
def test_random_engine_never_crashes_and_keeps_invariants(chat, name):
    env = make_env(name)
    tasks = env.tasks("train", 25, 1)
    engine = ScriptedEngine(chat, random_script(chat, 0))
    cfg = AgentConfig(max_new_tokens=24, max_context=400, record_messages=True)
    trajs = run(run_episodes(engine, chat, tasks, cfg, concurrency=5))
    finishes = set()
    for task, traj in zip(tasks, trajs):
        assert traj.reward in (0.0, 1.0)
        assert traj.info["finish_reason"] in FINISH_REASONS
        finishes.add(traj.info["finish_reason"])
        check_token_invariants(chat, engine, traj, task)
    assert {"length", "answer"} <= finishes
    assert sum(t.info["num_tool_errors"] for t in trajs) > 0


def test_turn_budget_ends_without_a_dangling_observation(chat):
    env = make_env("lookup")
    task = env.tasks("eval", 1, 0)[0]
    engine = ScriptedEngine(chat, expert_script(chat, [task]))
    traj = run(run_episode(engine, chat, task, AgentConfig(max_turns=2, record_messages=True)))
    assert traj.info["finish_reason"] == "max_turns" and traj.reward == 0.0 and traj.num_chunks == 2
    assert traj.tokens[-1] == chat.im_end_id and traj.action_mask[-1]
    assert traj.info["num_tool_calls"] == 1  # the second call was never executed
    check_token_invariants(chat, engine, traj, task)


def test_token_budgets(chat):
    env = make_env("lookup")
    task = env.tasks("eval", 1, 0)[0]
    script = expert_script(chat, [task])
    engine = ScriptedEngine(chat, script)
    traj = run(run_episode(engine, chat, task, AgentConfig(max_new_tokens=5, record_messages=True)))
    assert traj.info["finish_reason"] == "length" and traj.action_mask.sum() == 5 and traj.reward == 0.0
    prompt_len = len(chat.encode(chat.render(task.initial_messages(), task.tools, add_generation_prompt=True)))
    first_turn = len(chat.encode(expert_turn_texts(env, task)[0])) + 1
    # Room for the first turn but not for its observation plus one more token.
    traj = run(run_episode(engine, chat, task, AgentConfig(max_context=prompt_len + first_turn + 10)))
    assert traj.info["finish_reason"] == "context" and len(traj.tokens) == prompt_len + first_turn
    # The context also caps the turn's generation budget.
    traj = run(run_episode(engine, chat, task, AgentConfig(max_context=prompt_len + 3)))
    assert traj.info["finish_reason"] == "length" and len(traj.tokens) == prompt_len + 3
    with pytest.raises(ValueError, match="max_context"):
        run(run_episode(engine, chat, task, AgentConfig(max_context=prompt_len)))


def test_tool_errors_are_seen_and_counted(chat):
    env = make_env("lookup", extra_turns=3)
    task = env.tasks("train", 1, 0)[0]
    good = expert_turn_texts(env, task)
    turns = [
        '<tool_call>\n{"name": "lookup", "arguments": {"name": \n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
    ] + good
    engine = ScriptedEngine(chat, lambda prompt, i: turns[i])
    traj = run(run_episode(engine, chat, task, AgentConfig(record_messages=True)))
    assert traj.reward == 1.0 and traj.num_chunks == 5
    assert traj.info["num_tool_calls"] == 4 and traj.info["num_tool_errors"] == 2
    tool_msgs = [m["content"] for m in traj.info["messages"] if m["role"] == "tool"]
    assert tool_msgs[0].startswith("Error: invalid JSON") and "unknown tool 'search'" in tool_msgs[1]
    check_token_invariants(chat, engine, traj, task)


def test_endoftext_stop(chat):
    env = make_env("calculator")
    task = env.tasks("train", 1, 0)[0]
    texts = expert_turn_texts(env, task)
    eot = chat.endoftext_id
    engine = ScriptedEngine(chat, lambda prompt, i: chat.encode(texts[i]) + [eot] if i == 0 else texts[i])
    traj = run(run_episode(engine, chat, task, AgentConfig(record_messages=True)))
    assert traj.info["finish_reason"] == "endoftext" and traj.num_chunks == 1 and traj.tokens[-1] == eot
    engine = ScriptedEngine(chat, lambda prompt, i: chat.encode(texts[i]) + ([eot] if i == 2 else [chat.im_end_id]))
    traj = run(run_episode(engine, chat, task, AgentConfig(record_messages=True)))
    assert traj.info["finish_reason"] == "answer" and traj.reward == 1.0 and traj.tokens[-1] == eot


def test_abort_returns_none(chat):
    task = make_env("lookup").tasks("train", 1, 0)[0]
    engine = ScriptedEngine(chat, lambda p, i: "x")
    engine.abort_sessions.add("u1")
    assert run(run_episode(engine, chat, task, uid="u1")) is None


def test_versions_and_routed_experts(chat):
    env = make_env("lookup")
    task = env.tasks("train", 1, 3)[0]
    engine = ScriptedEngine(chat, expert_script(chat, [task]), routed_layout=(2, 3))
    engine.version = 4
    engine.bump_version_each_call = True
    traj = run(run_episode(engine, chat, task, AgentConfig(return_routed_experts=True)))
    assert traj.chunk_versions.tolist() == [4, 5, 6] and traj.policy_version == 4
    T = len(traj.tokens)
    last_prompt, last_ids, _ = engine.calls[traj.uid][-1]
    assert len(last_prompt) + len(last_ids) == T
    assert traj.routed_experts.shape == (T, 2, 3)
    expected = (np.arange((T - 1) * 6) % 7).reshape(T - 1, 2, 3)
    np.testing.assert_array_equal(traj.routed_experts[:-1], expected)
    traj.validate()


def test_prefill_reproduces_the_expert_prefix(chat):
    env = make_env("lookup_hard")
    task = env.tasks("eval", 1, 2)[0]
    messages = env.expert(task)
    engine = ScriptedEngine(chat, expert_script(chat, [task]))
    full = run(run_episode(engine, chat, task, uid="full"))
    # Anchor after expert chunk j (2 tool calls + responses prefilled).
    j = 2
    prefill = messages[1 : 1 + 2 * j]
    traj = run(run_episode(engine, chat, task, AgentConfig(record_messages=True), uid="anchored", prefill=prefill))
    assert traj.reward == 1.0 and traj.tokens.tolist() == full.tokens.tolist()
    # Expert-masked = the first j chunks of the full episode; actions = the rest, renumbered from 0.
    np.testing.assert_array_equal(traj.expert_mask, (full.chunk_ids >= 0) & (full.chunk_ids < j))
    np.testing.assert_array_equal(traj.action_mask, full.chunk_ids >= j)
    np.testing.assert_array_equal(traj.chunk_ids[traj.action_mask], full.chunk_ids[full.chunk_ids >= j] - j)
    assert traj.info["num_prefill_turns"] == j and traj.num_chunks == full.num_chunks - j
    assert traj.info["num_tool_calls"] == 5 - j
    # The engine saw the prefilled history as its first prompt.
    assert engine.calls["anchored"][0][0] == full.tokens[: len(engine.calls["anchored"][0][0])].tolist()
    traj.validate()
    bad = [dict(m) for m in prefill]
    bad[1] = {**bad[1], "content": "tampered"}
    with pytest.raises(ValueError, match="replaying lookup"):
        run(run_episode(engine, chat, task, prefill=bad))


def test_run_episodes_concurrency_and_order(chat):
    env = make_env("calculator")
    tasks = env.tasks("eval", 12, 0)
    engine = ScriptedEngine(chat, expert_script(chat, tasks), delay=0.01)
    trajs = run(run_episodes(engine, chat, tasks, concurrency=4))
    assert engine.max_in_flight == 4
    assert [t.info["task_id"] for t in trajs] == [t.task_id for t in tasks]
    assert all(t.reward == 1.0 for t in trajs) and len({t.uid for t in trajs}) == 12
    with pytest.raises(ValueError, match="concurrency"):
        run(run_episodes(engine, chat, tasks, concurrency=0))


class SubmitEnv(LookupEnv):
    """A lookup env whose extra `submit` tool ends the episode from a tool step (StepResult.done)."""

    name = "submit_test"

    @property
    def tools(self):
        return super().tools + [
            {
                "type": "function",
                "function": {
                    "name": "submit",
                    "parameters": {
                        "type": "object",
                        "properties": {"answer": {"type": "string"}},
                        "required": ["answer"],
                    },
                },
            }
        ]

    def step(self, tool_call):
        if isinstance(tool_call, ToolCall) and tool_call.name == "submit":
            self.num_tool_calls += 1
            return StepResult("submitted", done=True, reward=self.final_answer(tool_call.arguments["answer"]))
        return super().step(tool_call)


def test_environment_can_end_the_episode_from_a_tool_step(chat):
    env = SubmitEnv()
    task = env.tasks("train", 1, 0)[0]
    texts = expert_turn_texts(make_env("lookup"), Task.from_dict({**task.to_dict(), "env": "lookup"}))
    submit = format_tool_call(ToolCall("submit", {"answer": task.answer}))
    engine = ScriptedEngine(chat, lambda prompt, i: (texts[:-1] + [submit])[i])
    traj = run(run_episode(engine, chat, task, AgentConfig(record_messages=True), env=SubmitEnv()))
    assert traj.info["finish_reason"] == "env_done" and traj.reward == 1.0 and traj.num_chunks == 3
    assert traj.tokens[-1] == chat.im_end_id  # the final observation is not appended


def test_no_generated_token_returns_none(chat):
    task = make_env("lookup").tasks("train", 1, 0)[0]
    assert run(run_episode(ScriptedEngine(chat, lambda p, i: []), chat, task)) is None


def test_close_event_loop_cancels_what_is_left_on_it():
    """An engine's background task on a private loop is cancelled (not 'destroyed but pending'); a loop with no
    tasks closes too, while another loop is the thread's current one."""
    loop = asyncio.new_event_loop()
    background = loop.create_task(asyncio.sleep(3600))
    loop.run_until_complete(asyncio.sleep(0))  # the task starts
    close_event_loop(loop)
    assert background.cancelled() and loop.is_closed()
    current = asyncio.new_event_loop()
    asyncio.set_event_loop(current)
    try:
        empty = asyncio.new_event_loop()
        close_event_loop(empty)
        assert empty.is_closed()
    finally:
        asyncio.set_event_loop(None)
        current.close()
