"""run(): a finished run reruns as a no-op, a changed config is refused (or, when allowed, recorded and resumed; a
change the checkpoint cannot take, before anything is written), keys added to the config since a folder was written do
not count as changes, and updates skipped as non-finite are counted and, too many in a row, stop the run."""

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest
from tiny_pipeline import offline_rows

from ipa_jax.pipeline import ConfigError, RunFolder, load_config, run
from ipa_jax.train import TrainingStopped
from ipa_jax.trajectory import write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "offline_tiny.py")


@pytest.fixture
def finished_run(tmp_path):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, offline_rows(16))
    overrides = {
        "train.data": (str(data),),
        "train.run_dir": str(tmp_path / "run"),
        "train.steps": 2,
        "checkpoint.every": 1,
        "logging.tensorboard": False,
        "train.batch_size": 8,
    }
    run(load_config(TINY, overrides))
    return overrides, RunFolder(tmp_path / "run")


def test_rerunning_a_finished_run_changes_nothing(finished_run, capsys):
    overrides, folder = finished_run
    before = open(folder.summary_path, encoding="utf-8").read()
    mtime = os.path.getmtime(folder.summary_path)
    capsys.readouterr()
    summary = run(load_config(TINY, overrides))
    assert "is finished: step 2 of 2" in capsys.readouterr().out
    assert summary == json.loads(before) and open(folder.summary_path, encoding="utf-8").read() == before
    assert os.path.getmtime(folder.summary_path) == mtime
    assert [r["step"] for r in folder.read_metrics() if "loss" in r] == [1, 2]


def test_a_changed_config_is_refused_then_recorded_when_allowed(finished_run):
    overrides, folder = finished_run
    with pytest.raises(ConfigError, match=r"optimizer\.lr: 0\.003 -> 0\.001; train\.steps: 2 -> 3") as error:
        run(load_config(TINY, {**overrides, "train.steps": 3, "optimizer.lr": 1e-3}))
    assert error.value.key == "train.allow_config_change"
    assert folder.read_config()["train"]["steps"] == 2  # untouched
    summary = run(load_config(TINY, {**overrides, "train.steps": 3, "train.allow_config_change": True}))
    assert summary["steps"] == 3 and folder.read_config()["train"]["steps"] == 3
    (record,) = [json.loads(line) for line in open(folder.file("config_changes.jsonl"), encoding="utf-8")]
    assert record["step"] == 2 and record["changes"] == {"train.steps": [2, 3]}
    assert [r["step"] for r in folder.read_metrics() if "loss" in r] == [1, 2, 3]


def test_keys_added_since_the_folder_was_written_are_not_changes(finished_run, capsys):
    overrides, folder = finished_run
    old = folder.read_config()
    del old["env"]["module"], old["logging"]["console_every"]  # as written before these keys existed
    with open(folder.config_path, "w", encoding="utf-8") as f:
        json.dump(old, f)
    run(load_config(TINY, overrides))
    assert "is finished" in capsys.readouterr().out


def test_a_changed_shape_is_refused_on_one_line_before_the_folder_changes(finished_run, capfd):
    """hidden_size 32 -> 64 under train.allow_config_change: refused from the checkpoint's metadata, naming the first
    parameter, before config.json or config_changes.jsonl change (no restore attempted, so none of TensorStore's
    output); the folder's own config still resumes it afterwards."""
    overrides, folder = finished_run
    run(load_config(TINY, {**overrides, "train.steps": 3, "train.allow_config_change": True}))  # a change it takes
    files = {name: open(folder.file(name), "rb").read() for name in ("config.json", "config_changes.jsonl")}
    capfd.readouterr()
    wider = {**overrides, "train.steps": 4, "train.allow_config_change": True, "model.arch.hidden_size": 64}
    with pytest.raises(ConfigError) as error:
        run(load_config(TINY, wider))
    message = str(error.value)
    assert "\n" not in message and error.value.key == "train.allow_config_change"
    assert "checkpoint of step 3" in message
    assert "params.embed_tokens.value: stored float32[128, 32], requested float32[128, 64]" in message
    assert {name: open(folder.file(name), "rb").read() for name in files} == files
    assert "TensorStore" not in "".join(capfd.readouterr())
    run(load_config(TINY, {**overrides, "train.steps": 3}))  # the folder's own config: finished, not an inverted diff
    assert "is finished: step 3 of 3" in capfd.readouterr().out
    summary = run(load_config(TINY, {**overrides, "train.steps": 4, "train.allow_config_change": True}))
    assert summary["steps"] == 4
    assert [r["step"] for r in folder.read_metrics() if "loss" in r] == [1, 2, 3, 4]


