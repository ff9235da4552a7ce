"""Grading a terminal episode in its sandbox after the agent is done, each task layout as its own harness grades it.

Built-in suite (`TerminalSpec.checks`): the host compares. A trusted reader reports digests of the workspace files
the checks name, and every program the checks run (the agent's scripts) runs as a sandbox command of its own, with
only its hidden inputs mounted (read-only at /tests/inputs): no grader process shares the sandbox with it, and the
expected contents and outputs never enter the sandbox.

Harbor (`tests/test.sh`): the tests run with bash at /tests/test.sh; the reward is the number the grader writes to
/logs/verifier/reward.txt (or reward.json's "reward") when test.sh ends by itself, else 1.0 iff it exits 0.
Terminal-Bench 1 (`spec.parser`): the test run's output decides (see `parsers`), not its exit status, and there is no
/logs at all.

The agent's workspace is where the tests look, so nothing in it may steer how they run: the grader starts with a
clean environment of its own (`GRADER_ENV`): `HOME` is the command's private /tmp (not the workspace, whose
`.local` would hold a user site-packages with a planted `usercustomize.py`), user site-packages are off, Python
never puts the current folder or the script's folder on its path (`PYTHONSAFEPATH`, Python >= 3.11: a workspace
`json.py` or `pytest.py` is not imported; the tests' own folder is on `PYTHONPATH` instead), and `PATH` holds
only system folders. test.sh runs with the sandbox's `shell` (the bubblewrap backend's cannot be traced by what it
runs). The tests are a fresh copy taken after the agent's last step, read-only; /logs, where the reward file goes,
exists only while they run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from ipa_jax.envs.sandbox import CommandResult, Mount, Sandbox
from ipa_jax.envs.terminal.parsers import PARSERS
from ipa_jax.envs.terminal.spec import TEST_ENTRY, TerminalSpec

TESTS_MOUNT = "/tests"
INPUTS_MOUNT = f"{TESTS_MOUNT}/inputs"  # the hidden inputs of a built-in task's checks, as its programs see them
LOGS_MOUNT = "/logs"
REWARD_FILE_BYTES = 4096  # a reward file is a number or a small JSON object
RUN_TIMEOUT_S = 10.0  # each program a built-in task's checks run
GRADER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONNOUSERSITE": "1",
    "PYTHONSAFEPATH": "1",
    "PYTHONPATH": TESTS_MOUNT,
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTEST_ADDOPTS": "-rA",  # pytest's summary lists every test's outcome (what Terminal-Bench 1's verdict reads)
}
# What the checks' reader reports of the workspace (python3 -I: no variable, user site or folder of the workspace
# steers it): the digest of each named file's first bytes (one final newline dropped; reading 2 bytes past the
# expected length tells a longer file apart), which of the absent files exist and which executables are not.
FACTS_SCRIPT = """
import hashlib, json, os, sys
want = json.load(sys.stdin)
def digest(path, size):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read(size + 2).removesuffix(b"\\n")).hexdigest()
    except OSError as e:
        return f"cannot read it ({e.__class__.__name__})"
print(json.dumps({
    "files": {path: digest(path, size) for path, size in want["files"].items()},
    "present": [path for path in want["absent"] if os.path.lexists(path)],
    "not_executable": [p for p in want["executable"] if not (os.path.isfile(p) and os.access(p, os.X_OK))],
}))
"""


def grader_command(shell: str) -> str:
    """`bash /tests/test.sh` with `GRADER_ENV` only, bash being the sandbox's `shell`."""
    return " ".join(
        ["exec /usr/bin/env -i", *(f"{k}={v}" for k, v in GRADER_ENV.items()), f"{shell} {TESTS_MOUNT}/{TEST_ENTRY}"]
    )


def grade(sandbox: Sandbox, spec: TerminalSpec) -> tuple[float, CommandResult]:
    """The reward of the sandbox's workspace for `spec` (in [0, 1]) and what grading printed: `spec.checks` compared
    by the host, else `bash /tests/test.sh` with `GRADER_ENV` (tests read-only at /tests; a fresh writable /logs
    unless the test run's output decides, `spec.parser`)."""
    if spec.checks:
        return _grade_checks(sandbox, spec.checks)
    with tempfile.TemporaryDirectory(prefix="ipa_jax_grade_") as scratch:
        tests, logs = os.path.join(scratch, "tests"), os.path.join(scratch, "logs")
        if spec.tests_dir:
            shutil.copytree(spec.tests_dir, tests, symlinks=True)
        else:
            os.makedirs(tests)
        _write_files(tests, spec.tests)
        mounts = [Mount(tests, TESTS_MOUNT)]
        if not spec.parser:
            os.makedirs(os.path.join(logs, "verifier"))
            _make_writable_by_sandbox(sandbox, logs)
            mounts.append(Mount(logs, LOGS_MOUNT, writable=True))
        os.chmod(scratch, 0o755)
        result = sandbox.run(grader_command(sandbox.shell), timeout_s=spec.test_timeout_s, mounts=mounts)
        written = None if spec.parser else _reward_file(os.path.join(logs, "verifier"))
    if spec.parser:
        whole = not result.timed_out and not result.output_limited
        return (1.0 if whole and PARSERS[spec.parser](result.stdout_tail) else 0.0), result
    # A reward file counts only when test.sh ended by itself: a program it ran could write the file, then kill it
    # before it writes its own (a status of 128 + N: killed by signal N).
    ended_itself = not result.timed_out and not result.output_limited and result.exit_code < 128
    if written is not None and ended_itself:
        return written, result
    return (1.0 if result.ok else 0.0), result


