"""Terminal tasks: task folders (Harbor and Terminal-Bench 1 layouts) and the environment on the real bubblewrap
sandbox (episodes through the agent loop: tests/rollout/test_rollout_sandboxed.py)."""

import os

import pytest

from ipa_jax.envs import ToolCall, make_env
from ipa_jax.envs.terminal import DONE_MESSAGE, TerminalEnv, TerminalSpec, load_task_folder, split_solution

HARBOR_SOLVE = """#!/bin/bash
set -e
# step: look
cat data.txt
# step: write the answer
sort -n data.txt | tail -1 > answer.txt
"""


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def harbor_task(folder, numbers):
    write(f"{folder}/instruction.md", "Write the largest number in data.txt to answer.txt.\n")
    write(f"{folder}/task.toml", "[agent]\ntimeout_sec = 50.0\n[verifier]\ntimeout_sec = 20.0\n")
    write(f"{folder}/environment/Dockerfile", "FROM ubuntu\n")
    write(f"{folder}/environment/data.txt", "\n".join(map(str, numbers)) + "\n")
    write(
        f"{folder}/tests/test.sh",
        f"grep -qx {max(numbers)} /app/answer.txt && "
        "echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
    )
    write(f"{folder}/solution/solve.sh", HARBOR_SOLVE)


def tb1_task(folder):
    """A Terminal-Bench 1 task whose Dockerfile copies its input from the task folder. Its verdict is the test run's
    pytest summary; the sandbox's python3 has no pytest, so run-tests.sh prints the summary lines itself."""
    write(
        f"{folder}/task.yaml",
        "instruction: |\n  Create hello.txt containing the word in greeting.txt.\nmax_agent_timeout_sec: 40\n"
        "parser_name: pytest\n",
    )
    write(f"{folder}/Dockerfile", "FROM ubuntu\nWORKDIR /app\nCOPY greeting.txt ./\n")
    write(f"{folder}/greeting.txt", "hi\n")
    write(f"{folder}/solution.sh", "cp greeting.txt hello.txt\n")
    write(
        f"{folder}/run-tests.sh",
        'bash "$TEST_DIR/check.sh" && outcome=PASSED || outcome=FAILED\n'
        'printf "%s\\n" "=== short test summary info ===" "$outcome tests/check.sh::test_hello"\n',
    )
    write(f"{folder}/tests/check.sh", "grep -qx hi /app/hello.txt\n")


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    harbor_task(f"{root}/train/largest-a", [3, 17, 5])
    harbor_task(f"{root}/train/largest-b", [40, 2])
    tb1_task(f"{root}/train/hello")
    harbor_task(f"{root}/eval/largest-c", [9, 11, 10])
    return str(root)


def test_split_solution():
    assert split_solution(HARBOR_SOLVE) == ("set -e\ncat data.txt", "set -e\nsort -n data.txt | tail -1 > answer.txt")
    assert split_solution("#!/bin/sh\necho a\necho b\n") == ("echo a\necho b",)


def test_spec_validation():
    ok = dict(name="t", instruction="do it", tests={"test.sh": "true"}, solution=("true",))
    TerminalSpec(**ok)
    for bad, match in [
        ({"tests": {}}, "test.sh"),
        ({"solution": ()}, "solution"),
        ({"instruction": " "}, "instruc"),
        ({"files": {"../x": ""}}, "relative"),
        ({"files": {"/etc/x": ""}}, "relative"),
        ({"executable": ("run.sh",)}, "executable"),
        ({"checks": {"files": {"a": "b"}}}, "either tests/test.sh or checks"),
        ({"tests": {}, "checks": {}}, "either tests/test.sh or checks"),
        ({"parser": "swebench"}, "unknown parser 'swebench'"),
    ]:
        with pytest.raises(ValueError, match=match):
            TerminalSpec(**{**ok, **bad})
    spec = TerminalSpec(**ok, files={"a/b.txt": "x"})
    assert TerminalSpec.from_dict(spec.to_dict()) == spec


def test_task_folders(tasks_dir):
    harbor = load_task_folder(f"{tasks_dir}/train/largest-a")
    assert harbor.instruction == "Write the largest number in data.txt to answer.txt."
    assert (harbor.agent_timeout_s, harbor.test_timeout_s, len(harbor.solution)) == (50.0, 20.0, 2)
    tb1 = load_task_folder(f"{tasks_dir}/train/hello")
    assert tb1.instruction == "Create hello.txt containing the word in greeting.txt." and tb1.agent_timeout_s == 40.0
    assert (harbor.parser, tb1.parser) == ("", "pytest")  # Terminal-Bench 1: the test run's summary decides
    with pytest.raises(ValueError, match="not a task folder"):
        load_task_folder(tasks_dir)


