"""Run folders and checkpoints on an object store's URI: paths reach etils.epath (and Orbax) unchanged, and a
run folder at gs://bucket/run, served here by a fake bucket on a local folder, ends with the same files as the same
operations on a local run folder."""

import contextlib
import filecmp
import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from etils.epath import testing as epath_testing
from tiny_models import tiny_qwen3_config

from ipa_jax import storage
from ipa_jax.models import init_model
from ipa_jax.pipeline import RunFolder, load_config, validate
from ipa_jax.pipeline.export import existing_tokenizer, export_policy
from ipa_jax.pipeline.tokenizer import load_or_build_tokenizer
from ipa_jax.train import LoggingConfig
from ipa_jax.train.checkpoint import CheckpointConfig, Checkpointer
from ipa_jax.trajectory import Trajectory, build_chunk_ids

BUCKET = "gs://bucket"
TINY_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "offline_tiny.py")


@contextlib.contextmanager
def fake_bucket(root: str):
    """Serves gs://bucket/<key> from <root>/<key> through every etils.epath backend call (what an object store's
    backend receives); local paths pass through."""

    def local(path):
        path = os.fspath(path)
        return root + path[len(BUCKET) :] if path.startswith(BUCKET) else path

    def remote(path):
        return BUCKET + path[len(root) :] if path.startswith(root) else path

    def one(fn, path, *args, **kwargs):
        return fn(local(path), *args, **kwargs)

    def two(fn, path, dst, *args, **kwargs):
        return fn(local(path), local(dst), *args, **kwargs)

    def glob(fn, pattern):
        return [remote(p) for p in fn(local(pattern))]

    def walk(fn, top, **kwargs):
        for folder, dirs, files in fn(local(top), **kwargs):
            yield remote(os.fspath(folder)), dirs, files

    with epath_testing.mock_epath(
        copy=two,
        exists=one,
        glob=glob,
        isdir=one,
        listdir=one,
        makedirs=one,
        mkdir=one,
        open=one,
        remove=one,
        rename=two,
        replace=two,
        rmtree=one,
        stat=one,
        walk=walk,
    ):
        yield


def test_local_and_uri_paths():
    assert storage.is_local("runs/x") and storage.is_local("/abs/x") and not storage.is_local("gs://b/run")
    assert storage.absolute("gs://b/run") == "gs://b/run"
    assert storage.absolute("runs/x") == os.path.join(os.getcwd(), "runs", "x")


def test_local_write_and_append(tmp_path):
    path = str(tmp_path / "a" / "b.txt")
    storage.append_text(path, "one\n")
    storage.append_text(path, "two\n")
    assert open(path, encoding="utf-8").read() == "one\ntwo\n"
    storage.write_text(path, "three\n")
    assert open(path, encoding="utf-8").read() == "three\n" and os.listdir(tmp_path / "a") == ["b.txt"]


def test_checkpointer_hands_the_uri_to_orbax_unchanged(monkeypatch):
    received = []
    monkeypatch.setattr(ocp, "CheckpointManager", lambda directory, **kwargs: received.append(directory))
    checkpointer = Checkpointer(RunFolder(f"{BUCKET}/run").checkpoints_dir, CheckpointConfig())
    assert isinstance(received[0], epath.Path) and str(received[0]) == f"{BUCKET}/run/checkpoints"
    assert str(checkpointer.directory) == f"{BUCKET}/run/checkpoints"
    Checkpointer("runs/local/checkpoints", CheckpointConfig())  # local paths are made absolute, as before
    assert str(received[1]) == os.path.join(os.getcwd(), "runs", "local", "checkpoints")


