"""The online loop on two processes (gloo over loopback, 4 CPU devices each) against one process with the same 8
devices: the same trajectories consumed, the same parameters at the end; SIGTERM to one process stops both with one
checkpoint, from which both resume; a crash of process 0 ends the other; a weight sync that fails on process 0 stops
both; dynamic sampling's groups, drawn on process 0, train both. Each process runs
tests/pipeline/online_worker.py."""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from cpu_env import xla_flags
from tiny_pipeline import REPO, tiny_config

from ipa_jax.models.hf_io import SafetensorsReader, hf_tensors
from ipa_jax.pipeline import RunFolder, validate
from ipa_jax.pipeline.build import build_mesh, build_model

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "online_worker.py")


def _env(devices: int) -> dict:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(devices),
        "PYTHONPATH": os.pathsep.join([REPO, HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(run_dir, tokenizer_dir, processes: int, **overrides) -> list[subprocess.Popen]:
    port = str(_free_port())
    return [
        subprocess.Popen(
            [sys.executable, WORKER, str(run_dir), tokenizer_dir, str(processes), str(i), port, json.dumps(overrides)],
            env=_env(8 // processes),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    errors = [p.communicate(timeout=timeout)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for e in errors]
    return errors


@pytest.mark.slow
def test_two_processes_consume_the_trajectories_and_reach_the_parameters_of_one(tmp_path, tokenizer_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    _finish(_start(one, tokenizer_dir, 1))
    _finish(_start(two, tokenizer_dir, 2))
    a, b = RunFolder(one).read_trajectories("train"), RunFolder(two).read_trajectories("train")
    assert len(a) == 24 and all(t.info.get("expert") for t in a[:8])  # one IL batch, two resampling batches
    assert [t.uid.split("#")[0] for t in b] == [t.uid.split("#")[0] for t in a]  # (a sampled uid ends in a nonce)
    for x, y in zip(a, b):
        assert x.tokens.tolist() == y.tokens.tolist() and (x.action_mask == y.action_mask).all()
        assert x.reward == y.reward and x.policy_version == y.policy_version
        np.testing.assert_allclose(y.behavior_logprobs, x.behavior_logprobs, rtol=1e-4, atol=1e-5)
    assert sum(int(t.action_mask.sum()) for t in a) > 0  # the engine sampled them
    rows_a = [r for r in RunFolder(one).read_metrics() if "loss" in r]
    rows_b = [r for r in RunFolder(two).read_metrics() if "loss" in r]
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in rows_b], [r["loss"] for r in rows_a], rtol=1e-5, atol=1e-7)
    # The exported policy (hf_tensors gathered to process 0, written by it alone).
    ra, rb = SafetensorsReader(one / "hf"), SafetensorsReader(two / "hf")
    assert sorted(ra.keys()) == sorted(rb.keys()) and len(ra.keys()) > 10
    for key in ra.keys():
        x, y = np.asarray(ra.get(key), np.float64), np.asarray(rb.get(key), np.float64)
        assert np.linalg.norm(y - x) <= 1e-5 * np.linalg.norm(x), key
    summary_a, summary_b = (json.load(open(d / "summary.json")) for d in (one, two))
    assert summary_b["eval_history"][0]["step"] == 0 and len(summary_b["eval_history"]) == 3
    assert summary_b["il_warmup_steps"] == summary_a["il_warmup_steps"] == 1


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_trains_on_process_0s_groups(tmp_path, tokenizer_dir):
    """queue.dynamic_sampling with the trajectory queue: process 0 draws the groups, both processes train on the
    batch it decides. The untrained policy fails every task, so every group's rewards are equal: each RL batch hits
    the draw bound (one batch's worth: 4 groups of 2) and is made of the dropped groups."""
    run_dir = tmp_path / "run"
    overrides = {
        "rollout.source": "queue",
        "resample.il_fallback": False,
        "rollout.concurrency": 4,
        "rollout.group_size": 2,
        "objective.baseline": "group_mean",
        "queue.dynamic_sampling": True,
        "queue.dynamic_sampling_max_batches": 1,
        "checkpoint.export_hf": False,
    }
    errors = _finish(_start(run_dir, tokenizer_dir, 2, **overrides))
    assert "queue.dynamic_sampling_max_batches" in errors[0], errors[0][-3000:]
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows[1:]:
        assert r["source/dynamic_groups_drawn"] == r["source/dynamic_groups_dropped"] == 4
        assert r["source/dynamic_groups_filled"] == 4 and r["source/dynamic_bound_hit"] == 1
    sampled = [t for t in RunFolder(run_dir).read_trajectories("train") if not t.info.get("expert")]
    assert len(sampled) == 16 and {t.reward for t in sampled} == {0.0}
    for batch in (sampled[:8], sampled[8:]):
        assert sorted(collections.Counter(t.info["task_id"] for t in batch).values()) == [2, 2, 2, 2]


def _last_step(run_dir) -> int:
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return 0
    return max((r["step"] for r in RunFolder(run_dir).read_metrics() if "loss" in r), default=0)


@pytest.mark.slow
def test_a_pool_down_at_process_0s_weight_sync_stops_both_with_one_checkpoint(tmp_path, tokenizer_dir):
    """Process 0 writes the bfloat16 weights folder (from the weights gathered to it; the stacked layers of
    model.scan_layers one by one) and finds no server past the outage budget: its TrainingStopped reaches the other
    process, and both save the step-0 checkpoint together."""
    run_dir = tmp_path / "run"
    dead = f"http://127.0.0.1:{_free_port()}"
    overrides = {
        "rollout.engine": "sglang",
        "rollout.sglang_urls": [dead],
        "rollout.outage_budget_s": 1.0,
        "rollout.control_timeout_s": 2.0,
        "rollout.probe_interval_s": 0.2,
        "checkpoint.export_hf": False,
        "model.scan_layers": True,
    }
    procs = _start(run_dir, tokenizer_dir, 2, **overrides)
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], [e[-3000:] for e in errors]
    assert all("TrainingStopped: weight sync to version 0 failed" in e and "outage budget" in e for e in errors), [
        e[-3000:] for e in errors
    ]
    assert os.listdir(run_dir / "checkpoints") == ["0"]
    # The initial weights, built here on one process and rounded to bfloat16 by NumPy.
    exp = validate(tiny_config(run_dir, **{"model.tokenizer": tokenizer_dir, **overrides}))
    expected = hf_tensors(build_model(exp.model, build_mesh(exp.mesh), exp.train.seed))
    written = SafetensorsReader(run_dir / "weights" / "v00000000")
    assert sorted(written.keys()) == sorted(expected) and "model.layers.1.mlp.experts.3.up_proj.weight" in expected
    for name, value in expected.items():
        assert written.get(name).dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(written.get(name), value.astype(ml_dtypes.bfloat16), err_msg=name)


LONG = {"train.steps": 10_000, "checkpoint.every": 0, "checkpoint.export_hf": False}


def _start_long_and_wait(run_dir, tokenizer_dir, steps: int = 2) -> list[subprocess.Popen]:
    procs = _start(run_dir, tokenizer_dir, 2, **LONG)
    deadline = time.time() + 600
    while _last_step(run_dir) < steps and all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
    return procs


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_with_one_checkpoint_and_both_resume(tmp_path, tokenizer_dir):
    run_dir = tmp_path / "run"
    procs = _start_long_and_wait(run_dir, tokenizer_dir)
    procs[1].send_signal(signal.SIGTERM)  # the process that owns nothing: process 0 must stop with it
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], [e[-3000:] for e in errors]
    reached = _last_step(run_dir)
    assert 2 <= reached < 10_000
    assert f"interrupted at step {reached}: saving a checkpoint" in errors[0], errors[0][-3000:]
    assert os.listdir(run_dir / "checkpoints") == [str(reached)]
    consumed = len(RunFolder(run_dir).read_trajectories("train"))
    # Both processes resume from that checkpoint (process 0's source position) and train one more step.
    errors = _finish(
        _start(run_dir, tokenizer_dir, 2, **{**LONG, "train.steps": reached + 1, "train.allow_config_change": True})
    )
    assert f"resumed from step {reached}" in errors[0], errors[0][-3000:]
    assert _last_step(run_dir) == reached + 1 and json.load(open(run_dir / "summary.json"))["steps"] == reached + 1
    assert len(RunFolder(run_dir).read_trajectories("train")) == consumed + 8


@pytest.mark.slow
def test_a_crash_of_process_0_ends_the_other_process(tmp_path, tokenizer_dir):
    """Process 0 SIGKILLed mid-run: the other process's next collective fails (gloo: the peer's connection closes;
    else the distributed service's heartbeat timeout ends it) instead of waiting forever."""
    procs = _start_long_and_wait(tmp_path / "run", tokenizer_dir)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    _, error = procs[1].communicate(timeout=300)
    assert procs[1].returncode != 0 and (
        # gloo reports the dead peer as a closed or a reset connection; else the service's heartbeat timeout
        "Connection closed by peer" in error or "Connection reset by peer" in error or "heartbeat" in error.lower()
    ), error[-3000:]
