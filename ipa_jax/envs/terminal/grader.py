"""Grading a terminal episode: the task's tests run in the episode's sandbox, after the agent is done.

The agent's workspace is where the tests look, so nothing in it may steer how they run: the grader starts with a
clean environment of its own (`GRADER_ENV`): `HOME` is the command's private /tmp (not the workspace, whose
`.local` would hold a user site-packages with a planted `usercustomize.py`), user site-packages are off, Python
never puts the current folder or the script's folder on its path (`PYTHONSAFEPATH`, Python >= 3.11: a workspace
`json.py` or `pytest.py` is not imported; the tests' own folder is on `PYTHONPATH` instead), and `PATH` holds
only system folders. The tests are a fresh copy taken after the agent's last step, read-only; /logs, where the
reward file goes, exists only while they run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile

from ipa_jax.envs.sandbox import CommandResult, Mount, Sandbox
from ipa_jax.envs.terminal.spec import TEST_ENTRY, TerminalSpec

TESTS_MOUNT = "/tests"
LOGS_MOUNT = "/logs"
REWARD_FILE_BYTES = 4096  # a reward file is a number or a small JSON object
GRADER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONNOUSERSITE": "1",
    "PYTHONSAFEPATH": "1",
    "PYTHONPATH": TESTS_MOUNT,
    "PYTHONDONTWRITEBYTECODE": "1",
}
GRADER_COMMAND = " ".join(
    ["exec /usr/bin/env -i", *(f"{k}={v}" for k, v in GRADER_ENV.items()), f"/bin/bash {TESTS_MOUNT}/{TEST_ENTRY}"]
)


def grade(sandbox: Sandbox, spec: TerminalSpec) -> tuple[float, CommandResult]:
    """Run `bash /tests/test.sh` in `sandbox` with `GRADER_ENV` (tests read-only at /tests, a fresh writable /logs
    unless `spec.reward_file` is off); the reward is /logs/verifier/reward.txt or reward.json when the grader writes
    one, else 1.0 iff it exits 0. In [0, 1]."""
    with tempfile.TemporaryDirectory(prefix="ipa_jax_grade_") as scratch:
        tests, logs = os.path.join(scratch, "tests"), os.path.join(scratch, "logs")
        if spec.tests_dir:
            shutil.copytree(spec.tests_dir, tests, symlinks=True)
        else:
            os.makedirs(tests)
        for rel, text in spec.tests.items():
            path = os.path.join(tests, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        mounts = [Mount(tests, TESTS_MOUNT)]
        if spec.reward_file:
            os.makedirs(os.path.join(logs, "verifier"))
            _make_writable_by_sandbox(sandbox, logs)
            mounts.append(Mount(logs, LOGS_MOUNT, writable=True))
        os.chmod(scratch, 0o755)
        result = sandbox.run(GRADER_COMMAND, timeout_s=spec.test_timeout_s, mounts=mounts)
        written = _reward_file(os.path.join(logs, "verifier")) if spec.reward_file else None
    if written is not None and not result.timed_out:
        return written, result
    return (1.0 if result.ok else 0.0), result


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
