"""One trainer per run folder: an exclusive lock on <run_dir>/trainer.lock, held for the run's life.

The lock is an flock on that file: the kernel releases it when its holder exits, however it ends (SIGKILL
included), so a crashed trainer never leaves the folder locked. The file also names the holder (pid, host, start
time) for the one-line refusal a second trainer gets, and is emptied on a clean release: a holder found in it by the
next trainer ended without releasing (a crash), which is logged as a takeover. Where the filesystem has no flock (some
network and FUSE mounts) the named holder is the lock, best effort: it is taken over when it is a process of this
host that no longer runs, and otherwise refused (delete the file when its trainer is known to be gone). An object
store (gs://...) has no lock at all: a warning says so, and one trainer per folder is then the user's to keep.
Multi-host: process 0 holds it (it alone writes the run folder) and tells the others whether it got it, so that a
refused multi-host trainer exits on every host at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ipa_jax import storage
from ipa_jax.pipeline.config import ConfigError
from ipa_jax.pipeline.run_folder import is_writer

log = logging.getLogger(__name__)

LOCK_FILE = "trainer.lock"
# flock errors that mean "this filesystem cannot lock", not "someone holds the lock".
NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunFolderBusy(ConfigError):
    """Another trainer holds the run folder; the message names it."""

    def __init__(self, run_dir: str, holder: str):
        super().__init__(
            "train.run_dir",
            f"{storage.absolute(run_dir)} is in use by another trainer ({holder}): "
            "wait for it to end, stop it, or choose another train.run_dir",
        )


def describe_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "it has not recorded itself yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


@contextlib.contextmanager
def run_folder_lock(run_dir: str) -> Iterator[None]:
    """Holds the run folder's lock for the `with` block (process 0 only); raises RunFolderBusy when another
    trainer holds it (on every process of a multi-host run)."""
    lock = RunLock(run_dir) if is_writer() and storage.is_local(run_dir) else None
    if is_writer() and lock is None:
        log.warning("%s is on an object store, which has no lock: nothing keeps a second trainer out", run_dir)
    error: BaseException | None = None
    if lock is not None:
        try:
            lock.acquire()
        except BaseException as e:  # noqa: BLE001 - re-raised below, once the other processes know
            error = e
    if jax.process_count() > 1:
        held = bool(multihost_utils.broadcast_one_to_all(np.asarray(error is None)))
        if not held and lock is None:
            raise RunFolderBusy(run_dir, "process 0 could not lock it: see its error")
    if error is not None:
        raise error
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


class RunLock:
    """The lock file of one run folder (module doc)."""

    def __init__(self, run_dir: str):
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunFolderBusy(self.run_dir, describe_holder(holder)) from None
        except OSError as e:
            if e.errno not in NO_FLOCK_ERRNOS:
                os.close(fd)
                raise
            log.warning(
                "%s: the filesystem has no flock (%s); the lock file's recorded holder is the lock",
                self.path,
                e.strerror,
            )
            holder = _read_holder(fd)
            if holder and not _gone(holder):
                os.close(fd)
                raise RunFolderBusy(self.run_dir, describe_holder(holder)) from None
        else:
            holder = _read_holder(fd)
        if holder:
            log.warning(
                "%s: taking over the lock of a trainer that ended without releasing it (%s)",
                self.path,
                describe_holder(holder),
            )
        _write_holder(
            fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        )
        self._fd = fd

    def release(self) -> None:
        """Empties the file (a clean end: no takeover to report) and unlocks. The file stays: deleting it would let
        a trainer that opened it just before lock a file no longer in the folder."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None


def _read_holder(fd: int) -> dict[str, Any]:
    """The recorded holder, {} when the file is empty (free, or its holder has not written yet) or unreadable."""
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 4096)
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int, holder: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    os.fsync(fd)


def _gone(holder: dict[str, Any]) -> bool:
    """Whether the recorded holder is known to have ended: a process of this host that no longer runs. A process of
    another host cannot be checked from here."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # runs, as another user
        return False
    return False