def test_terminal_bench_1_dockerfile_stages_the_task_folder_files(tmp_path):
    folder = tmp_path / "task"
    tb1_task(str(folder))
    write(f"{folder}/data/a.csv", "1\n")
    write(f"{folder}/data/sub/b.csv", "2\n")
    write(f"{folder}/tests/test_outputs.py", "secret\n")
    write(
        f"{folder}/Dockerfile",
        """FROM python:3.11 AS build
COPY --from=build /opt/x /app/x
WORKDIR /app
# COPY never.txt /app/
COPY --chown=1000:1000 greeting.txt \\
     /app/input/greeting.txt
COPY ["data/a.csv", "greeting.txt", "extra/"]
COPY data /app/data
COPY . /app/all
COPY *.sh tests/ /app/leaks/
""",
    )
    assert load_task_folder(str(folder)).environment_files == {
        "input/greeting.txt": f"{folder}/greeting.txt",
        "extra/a.csv": f"{folder}/data/a.csv",
        "extra/greeting.txt": f"{folder}/greeting.txt",
        "data/a.csv": f"{folder}/data/a.csv",
        "data/sub": f"{folder}/data/sub",
        "all/data": f"{folder}/data",
        "all/greeting.txt": f"{folder}/greeting.txt",
    }
    for line, match in [
        ("COPY greeting.txt /usr/local/bin/", "outside /app"),
        ("COPY missing.txt /app/", "not in"),
        ("ADD https://example.com/f /app/", "downloads"),
        ("COPY ../other /app/", "not in|outside"),
    ]:
        write(f"{folder}/Dockerfile", f"FROM ubuntu\n{line}\n")
        with pytest.raises(ValueError, match=match):
            load_task_folder(str(folder))


def test_folder_library_splits_expert_and_empty_episode(tasks_dir):
    env = TerminalEnv(tasks_dir=tasks_dir)
    train = env.tasks("train", 5, seed=0)
    assert sorted({t.task_id for t in train}) == [
        "terminal/train/hello",
        "terminal/train/largest-a",
        "terminal/train/largest-b",
    ]  # 5 > 3 tasks: repeats
    assert [t.task_id for t in env.tasks("eval", 2)] == ["terminal/eval/largest-c"] * 2
    for task in train[:3] + env.tasks("eval", 1):
        messages = env.expert(task)  # raises unless the reference solution passes the tests
        calls = [m for m in messages if m.get("tool_calls")]
        assert len(calls) == len(task.data["spec"]["solution"]) and messages[-1]["content"] == DONE_MESSAGE
        assert task.max_turns == len(calls) + 1 + env.extra_turns
        env.reset(task)
        assert env.final_answer("I am done") == 0.0  # an empty episode fails the tests
    assert [env.check_task(t) for t in env.library_tasks("train")] == [{"solution": 1.0, "untouched": 0.0}] * 3
    env.reset(train[0])
    listing = env.step(ToolCall("bash", {"command": "ls -a"})).observation
    assert "data.txt" in listing and "Dockerfile" not in listing and "tests" not in listing
    assert env.step(ToolCall("bash", {"command": "ls /tests"})).error  # the grader is not visible to the agent
    env.close()


def test_environment_settings_are_checked():
    with pytest.raises(ValueError, match="tools must include bash"):
        TerminalEnv(tools=("python",))
    with pytest.raises(ValueError, match="unknown tiers"):
        TerminalEnv(tiers=("impossible",))
    with pytest.raises(ValueError, match="not a folder"):
        TerminalEnv(tasks_dir="/no/such/folder")
    with pytest.raises(ValueError, match="SandboxLimits.timeout_s"):
        TerminalEnv(limits={"timeout_s": 0})
    with pytest.raises(ValueError, match="leave part of memory_mb"):
        TerminalEnv(limits={"memory_mb": 256, "tmp_mb": 256})
    with pytest.raises(TypeError, match="disk_mb"):
        TerminalEnv(limits={"disk_mb": 1})


def test_registered_with_the_built_in_suite():
    env = make_env("terminal", tiers=["easy"])
    task = env.tasks("train", 1, seed=0)[0]
    assert task.env == "terminal" and task.data["spec"]["tier"] == "easy"
    assert env.expert(task)[-1]["content"] == DONE_MESSAGE


def test_the_documented_example_library_is_sound():
    env = TerminalEnv(tasks_dir=os.path.join(os.path.dirname(__file__), "..", "..", "docs", "terminal_tasks"))
    tasks = env.library_tasks("train") + env.library_tasks("eval")
    assert len(tasks) == 3
    for task in tasks:
        assert env.check_task(task) == {"solution": 1.0, "untouched": 0.0}, task.task_id
