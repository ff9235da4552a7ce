"""DatasetEnv: JSONL validation, graders, splits, cycling, and episodes with the python tool in the real sandbox."""

import json
import os
import re

import pytest

from ipa_jax.envs import ToolCall, make_env
from ipa_jax.envs.dataset import DatasetEnv, grade, read_dataset


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def numbered_rows(n: int, **extra):
    return [{"prompt": f"What is {i} times 7?", "answer": str(7 * i), **extra} for i in range(n)]


# ---- the file format ----------------------------------------------------------------------------------------


GOOD = {"prompt": "2+2?", "answer": "4"}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "2+2?", "answer": "4"', "not valid JSON"),
        ('["2+2?", "4"]', "must be a JSON object"),
        ({"answer": "4"}, "'prompt' must be a non-empty string"),
        ({"prompt": "", "answer": "4"}, "'prompt' must be a non-empty string"),
        ({"prompt": "2+2?"}, "'answer' is missing"),
        ({"prompt": "2+2?", "answer": 4}, "'answer' must be a string"),
        ({**GOOD, "grader": "fuzzy"}, "grader must be one of exact, numeric, contains, regex"),
        ({**GOOD, "answer": "four", "grader": "numeric"}, "needs a number"),
        ({**GOOD, "answer": "(unclosed", "grader": "regex"}, "not a valid regular expression"),
        ({**GOOD, "grader": "no_such_module_xyz:grade"}, "cannot import grader"),
        ({**GOOD, "tools": ["python", "browser"]}, "'tools' must be of bash, python"),
        ({**GOOD, "tools": "python"}, "'tools' must be a list"),
        ({**GOOD, "split": "test"}, "'split' must be one of"),
        ({**GOOD, "system": ["be brief"]}, "'system' must be a string"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "tasks.jsonl", [GOOD, "", bad_line])  # the blank line 2 is skipped
    with pytest.raises(ValueError, match=message) as info:
        DatasetEnv(path)
    assert f"{path}:3: " in str(info.value)


def test_duplicate_ids_empty_and_missing_files(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [{**GOOD, "id": "a"}, {**GOOD, "id": "b"}, {**GOOD, "id": "a"}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: id 'a' is already used on line 1")):
        DatasetEnv(path)
    with pytest.raises(ValueError, match="no task"):
        DatasetEnv(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(ValueError, match="does not exist"):
        DatasetEnv(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="grader must be one of"):
        DatasetEnv(write_jsonl(tmp_path / "ok.jsonl", [GOOD]), grader="fuzzy")
    with pytest.raises(ValueError, match="no path given"):
        DatasetEnv().tasks("train", 1)


def test_line_fields_and_defaults(tmp_path):
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {
                "prompt": "Capital of France?",
                "answer": "Paris",
                "id": "france",
                "split": "eval",
                "system": "Be brief.",
                "tools": [],
                "topic": "geography",
            },
            {
                "prompt": "Count the apples.",
                "answer": r"\d+ apples",
                "grader": "regex",
                "solution": "12 apples",
                "split": "eval",
            },
        ],
    )
    env = DatasetEnv(path, tools=["python"], grader="contains")
    france, apples = read_dataset(path, "contains", ["python"])
    assert (france.key, france.grader, france.tools, france.system) == ("france", "contains", (), "Be brief.")
    assert france.record["topic"] == "geography"  # extra keys are kept for custom graders
    assert (apples.key, apples.grader, apples.tools, apples.solution) == (
        "tasks.jsonl:2",
        "regex",
        ("python",),
        "12 apples",
    )
    tasks = {t.task_id: t for t in env.tasks("eval", 2)}
    assert set(tasks) == {"dataset/eval/france", "dataset/eval/tasks.jsonl:2"}
    france_task, apples_task = tasks["dataset/eval/france"], tasks["dataset/eval/tasks.jsonl:2"]
    assert france_task.tools == [] and france_task.max_turns == 1
    assert france_task.initial_messages()[0] == {"role": "system", "content": "Be brief."}
    assert [s["function"]["name"] for s in apples_task.tools] == ["python"] and apples_task.max_turns == 4
    # The expert answers with the solution when given (a regex is not an answer), else the reference.
    assert env.expert(apples_task)[-1] == {"role": "assistant", "content": "12 apples"}
    assert env.expert(france_task)[-1] == {"role": "assistant", "content": "Paris"}


# ---- graders ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grader, answer, reference, expected",
    [
        ("exact", "  Paris. ", "paris", 1.0),  # case, surrounding spaces and a trailing period are ignored
        ("exact", "New   York", "new york", 1.0),
        ("exact", "Paris, France", "paris", 0.0),
        ("numeric", "42.0", "42", 1.0),
        ("numeric", " 1e3 ", "1000", 1.0),
        ("numeric", "1000000.5", "1000000", 1.0),  # relative error 5e-7 <= 1e-6
        ("numeric", "1000002", "1000000", 0.0),  # relative error 2e-6
        ("numeric", "0.0", "0", 1.0),
        ("numeric", "forty-two", "42", 0.0),
        ("numeric", "42 apples", "42", 0.0),
        ("contains", "The capital is PARIS.", "paris", 1.0),
        ("contains", "Lyon", "paris", 0.0),
        ("regex", " 12 apples\n", r"\d+ apples", 1.0),  # the stripped answer
        ("regex", "12 apples!", r"\d+ apples", 0.0),  # a full match is needed
        ("regex", "Twelve Apples", r"(?i)twelve apples", 1.0),
    ],
)
def test_builtin_graders(grader, answer, reference, expected):
    assert grade(grader, answer, reference, {}) == expected