def test_updates_skipped_in_a_row_stop_the_run_with_a_checkpoint(tmp_path):
    """optimizer.lr = 1e30 overflows every update: each is skipped, and the third in a row stops the run
    (TrainingStopped, status 1 on the command line) with a checkpoint and no summary."""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, offline_rows(16))
    config = load_config(
        TINY,
        {
            "train.data": (str(data),),
            "train.run_dir": str(tmp_path / "run"),
            "train.steps": 8,
            "train.batch_size": 8,
            "checkpoint.every": 0,
            "logging.tensorboard": False,
            "optimizer.lr": 1e30,
            "train.max_consecutive_skipped": 3,
        },
    )
    with pytest.raises(TrainingStopped) as stopped:
        run(config)
    assert re.fullmatch(
        r"the last 3 updates \(steps 1-3\) were all skipped as non-finite \(at step 3: the update "
        r"would not be finite at lr 1e\+30; loss [\d.]+, grad_norm [\d.]+\); "
        r"train\.max_consecutive_skipped = 3",
        str(stopped.value),
    )
    folder = RunFolder(tmp_path / "run")
    assert folder.latest_checkpoint_step() == 3 and not folder.has_summary()
    assert [r["skipped_total"] for r in folder.read_metrics() if "loss" in r] == [1, 2, 3]


def test_rl_updates_with_zero_gradient_in_a_row_stop_the_run_with_the_remedy(tmp_path, caplog):
    """Every reward 0 and no baseline (the ipa preset): every RL advantage is 0, so every RL gradient is exactly 0;
    the IL warm start's 2 updates (a gradient from the expert tokens) do not count, the first RL update warns and
    the third in a row stops the run naming the remedy."""
    data = tmp_path / "data.jsonl"
    rows = offline_rows(16)
    for i, tr in enumerate(rows):
        tr.reward = 0.0
        if i % 2:  # a scripted expert's episode: the warm start's signal
            tr.expert_mask, tr.action_mask = tr.action_mask, np.zeros(24, bool)
            tr.behavior_logprobs, tr.chunk_ids = np.zeros(24), np.full(24, -1)
    write_jsonl(data, rows)
    config = load_config(
        TINY,
        {
            "train.data": (str(data),),
            "train.run_dir": str(tmp_path / "run"),
            "train.steps": 8,
            "train.batch_size": 8,
            "train.il_warmup_steps": 2,
            "checkpoint.every": 0,
            "logging.tensorboard": False,
            "train.max_consecutive_zero_grad": 3,
        },
    )
    with pytest.raises(TrainingStopped) as stopped:
        run(config)
    assert re.fullmatch(
        r"the last 3 RL updates \(steps 3-5\) had a zero gradient \(every advantage 0, batch reward "
        r"mean 0\): use a baseline \(objective\.baseline=batch_mean\) or a longer warm start "
        r"\(train\.il_warmup_steps\) so that rewards differ; train\.max_consecutive_zero_grad = 3",
        str(stopped.value),
    )
    assert sum("RL update 3 has a zero gradient" in r.getMessage() for r in caplog.records) == 1
    grad_norms = [r["grad_norm"] for r in RunFolder(tmp_path / "run").read_metrics() if "loss" in r]
    assert len(grad_norms) == 5 and min(grad_norms[:2]) > 0 and grad_norms[2:] == [0.0] * 3


