"""A terminal task as data (`TerminalSpec`), and the Terminal-Bench / Harbor task folders it is read from.

A terminal task is what the agent is told (`instruction`), the files its workspace starts with, how it is graded
after the episode, and a reference solution: a list of bash commands, one per expert step (the scripted expert
makes one `bash` call per step, then ends the episode). Grading (`ipa_jax/envs/terminal/grader.py`) is either
`checks` the host compares (the built-in suite), or `tests` run in the same sandbox (`test.sh` the entry point,
mounted read-only at /tests only while grading, so the agent never sees them).

Reward of `tests`: the test run's output when a `parser` reads it (Terminal-Bench 1: pytest's summary), else the
grader's `/logs/verifier/reward.txt` (a number) or `reward.json` (`{"reward": x}`) when it writes one, else 1.0 when
`test.sh` exits 0 and 0.0 otherwise; clipped to [0, 1].

Folder layouts read by `load_task_folder`:

  Harbor / Terminal-Bench 2.0:  instruction.md, task.toml ([agent] timeout_sec, [verifier] timeout_sec),
                                environment/ (copied into the workspace; Dockerfile and compose files skipped),
                                tests/test.sh (+ any files it uses), solution/solve.sh
  Terminal-Bench 1:             task.yaml (instruction, max_agent_timeout_sec, max_test_timeout_sec, parser_name:
                                pytest, the default), solution.sh, run-tests.sh (the entry point; TEST_DIR=/tests),
                                tests/, and a Dockerfile whose COPY / ADD lines stage files of the task folder into
                                the workspace (/app)

A solution script is split into expert steps at lines that start with `# step` (the rest of the line is a
comment); a script without such lines is one step. Lines before the first marker (a shebang, `set -e`) are
prepended to every step.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ipa_jax.envs.sandbox.base import check_relative_path
from ipa_jax.envs.terminal.parsers import PARSERS

TEST_ENTRY = "test.sh"
STEP_MARKER = "# step"
SKIPPED_ENVIRONMENT_FILES = ("Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore")
TB1_WORKDIR = "/app"  # where Terminal-Bench 1 images keep the task's files: the workspace
# Terminal-Bench 1 folder entries that are never the agent's: a Dockerfile copying them (`COPY . /app`) is not
# followed there.
TB1_PRIVATE = ("task.yaml", "solution.sh", "run-tests.sh", "tests", "solution", *SKIPPED_ENVIRONMENT_FILES)


@dataclass(frozen=True)
class TerminalSpec:
    """One terminal task instance (JSON-serialisable: it travels in `Task.data`).

    name: a short identifier (a folder name, or `<family>` for generated tasks).
    instruction: the user message.
    files: workspace files the episode starts with (relative path -> text), written after `environment_dir`.
    tests: grader files (relative path -> text) mounted at /tests while grading; `test.sh` is the entry point.
    checks: instead of tests, expectations the host compares (JSON: "files" path -> exact text, "absent" and
      "executable" paths, "runs" of {"command", "stdout" (None: any), "exit_code"}, "inputs" name -> text mounted
      read-only at /tests/inputs for the runs only); see ipa_jax/envs/terminal/suite/_common.py.
    solution: the reference solution, one bash command (a script) per expert step.
    executable: entries of `files` made executable.
    environment_dir / tests_dir: host folders used instead of (or, for environment_dir, before) the inline
      files: task folders are not copied into every Task.
    environment_files: workspace path -> host file or folder copied there (after environment_dir): what a
      Terminal-Bench 1 Dockerfile copies from its task folder.
    agent_timeout_s: the wall-clock time the agent's commands may take in all (each command is also bounded by
      the sandbox's per-command timeout). test_timeout_s: the grader's limit.
    tier / family: where a generated task comes from ("" for folder tasks).
    parser: how the test run's output gives the verdict ("pytest", Terminal-Bench 1); "": the reward file, else the
      exit status.
    """

    name: str
    instruction: str
    files: Mapping[str, str] = field(default_factory=dict)
    tests: Mapping[str, str] = field(default_factory=dict)
    checks: Mapping[str, Any] = field(default_factory=dict)
    solution: tuple[str, ...] = ()
    executable: tuple[str, ...] = ()
    environment_dir: str = ""
    environment_files: Mapping[str, str] = field(default_factory=dict)
    tests_dir: str = ""
    agent_timeout_s: float = 120.0
    test_timeout_s: float = 60.0
    tier: str = ""
    family: str = ""
    parser: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", dict(self.files))
        object.__setattr__(self, "tests", dict(self.tests))
        object.__setattr__(self, "checks", dict(self.checks))
        object.__setattr__(self, "environment_files", dict(self.environment_files))
        object.__setattr__(self, "solution", tuple(self.solution))
        object.__setattr__(self, "executable", tuple(self.executable))
        if not self.instruction.strip():
            raise ValueError(f"terminal task {self.name!r}: empty instruction")
        has_tests = TEST_ENTRY in self.tests or bool(self.tests_dir)
        if has_tests == bool(self.checks):
            raise ValueError(f"terminal task {self.name!r}: needs either tests/{TEST_ENTRY} or checks")
        if self.parser and self.parser not in PARSERS:
            raise ValueError(f"terminal task {self.name!r}: unknown parser {self.parser!r} (known: {sorted(PARSERS)})")
        if not self.solution:
            raise ValueError(f"terminal task {self.name!r}: no reference solution")
        for path in [*self.files, *self.tests, *self.environment_files]:
            check_relative_path(path)
        missing = set(self.executable) - set(self.files)
        if missing:
            raise ValueError(f"terminal task {self.name!r}: executable names files it does not have: {sorted(missing)}")
        if self.agent_timeout_s <= 0 or self.test_timeout_s <= 0:
            raise ValueError(f"terminal task {self.name!r}: timeouts must be > 0")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["solution"], d["executable"] = list(self.solution), list(self.executable)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TerminalSpec:
        return cls(**d)


def split_solution(script: str) -> tuple[str, ...]:
    """A solution script -> expert steps, split at `# step` lines; the preamble is prepended to every step."""
    preamble: list[str] = []
    steps: list[list[str]] = []
    for line in script.splitlines():
        if line.lstrip().startswith(STEP_MARKER):
            steps.append([])
        elif steps:
            steps[-1].append(line)
        elif not line.startswith("#!"):
            preamble.append(line)
    if not steps:
        steps, preamble = [preamble], []
    out = tuple("\n".join(preamble + s).strip() for s in steps)
    return tuple(s for s in out if s)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def load_task_folder(path: str) -> TerminalSpec:
    """A Harbor (instruction.md + task.toml) or Terminal-Bench 1 (task.yaml) task folder as a TerminalSpec."""
    path = os.path.abspath(path)
    name = os.path.basename(path.rstrip("/"))
    if os.path.isfile(os.path.join(path, "instruction.md")):
        meta: dict[str, Any] = {}
        if os.path.isfile(os.path.join(path, "task.toml")):
            with open(os.path.join(path, "task.toml"), "rb") as f:
                meta = tomllib.load(f)
        solution = os.path.join(path, "solution", "solve.sh")
        env_dir = os.path.join(path, "environment")
        return TerminalSpec(
            name=name,
            instruction=_read(os.path.join(path, "instruction.md")).strip(),
            solution=split_solution(_read(solution)) if os.path.isfile(solution) else (),
            environment_dir=env_dir if os.path.isdir(env_dir) else "",
            tests_dir=_require_dir(os.path.join(path, "tests"), TEST_ENTRY),
            agent_timeout_s=float(meta.get("agent", {}).get("timeout_sec", 120.0)),
            test_timeout_s=float(meta.get("verifier", {}).get("timeout_sec", 60.0)),
        )
    if os.path.isfile(os.path.join(path, "task.yaml")):
        import yaml  # transformers' dependency

        with open(os.path.join(path, "task.yaml"), encoding="utf-8") as f:
            meta = yaml.safe_load(f) or {}
        if "instruction" not in meta:
            raise ValueError(f"{path}/task.yaml has no 'instruction'")
        tests_dir = os.path.join(path, "tests")
        return TerminalSpec(
            name=name,
            instruction=str(meta["instruction"]).strip(),
            # Terminal-Bench 1's entry point sits beside tests/: the grader runs it with TEST_DIR=/tests.
            tests={TEST_ENTRY: "export TEST_DIR=/tests\n" + _read(os.path.join(path, "run-tests.sh"))},
            tests_dir=tests_dir if os.path.isdir(tests_dir) else "",
            environment_files=dockerfile_copies(path),
            solution=split_solution(_read(os.path.join(path, "solution.sh"))),
            agent_timeout_s=float(meta.get("max_agent_timeout_sec", 120.0)),
            test_timeout_s=float(meta.get("max_test_timeout_sec", 60.0)),
            # Terminal-Bench 1 reads the verdict from the test run's output: no reward file, not the exit status.
            parser=str(meta.get("parser_name", "pytest")),
        )
    raise ValueError(f"{path} is not a task folder: expected instruction.md (Harbor) or task.yaml (Terminal-Bench 1)")


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        instruction, _, args = (pending + line).strip().partition(" ")
        out.append((instruction.upper(), args.strip()))
        pending = ""
    return out


def dockerfile_copies(folder: str) -> dict[str, str]:
    """What a Terminal-Bench 1 task's Dockerfile copies from its folder into the workspace: workspace path -> host
    file or folder (a folder's content goes there, as with COPY). Destinations are taken relative to WORKDIR and must
    lie under /app (the workspace); COPY --from (another build stage), URLs and the folder's private entries
    (`TB1_PRIVATE`: tests, solution, task.yaml) are not staged. No Dockerfile: nothing."""
    dockerfile = os.path.join(folder, "Dockerfile")
    if not os.path.isfile(dockerfile):
        return {}
    copies: dict[str, str] = {}
    workdir = "/"
    for instruction, args in _dockerfile_instructions(_read(dockerfile)):
        if instruction == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, args.strip("\"'")))
        if instruction not in ("COPY", "ADD"):
            continue
        words = json.loads(args) if args.startswith("[") else shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        if any(f.startswith("--from") for f in flags) or len(paths) < 2:
            continue
        *sources, dest = paths
        if any("://" in src for src in sources):
            raise ValueError(
                f"{dockerfile}: {instruction} {args}: downloads are not staged; put the file in the task folder"
            )
        target = os.path.normpath(os.path.join(workdir, dest))
        if os.path.relpath(target, TB1_WORKDIR).startswith(".."):
            raise ValueError(
                f"{dockerfile}: {instruction} {args}: copies to {target}, outside {TB1_WORKDIR}; only "
                f"files under {TB1_WORKDIR} reach the workspace"
            )
        into_folder = dest.endswith("/") or len(sources) > 1 or target == TB1_WORKDIR
        for pattern in sources:
            matches = sorted(glob.glob(os.path.join(folder, pattern)))
            if not matches:
                raise ValueError(f"{dockerfile}: {instruction} {args}: {pattern} is not in the task folder")
            for host in matches:
                rel = os.path.relpath(os.path.realpath(host), os.path.realpath(folder))
                if rel.startswith(".."):
                    raise ValueError(f"{dockerfile}: {instruction} {args}: {pattern} is outside the task folder")
                if rel == ".":  # the whole folder: its entries, without the task's private ones
                    entries = [os.path.join(folder, e) for e in sorted(os.listdir(folder)) if e not in TB1_PRIVATE]
                elif rel.split(os.sep)[0] in TB1_PRIVATE:
                    continue
                elif os.path.isdir(host):  # a folder's content
                    entries = [os.path.join(host, e) for e in sorted(os.listdir(host))]
                else:
                    placed = os.path.join(target, os.path.basename(host)) if into_folder else target
                    copies[_workspace_path(placed)] = host
                    continue
                for entry in entries:
                    copies[_workspace_path(os.path.join(target, os.path.basename(entry)))] = entry
    return copies


def _workspace_path(target: str) -> str:
    return os.path.relpath(target, TB1_WORKDIR)


def _require_dir(path: str, entry: str) -> str:
    if not os.path.isfile(os.path.join(path, entry)):
        raise ValueError(f"task folder {os.path.dirname(path)} has no tests/{entry}")
    return path