def test_custom_grader_gets_the_line_and_its_range_is_checked(tmp_path, monkeypatch):
    (tmp_path / "my_graders_for_test.py").write_text(
        "def accepted(answer, reference, task):\n"
        "    return 1.0 if answer.strip() in task['accepted'] else 0.25 if answer.strip() == reference else 0.0\n"
        "def broken(answer, reference, task):\n"
        "    return 2.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {
                "prompt": "Name a prime below 6.",
                "answer": "2",
                "accepted": ["2", "3", "5"],
                "split": "train",
                "grader": "my_graders_for_test:accepted",
            },
            {"prompt": "Anything.", "answer": "x", "split": "eval", "grader": "my_graders_for_test:broken"},
        ],
    )
    env = DatasetEnv(path)
    (task,) = env.tasks("train", 1)
    assert env.blocking is False  # before an episode: this env's tools (none)
    for answer, expected in [("5", 1.0), ("4", 0.0)]:
        env.reset(task)
        assert env.blocking  # a custom grader may wait on I/O: run off the event loop
        assert env.final_answer(answer) == expected
    (broken,) = env.tasks("eval", 1)
    env.reset(broken)
    with pytest.raises(ValueError, match=r"score of dataset/eval/tasks.jsonl:2 is 2.0, not in \[0, 1\]"):
        env.final_answer("x")


# ---- splits and task lists ------------------------------------------------------------------------------


def test_splits_are_disjoint_and_follow_the_lines(tmp_path):
    rows = numbered_rows(200)
    rows += [
        {"prompt": rows[0]["prompt"], "answer": rows[0]["answer"], "id": "same-prompt"},  # same split as row 0
        {"prompt": "Pinned to eval.", "answer": "x", "split": "eval"},
        {"prompt": "Pinned to train.", "answer": "y", "split": "train"},
    ]
    env = DatasetEnv(write_jsonl(tmp_path / "tasks.jsonl", rows))
    train, evals = env.split_lines("train"), env.split_lines("eval")
    assert len(train) + len(evals) == len(rows)
    assert not {line.prompt for line in train} & {line.prompt for line in evals}
    assert 20 <= len(evals) <= 70  # about eval_fraction = 0.2 of 200 by content hash
    assert "Pinned to eval." in {line.prompt for line in evals}
    assert "Pinned to train." in {line.prompt for line in train}
    # The split is a property of the content: another instance, a later file version, agree.
    again = DatasetEnv(write_jsonl(tmp_path / "tasks2.jsonl", rows[::-1]))
    assert {line.prompt for line in again.split_lines("eval")} == {line.prompt for line in evals}


