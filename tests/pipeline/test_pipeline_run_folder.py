"""The metrics sink of the run folder: grouped TensorBoard / W&B tags for every metric name the code logs, the
TensorBoard events under those tags, metrics.jsonl's flat names and resume truncation, and W&B in offline mode
(read back from the offline run's record file)."""

import collections
import functools
import glob
import json
import math
import os
import struct
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from ipa_jax.engines.base import PartialCounts, PrefixCounts
from ipa_jax.pipeline import RunFolder, load_config, validate
from ipa_jax.pipeline.build import build_mesh, build_state, build_steps
from ipa_jax.pipeline.evaluation import episode_metrics
from ipa_jax.pipeline.online import EngineHost, OnlineSource, QueueSource, ResamplingSource
from ipa_jax.pipeline.run_folder import tensorboard_tag
from ipa_jax.rollout.resample import Resampler
from ipa_jax.train import Learner, LoggingConfig
from ipa_jax.train.step import train_step
from ipa_jax.trajectory import Trajectory, build_chunk_ids, pack_batch, pad_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CONFIG = os.path.join(REPO, "configs", "offline_tiny.py")

# Every metric name the learner logs, with its tag. A new name must be added here, in the group it belongs to
# (test_every_logged_name_is_in_the_table fails until it is).
TRAIN = (  # train_step's metrics and the learner's own numbers about the update
    "loss",
    "rl_loss",
    "il_loss",
    "grad_norm",
    "lr",
    "skipped",
    "skipped_total",
    "reward_mean",
    "reward_std",
    "advantage_mean",
    "advantage_std",
    "advantage_min",
    "advantage_max",
    "credit_negative_share_success",
    "admitted_fraction",
    "kept_token_fraction",
    "il_rows",
    "il_greedy_match",
    "kept_chunk_fraction",
    "is_ratio_mean",
    "is_ratio_max",
    "clip_fraction",
    "mismatch_abs",
    "mismatch_kl",
    "mismatch_ratio_mean",
    "mismatch_masked_fraction",
    "mismatch_capped_fraction",
    "chunks_mean",
    "chunks_max",
    "action_tokens",
    "real_tokens",
    "shared_prefix_tokens",
    "nonfinite_weights",
    "load_balancing_loss",
    "router_z_loss",
    "entropy",
    "dropped_trajectories",
    "dropped_total",
    "policy_lag_mean",
    "policy_lag_max",
    "rl_start",
)
PERF = ("step_time_s", "tokens_per_s", "mfu", "seq_len")
EVAL = ("success", "reward", "tool_calls", "tool_errors", "turns", "episodes", "time_s", "pass_at_k")
ROLLOUT = (
    "episodes_per_s",
    "generated_tokens_per_s",
    "success_rate",
    "finished",
    "failed",
    "partial_interrupted_per_update",
    "partial_resumed_per_update",
    "partial_interrupted",
    "partial_resumed",
    "prefix_reused_fraction",
)
RESAMPLE = ("episodes", "success_rate", "il_groups", "rollback_moves", "rollback_anchor_frac", "tasks_at_start")
QUEUE = (
    "depth",
    "dropped_total",
    "dropped_stale",
    "dropped_invalid",
    "dropped_duplicate",
    "lag_taken_mean",
    "put_per_s",
    "admitted_fraction",
)
EXPECTED_TAGS = {
    **{name: f"train/{name}" for name in TRAIN},
    **{name: f"perf/{name}" for name in PERF},
    **{f"eval/{name}": f"eval/{name}" for name in EVAL},
    **{f"source/{name}": f"rollout/{name}" for name in ROLLOUT},
    **{f"source/resample_{name}": f"rollout/resample_{name}" for name in RESAMPLE},
    **{f"source/queue_{name}": f"queue/{name}" for name in QUEUE},
    "source/learner_idle_fraction": "queue/learner_idle_fraction",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_TAGS))
def test_tag_rules(name):
    assert tensorboard_tag(name) == EXPECTED_TAGS[name]


