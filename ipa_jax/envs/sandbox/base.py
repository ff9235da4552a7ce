"""The sandbox interface: a backend creates one `Sandbox` per episode; a sandbox runs shell commands in its workspace.

A backend owns isolation (filesystem view, network, PIDs, privileges) and resource limits; the tools and terminal
tasks only use `Sandbox.run`. To slot in another isolation technology (a Docker daemon, a remote sandbox service
such as ROCK, E2B or Daytona), implement `SandboxBackend.create` and `Sandbox.run` / `Sandbox.close` and register
the backend with `register_backend`; docs/environments.md lists what each method must guarantee.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, was closed): not the command's fault."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of every command run in a sandbox.

    cpu_s: CPU seconds per command (RLIMIT_CPU).
    memory_mb: the command's memory budget, its RAM-backed folders (the workspace: `workspace_mb`, /tmp: `tmp_mb`,
      /dev/shm: `shm_mb`) and its processes together. Where the learner may make cgroups, a cgroup per command caps
      the sum; each process's address space (RLIMIT_AS) gets what the folders leave (`address_space_mb`). Without
      one, each process gets that divided by `max_processes`, so that all of them stay within the budget.
    max_processes: processes and threads inside one command's sandbox (its cgroup's pids.max, and RLIMIT_NPROC in its
      own user namespace).
    file_size_mb: largest file a command may write (RLIMIT_FSIZE).
    workspace_mb / workspace_files: the workspace's size and number of entries (files, folders, links).
    tmp_mb / shm_mb: size of the command's private /tmp and /dev/shm (memory, freed when the command ends).
    timeout_s: wall-clock limit per command (the command's whole process tree is killed).
    output_bytes: stdout and stderr kept per command; a command writing more than 4x this is killed.
    """

    cpu_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 16
    file_size_mb: int = 16
    workspace_mb: int = 256
    workspace_files: int = 10000
    tmp_mb: int = 64
    shm_mb: int = 16
    timeout_s: float = 10.0
    output_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in (
            "cpu_s",
            "memory_mb",
            "max_processes",
            "file_size_mb",
            "workspace_mb",
            "workspace_files",
            "tmp_mb",
            "shm_mb",
            "timeout_s",
            "output_bytes",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.address_space_mb < 1:
            raise ValueError(
                f"SandboxLimits: workspace_mb ({self.workspace_mb}) + tmp_mb ({self.tmp_mb}) + shm_mb "
                f"({self.shm_mb}) live in memory and must leave part of memory_mb ({self.memory_mb}) to "
                "the processes"
            )

    @property
    def address_space_mb(self) -> int:
        """What the RAM-backed folders leave of the memory budget to the processes."""
        return self.memory_mb - self.workspace_mb - self.tmp_mb - self.shm_mb


@dataclass(frozen=True)
class Mount:
    """A host folder visible inside the sandbox for one command (e.g. the grader's tests)."""

    host_path: str
    sandbox_path: str
    writable: bool = False


@dataclass(frozen=True)
class CommandResult:
    """What one command did. `exit_code` is the shell's status (128 + N when killed by signal N)."""

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    output_limited: bool = False  # killed for writing more than 4x limits.output_bytes
    stdout_bytes: int = 0  # bytes the command wrote (kept or not)
    stderr_bytes: int = 0
    full: tuple[str, ...] = ()  # size-capped folders the command filled (e.g. "/tmp"): a failed step
    stdout_tail: str = ""  # the last output_bytes of stdout (all of it when it fit): where a test run's summary is

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_limited and not self.full


class Sandbox(abc.ABC):
    """One episode's isolated workspace. Thread-safe: `close` may be called while a command runs (it kills it)."""

    workdir: str  # the workspace's path inside the sandbox (commands start there)
    # The bash a grader runs its tests with. A backend whose commands cannot trace a process running its own copy
    # (the bubblewrap backend's execute-only bash) names that copy here.
    shell: str = "/bin/bash"

    @abc.abstractmethod
    def run(
        self, command: str, *, stdin: bytes = b"", timeout_s: float | None = None, mounts: Sequence[Mount] = ()
    ) -> CommandResult:
        """Run `command` with bash in the workspace under the backend's limits. Raises SandboxError when closed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill whatever still runs and delete the workspace. Idempotent."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_relative_path(path: str) -> None:
    """Task file names stay inside their folder: relative, no `..`, no empty parts."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"task file name {path!r} must be a relative path without '.', '..' or empty parts")


class SandboxBackend(abc.ABC):
    """Creates sandboxes. `files`: relative path -> text written into the fresh workspace; `source_dir`: a host
    folder copied in first; `source_files`: relative path -> a host file or folder copied there next (a folder's
    content); `executable`: files made executable."""

    limits: SandboxLimits

    @abc.abstractmethod
    def create(
        self,
        files: Mapping[str, str] | None = None,
        *,
        source_dir: str = "",
        source_files: Mapping[str, str] | None = None,
        executable: Sequence[str] = (),
    ) -> Sandbox:
        """A new sandbox with its own workspace."""


_BACKENDS: dict[str, Callable[..., SandboxBackend]] = {}


def register_backend(name: str, factory: Callable[..., SandboxBackend]) -> None:
    """Register `factory(limits=SandboxLimits, **kwargs) -> SandboxBackend` under `name`."""
    _BACKENDS[name] = factory


def make_backend(name: str, limits: SandboxLimits | None = None, **kwargs: Any) -> SandboxBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name](limits=limits or SandboxLimits(), **kwargs)


@functools.cache
def shared_backend(name: str, limits: SandboxLimits, workdir: str = "/app") -> SandboxBackend:
    """One backend per setting and process: environments are created per episode, while a backend sweeps stale
    workspaces once and closes what is left open at exit."""
    return make_backend(name, limits, workdir=workdir)
