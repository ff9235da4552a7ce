"""Multi-process and crash-recovery tests (subprocesses; marked slow)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from cpu_env import xla_flags
from train_helpers import REPO, TINY_CONFIG, synthetic_trajectories

from ipa_jax.pipeline import RunFolder
from ipa_jax.trajectory import write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))


def _env(devices: int) -> dict:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(devices),
        "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    worker = os.path.join(HERE, "dist_worker.py")
    one = subprocess.run(
        [sys.executable, worker, str(tmp_path / "one.npz"), "1", "0", "0"],
        env=_env(8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(tmp_path / "two.npz"), "2", str(i), port],
            env=_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outputs]
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert set(a.files) == set(b.files) and len(a.files) > 10
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-6)
    for key in a.files:
        scale = np.linalg.norm(a[key])
        assert np.linalg.norm(b[key] - a[key]) <= 1e-5 * scale, key


def _train_cmd(data: str, run_dir: str, steps: int) -> list[str]:
    return [
        sys.executable,
        os.path.join(REPO, "experiments", "train.py"),
        f"--config={TINY_CONFIG}",
        f"--config.train.data=('{data}',)",
        f"--config.train.run_dir={run_dir}",
        f"--config.train.steps={steps}",
        "--config.checkpoint.every=2",
        "--config.logging.tensorboard=False",
    ]


def _last_step(run_dir: str) -> int:
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return 0
    rows = RunFolder(run_dir).read_metrics()
    return max((r["step"] for r in rows), default=0)


@pytest.mark.slow
def test_kill9_then_restart_resumes_with_identical_losses(tmp_path):
    data = str(tmp_path / "data.jsonl")
    write_jsonl(data, synthetic_trajectories(10, seed=7))  # batch 4: batches straddle epochs of the file
    steps = 24
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    env = _env(1)  # the three runs compile the same programs once: the session's compilation cache (conftest)
    reference = subprocess.run(_train_cmd(data, ref_dir, steps), env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]

    victim = subprocess.Popen(
        _train_cmd(data, run_dir, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while _last_step(run_dir) < 7 and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = _last_step(run_dir)
    assert victim.returncode == -signal.SIGKILL and 7 <= killed_at < steps, (victim.returncode, killed_at)

    restart = subprocess.run(_train_cmd(data, run_dir, steps), env=env, capture_output=True, text=True, timeout=300)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "resumed from step" in restart.stderr
    resumed_from = int(restart.stderr.split("resumed from step")[1].split()[0])
    assert 2 <= resumed_from <= killed_at and resumed_from % 2 == 0

    ref = {r["step"]: r for r in RunFolder(ref_dir).read_metrics()}
    got = {r["step"]: r for r in RunFolder(run_dir).read_metrics()}
    assert sorted(got) == sorted(ref) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        for key in ("loss", "grad_norm", "reward_mean", "dropped_total"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-6, abs=1e-9), (step, key)
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["train"]["steps"] == steps


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_in_a_background_job_and_sigterm_stop_with_a_checkpoint(tmp_path, sig):
    """A shell starts background jobs with SIGINT ignored; a scheduler preempts with SIGTERM. Both must stop
    the run with a checkpoint at the step reached (periodic checkpoints are off here)."""
    data = str(tmp_path / "data.jsonl")
    write_jsonl(data, synthetic_trajectories(10, seed=7))
    run_dir = str(tmp_path / "run")
    cmd = _train_cmd(data, run_dir, 10_000)
    cmd[cmd.index("--config.checkpoint.every=2")] = "--config.checkpoint.every=0"
    victim = subprocess.Popen(
        cmd,
        env=_env(1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.time() + 300
    while _last_step(run_dir) < 3 and victim.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    victim.send_signal(sig)
    _, stderr = victim.communicate(timeout=120)
    # After its checkpoint: SIGTERM exits 143 (128 + 15, a preempted job's status), SIGINT as an interrupted Python.
    assert victim.returncode == (143 if sig == signal.SIGTERM else -signal.SIGINT), stderr[-3000:]
    reached = _last_step(run_dir)
    assert f"interrupted at step {reached}: saving a checkpoint" in stderr, stderr[-3000:]
    assert 3 <= reached < 10_000 and os.listdir(os.path.join(run_dir, "checkpoints")) == [str(reached)]