def test_tags_are_unique_and_unknown_names_default_to_train():
    assert len(set(EXPECTED_TAGS.values())) == len(EXPECTED_TAGS)
    assert tensorboard_tag("some_new_loss") == "train/some_new_loss"
    assert tensorboard_tag("source/queue_take_per_s") == "queue/take_per_s"
    assert tensorboard_tag("source/in_flight") == "rollout/in_flight"


def _trajectory(i: int, length: int = 20, vocab: int = 128) -> Trajectory:
    """A valid episode: prompt of 3, two action chunks around a 2-token observation, expert prompt tokens."""
    tokens = (np.arange(length) * 7 + i) % vocab
    action = np.zeros(length, bool)
    action[3:8] = action[10:length] = True
    expert = np.zeros(length, bool)
    expert[1:3] = True
    return Trajectory(
        uid=f"t{i}",
        tokens=tokens,
        action_mask=action,
        behavior_logprobs=np.where(action, -4.8, 0.0),
        chunk_ids=build_chunk_ids(action, [7]),
        expert_mask=expert,
        reward=float(i % 2),
        policy_version=0,
    )


def _logged_names() -> set[str]:
    """The names one online training line and one evaluation carry, from the code that makes them: train_step's
    metrics (traced, not run), Learner._host_metrics over an online source with a queue, a worker and resampling,
    and the evaluation's episode metrics."""
    moe = (
        "model.arch.num_experts=4",
        "model.arch.num_experts_per_tok=2",
        "model.arch.moe_intermediate_size=16",
        "model.load_balancing_coef=0.01",
        "model.router_z_coef=0.001",
        "train.batch_size=8",
    )
    exp = validate(load_config(TINY_CONFIG, moe))
    mesh = build_mesh(exp.mesh)
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    batch = pad_batch([_trajectory(i) for i in range(8)], exp.train.buckets)
    fn = functools.partial(train_step, options=step.options, schedule=step.schedule)
    metrics = jax.eval_shape(fn, state, batch, None)[1]
    # packed rows with shared prefixes (train.share_prefix) add theirs
    shared = pack_batch([_trajectory(i) for i in range(8)], exp.train.buckets, share_prefix=True)[0]
    metrics = {**metrics, **jax.eval_shape(fn, state, shared, None)[1]}

    zeros = lambda: collections.defaultdict(float)  # noqa: E731  (stats() with every key at 0)
    resampler = SimpleNamespace(
        metrics=functools.partial(Resampler.metrics, SimpleNamespace(experts={}, _anchor={}, totals=zeros()))
    )
    engines = SimpleNamespace(
        _counted=PartialCounts(),
        _prefix_counted=PrefixCounts(),
        rollout=SimpleNamespace(partial_counts=PartialCounts, prefix_counts=PrefixCounts),
    )
    sources = [cls.__new__(cls) for cls in (QueueSource, ResamplingSource)]  # the fields metrics() reads only
    for source in sources:
        source.__dict__.update(
            rl_started_at=time.perf_counter(),
            wait_s=0.0,
            queue=SimpleNamespace(stats=zeros),
            worker=SimpleNamespace(stats=zeros),
            resample=SimpleNamespace(resampler=resampler),
            groups=None,  # queue.dynamic_sampling off, objective.credit not "branch": the tiny config's defaults
            branching=None,
            engines=SimpleNamespace(
                partial_metrics=functools.partial(EngineHost.partial_metrics, engines),
                prefix_metrics=functools.partial(EngineHost.prefix_metrics, engines),
            ),
        )
    union = lambda: {name: v for source in sources for name, v in source.metrics().items()}  # noqa: E731
    online = SimpleNamespace(local=SimpleNamespace(metrics=union))
    learner = SimpleNamespace(
        rl_start=0,
        dropped_total=0,
        flops_per_token=lambda t: 1.0,
        peak_flops=1.0,
        source=SimpleNamespace(metrics=functools.partial(OnlineSource.metrics, online)),
    )
    host = Learner._host_metrics(learner, {"real_tokens": 100.0}, batch, 0, np.zeros(8), 0.5)

    episode = SimpleNamespace(reward=1.0, info={"num_tool_calls": 1, "num_tool_errors": 0, "num_turns": 2})
    # What OnlineSource.evaluate returns (EvalReport.scalars): pass_at_k with train.eval_samples > 1.
    evaluation = {**episode_metrics([episode]), "time_s": 1.0, "pass_at_k": 1.0}
    return set(metrics) | set(host) | {f"eval/{k}" for k in evaluation}


