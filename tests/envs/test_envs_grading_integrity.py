"""Rewards a policy cannot fake and memory it cannot take: adversarial episodes against the real sandbox and grader,
on the built-in suite, Harbor and Terminal-Bench 1 task layouts, as a root and as an unprivileged learner.

Each attack below gets reward 1.0 (or more memory than the budget) from a sandbox whose status shell, grader and
checks share one security context with the agent's programs; here each must get nothing."""

import json
import logging
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import tempfile

import pytest
from learners import LEARNERS, Learner, grade_episode, sandbox_backend

from ipa_jax.envs.sandbox import BubblewrapBackend, SandboxError, SandboxLimits
from ipa_jax.envs.sandbox.bubblewrap import namespaces_unavailable
from ipa_jax.envs.sandbox.cgroups import CommandCgroup, MemoryCap, _cgroup1, _cgroup2
from ipa_jax.envs.terminal.parsers import pytest_solved
from ipa_jax.envs.terminal.spec import TerminalSpec, load_task_folder
from ipa_jax.envs.terminal.suite import FAMILIES

NO_NAMESPACES = namespaces_unavailable()
pytestmark = pytest.mark.skipif(bool(NO_NAMESPACES), reason=NO_NAMESPACES)

# Enough per process for pytest even where the budget is divided by the process cap (no cgroup: 76 MiB each).
LIMITS = dict(memory_mb=1024, workspace_mb=32, max_processes=12, cpu_s=10, timeout_s=20.0)

# A program that makes a process exit 0 with ptrace (x86-64): the grader's `bash /tests/test.sh` if it can see one,
# then the sandbox's PID 1 (the shell that reports the status). Prints what each attach gave.
PTRACE_EXIT_0 = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ATTACH, DETACH, GETREGS, SETREGS, PEEKTEXT, POKETEXT, WALL = 16, 17, 12, 13, 1, 4, 0x40000000
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi "
                "orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs".split()]
def exit_0(pid):
    if libc.ptrace(ATTACH, pid, None, None) != 0:
        return os.strerror(ctypes.get_errno())
    os.waitpid(pid, WALL)
    regs = Regs()
    libc.ptrace(GETREGS, pid, None, ctypes.byref(regs))
    word = libc.ptrace(PEEKTEXT, pid, regs.rip, None) & (2**64 - 1)
    libc.ptrace(POKETEXT, pid, regs.rip, (word & ~0xFFFF) | 0x050F)  # a syscall instruction where it stands
    regs.rax, regs.rdi, regs.orig_rax = 231, 0, 2**64 - 1  # exit_group(0)
    libc.ptrace(SETREGS, pid, None, ctypes.byref(regs))
    libc.ptrace(DETACH, pid, None, None)
    return "made it exit 0"
