"""Shared test setup: 8 fake CPU devices so every sharding can be tested on one machine; fake dev servers in their
own processes for fault-injection tests."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest
from cpu_env import xla_flags
from server_process import ServerProcess, cli_flags

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


@pytest.fixture
def fake_server():
    """Starts tests/engines/fake_devserver.py with `flags` (step_s=0.01 -> --step-s=0.01, poisoned=True ->
    --poisoned) as a ServerProcess; each one started is killed at teardown."""
    started: list[ServerProcess] = []

    def start(**flags) -> ServerProcess:
        started.append(ServerProcess([sys.executable, FAKE_DEVSERVER, *cli_flags(**flags)]))
        return started[-1]

    yield start
    for server in started:
        server.close()