def test_every_logged_name_is_in_the_table():
    names = _logged_names()
    assert names - set(EXPECTED_TAGS) == set(), "new metric names: add them to EXPECTED_TAGS in their group"
    assert set(EXPECTED_TAGS) - names == set(), "EXPECTED_TAGS lists names the code no longer logs"


def _records(path: str):
    """The records of a TFRecord file (TensorBoard events): u64 length, u32 crc, data, u32 crc."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def _tensorboard_scalars(tb_dir: str) -> dict[str, dict[int, float]]:
    from tensorboardX.proto.event_pb2 import Event

    out = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))):
        for record in _records(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                out[value.tag][event.step] = value.simple_value
    return dict(out)


ROWS = {
    1: {
        "loss": np.float32(2.0),
        "grad_norm": float("nan"),
        "tokens_per_s": 100.0,
        "source/queue_depth": 3,
        "source/success_rate": 0.25,
        "skipped": np.int32(0),
    },
    2: {
        "loss": 1.5,
        "grad_norm": 0.5,
        "tokens_per_s": 110.0,
        "source/queue_depth": 1,
        "source/success_rate": 0.5,
        "skipped": 0,
    },
}


def test_tensorboard_tags_are_grouped_and_metrics_jsonl_keeps_flat_names(tmp_path):
    folder = RunFolder(tmp_path / "run")
    log = folder.metrics_log(LoggingConfig())
    log.start(None)
    for step, row in ROWS.items():
        log.write(step, row)
    log.write(2, {"eval/success": 0.75})
    log.close()

    rows = folder.read_metrics()
    assert [set(r) for r in rows] == [{"step", *ROWS[1]}, {"step", *ROWS[2]}, {"step", "eval/success"}]
    assert math.isnan(rows[0]["grad_norm"]) and rows[1]["source/queue_depth"] == 1

    scalars = _tensorboard_scalars(folder.tensorboard_dir)
    assert scalars == {
        "train/loss": {1: 2.0, 2: 1.5},
        "train/grad_norm": {2: 0.5},  # non-finite values reach metrics.jsonl only
        "train/skipped": {1: 0.0, 2: 0.0},
        "perf/tokens_per_s": {1: 100.0, 2: 110.0},
        "queue/depth": {1: 3.0, 2: 1.0},
        "rollout/success_rate": {1: 0.25, 2: 0.5},
        "eval/success": {2: 0.75},
    }


def test_the_trajectory_log_is_cut_back_to_a_count(tmp_path):
    folder = RunFolder(tmp_path)
    folder.append_trajectories("train", [_trajectory(i) for i in range(5)])
    with open(folder.trajectories_path("train"), "a", encoding="utf-8") as f:
        f.write('{"uid": "cut sh')  # a kill in the middle of a line
    assert folder.count_trajectories("train") == 5
    folder.truncate_trajectories("train", 3)
    assert [t.uid for t in folder.read_trajectories("train")] == ["t0", "t1", "t2"]


def test_resume_truncates_metrics_jsonl_and_eval_task_records(tmp_path):
    folder = RunFolder(tmp_path)
    lines = "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6))
    with open(folder.metrics_path, "w", encoding="utf-8") as f:
        f.write(lines + '{"step": 6, "lo')  # a line cut short by a kill
    for step in (0, 2, 4):  # evaluations; the one at step 4 came after the checkpoint of step 3
        folder.write_eval_tasks(step, {"tasks": [{"task_id": "a", "samples": 1, "successes": step % 3}]})
    log = folder.metrics_log(LoggingConfig(tensorboard=False))
    log.start(resume_step=3)
    log.write(4, {"loss": 4.5})
    log.close()
    assert [(r["step"], r["loss"]) for r in folder.read_metrics()] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)]
    assert folder.eval_tasks_steps() == [0, 2]
    assert folder.read_eval_tasks(2) == {"step": 2, "tasks": [{"task_id": "a", "samples": 1, "successes": 2}]}
    with pytest.raises(FileNotFoundError, match="per-task record of the evaluation at step 4"):
        folder.read_eval_tasks(4)

    log.start(resume_step=None)  # a fresh start drops everything
    log.close()
    assert folder.read_metrics() == [] and folder.eval_tasks_steps() == []


def test_wandb_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    log = RunFolder(tmp_path).metrics_log(LoggingConfig(tensorboard=False, wandb=True))
    with pytest.raises(ImportError, match=r"pip install 'ipa_jax\[wandb\]'"):
        log.start(None)


# ---------------------------------------------------------------------------------------------- W&B offline
def _wandb_records(path: str):
    """The protobuf records of an offline run's run-<id>.wandb file: a 7-byte header, then LevelDB-log blocks
    of 32 KiB whose records (u32 crc, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last) may span blocks."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / zero padding
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(parts)
            parts = b""


