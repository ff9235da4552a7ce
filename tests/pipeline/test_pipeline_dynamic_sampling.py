"""Dynamic sampling in the online loop (queue.dynamic_sampling): its config errors, its progress-line field, and a
tiny online run (the shared tiny setting, groups of 2) whose metrics, consumed batches and summary show the groups
drawn, dropped and refilled. The GroupSampler's own logic: tests/rollout/test_rollout_dynamic_sampling.py."""

import collections
import dataclasses
import hashlib
import io
import os

import pytest
from tiny_pipeline import tiny_config

from ipa_jax.pipeline import ConfigError, RunFolder, run, validate
from ipa_jax.pipeline.run import format_summary
from ipa_jax.rollout import workers
from ipa_jax.train.progress import Progress
from ipa_jax.trajectory import group_key, read_jsonl

GROUPS = {"rollout.group_size": 2, "objective.baseline": "group_mean", "queue.dynamic_sampling": True}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout.group_size": 1, "objective.baseline": "none"}, "rollout.group_size > 1"),
        ({"rollout.group_size": 3}, "must divide train.batch_size=8"),
        ({"resample.mode": "rollback"}, "needs rollout.source 'queue' .*'resample'"),
        ({"queue.dynamic_sampling_max_batches": 0}, "must be >= 1"),
    ],
)
def test_dynamic_sampling_without_whole_groups_from_the_queue_is_a_config_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        validate(tiny_config(tmp_path, **{**GROUPS, **overrides}))
    assert error.value.key.startswith("queue.dynamic_sampling")


def test_dynamic_sampling_of_offline_data_is_a_config_error(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("")
    with pytest.raises(ConfigError, match="offline trajectories"):
        validate(tiny_config(tmp_path, **{**GROUPS, "train.data": (str(data),)}))


def test_progress_line_shows_the_groups_kept_of_those_drawn():
    stream = io.StringIO()
    progress = Progress(total=4, initial=0, every=1, stream=stream)
    metrics = {"loss": 0.5, "reward_mean": 0.5, "tokens_per_s": 100.0}
    progress.step(1, {**metrics, "source/dynamic_groups_drawn": 7.0, "source/dynamic_groups_dropped": 3.0}, False)
    drawn = {"source/dynamic_groups_drawn": 8.0, "source/dynamic_groups_dropped": 7.0, "source/dynamic_bound_hit": 1.0}
    progress.step(2, {**metrics, **drawn}, False)
    progress.step(3, metrics, False)
    lines = stream.getvalue().splitlines()
    assert "groups kept 4/7  " in lines[0] and "groups kept 1/8 (draw bound)" in lines[1] and "groups" not in lines[2]


def mixed_task(task_id: str) -> bool:
    """Half of the tasks (by a hash of their id): their groups get rewards 1, 0, ...; the others all 0."""
    return hashlib.sha256(task_id.encode()).digest()[0] % 2 == 0


@pytest.fixture
def coin_rewards(monkeypatch):
    """The tiny random policy never answers correctly, so every group's rewards would be equal: the rollout
    worker's episodes (real ones, from the embedded engine) get reward 1 for the first finished sample of a mixed
    task, 0 otherwise."""
    real_episode = workers.run_episode
    finished = collections.Counter()

    async def run_episode(engine, chat, task, config, **kwargs):
        traj = await real_episode(engine, chat, task, config, **kwargs)
        if traj is None:
            return None
        first = finished[task.task_id] == 0
        finished[task.task_id] += 1
        return dataclasses.replace(traj, reward=float(first and mixed_task(task.task_id)))

    monkeypatch.setattr(workers, "run_episode", run_episode)


@pytest.mark.slow
def test_online_run_drops_groups_of_equal_rewards_and_refills_the_batch(tmp_path, tokenizer_dir, coin_rewards):
    run_dir = tmp_path / "run"
    summary = run(
        tiny_config(
            run_dir,
            **{
                **GROUPS,
                "model.tokenizer": tokenizer_dir,
                "train.steps": 3,
                "train.il_warmup_steps": 1,
                "queue.dynamic_sampling_max_batches": 4,
            },
        )
    )
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    rl_rows = rows[1:]  # step 1 is the warm start's (expert episodes)
    assert "source/dynamic_groups_drawn" not in rows[0] and len(rl_rows) == 2
    for r in rl_rows:
        drawn, dropped = r["source/dynamic_groups_drawn"], r["source/dynamic_groups_dropped"]
        assert r["source/dynamic_episodes_drawn"] == 2 * drawn and r["source/dynamic_episodes_dropped"] == 2 * dropped
        # 4 groups of 2 fill the batch of 8: groups with different rewards, and equal-reward ones only at the bound.
        assert drawn - dropped + r["source/dynamic_groups_filled"] == 4
        assert r["source/dynamic_bound_hit"] == (drawn == 16 and drawn - dropped < 4)
        assert r["policy_lag_max"] <= 4  # queue.max_policy_lag
    assert sum(r["source/dynamic_groups_dropped"] for r in rl_rows) > 0  # drops ...
    assert any(r["source/dynamic_groups_drawn"] > 4 for r in rl_rows)  # ... and refills
    # The consumed batches: whole groups of one task each, with different rewards (unless the bound was hit).
    consumed = [t for t in read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl")) if not t.info.get("expert")]
    assert len(consumed) == 16
    for r, batch in zip(rl_rows, (consumed[:8], consumed[8:]), strict=True):
        groups = collections.defaultdict(list)
        for t in batch:
            groups[group_key(t)].append(t.reward)
        assert sorted(map(len, groups.values())) == [2, 2, 2, 2]
        varied = sum(max(g) != min(g) for g in groups.values())
        assert varied == 4 - r["source/dynamic_groups_filled"]
        assert all(mixed_task(task) for task, g in groups.items() if max(g) != min(g))
    # The summary counts the run's draws (every step logged) and prints them.
    assert summary["dynamic_groups_drawn"] == sum(r["source/dynamic_groups_drawn"] for r in rl_rows)
    assert summary["dynamic_groups_dropped"] == sum(r["source/dynamic_groups_dropped"] for r in rl_rows)
    assert "dynamic sampling: " in format_summary(summary)