def _trajectories(n: int, seed: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        action = np.arange(12) >= 4
        out.append(
            Trajectory(
                uid=f"t{seed}-{i}",
                tokens=(np.arange(12) * (i + 3)) % 64,
                action_mask=action,
                behavior_logprobs=np.where(action, -2.0, 0.0),
                chunk_ids=build_chunk_ids(action, [11]),
                expert_mask=np.zeros(12, bool),
                reward=float(i % 2),
                policy_version=seed,
                info={"task_id": f"task-{i}", "split": "train"},
            )
        )
    return out


def _use(folder: RunFolder) -> dict:
    """Every kind of run-folder write, a resume that cuts the logs back, and the reads; returns what was read."""
    folder.write_config({"train": {"il_warmup_steps": 0}})
    log = folder.metrics_log(LoggingConfig(tensorboard=False))
    log.start(None)
    for step in range(1, 5):
        log.write(step, {"loss": 1.0 / step, "nan": float("nan")})
    log.close()
    folder.append_trajectories("train", _trajectories(3, 0))
    folder.append_trajectories("train", _trajectories(2, 1))
    folder.write_samples(2, _trajectories(2, 2))
    for step in (2, 4):
        folder.write_eval_tasks(step, {"tasks": [step]})
        for name in ("model.safetensors", "config.json"):
            storage.write_text(os.path.join(folder.checkpoints_dir, str(step), name), "{}")
    folder.record_config_change(2, {"train.steps": (4, 6)})
    # resume from the checkpoint at step 2
    folder.truncate_trajectories("train", 4)
    log = folder.metrics_log(LoggingConfig(tensorboard=False))
    log.start(2)
    log.write(3, {"loss": 0.25})
    log.close()
    folder.write_summary({"steps": 3})
    return {
        "metrics": [(r["step"], r["loss"]) for r in folder.read_metrics()],
        "train": [t.uid for t in folder.read_trajectories("train")],
        "count": folder.count_trajectories("train"),
        "samples": [(s, t.uid) for s, t in folder.read_samples("train")],
        "eval": folder.eval_tasks_steps(),
        "checkpoint": folder.latest_checkpoint_step(),
        "summary": folder.read_summary(),
        "rl_start": folder.rl_start(),
        "has": (folder.has_config(), folder.has_summary()),
    }


def _same_tree(a, b, ignore: tuple[str, ...] = ()) -> None:
    comparison = filecmp.dircmp(a, b, ignore=[*filecmp.DEFAULT_IGNORES, *ignore])
    assert comparison.left_only == comparison.right_only == comparison.diff_files == [], (a, b)
    assert filecmp.cmpfiles(a, b, comparison.common_files, shallow=False)[0] == sorted(comparison.common_files)
    for sub in comparison.common_dirs:
        _same_tree(os.path.join(a, sub), os.path.join(b, sub), ignore)


def test_run_folder_on_a_bucket_ends_like_a_local_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URI taken for a relative local path would show up here as ./gs:/...
    local = _use(RunFolder(str(tmp_path / "local")))
    assert local["metrics"] == [(1, 1.0), (2, 0.5), (3, 0.25)] and local["count"] == 4
    assert local["train"] == ["t0-0", "t0-1", "t0-2", "t1-0"] and local["eval"] == [2] and local["checkpoint"] == 4
    with fake_bucket(str(tmp_path / "bucket")):
        remote = _use(RunFolder(f"{BUCKET}/run"))
    assert remote == local
    assert sorted(os.listdir(tmp_path)) == ["bucket", "local"]
    # config_changes.jsonl stamps each record with the wall-clock second it was written: the same records but for
    # "time" (the two runs can straddle a second, more often on a loaded machine)
    changes = []
    for run_dir in (tmp_path / "local", tmp_path / "bucket" / "run"):
        with open(run_dir / "config_changes.jsonl", encoding="utf-8") as f:
            changes.append([{k: v for k, v in json.loads(line).items() if k != "time"} for line in f])
    assert changes[0] == changes[1] == [{"step": 2, "changes": {"train.steps": [4, 6]}}]
    _same_tree(str(tmp_path / "local"), str(tmp_path / "bucket" / "run"), ignore=("config_changes.jsonl",))


def test_wandb_needs_a_local_run_folder():
    pytest.importorskip("wandb")
    log = RunFolder(f"{BUCKET}/run").metrics_log(LoggingConfig(tensorboard=False, wandb=True))
    with pytest.raises(ValueError, match="must be local"):
        log._start_wandb(None)


def test_local_folder_and_local_copy_round_trip_a_tree(tmp_path):
    with fake_bucket(str(tmp_path / "bucket")):
        with storage.local_folder(f"{BUCKET}/tree") as local:
            assert storage.is_local(local)
            os.makedirs(os.path.join(local, "sub"))
            for name, data in (("a.bin", b"\0\1" * 1000), ("sub/b.json", b"{}")):
                with open(os.path.join(local, name), "wb") as f:
                    f.write(data)
        with storage.local_copy(f"{BUCKET}/tree") as copy:
            _same_tree(copy, str(tmp_path / "bucket" / "tree"))
    assert not os.path.exists(local) and not os.path.exists(copy)  # the temporary folders are gone
    with storage.local_folder(tmp_path / "here") as local:  # a local path is used as it is
        assert local == str(tmp_path / "here")


def test_hf_folders_of_a_bucket_run_folder(tmp_path, monkeypatch):
    """The run's tokenizer and the exported policy (libraries that write local folders only) on gs://."""
    monkeypatch.chdir(tmp_path)
    exp = validate(load_config(TINY_CONFIG, ["model.arch.vocab_size=1024"]))
    model = init_model(tiny_qwen3_config())
    local = RunFolder(str(tmp_path / "local"))
    tokenizer = load_or_build_tokenizer(exp.model, local)
    export_policy(model, None, local.hf_dir)
    with fake_bucket(str(tmp_path / "bucket")):
        remote = RunFolder(f"{BUCKET}/run")
        assert len(load_or_build_tokenizer(exp.model, remote)) == len(tokenizer)  # built and copied there
        assert existing_tokenizer(exp.model, remote).get_vocab() == tokenizer.get_vocab()  # read back from there
        export_policy(model, None, remote.hf_dir)
    assert sorted(os.listdir(tmp_path)) == ["bucket", "local"]
    _same_tree(local.tokenizer_dir, str(tmp_path / "bucket" / "run" / "tokenizer"))
    _same_tree(local.hf_dir, str(tmp_path / "bucket" / "run" / "hf"))
