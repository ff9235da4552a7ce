"""Imperfect and partial experts: the systematic mistake fails every time, the share of tasks it hits, task
families, and the demonstrations the IL stream yields (env.expert_error, expert_families, expert_successes_only)."""

import json
import re

import pytest

from ipa_jax.envs import Env, StepResult, ToolCall, expert_errs, make_env, register_env
from ipa_jax.pipeline import ConfigError, load_config, validate
from ipa_jax.pipeline.config import EnvConfig
from ipa_jax.pipeline.online import ExpertStream
from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer

MISTAKEN_ENVS = {
    "calculator": {},
    "calculator_1op_zeros": {"ops": 1, "low": 0, "high": 1},  # 0 op 0: the same result under every op
    "calculator_3ops": {"ops": 3},
    "kv_chain": {"hops": 4, "min_hops": 1},
    "lookup": {},
    "lookup_1hop": {"hops": 1},
    "lookup_hard": {},
}


def replay(task, messages) -> float:
    """Replays a conversation's calls in a fresh environment and scores its answer."""
    env = make_env(task.env)
    env.reset(task)
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            assert not env.step(ToolCall(fn["name"], fn["arguments"])).error
    return env.final_answer(messages[-1]["content"])


@pytest.mark.parametrize("case", sorted(MISTAKEN_ENVS))
def test_mistaken_expert_fails_on_every_task(case):
    name = case.split("_1op")[0].split("_3ops")[0].split("_1hop")[0]
    env = make_env(name, **MISTAKEN_ENVS[case])
    tasks = env.tasks("train", 8 if "zeros" in case else 60, seed=1)
    if "zeros" in case:
        assert any(t.data["nums"] == [0, 0] for t in tasks)
    for task in tasks:
        right, wrong = env.expert(task), env.expert(task, mistaken=True)
        assert replay(task, right) == 1.0 and replay(task, wrong) == 0.0
        assert wrong[-1]["content"] != task.answer
        assert wrong[: len(task.initial_messages())] == right[: len(task.initial_messages())]


def test_mistakes_are_the_documented_ones():
    calc = make_env("calculator", ops=2)
    task = calc.tasks("train", 1)[0]
    calls = [m["tool_calls"][0]["function"]["arguments"] for m in calc.expert(task, True) if m.get("tool_calls")]
    assert calls[0]["op"] == task.data["ops"][0] and calls[1]["op"] != task.data["ops"][1]
    chain = make_env("kv_chain", hops=3)
    task = chain.tasks("train", 1)[0]
    wrong = chain.expert(task, mistaken=True)
    assert sum(bool(m.get("tool_calls")) for m in wrong) == 2 and wrong[-1]["content"] == task.data["path"][-1]


def test_expert_error_share_is_fixed_by_task():
    tasks = make_env("calculator").tasks("train", 2000, seed=3)
    for share in (0.0, 0.25, 0.5, 1.0):
        hit = [expert_errs(t, share) for t in tasks]
        assert hit == [expert_errs(t, share) for t in tasks]  # deterministic
        assert abs(sum(hit) / len(tasks) - share) < 0.04  # 4 binomial sd at n = 2000
    assert all(expert_errs(t, 0.5) <= expert_errs(t, 0.75) for t in tasks)  # nested: a larger share adds tasks
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expert_errs(tasks[0], 1.5)


def test_families_from_the_task_text():
    calc = make_env("calculator", ops=3)
    names = {"+": "add", "-": "sub", "*": "mul"}
    for task in calc.tasks("eval", 100):
        ops = set(re.findall(r" ([-+*]) ", task.prompt))
        assert calc.family(task) == "_".join(names[o] for o in "+-*" if o in ops)
    chain = make_env("kv_chain", hops=5, min_hops=2)
    for task in chain.tasks("eval", 50):
        calls = sum(bool(m.get("tool_calls")) for m in chain.expert(task))
        assert chain.family(task) == f"hops_{calls}"
    lookup = make_env("lookup")
    assert {lookup.family(t) for t in lookup.tasks("eval", 50)} == {"city", "pet"}


class NoMistakeEnv(Env):
    """An environment without a systematic mistake (expert_error must stay 0)."""

    name = "no_mistake"
    tools = []

    def _sample(self, rng):
        n = rng.randrange(10**6)
        return f"Say {n}.", str(n), {}

    def _execute(self, call):
        return StepResult("")

    def expert_action(self, task, observations):
        return task.answer


def config(**env):
    return load_config("configs/quickstart.py", {"train.eval_episodes": 4, **{f"env.{k}": v for k, v in env.items()}})


def test_demonstration_settings_are_validated():
    exp = validate(config(expert_error=0.5, expert_families=("add_mul",)))
    assert exp.env.expert_error == 0.5 and exp.env.expert_families == ("add_mul",)
    with pytest.raises(ConfigError, match=r"env.expert_error.*\[0, 1\]"):
        validate(config(expert_error=1.5))
    with pytest.raises(ConfigError, match=r"env.expert_families.*\['div'\].*'add_mul'"):
        validate(config(expert_families=("div",)))
    filtered = {"rollout.expert_successes_only": True, "env.expert_error": 1.0}
    with pytest.raises(ConfigError, match="rollout.expert_successes_only.*nothing would be left"):
        validate(load_config("configs/quickstart.py", {"train.eval_episodes": 4, **filtered}))
    register_env("no_mistake", NoMistakeEnv, overwrite=True)
    with pytest.raises(ConfigError, match="env.expert_error.*no systematic expert mistake"):
        EnvConfig(name="no_mistake", expert_error=0.1)


@pytest.fixture(scope="module")
def chat():
    from ipa_jax.chat import ChatFormat

    return ChatFormat(build_corpus_tokenizer())


def test_expert_stream_yields_the_configured_demonstrations(chat):
    exp = validate(config(expert_error=0.5, expert_families=("add", "mul")))
    env = exp.env.make()
    stream = ExpertStream(exp.env.make, env.task_stream("train", seed=5), chat, exp.env)
    trajs = stream.take(40)
    tasks = {t.task_id: t for t in env.tasks("train", stream.count, seed=5)}
    assert len(trajs) == 40 and stream.count > 40  # other families were drawn and skipped
    for traj in trajs:
        task = tasks[traj.info["task_id"]]
        assert env.family(task) in ("add", "mul")
        assert traj.reward == (0.0 if expert_errs(task, 0.5) else 1.0)
    assert 0 < sum(t.reward == 0 for t in trajs) < 40
    demos = validate(config(expert_error=0.5)).env
    stream = ExpertStream(demos.make, env.task_stream("train", seed=5), chat, demos)
    assert all(t.reward == 1.0 for t in stream.take(20, successes_only=True)) and stream.count > 20
    # Resume: a stream skipped to the count yields what the original yields next.
    again = ExpertStream(demos.make, env.task_stream("train", seed=5), chat, demos)
    again.skip_to(stream.count)
    assert [t.uid for t in again.take(5, True)] == [t.uid for t in stream.take(5, True)]
    assert json.dumps([t.info["task_id"] for t in trajs])  # JSON-serialisable ids
