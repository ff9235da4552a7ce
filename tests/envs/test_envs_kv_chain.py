"""kv_chain, the long-horizon task: generated stores are what the prompt promises, the expert solves every task, tool
errors are observations, the reward is 0/1 on the final answer, and failures differ in length from successes."""

import json

import pytest

from ipa_jax.envs import KVChainEnv, StepResult, ToolCall, ToolCallError, list_envs, make_env, parse_tool_calls
from ipa_jax.envs.kv_chain import DISTRACTOR_FIELDS

SETTINGS = [
    dict(),
    dict(hops=12, distractors=3, decoys=10),
    dict(hops=9, min_hops=6, distractors=0, decoys=0),
    dict(hops=1, decoys=2, shuffle_fields=False),
    dict(hops=3, distractors=2, decoys=2),
]


def _walk(store: dict, start: str) -> list[str]:
    """The keys visited by following "next" from `start` until a record without it (independent of the expert)."""
    keys = [start]
    while "next" in store[keys[-1]]:
        keys.append(store[keys[-1]]["next"])
        assert len(keys) <= len(store), "the chain loops"
    return keys


def test_registered_with_its_settings():
    assert "kv_chain" in list_envs()
    env = make_env("kv_chain", hops=8, distractors=2)
    assert isinstance(env, KVChainEnv) and env.name == "kv_chain" and (env.hops, env.min_hops) == (8, 8)
    for bad in (
        dict(hops=0),
        dict(min_hops=7),
        dict(distractors=4),
        dict(decoys=-1),
        dict(hops=20, decoys=7),
        dict(decoys=1),
        dict(decoys=22),
        dict(extra_turns=-1),
    ):
        with pytest.raises(ValueError):
            KVChainEnv(**bad)


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_task_generation(kwargs):
    env = make_env("kv_chain", **kwargs)
    hops, min_hops = env.hops, env.min_hops
    tasks = env.tasks("train", 200, seed=0)
    assert [t.to_dict() for t in tasks] == [t.to_dict() for t in make_env("kv_chain", **kwargs).tasks("train", 200)]
    assert {json.dumps(t.data) for t in tasks}.isdisjoint(json.dumps(t.data) for t in env.tasks("eval", 200))
    lengths = set()
    for task in tasks:
        store, path = task.data["store"], task.data["path"]
        lengths.add(len(path))
        assert min_hops <= len(path) <= hops and len(store) == len(path) + env.decoys
        assert f'"{path[0]}"' in task.prompt and task.answer not in task.prompt
        assert _walk(store, path[0]) == path  # "next" from the prompt's key is the chain, ending on the answer
        assert store[path[-1]]["value"] == task.answer
        assert [k for k, r in store.items() if r.get("value") == task.answer] == [path[-1]]  # decoys never pay
        assert task.max_turns == len(path) + 1 + env.extra_turns
        for key, record in store.items():
            links = {f: record[f] for f in DISTRACTOR_FIELDS[: env.distractors]}
            assert set(record) == set(links) | ({"value"} if "value" in record else {"next"})
            assert all(k in store and k not in (key, record.get("next")) for k in links.values())
            if key in path[1:] and links:
                assert record["prev"] == path[path.index(key) - 1]
        # No shortcut: chain key i > 0 is linked to only by key i - 1 ("next") and key i + 1 ("prev").
        for i, key in enumerate(path[1:], start=1):
            pointing = {(k, f) for k, r in store.items() for f, v in r.items() if v == key and f != "value"}
            assert pointing == {(path[i - 1], "next")} | (
                {(path[i + 1], "prev")} if i + 1 < len(path) and env.distractors else set()
            )
    assert lengths == set(range(min_hops, hops + 1))
    assert len(env.tasks("train", 256, seed=1)) == 256  # the task stream's block fits in the task space


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_expert_solves_every_task(kwargs):
    env = make_env("kv_chain", **kwargs)
    for split in ("train", "eval"):
        for task in env.tasks(split, 100, seed=3):
            messages = env.expert(task)  # raises if a call fails or the answer is wrong
            calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
            assert [c["arguments"]["key"] for c in calls] == task.data["path"]
            assert messages[-1] == {"role": "assistant", "content": task.answer}
            replay = make_env("kv_chain", **kwargs)
            replay.reset(task)
            observations = [replay.step(ToolCall(c["name"], c["arguments"])) for c in calls]
            assert observations == [StepResult(json.dumps(task.data["store"][k])) for k in task.data["path"]]
            assert replay.final_answer(task.answer) == 1.0 and replay.num_tool_errors == 0