def test_skipped_updates_are_in_the_summary_and_its_console_lines(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, offline_rows(16))
    summary = run(
        load_config(
            TINY,
            {
                "train.data": (str(data),),
                "train.run_dir": str(tmp_path / "run"),
                "train.steps": 2,
                "train.batch_size": 8,
                "checkpoint.every": 0,
                "logging.tensorboard": False,
                "optimizer.lr": 1e30,
                "train.max_consecutive_skipped": 0,
            },
        )
    )
    assert summary["skipped_updates"] == 2 == RunFolder(tmp_path / "run").read_summary()["skipped_updates"]
    assert "steps: 2 (0 IL warm start, 2 skipped as non-finite)" in capsys.readouterr().out


def test_reference_kl_runs_offline_with_its_metrics_cost_and_a_resume(tmp_path):
    """The KL term and penalty in a tiny offline run: their metrics and the reference forward's time in every
    update's metrics and in the summary; the reference ("rl_start": the weights at RL's start, after a 1-step warm
    start) is saved with the checkpoint, so a resumed run continues with the same reference."""
    data = tmp_path / "data.jsonl"
    expert = np.arange(24) < 4  # imitation targets in the prompt: the warm start moves the weights
    expert[0] = False
    write_jsonl(data, [dataclasses.replace(t, expert_mask=expert) for t in offline_rows(24)])
    overrides = {
        "train.data": (str(data),),
        "train.run_dir": str(tmp_path / "run"),
        "train.steps": 3,
        "train.batch_size": 8,
        "train.il_warmup_steps": 1,
        "checkpoint.every": 1,
        "logging.tensorboard": False,
        "objective.kl_weight": 0.1,
        "objective.kl_penalty": 0.01,
        "model.reference": "rl_start",
    }
    summary = run(load_config(TINY, overrides))
    folder = RunFolder(tmp_path / "run")
    rows = [r for r in folder.read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "kl_loss" not in rows[0] and "reference_forward_s" not in rows[0]  # the warm start imitates only
    for r in rows[1:]:
        assert r["reference_forward_s"] > 0 and np.isfinite([r["kl_loss"], r["reference_kl"]]).all()
        assert np.isfinite(r["kl_penalty_sequence_mean"])
    # the reference is the policy at RL's start, not the initial one (the warm start moved it)
    assert rows[1]["kl_loss"] == pytest.approx(0.0, abs=1e-6) and rows[0]["grad_norm"] > 0
    assert rows[2]["kl_loss"] > 1e-6
    assert summary["time_reference_forward_s"] > 0
    # Resumed from step 2 (a later snapshot would make step 3's KL 0, the initial weights another value): the
    # reference is the checkpointed one and step 3 repeats the uninterrupted run's.
    shutil.rmtree(os.path.join(folder.checkpoints_dir, "3"))
    os.remove(folder.summary_path)
    run(load_config(TINY, overrides))
    resumed = [r for r in folder.read_metrics() if "loss" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[2]["kl_loss"] == pytest.approx(rows[2]["kl_loss"], rel=1e-5)
    # Turning the KL off on a resume: its checkpoints hold a reference the new state has no place for.
    off = {**overrides, "objective.kl_weight": 0.0, "objective.kl_penalty": 0.0, "train.steps": 4}
    with pytest.raises(ConfigError, match=r"ref_params\..*requested nothing"):
        run(load_config(TINY, {**off, "train.allow_config_change": True}))
    # Two updates per batch (minibatches of rows, advantages with the penalty from the whole batch): the first RL
    # batch takes the snapshot before its first update, and each update gets its rows of the reference log-probs.
    minibatched = {
        **overrides,
        "train.run_dir": str(tmp_path / "mb"),
        "train.minibatches": 2,
        "train.steps": 4,
        "train.batch_size": 16,
    }
    run(load_config(TINY, {**minibatched, "train.il_warmup_steps": 2}))
    rows = [r for r in RunFolder(tmp_path / "mb").read_metrics() if "loss" in r]
    assert [("kl_loss" in r) for r in rows] == [False, False, True, True]
    assert rows[2]["kl_loss"] == pytest.approx(0.0, abs=1e-6) and rows[3]["kl_loss"] > 1e-6
