"""The memory and process caps of a sandboxed command: one cgroup per command where the machine lets the learner make
one, else per-process rlimits whose product stays within the budget.

A cgroup caps the sum over the command's processes (and what they write to its RAM-backed folders); an address-space
rlimit caps each process alone, so without a cgroup the sandbox divides the budget by the process cap. Which one a
backend uses is detected once (`detect_memory_cap`), logged, and kept in `BubblewrapBackend.memory_cap`:

  cgroup2  a cgroup v2 folder (the learner's own cgroup or an ancestor) with `memory` and `pids` in its
           cgroup.subtree_control that the learner can write: per command memory.max, memory.swap.max and pids.max
  cgroup1  cgroup v1 `memory` and `pids` hierarchies the learner can write (root on a v1 or hybrid machine):
           memory.limit_in_bytes, memory.memsw.limit_in_bytes and pids.max
  rlimit   neither: RLIMIT_AS of (memory budget / max_processes) per process, RLIMIT_NPROC of max_processes
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "ipa_jax-"  # per-command cgroups: ipa_jax-<learner pid>-<id>
REMOVE_WAIT_S = 5.0  # a killed command's processes leave its cgroup as the kernel tears its namespace down


@dataclass(frozen=True)
class MemoryCap:
    """How commands' memory is capped. `hierarchies`: (folder, kind) of the cgroup folders under which each command
    gets a cgroup of its own, kind "cgroup2" or, for cgroup v1, "memory" / "pids" (none in rlimit mode); `reason`: why
    no cgroup could be used (rlimit mode)."""

    mode: str  # "cgroup2", "cgroup1" or "rlimit"
    hierarchies: tuple[tuple[str, str], ...] = ()
    reason: str = ""

    @property
    def sums(self) -> bool:
        """Whether the cap holds for the sum of a command's processes (a cgroup), not for each alone."""
        return self.mode != "rlimit"

    def describe(self, memory_mb: int, processes: int, process_mb: int) -> str:
        if self.sums:
            folders = ", ".join(folder for folder, _ in self.hierarchies)
            return f"{self.mode}: each command's processes together within {memory_mb} MiB and {processes} ({folders})"
        return (
            f"rlimit: each command's processes within {processes} x {process_mb} MiB of address space (no cgroup: "
            f"{self.reason})"
        )


LIMIT_FILES = {  # per hierarchy kind: the files a command's cgroup gets, in this order
    "cgroup2": ("memory.max", "memory.swap.max", "pids.max"),
    "memory": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
    "pids": ("pids.max",),
}
OPTIONAL_FILES = ("memory.swap.max", "memory.memsw.limit_in_bytes")  # absent without swap accounting


class CommandCgroup:
    """One command's cgroup (a folder per hierarchy), created with its limits; `add` moves a process (and its future
    children) in; `remove` deletes it once its processes are gone."""

    def __init__(self, cap: MemoryCap, memory_bytes: int, processes: int) -> None:
        self.cap = cap
        self.paths: list[str] = []
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            for folder, kind in cap.hierarchies:
                path = os.path.join(folder, name)
                os.mkdir(path)
                self.paths.append(path)
                for file in LIMIT_FILES[kind]:
                    if file in OPTIONAL_FILES and not os.path.exists(os.path.join(path, file)):
                        continue
                    value = processes if file == "pids.max" else 0 if file == "memory.swap.max" else memory_bytes
                    _write(os.path.join(path, file), str(value))
        except BaseException:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        for path in self.paths:
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def remove(self) -> None:
        """Delete the cgroup, waiting (up to REMOVE_WAIT_S) for the last processes of a killed command to leave it; one
        still busy then stays for `sweep_stale_cgroups`."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        for path in reversed(self.paths):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("sandbox cgroup %s still has processes; left for the next backend to sweep", path)
                        break
                    time.sleep(0.01)
        self.paths = []


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(filesystem type, root inside the filesystem, mount point, super options) of the cgroup mounts."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, tail = line.partition(" - ")
            fstype, _, options = (tail.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                parts = fields.split()
                out.append((fstype, parts[3], parts[4], set(options.split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                out[controller] = path
    return out


def _folder(mount_root: str, mount_point: str, path: str) -> str:
    """The folder of cgroup `path` under a mount of the hierarchy's `mount_root`; "" when the mount does not show it."""
    relative = os.path.relpath(path, mount_root)
    return "" if relative.startswith("..") else os.path.normpath(os.path.join(mount_point, relative))