def test_tasks_cycle_through_a_seeded_order(tmp_path):
    env = DatasetEnv(write_jsonl(tmp_path / "tasks.jsonl", [{**row, "split": "train"} for row in numbered_rows(5)]))
    tasks = env.tasks("train", 13, seed=3)
    ids = [t.task_id for t in tasks]
    assert sorted(ids[:5]) == sorted({t.task_id for t in tasks}) and len(set(ids[:5])) == 5
    assert ids[5:10] == ids[:5] and ids[10:] == ids[:3]  # the same order, again
    assert [t.task_id for t in env.tasks("train", 13, seed=3)] == ids
    orders = {tuple(t.task_id for t in env.tasks("train", 5, seed=s)) for s in range(10)}
    assert len(orders) > 1
    assert env.tasks("train", 0) == []
    with pytest.raises(ValueError, match="has no eval task"):
        env.tasks("eval", 1)
    with pytest.raises(ValueError, match="split must be one of"):
        env.tasks("test", 1)


# ---- episodes -------------------------------------------------------------------------------------------


def test_episode_without_tools_is_pure(tmp_path):
    env = DatasetEnv(write_jsonl(tmp_path / "tasks.jsonl", numbered_rows(10, grader="numeric", split="train")))
    task = env.tasks("train", 1)[0]
    player = make_env(task.env)  # no arguments: the task carries what scoring needs
    player.reset(task)
    assert not player.blocking and player.sandbox is None and player.tools == []
    result = player.step(ToolCall("python", {"code": "print(1)"}))
    assert result.error and "python" in result.observation
    assert player.final_answer(f"{task.answer}.0") == 1.0


def test_episode_with_the_python_tool_in_the_sandbox(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", numbered_rows(10, grader="numeric", split="train"))
    task = DatasetEnv(path, tools=["python"]).tasks("train", 1)[0]
    env = make_env(task.env)
    assert not env.blocking
    env.reset(task)
    assert env.blocking and env.sandbox is not None
    workspace = env.sandbox.folder
    assert os.path.isdir(workspace)
    result = env.step(ToolCall("python", {"code": "print(6 * 7)"}))
    assert not result.error and result.observation == "exit code: 0\nstdout:\n42\n"
    failed = env.step(ToolCall("python", {"code": "raise SystemExit(3)"}))
    assert failed.error and failed.observation.startswith("exit code: 3")
    assert env.step(ToolCall("bash", {"command": "ls"})).error  # not one of the task's tools
    assert (env.num_tool_calls, env.num_tool_errors) == (3, 2)
    assert env.final_answer(f" {task.answer} ") == 1.0
    assert env.sandbox is None and not os.path.exists(workspace)
    with pytest.raises(ValueError, match="episode is over"):
        env.step(ToolCall("python", {"code": "print(1)"}))

    env.reset(task)  # close() mid-episode deletes the workspace too
    workspace = env.sandbox.folder
    env.close()
    assert not os.path.exists(workspace)
    env.close()  # idempotent


def test_expert_scores_one_without_calling_a_tool(tmp_path):
    rows = numbered_rows(6, split="train", tools=["python"]) + numbered_rows(4, split="eval", grader="numeric")
    env = DatasetEnv(write_jsonl(tmp_path / "tasks.jsonl", rows))
    for task in env.tasks("train", 6) + env.tasks("eval", 4):
        messages = env.expert(task)  # raises unless the answer scores 1
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert env.sandbox is None
        env.reset(task)
        assert bool(task.tools) == (env.sandbox is not None) == task.task_id.startswith("dataset/train/")
        assert env.final_answer(env.expert_action(task, [])) == 1.0
