"""Built-in environments: experts solve everything, splits are disjoint and seeded, errors are observations."""

import itertools
import json

import pytest

from ipa_jax.envs import StepResult, Task, ToolCall, ToolCallError, list_envs, make_env, register_env
from ipa_jax.envs.lookup import LookupEnv

EASY = ("lookup", "calculator")
# Tool calls the expert needs per env (== lookups / operators).
EXPECTED_CALLS = {"lookup": 2, "calculator": 2, "lookup_hard": 5}


def test_registry():
    assert set(EXPECTED_CALLS) <= set(list_envs())
    env = make_env("lookup", hops=3)
    assert isinstance(env, LookupEnv) and env.hops == 3 and env.name == "lookup"
    assert make_env("lookup_hard").name == "lookup_hard"
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_env("lookup", LookupEnv)


@pytest.mark.parametrize("name", sorted(EXPECTED_CALLS))
@pytest.mark.parametrize("split", ["train", "eval"])
def test_expert_solves_every_task(name, split):
    env = make_env(name)
    for seed in range(3):
        for task in env.tasks(split, 100, seed):
            messages = env.expert(task)  # raises if the expert's answer is wrong
            calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
            tools = [m for m in messages if m["role"] == "tool"]
            assert len(calls) == len(tools) == EXPECTED_CALLS[name]
            assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == task.answer
            assert len(calls) + 1 <= task.max_turns
            # Independently replay the conversation: every call succeeds and the answer scores 1.
            replay = make_env(task.env)
            assert replay.reset(task) == task.prompt
            for call_msg, tool_msg in zip(calls, tools):
                fn = call_msg["tool_calls"][0]["function"]
                result = replay.step(ToolCall(fn["name"], fn["arguments"]))
                assert result == StepResult(tool_msg["content"])
            assert replay.final_answer(messages[-1]["content"]) == 1.0
            assert replay.num_tool_errors == 0


@pytest.mark.parametrize("name", sorted(EXPECTED_CALLS))
def test_splits_are_disjoint_deterministic_and_seeded(name):
    env = make_env(name)
    key = lambda t: json.dumps([t.prompt, t.data], sort_keys=True)  # noqa: E731
    train = {key(t) for s in range(3) for t in env.tasks("train", 200, s)}
    evals = {key(t) for s in range(3) for t in env.tasks("eval", 200, s)}
    assert not train & evals
    a, b = env.tasks("train", 50, 7), make_env(name).tasks("train", 50, 7)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert [key(t) for t in a] != [key(t) for t in env.tasks("train", 50, 8)]
    assert len({key(t) for t in a}) == 50  # distinct within a call
    assert len({t.task_id for t in a}) == 50
    with pytest.raises(ValueError, match="split"):
        env.tasks("test", 1)


def test_task_stream_is_endless_and_deterministic():
    env = make_env("calculator")
    stream = list(itertools.islice(env.task_stream("eval", seed=3, block=10), 25))
    assert [t.to_dict() for t in stream[:10]] == [t.to_dict() for t in env.tasks("eval", 10, 3)]
    assert [t.to_dict() for t in stream[10:20]] == [t.to_dict() for t in env.tasks("eval", 10, 4)]
    assert len({t.task_id for t in stream}) == 25


def test_task_json_round_trip():
    task = make_env("lookup").tasks("eval", 1, 0)[0]
    again = Task.from_dict(json.loads(json.dumps(task.to_dict())))
    assert again == task
    assert again.initial_messages() == [{"role": "user", "content": task.prompt}]


def test_wrong_and_normalised_answers():
    env = make_env("calculator")
    task = env.tasks("train", 1, 0)[0]
    env.reset(task)
    assert env.final_answer(f"  {task.answer}. ") == 1.0
    env.reset(task)
    assert env.final_answer(task.answer + "0") == 0.0
    assert env.done
    with pytest.raises(ValueError, match="episode is over"):
        env.step(ToolCall("calc", {"a": 1, "op": "+", "b": 1}))


def test_errors_are_observations_and_counted():
    env = make_env("lookup")
    task = env.tasks("train", 1, 0)[0]
    env.reset(task)
    results = [
        env.step(ToolCallError("invalid JSON in tool call: {")),
        env.step(ToolCall("search", {"q": "x"})),
        env.step(ToolCall("lookup", {"who": "x"})),
        env.step(ToolCall("lookup", {"name": "nobody"})),
        env.step(ToolCall("lookup", {"name": task.data["path"][0]})),
    ]
    assert [r.error for r in results] == [True, True, True, True, False]
    assert all(r.observation.startswith("Error: ") for r in results[:4])
    assert "no person named 'nobody'" in results[3].observation
    assert env.num_tool_calls == 5 and env.num_tool_errors == 4
    env.reset(task)  # counters restart per episode
    assert env.num_tool_calls == env.num_tool_errors == 0


def test_calculator_tool_errors():
    env = make_env("calculator")
    env.reset(env.tasks("train", 1, 0)[0])
    assert env.step(ToolCall("calc", {"a": 2, "op": "/", "b": 1})).observation == "Error: op must be one of + - *"
    assert env.step(ToolCall("calc", {"a": 10**6, "op": "*", "b": 10**6})).observation == "Error: result too large"
    assert env.step(ToolCall("calc", {"a": 6, "op": "*", "b": 7})) == StepResult("42")


@pytest.mark.parametrize("ops", [1, 2, 3, 4])
def test_calculator_prompt_evaluates_to_the_answer(ops):
    env = make_env("calculator", ops=ops)
    for task in env.tasks("train", 20, 0):
        expr = task.prompt.removeprefix("Compute ").removesuffix(".")
        assert str(eval(expr)) == task.answer, task.prompt  # Python's arithmetic, independent of the env
        assert expr.count("(") == ops - 1 and len(task.data["ops"]) == ops


def test_reset_rejects_a_task_of_another_env():
    with pytest.raises(ValueError, match="task.env"):
        make_env("lookup").reset(make_env("calculator").tasks("train", 1, 0)[0])


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="hops"):
        make_env("lookup", hops=0)
    with pytest.raises(ValueError, match="num_people"):
        make_env("lookup", num_people=1)
    with pytest.raises(ValueError, match="ops"):
        make_env("calculator", ops=0)