def _write_files(folder: str, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _same(actual: str, expected: str) -> bool:
    """Equal apart from one final newline (`echo 5 > n.txt` and `printf 5 > n.txt` both pass)."""
    return actual.removesuffix("\n") == expected.removesuffix("\n")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode().removesuffix(b"\n")).hexdigest()


def _grade_checks(sandbox: Sandbox, checks: Mapping[str, Any]) -> tuple[float, CommandResult]:
    """1.0 iff every expectation holds: files with exact contents, files absent or executable, and programs whose exit
    status and stdout match (see `ipa_jax/envs/terminal/suite/_common.py`). Returns the reward and a summary of
    what failed as a CommandResult."""
    start, problems, timed_out = time.perf_counter(), [], False
    want = {
        "files": {path: len(text.encode()) for path, text in checks["files"].items()},
        "absent": checks["absent"],
        "executable": checks["executable"],
    }
    read = sandbox.run(
        f"python3 -I -c {shlex.quote(FACTS_SCRIPT)}", stdin=json.dumps(want).encode(), timeout_s=RUN_TIMEOUT_S
    )
    try:
        facts = json.loads(read.stdout)
    except ValueError:
        facts = None
    if not read.ok or facts is None:
        problems.append(f"cannot read the workspace: exit status {read.exit_code}, {read.stderr.strip()[-300:]}")
    else:
        for path, text in checks["files"].items():
            got = facts["files"][path]
            if got != _digest(text):
                problems.append(f"{path}: {got if got.startswith('cannot') else 'wrong content'}")
        problems += [f"{path}: should not exist" for path in facts["present"]]
        problems += [f"{path}: not an executable file" for path in facts["not_executable"]]
    with tempfile.TemporaryDirectory(prefix="ipa_jax_grade_") as inputs:
        _write_files(inputs, checks["inputs"])
        os.chmod(inputs, 0o755)
        mounts = [Mount(inputs, INPUTS_MOUNT)] if checks["inputs"] else []
        for run in checks["runs"]:
            done = sandbox.run(run["command"], timeout_s=RUN_TIMEOUT_S, mounts=mounts)
            timed_out |= done.timed_out
            if done.timed_out or done.output_limited:
                problems.append(f"{run['command']}: {'timed out' if done.timed_out else 'too much output'}")
            elif done.exit_code != run["exit_code"]:
                problems.append(f"{run['command']}: exit status {done.exit_code}, expected {run['exit_code']}")
            elif run["stdout"] is not None and not _same(done.stdout, run["stdout"]):
                problems.append(f"{run['command']}: wrong output")
    report = "".join(f"FAIL {problem}\n" for problem in problems) + (
        f"{len(problems)} check(s) failed\n" if problems else "PASS\n"
    )
    result = CommandResult(
        exit_code=1 if problems else 0,
        stdout=report,
        stderr="",
        duration_s=time.perf_counter() - start,
        timed_out=timed_out,
        stdout_tail=report,
    )
    return (0.0 if problems else 1.0), result


def _make_writable_by_sandbox(sandbox: Sandbox, path: str) -> None:
    uid = getattr(getattr(sandbox, "backend", None), "run_as", None)
    for base, dirs, _ in os.walk(path):
        for d in [base, *(os.path.join(base, n) for n in dirs)]:
            os.chmod(d, 0o777 if uid is None else 0o755)
            if uid is not None:
                os.chown(d, uid, uid)


def _reward_file(verifier_dir: str) -> float | None:
    """The number in reward.txt / reward.json's "reward", read without following links; None when absent or
    malformed (then the exit status decides)."""
    for name in ("reward.txt", "reward.json"):
        path = os.path.join(verifier_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            raw = f.read(REWARD_FILE_BYTES).decode("utf-8", "replace").strip()
        try:
            value = float(json.loads(raw)["reward"]) if name == "reward.json" else float(raw)
        except (ValueError, TypeError, KeyError):
            return None
        return min(max(value, 0.0), 1.0) if math.isfinite(value) else None
    return None
