"""Shared test setup: 8 fake CPU devices so every sharding can be tested on one machine; fake dev servers in their
own processes for fault-injection tests."""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from cpu_env import xla_flags

from ipa_jax.host_memory import keep_freed_host_memory

# Must happen before JAX initialises its backend; a test run imports this first.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent XLA compilation cache for the session: pytest-xdist's workers and every process a test starts
# inherit it, so a program that several tests, workers or subprocesses build (the same tiny learner, engine and
# pipeline) compiles once. The process that made it removes it at exit.
# Tiny shapes run in microseconds while XLA's LLVM passes take seconds per program: compile with few optimizations.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ipa_jax_tests_xla_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# A test process runs JAX as the entry points do, with their malloc settings (ipa_jax/host_memory.py).
keep_freed_host_memory()


# ---------------------------------------------------------------------------------------------- server processes
FAKE_DEVSERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines", "fake_devserver.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServerProcess:
    """tests/engines/fake_devserver.py in its own process: a dev server to SIGKILL, SIGSTOP and restart on its port.
    `flags`: the script's options (step_s=0.01 -> --step-s 0.01, poisoned=True -> --poisoned)."""

    def __init__(self, port: int | None = None, **flags):
        self.port = port or free_port()
        self.args = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in flags.items()]
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "FakeServerProcess":
        """(Re)start on the same port and wait until /health answers."""
        self.proc = subprocess.Popen([sys.executable, FAKE_DEVSERVER, f"--port={self.port}", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"fake dev server on port {self.port} exited"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return self
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"fake dev server on port {self.port} not up"
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def hang(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


@pytest.fixture
def fake_server():
    """Starts FakeServerProcess(**flags); each one started is killed at teardown."""
    started: list[FakeServerProcess] = []

    def start(**flags) -> FakeServerProcess:
        started.append(FakeServerProcess(**flags))
        return started[-1]

    yield start
    for server in started:
        server.close()
