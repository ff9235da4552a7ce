"""Faults injected into whole training runs: rollout servers (fake dev servers in their own processes, on loopback)
SIGKILLed during RL, a pool that stays down, rollouts that are all invalid, a run killed between checkpoints, a
damaged checkpoint, trajectory lines the learner cannot represent. The run must neither crash nor lose, duplicate or
hang beyond its configured timeouts; where it cannot go on it stops with a checkpoint and says why. The client-level
faults (hung servers, cancelled syncs, hostile requests) are in tests/engines/test_engines_fault_injection.py."""

import glob
import logging
import os
import threading

import numpy as np
import pytest
from tiny_pipeline import REPO, TINY, tiny_config

from ipa_jax.pipeline import RunFolder, load_config, run, validate
from ipa_jax.pipeline.build import build_learner, build_mesh, build_state
from ipa_jax.pipeline.cli import EXIT_STOPPED, exit_on_stop
from ipa_jax.pipeline.online import OnlineSource
from ipa_jax.train import TrainingStopped
from ipa_jax.trajectory import Trajectory, build_chunk_ids, write_jsonl

# The pool's timeouts in seconds (production: minutes); the fake servers generate instantly.
POOL = {
    "rollout.engine": "sglang",
    "rollout.request_timeout_s": 2.0,
    "rollout.control_timeout_s": 2.0,
    "rollout.probe_interval_s": 0.2,
    "rollout.keep_weight_folders": 1,
    "train.il_warmup_steps": 0,
    "checkpoint.export_hf": False,
    "model.arch": {**TINY["model.arch"], "num_experts": 0},
}
OFFLINE_TINY = os.path.join(REPO, "configs", "offline_tiny.py")


def pool_config(run_dir, tokenizer_dir, servers, **overrides):
    return tiny_config(
        run_dir,
        **{**POOL, "model.tokenizer": tokenizer_dir, "rollout.sglang_urls": tuple(s.url for s in servers), **overrides},
    )


def consumed_uids(run_dir) -> list[str]:
    return [t.uid for t in RunFolder(run_dir).read_trajectories("train")]


@pytest.mark.slow
def test_servers_killed_during_rl_then_a_crash_the_run_resumes_consistently(
    tmp_path, tokenizer_dir, fake_server, caplog
):
    """Both servers SIGKILLed after step 1 and restarted 1 s later: the weight sync waits for them and the run goes on.
    Then the learner dies after step 3 with its last checkpoint at step 2 (a kill): the rerun resumes there, and
    trajectories/train.jsonl holds exactly what the checkpointed learner consumed, then the new batch; only the newest
    weights/v* folder is kept."""
    servers = [fake_server(), fake_server()]
    run_dir = str(tmp_path / "run")
    config = pool_config(run_dir, tokenizer_dir, servers, **{"train.steps": 3, "checkpoint.every": 2})
    exp = validate(config)
    mesh = build_mesh(exp.mesh)
    state = build_state(exp, mesh)
    source = OnlineSource(exp, state, RunFolder(run_dir))
    restart = threading.Timer(1.0, lambda: [s.start() for s in servers])

    def faults(st):
        step = int(st.step)
        if step == 1:
            for s in servers:
                s.kill()
            restart.start()
        source.after_update(st)  # the weight sync of step 1 waits for the servers
        if step == 3:
            raise RuntimeError("killed after step 3")

    learner = build_learner(exp, source, run_dir=run_dir, mesh=mesh, state=state, after_update=faults)
    with (
        caplog.at_level(logging.WARNING, logger="ipa_jax.engines.sglang"),
        pytest.raises(RuntimeError, match="killed after step 3"),
    ):
        try:
            learner.run()
        finally:
            source.close()
            restart.cancel()
            if restart.is_alive():
                restart.join()
    assert "weight update to version 1: 0 server(s) took it" in caplog.text  # it waited for them
    assert learner.checkpointer.latest_step() == 2
    before = consumed_uids(run_dir)
    assert len(before) == 24  # 16 consumed up to the checkpoint, then the batch of step 3

    summary = run(config)
    assert summary["steps"] == 3
    after = consumed_uids(run_dir)
    assert len(after) == 24 == len(set(after)) and after[:16] == before[:16]
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert os.listdir(os.path.join(run_dir, "weights")) == ["v00000003"]


def test_a_pool_down_past_its_outage_budget_stops_the_run_with_a_checkpoint(tmp_path, tokenizer_dir, fake_server):
    """The first weight sync finds both servers dead: after rollout.outage_budget_s the run stops, with a checkpoint
    and a message naming the servers (experiments/train.py prints it on one line and exits with status 1)."""
    servers = [fake_server(), fake_server()]
    for s in servers:
        s.kill()
    run_dir = str(tmp_path / "run")
    with pytest.raises(TrainingStopped, match="outage budget") as stopped:
        run(pool_config(run_dir, tokenizer_dir, servers, **{"rollout.outage_budget_s": 1.0}))
    assert all(s.url in str(stopped.value) for s in servers)
    assert RunFolder(run_dir).latest_checkpoint_step() == 0  # resumable once the servers are back