def _fetch(env, key: str) -> dict:
    result = env.step(ToolCall("get", {"key": key}))
    assert not result.error, result.observation
    return json.loads(result.observation)


def test_tool_errors_are_observations():
    env = make_env("kv_chain")
    task = env.tasks("eval", 1)[0]
    store, path = task.data["store"], task.data["path"]
    env.reset(task)
    absent = next(k for k in ("zzz", "nobody") if k not in store)
    bad = [
        ToolCall("get", {"key": absent}),
        ToolCall("get", {"key": path[-1]}),
        ToolCall("get", {}),
        ToolCall("get", {"key": 3}),
        ToolCall("lookup", {"key": path[0]}),
        ToolCall("get", {"key": "x", "other": 1}),
        parse_tool_calls('<tool_call>\n{"name": "get", "arguments": {"key": \n</tool_call>').calls[0],
    ]
    assert isinstance(bad[-1], ToolCallError)
    results = [env.step(call) for call in bad]
    assert all(r.error and not r.done and r.observation.startswith("Error: ") for r in results)
    # A key in the store but not given yet (the chain's end) gets the error of an absent key: no guessing, no leak.
    assert [r.observation for r in results[:2]] == [f"Error: unknown key '{k}'" for k in (absent, path[-1])]
    assert env.num_tool_errors == env.num_tool_calls == len(bad)
    # The episode goes on: the right call still works, keys are matched case- and space-insensitively, and the keys a
    # fetched record names become fetchable.
    assert env.step(ToolCall("get", {"key": f" {path[0].upper()} "})) == StepResult(json.dumps(store[path[0]]))
    for key in store[path[0]].values():  # "next" and a distractor
        _fetch(env, key)
    assert env.step(ToolCall("get", {"key": path[-1]})).error  # still not named (6 hops)


def test_reward_is_on_the_final_answer_read_in_the_episode():
    env = make_env("kv_chain", decoys=6)
    task = next(
        t
        for t in env.tasks("train", 50)
        if any("value" in r for k, r in t.data["store"].items() if k not in t.data["path"])
    )
    path = task.data["path"]
    decoy_value = next(r["value"] for k, r in task.data["store"].items() if k not in path and "value" in r)
    for answer, reward in (
        (task.answer, 1.0),
        (f"  {task.answer}. ", 1.0),
        (decoy_value, 0.0),
        (path[-1], 0.0),
        ("", 0.0),
        (f"{task.answer}0", 0.0),
    ):
        env.reset(task)
        for key in path:
            _fetch(env, key)
        assert env.final_answer(answer) == reward, answer
        assert env.done
    # The right value without having read its record is a guess: 0, also after every hop but the last.
    for hops_done in (0, len(path) - 1):
        env.reset(task)
        for key in path[:hops_done]:
            _fetch(env, key)
        assert env.final_answer(task.answer) == 0.0


def test_failures_range_from_short_to_the_whole_budget():
    """What makes the task long-horizon: a policy that answers early fails in one turn, one that confuses "prev" with
    "next" walks back and forth until the turn budget; a success takes every hop."""
    env = make_env("kv_chain", hops=6, distractors=1, decoys=4, extra_turns=2)
    task = env.tasks("eval", 1)[0]
    path, store = task.data["path"], task.data["store"]
    assert len(env.expert(task)) == 2 + 2 * len(path)  # user, hops x (call, response), answer: 7 assistant turns
    env.reset(task)
    key, turns = path[0], 0
    while turns < task.max_turns - 1:  # the last turn must answer
        record = _fetch(env, key)
        turns += 1
        key = record["next"] if turns % 2 else record["prev"]  # one step forward, one back
    assert env.num_tool_calls == task.max_turns - 1 == len(path) + env.extra_turns and key in path[:2]
    assert "value" not in store[key]