def _wandb_run(offline_dir: str) -> tuple[SimpleNamespace, dict[int, dict[str, float]]]:
    """(the run record, {step: {key: value}}) of one offline run directory, W&B's own keys (_step, ...) left out.
    W&B's service process writes the file after wandb.finish() returns: wait for its exit record."""
    (path,) = glob.glob(os.path.join(offline_dir, "run-*.wandb"))
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        assert time.monotonic() < deadline, f"{path}: no exit record"
        time.sleep(0.1)
    run, history = None, collections.defaultdict(dict)
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num].update({k: v for k, v in items.items() if not k.startswith("_")})
    return run, dict(history)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'ipa_jax[wandb]')")
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return tmp_path


def test_wandb_offline_logs_grouped_tags_and_resumes_the_same_run(wandb_offline):
    folder = RunFolder(wandb_offline / "my_run")
    config = {"train": {"steps": 2}, "objective": {"is_clip_max": math.inf}}
    logging = LoggingConfig(tensorboard=False, wandb=True, wandb_project="ipa_test")
    log = folder.metrics_log(logging, config)
    log.start(None)
    for step, row in ROWS.items():
        log.write(step, row)
    log.write(2, {"eval/success": 0.75})
    log.close()

    with open(folder.wandb_id_path, encoding="utf-8") as f:
        run_id = f.read().strip()
    (offline,) = glob.glob(folder.file("wandb", "offline-run-*"))
    run, history = _wandb_run(offline)
    assert (run.run_id, run.display_name, run.project) == (run_id, "my_run", "ipa_test")
    logged_config = {item.key: item.value_json for item in run.config.update}
    assert json.loads(logged_config["train"]) == {"steps": 2}
    assert history == {
        1: {
            "train/loss": 2.0,
            "train/skipped": 0,
            "perf/tokens_per_s": 100.0,
            "queue/depth": 3,
            "rollout/success_rate": 0.25,
        },
        2: {
            "train/loss": 1.5,
            "train/grad_norm": 0.5,
            "train/skipped": 0,
            "perf/tokens_per_s": 110.0,
            "queue/depth": 1,
            "rollout/success_rate": 0.5,
            "eval/success": 0.75,
        },
    }

    # Resuming continues the same W&B run in a new offline directory (moved out of the way: its name has the
    # start time in seconds); metrics.jsonl is cut back.
    os.rename(offline, folder.file("wandb", "first_run"))
    log.start(resume_step=1)
    log.write(2, {"loss": 1.25})
    log.close()
    assert [r["step"] for r in folder.read_metrics()] == [1, 2]
    (resumed,) = glob.glob(folder.file("wandb", "offline-run-*"))
    run, history = _wandb_run(resumed)
    assert run.run_id == run_id
    assert history[2]["train/loss"] == 1.25

    log.start(resume_step=None)  # a fresh start is a new W&B run
    log.close()
    with open(folder.wandb_id_path, encoding="utf-8") as f:
        assert f.read().strip() != run_id