def test_a_run_whose_rollouts_are_all_invalid_stops_naming_the_drop_reasons(
    tmp_path, tokenizer_dir, fake_server, caplog
):
    """Every rollout of a poisoned server is invalid (log-probs > 0): the drops are logged (rate-limited), and after
    queue.stall_timeout_s without an admitted trajectory the run stops with a checkpoint and the reasons."""
    server = fake_server(poisoned=True)
    run_dir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="ipa_jax.rollout.queue"):
        with pytest.raises(TrainingStopped, match="no trajectory admitted for 3s") as stopped:
            run(pool_config(run_dir, tokenizer_dir, [server], **{"queue.stall_timeout_s": 3.0}))
    message = str(stopped.value)
    assert "invalid" in message and "behavior_logprobs" in message and "is not finite and <= 0" in message
    drop_lines = [r for r in caplog.records if "trajectory queue dropped" in r.getMessage()]
    assert 1 <= len(drop_lines) <= 2  # one line per 30 s, however many were dropped
    assert RunFolder(run_dir).latest_checkpoint_step() == 0


def test_a_stopped_run_exits_with_one_line_and_status_1(capsys):
    @exit_on_stop
    def main():
        raise TrainingStopped("the pool is gone")

    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == EXIT_STOPPED == 1
    assert capsys.readouterr().err == "stopped: the pool is gone\n"


def _offline_rows(n: int, seed: int = 0) -> list[Trajectory]:
    """n valid rows of 24 tokens: a prompt of 4, then one chunk of 20 sampled tokens."""
    rng = np.random.default_rng(seed)
    action = np.arange(24) >= 4
    return [
        Trajectory(
            uid=f"t{seed}-{i}",
            tokens=rng.integers(0, 128, 24),
            action_mask=action,
            behavior_logprobs=np.where(action, -4.8, 0.0),
            chunk_ids=build_chunk_ids(action, [23]),
            expert_mask=np.zeros(24, bool),
            reward=float(i % 2),
            policy_version=0,
        )
        for i in range(n)
    ]


def _offline_config(data, run_dir, **overrides):
    return load_config(
        OFFLINE_TINY,
        {"train.data": (str(data),), "train.run_dir": str(run_dir), "logging.tensorboard": False, **overrides},
    )


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    """The newest checkpoint's arrays are truncated after it was written: the restart resumes from the previous
    complete checkpoint, says so, moves the damaged one aside and trains the same steps again, to the same losses."""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, _offline_rows(16))
    config = _offline_config(data, tmp_path / "run", **{"train.steps": 4, "checkpoint.every": 2, "train.batch_size": 8})
    run(config)
    folder = RunFolder(tmp_path / "run")
    first = {r["step"]: r["loss"] for r in folder.read_metrics() if "loss" in r}
    for path in glob.glob(os.path.join(folder.checkpoints_dir, "4", "state", "**", "d", "*"), recursive=True):
        open(path, "wb").close()
    os.remove(folder.summary_path)  # as if killed after its last checkpoint
    with caplog.at_level(logging.WARNING):
        summary = run(config)
    assert summary["steps"] == 4
    assert "checkpoint 4" in caplog.text and "restored checkpoint 2, the newest that loads" in caplog.text
    again = {r["step"]: r["loss"] for r in folder.read_metrics() if "loss" in r}
    assert again == pytest.approx(first, rel=1e-6)
    checkpoints = sorted(os.listdir(folder.checkpoints_dir))
    assert "4" in checkpoints and any(name.startswith("4.damaged-") for name in checkpoints)


def test_trajectory_lines_the_learner_cannot_represent_are_dropped_and_the_run_trains(tmp_path):
    """A version beyond int32 (it crashed padding on every resume), a reward finite in float64 but not in float32
    (every batch holding it was skipped) and one outside train.reward_range are invalid: dropped and counted."""
    rows = _offline_rows(11)
    rows[1].policy_version, rows[3].reward, rows[5].reward = 2**40, 1e300, 1e7
    data = tmp_path / "data.jsonl"
    write_jsonl(data, rows)
    summary = run(_offline_config(data, tmp_path / "run", **{"train.steps": 2, "train.batch_size": 8}))
    assert summary["steps"] == 2
    train = [r for r in RunFolder(tmp_path / "run").read_metrics() if "loss" in r]
    assert all(r["skipped"] == 0 and np.isfinite(r["loss"]) and np.isfinite(r["reward_mean"]) for r in train)
    assert train[0]["dropped_trajectories"] == 3