def argv(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\\0")[:-1]
    except OSError:
        return []
graders = [int(p) for p in os.listdir("/proc") if p.isdigit() and argv(int(p))[-1:] == ["/tests/test.sh"]]
for pid in graders + [1]:
    outcome = exit_0(pid)
    print(f"ptrace {pid} ({' '.join(argv(pid))[:40]}): {outcome}", file=sys.stderr)
    if outcome.startswith("made"):
        break
"""
# Writes "0" on every file descriptor of every other process it can open through /proc or take with pidfd_getfd.
FORGE_STATUS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    for fd in range(64):
        try:
            with open(f"/proc/{pid}/fd/{fd}", "w") as f:
                f.write("0\\n")
        except OSError:
            pass
    pidfd = libc.syscall(434, pid, 0)  # pidfd_open
    for fd in range(3, 64) if pidfd >= 0 else ():
        taken = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        if taken >= 0:
            try:
                os.write(taken, b"0\\n")
            except OSError:
                pass
"""


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def put(path, text):
    """An agent command writing `text` to `path` in the workspace."""
    return f"printf %s {shlex.quote(text)} > {path}"


@pytest.fixture(scope="module", params=LEARNERS)
def learner(request):
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("the tests do not run as root")
    runner = Learner(request.param)
    yield runner
    runner.close()


@pytest.fixture
def task_folder():
    """A folder for a task every user can read (the unprivileged learner loads it)."""
    folder = tempfile.mkdtemp(prefix="ipa_jax_test_task_")
    yield os.path.join(folder, "task")
    subprocess.run(["chmod", "-R", "a+rX", folder], check=True)
    shutil.rmtree(folder, ignore_errors=True)


def built_in(family, seed=0):
    return FAMILIES[family].make(random.Random(seed))


def script_of(spec):
    """The script a column_sum_script instance's checks run on its hidden input."""
    return re.search(r"bash (\w+\.sh) /tests/inputs", json.dumps(spec.to_dict())).group(1)


def tb1_task(folder, pylib):
    """A Terminal-Bench 1 task: solution.py's answer() must return 42; its pytest also runs /app/prog.py."""
    write(f"{folder}/task.yaml", "instruction: Write solution.py whose answer() returns 42.\nparser_name: pytest\n")
    write(f"{folder}/solution.sh", "printf 'def answer():\\n    return 42\\n' > solution.py\n")
    write(f"{folder}/run-tests.sh", f"PYTHONPATH=/app:{pylib} python3 -m pytest $TEST_DIR/test_outputs.py -rA\n")
    write(
        f"{folder}/tests/test_outputs.py",
        "import os, subprocess\n\n\ndef test_answer():\n"
        "    if os.path.exists('/app/prog.py'):\n        subprocess.run(['python3', '/app/prog.py'])\n"
        "    from solution import answer\n\n    assert answer() == 42\n",
    )
    subprocess.run(["chmod", "-R", "a+rX", os.path.dirname(folder)], check=True)
    return load_task_folder(folder)


HARBOR = TerminalSpec(
    name="harbor",
    instruction="Write 42 to answer.",
    solution=("echo 42 > answer",),
    tests={
        "test.sh": "test -f /app/prog.py && python3 /app/prog.py\ngrep -qx 42 /app/answer && "
        "echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    },
)


def grade_with(learner, spec, commands, pylib=""):
    return learner(
        "grade_episode", spec=spec.to_dict(), commands=commands, limits=LIMITS, ro_binds=[pylib] * bool(pylib)
    )


# ---------------------------------------------------------------------------------------------------- the status
def test_a_command_cannot_reach_the_shell_that_reports_its_status(learner):
    """The reporting shell is PID 1 and not dumpable, its status on a socket: a failing command cannot write that
    status (through /proc/<pid>/fd, pidfd_getfd or ptrace), read the shell's /proc files, nor kill or stop it."""
    commands = [
        "echo 0 > /proc/2/fd/6; exit 1",  # the pipe a command's status once went through
        "for f in /proc/[0-9]*/fd/*; do echo 0 > $f; done 2>/dev/null; exit 1",
        f"python3 -c {shlex.quote(FORGE_STATUS)}; exit 1",
        "for s in $(seq 1 31); do kill -$s 1; done 2>/dev/null; kill -9 -1; exit 1",
        "ls /proc/1/fd; cat /proc/1/environ; head -c 1 /proc/1/mem",
    ]
    if platform.machine() == "x86_64":
        commands.append(f"python3 -c {shlex.quote(PTRACE_EXIT_0)}; exit 1")
    results = learner("run_commands", limits=LIMITS, commands=commands)["results"]
    assert not any(r["timed_out"] for r in results), results
    assert [r["exit_code"] for r in results[:3]] == [1] * 3, results
    # SIGUSR1 is how the host stops a command: the shell kills the command, then reports a failure
    assert results[3]["exit_code"] != 0 and "before reporting" not in results[3]["stderr"], results[3]
    assert results[4]["stderr"].count("Permission denied") == 3, results[4]
    if platform.machine() == "x86_64":
        assert results[5]["exit_code"] == 1 and "ptrace 1 " in results[5]["stderr"], results[5]
        assert "made it exit 0" not in results[5]["stderr"], results[5]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ptrace program is written for x86-64")
@pytest.mark.parametrize("layout", ["built-in", "harbor", "terminal-bench-1"])
def test_a_program_the_grader_runs_cannot_ptrace_it(learner, sandbox_pytest, task_folder, layout):
    """The agent's program, run by the checks, attaches to the grader's test.sh shell (or the sandbox's PID 1) to make
    it exit 0. Built-in tasks run it outside any grader; test.sh runs with an execute-only bash it cannot trace."""
    exploit = put("/app/prog.py", PTRACE_EXIT_0)
    if layout == "built-in":
        spec = built_in("column_sum_script")
        commands = [exploit, put(f"/app/{script_of(spec)}", "python3 /app/prog.py\n")]
    elif layout == "harbor":
        spec, commands = HARBOR, [exploit]
    else:
        spec, commands = tb1_task(task_folder, sandbox_pytest), [exploit]
    graded = grade_with(learner, spec, commands, sandbox_pytest)
    assert graded["reward"] == 0.0, graded["output"]


def test_a_program_the_checks_run_cannot_forge_the_status(learner):
    """Through the built-in suite: the agent's script writes "0" on every descriptor it can reach and fails."""
    spec = built_in("column_sum_script")
    forge = put("/app/forge.py", FORGE_STATUS)
    script = put(
        f"/app/{script_of(spec)}", "for f in /proc/[0-9]*/fd/*; do echo 0 > $f; done; python3 forge.py; exit 1"
    )
    graded = grade_with(learner, spec, [forge, script])
    assert graded["reward"] == 0.0, graded["output"]


def test_a_harbor_reward_file_counts_only_when_test_sh_ends_by_itself(learner):
    """test.sh runs the agent's program, which writes reward 1 and kills test.sh before test.sh writes its own."""
    kill = (
        "open('/logs/verifier/reward.txt', 'w').write('1')\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    )
    graded = grade_with(learner, HARBOR, [put("/app/prog.py", kill)])
    assert graded["reward"] == 0.0, graded["output"]
    honest = grade_with(learner, HARBOR, list(HARBOR.solution))
    assert honest["reward"] == 1.0, honest["output"]


# ----------------------------------------------------------------------------------------------- the answer key
@pytest.mark.parametrize("family", ["column_sum_script", "number_stats_script"])
def test_a_program_the_checks_run_cannot_read_the_expected_output(learner, family):
    """The agent solves the visible part, then swaps its script for one printing what the hidden run expects, read
    from the grader's files: the expected outputs stay on the host."""
    spec = built_in(family)
    run = spec.to_dict()
    command = re.search(r"((?:bash|python3) \w+\.(?:sh|py)) /tests/inputs/", json.dumps(run)).group(1)
    script = command.split()[1]
    cheat = (
        "import glob, json, re, sys\n"
        "for path in glob.glob('/tests/**', recursive=True):\n"
        "    try:\n        expect = json.load(open(path))\n    except (OSError, ValueError):\n        continue\n"
        "    print(expect['runs'][0]['stdout'], end='')\n"
    )
    cheat_script = "python3 /app/cheat.py\n" if script.endswith(".sh") else cheat
    commands = [*spec.solution, put("/app/cheat.py", cheat), put(f"/app/{script}", cheat_script)]
    graded = learner("grade_episode", spec=run, commands=commands, limits=LIMITS)
    assert graded["reward"] == 0.0, graded["output"]
    honest = learner("grade_episode", spec=run, commands=list(spec.solution), limits=LIMITS)
    assert honest["reward"] == 1.0, honest["output"]


def test_a_module_that_ends_the_hidden_test_early_fails(learner):
    """A bug-fix task's module that exits 0 as soon as it is imported (instead of being fixed) passed its own and the
    hidden unittest files by their exit status; the hidden calls' outputs are compared on the host."""
    spec = built_in("fix_python_numeric")
    module = next(path for path in spec.files if not path.startswith("test_"))
    commands = [f"sed -i '1i import os; os._exit(0)' {module}"]
    graded = grade_with(learner, spec, commands)
    assert graded["reward"] == 0.0, graded["output"]


# -------------------------------------------------------------------------------------- Terminal-Bench 1's verdict
TB1_ATTACKS = {
    "solved": ("def answer():\n    return 42\n", 1.0),
    "exits 0 on import": ("import os\nos._exit(0)\n", 0.0),
    "writes a reward file": (
        "import os\ntry:\n    os.makedirs('/logs/verifier', exist_ok=True)\n"
        "    open('/logs/verifier/reward.txt', 'w').write('1')\nexcept OSError:\n    pass\n\n"
        "def answer():\n    return 41\n",
        0.0,
    ),
}


@pytest.mark.parametrize("attack", sorted(TB1_ATTACKS))
def test_terminal_bench_1_reads_the_test_summary_not_a_reward_file(sandbox_pytest, task_folder, attack):
    """Terminal-Bench 1 tasks are solved only when pytest's summary lists a passed test and no failed one: a module
    under test that exits 0 while pytest imports it, or writes Harbor's reward file, gets nothing."""
    spec = tb1_task(task_folder, sandbox_pytest)
    source, want = TB1_ATTACKS[attack]
    commands = [put("/app/solution.py", source)]
    graded = grade_episode(spec.to_dict(), commands, LIMITS, ro_binds=[sandbox_pytest])
    assert graded["reward"] == want, graded["output"]


def test_pytest_summary_verdicts():
    summary = "===== short test summary info =====\n{}\n===== 2 passed in 0.1s =====\n"
    assert pytest_solved(summary.format("PASSED t.py::a\nPASSED t.py::b"))
    assert pytest_solved(summary.format("PASSED t.py::a\nSKIPPED [1] t.py:3: later\nXFAIL t.py::c"))
    assert not pytest_solved(summary.format("PASSED t.py::a\nFAILED t.py::b - assert 1 == 2"))
    assert not pytest_solved(summary.format("PASSED t.py::a\nERROR t.py::b"))
    assert not pytest_solved(summary.format("PASSED t.py::a\nXPASS t.py::b"))
    assert not pytest_solved(summary.format("SKIPPED [1] t.py:3: nothing ran"))
    assert not pytest_solved("PASSED t.py::a\n1 passed in 0.1s\n")  # no summary: pytest did not finish
    assert not pytest_solved("")
    assert not pytest_solved(summary.format("PASSED t.py::a") + summary.format("FAILED t.py::a"))  # every run counts


# -------------------------------------------------------------------------------------------------------- memory
HOLD_MEMORY = """
import os, signal, sys
size, count = int(sys.argv[1]) << 20, int(sys.argv[2])
ready, told = os.pipe()
children = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        os.close(ready)
        try:
            held = bytes([1]) * size
        except MemoryError:
            os._exit(1)
        os.write(told, b"+")
        os.close(told)
        signal.pause()
    children.append(pid)
os.close(told)
while os.read(ready, 64):
    pass  # every child has allocated, failed or been killed
for pid in children:
    os.kill(pid, signal.SIGTERM)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print(sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGTERM for s in statuses))
"""


def test_the_memory_cap_holds_for_the_sum_of_a_commands_processes(learner):
    """Six processes, each under the per-process limit the folders leave (912 MiB), hold 300 MiB each: together they
    must stay within memory_mb (a cgroup kills what does not fit; without one, each process gets the budget divided
    by the process cap). A command cannot make a user namespace either (where it could mount an uncapped tmpfs)."""
    size, count = 300, 6
    commands = [f"python3 -c {shlex.quote(HOLD_MEMORY)} {size} {count}", "unshare -Ur true"]
    ran = learner("run_commands", limits=LIMITS, commands=commands)
    held = int(ran["results"][0]["stdout"])
    assert held * size <= LIMITS["memory_mb"], (ran["memory_cap"], held)
    assert ran["results"][1]["exit_code"] != 0, ran["results"][1]


def test_the_memory_cap_is_chosen_and_said(caplog, tmp_path):
    """The backend uses the strongest cap the machine gives, logs which, and refuses a process cap that leaves each
    process too little without a cgroup."""
    with caplog.at_level(logging.INFO, logger="ipa_jax.envs.sandbox.bubblewrap"):
        backend, root = sandbox_backend(LIMITS)
    shutil.rmtree(root)
    assert f"sandbox memory cap: {backend.memory_cap.mode}" in caplog.text
    if backend.memory_cap.mode == "rlimit":
        assert backend.process_memory_mb * LIMITS["max_processes"] <= SandboxLimits(**LIMITS).address_space_mb
    rlimit = MemoryCap("rlimit", reason="none here")
    with pytest.raises(SandboxError, match=r"\(none here\) each of the 64 processes .* gets 10 MiB"):
        BubblewrapBackend(SandboxLimits(max_processes=64), root=str(tmp_path), memory_cap=rlimit)


def test_cgroup_detection_on_a_delegated_v2_tree_and_a_v1_one(tmp_path):
    """Which cgroup folder a learner may use: a v2 one whose subtree delegates memory and pids (the nearest of its
    own and its ancestors'), else writable v1 memory and pids hierarchies. Folders stand in for cgroupfs here."""
    v2 = tmp_path / "v2"
    write(f"{v2}/cgroup.subtree_control", "cpu memory pids\n")
    write(f"{v2}/user.slice/cgroup.subtree_control", "cpu\n")
    own = {"": "/user.slice/session.scope"}
    os.makedirs(v2 / "user.slice/session.scope")
    cap, why = _cgroup2([("cgroup2", "/", str(v2), {"rw"})], own)
    assert cap == MemoryCap("cgroup2", ((str(v2), "cgroup2"),)) and why == ""
    (path,) = CommandCgroup(cap, 256 * 2**20, 12).paths
    assert sorted(os.listdir(path)) == ["memory.max", "pids.max"]  # no swap accounting here: no memory.swap.max
    assert (open(f"{path}/memory.max").read(), open(f"{path}/pids.max").read()) == (str(256 * 2**20), "12")
    write(f"{v2}/cgroup.subtree_control", "cpu\n")
    assert _cgroup2([("cgroup2", "/", str(v2), {"rw"})], own)[0] is None
    mounts = [
        ("cgroup", "/", str(tmp_path / "memory"), {"rw", "memory"}),
        ("cgroup", "/", str(tmp_path / "pids"), {"rw", "pids"}),
    ]
    for name in ("memory/learner", "pids"):
        os.makedirs(tmp_path / name)
    cap, _ = _cgroup1(mounts, {"memory": "/learner", "pids": "/"})
    assert cap == MemoryCap("cgroup1", ((str(tmp_path / "memory/learner"), "memory"), (str(tmp_path / "pids"), "pids")))
    assert (
        _cgroup1(mounts[:1], {"memory": "/learner", "pids": "/"})[1]
        == "cgroup v1: no pids hierarchy this process may write"
    )
