"""ReasoningGymEnv: reasoning-gym generators as tasks, scored by their own scorers; the extra's absence is explained."""

import os
import sys
from pathlib import Path

import pytest

from ipa_jax.envs import ToolCall, make_env
from ipa_jax.envs.reasoning_gym import ReasoningGymEnv

GENERATORS = (
    "chain_sum",
    "basic_arithmetic",
    "letter_counting",
    "spell_backward",
    "simple_equations",
    "family_relationships",
)


@pytest.fixture
def reasoning_gym():
    return pytest.importorskip(
        "reasoning_gym", reason="reasoning-gym is an optional extra: pip install -e '.[reasoning-gym]'"
    )


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[reasoning-gym\]'"):
        ReasoningGymEnv(seed=987_654)  # a generator never made before (they are cached)
    # ... an extra setup.py defines, under the name pip's metadata gives it (pip 23 installs nothing for the
    # underscore spelling of a hyphenated extra, with only a warning)
    assert '"reasoning-gym": [' in (Path(__file__).parents[2] / "setup.py").read_text()


@pytest.mark.parametrize("dataset", GENERATORS)
def test_expert_scores_one_and_a_wrong_answer_less(reasoning_gym, dataset):
    env = ReasoningGymEnv(dataset=dataset)
    for task in env.tasks("train", 4, seed=1) + env.tasks("eval", 2, seed=1):
        player = make_env(task.env)  # no arguments: the task names its generator, config, seed and index
        messages = player.expert(task)  # raises unless the reference answer scores 1
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[-1]["content"] == task.answer
        assert task.tools == [] and task.max_turns == 1
        player.reset(task)
        assert player.final_answer(task.answer + " but maybe not") < 1.0


def test_train_and_eval_never_share_a_question(reasoning_gym):
    # A small question space (2 one-digit terms) in a larger pool of indices: the same question comes from many
    # indices, and the split by question text must keep it on one side.
    env = ReasoningGymEnv(config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, size=3000)
    train, evals = env.tasks("train", 400, seed=0), env.tasks("eval", 100, seed=0)
    train_questions, eval_questions = {t.prompt for t in train}, {t.prompt for t in evals}
    assert len(train_questions) > 50 and len(eval_questions) > 10
    assert not train_questions & eval_questions
    assert [t.prompt for t in env.tasks("eval", 100, seed=0)] == [t.prompt for t in evals]  # seeded
    assert {t.prompt for t in env.tasks("eval", 100, seed=1)} != eval_questions


def test_score_is_the_datasets_own_scorer(reasoning_gym):
    env = ReasoningGymEnv(dataset="chain_sum")
    task = env.tasks("train", 1)[0]
    generator = reasoning_gym.create_dataset("chain_sum", seed=0, size=100_000)
    entry = generator[task.data["index"]]
    assert entry["question"] == task.prompt
    for answer in (task.answer, f"+{task.answer}.00", "12345678", ""):
        env.reset(task)
        assert env.final_answer(answer) == generator.score_answer(answer=answer, entry=entry)
    task.prompt = "What is 1 + 1?"  # not the instance its data names
    env.reset(task)
    with pytest.raises(ValueError, match="regenerated another question"):
        env.final_answer("2")


def test_python_tool_in_the_sandbox(reasoning_gym):
    task = ReasoningGymEnv(tools=["python"], max_turns=3).tasks("train", 1)[0]
    assert [s["function"]["name"] for s in task.tools] == ["python"] and task.max_turns == 3
    env = make_env(task.env)
    env.reset(task)
    workspace = env.sandbox.folder
    expression = task.prompt.rsplit(":", 1)[1].rstrip("= ")
    result = env.step(ToolCall("python", {"code": f"print({expression})"}))
    assert not result.error and result.observation == f"exit code: 0\nstdout:\n{task.answer}\n"
    assert env.final_answer(task.answer) == 1.0
    assert not os.path.exists(workspace)


def test_bad_arguments(reasoning_gym):
    with pytest.raises(ValueError, match=r"no dataset 'chain_sums'; did you mean \['chain_sum'"):
        ReasoningGymEnv(dataset="chain_sums")
    with pytest.raises(ValueError, match="rejects config"):
        ReasoningGymEnv(config={"min_termz": 3})
    with pytest.raises(ValueError, match="rejects config"):
        ReasoningGymEnv(config={"min_terms": 5, "max_terms": 2})  # the config's own validate()
    with pytest.raises(ValueError, match="not in config"):
        ReasoningGymEnv(config={"seed": 3})
    with pytest.raises(ValueError, match="tools must be a non-empty subset"):
        ReasoningGymEnv(tools=["browser"])