def _usable(cap: MemoryCap) -> tuple[MemoryCap | None, str]:
    """(`cap`, "") when a command cgroup can be made and limited under its folders and a child process moved into it,
    else (None, why not)."""
    try:
        cgroup = CommandCgroup(cap, 64 * 2**20, 8)
    except OSError as e:
        return None, f"cannot make a cgroup under {', '.join(f for f, _ in cap.hierarchies)} ({e.strerror})"
    child = subprocess.Popen(["sleep", "60"], env={"PATH": "/usr/bin:/bin"})
    try:
        cgroup.add(child.pid)
    except OSError as e:
        return None, f"cannot move a process into a cgroup under {cgroup.paths[0]} ({e.strerror})"
    finally:
        child.kill()
        child.wait()
        cgroup.remove()
    return cap, ""


def _cgroup2(mounts: list[tuple[str, str, str, set[str]]], own: Mapping[str, str]) -> tuple[MemoryCap | None, str]:
    """This process's cgroup v2 folder or the nearest folder above it that delegates memory and pids to its children and
    that this process may write."""
    mount = next((m for m in mounts if m[0] == "cgroup2"), None)
    folder = _folder(mount[1], mount[2], own[""]) if mount and "" in own else ""
    if not folder:
        return None, "no cgroup v2 hierarchy shows this process's cgroup"
    while True:
        try:
            with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
        except OSError:
            enabled = set()
        if {"memory", "pids"} <= enabled and os.access(folder, os.W_OK):
            return MemoryCap("cgroup2", ((folder, "cgroup2"),)), ""
        if folder == mount[2]:
            return (
                None,
                f"cgroup v2 ({mount[2]}): no cgroup of this process, or above it, it may write with memory and pids",
            )
        folder = os.path.dirname(folder)


def _cgroup1(mounts: list[tuple[str, str, str, set[str]]], own: Mapping[str, str]) -> tuple[MemoryCap | None, str]:
    """This process's cgroups in the v1 memory and pids hierarchies, when it may write both."""
    hierarchies = []
    for controller in ("memory", "pids"):
        mount = next((m for m in mounts if m[0] == "cgroup" and controller in m[3]), None)
        folder = _folder(mount[1], mount[2], own[controller]) if mount and controller in own else ""
        if not folder or not os.access(folder, os.W_OK):
            return None, f"cgroup v1: no {controller} hierarchy this process may write"
        hierarchies.append((folder, controller))
    return MemoryCap("cgroup1", tuple(hierarchies)), ""


@functools.cache
def detect_memory_cap() -> MemoryCap:
    """The strongest cap this machine gives this process: cgroup2, else cgroup1, else rlimit (with the reasons)."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as e:
        return MemoryCap("rlimit", reason=f"cannot read this process's cgroups ({e.strerror})")
    reasons = []
    for candidate in (_cgroup2, _cgroup1):
        cap, why = candidate(mounts, own)
        if cap is not None:
            cap, why = _usable(cap)
        if cap is not None:
            return cap
        reasons.append(why)
    return MemoryCap("rlimit", reason="; ".join(reasons))


def sweep_stale_cgroups(cap: MemoryCap, alive: Callable[[int], bool]) -> None:
    """Delete the command cgroups of learners that no longer run (`alive(pid)` says which do)."""
    for folder, _ in cap.hierarchies:
        for entry in os.listdir(folder):
            pid = entry.removeprefix(PREFIX).partition("-")[0]
            if entry.startswith(PREFIX) and pid.isdigit() and not alive(int(pid)):
                try:
                    os.rmdir(os.path.join(folder, entry))
                except OSError:  # still has processes: a later sweep
                    pass
