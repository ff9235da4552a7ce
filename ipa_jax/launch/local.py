"""A launcher's local dry run: its per-process command as processes on this machine, each given the environment
its cluster would give it (`Target.process_env`), on CPU with gloo collectives."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass

from ipa_jax.launch.spec import LaunchSpec
from ipa_jax.launch.targets import TARGETS

# Variables by which this machine could itself look like a cluster to jax: a dry run starts without them.
CLUSTER_VARIABLE_PREFIXES = (
    "JAX_COORDINATOR_",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_",
    "OMPI_",
    "TPU_WORKER_",
    "TPU_PROCESS_ADDRESSES",
    "MEGASCALE_",
)


@dataclass(frozen=True)
class LocalProcess:
    process_id: int
    returncode: int
    log_path: str


# How long the other processes may take to exit by themselves once one failed: an error every process meets (a bad
# config, bad data) stops each of them with its own message; a process left waiting in a collective is killed.
STOP_GRACE_S = 10.0


def run_local(spec: LaunchSpec, target: str, log_dir: str, timeout_s: float = 600.0) -> list[LocalProcess]:
    """Renders `spec` for `target` (so it must be valid there), then runs its `spec.num_processes` processes here:
    `spec.train_argv()` in `spec.workdir` with JAX_PLATFORMS=cpu. Each process's output goes to
    <log_dir>/process_<i>.log. When one process fails, the others get STOP_GRACE_S to exit by themselves and are
    then stopped (they would wait in a collective), as they are when `timeout_s` passes. Returns each process's
    exit status (-9: stopped)."""
    if target not in TARGETS:
        raise ValueError(f"launch target must be one of {sorted(TARGETS)}, got {target!r}")
    TARGETS[target].render(spec)
    os.makedirs(log_dir, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLE_PREFIXES)}
    port, count = _free_port(), spec.num_processes
    procs, logs = [], []
    for i in range(count):
        env = {**base, **spec.env, "JAX_PLATFORMS": "cpu", **TARGETS[target].process_env("localhost", port, count, i)}
        logs.append(os.path.join(log_dir, f"process_{i}.log"))
        with open(logs[-1], "w", encoding="utf-8") as log:
            procs.append(
                subprocess.Popen(
                    spec.train_argv(),
                    cwd=spec.workdir,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [LocalProcess(i, p.returncode, log) for i, (p, log) in enumerate(zip(procs, logs, strict=True))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
