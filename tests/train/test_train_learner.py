"""The learner loop end to end on a synthetic trajectory file: learning, dropped trajectories, metrics,
TensorBoard, hooks, checkpoints (atomic, restorable), epochs/minibatches, sources, FLOP count, HF export."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import MOE_ARCH, make_exp, synthetic_trajectories, tree_copy

from ipa_jax.models import MeshConfig, Qwen3ForCausalLM, from_pretrained, make_mesh
from ipa_jax.pipeline import RunFolder
from ipa_jax.pipeline.build import build_learner, build_state, model_config
from ipa_jax.pipeline.export import export_policy
from ipa_jax.train import CheckpointConfig, Checkpointer, JsonlSource, LoggingConfig, make_schedule
from ipa_jax.train.learner import policy_lag
from ipa_jax.train.metrics import active_params_per_token, train_flops_per_token
from ipa_jax.trajectory import write_jsonl

REQUIRED_METRICS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "reward_mean",
    "advantage_mean",
    "advantage_std",
    "admitted_fraction",
    "is_ratio_mean",
    "is_ratio_max",
    "clip_fraction",
    "mismatch_abs",
    "mismatch_kl",
    "mismatch_ratio_mean",
    "mismatch_masked_fraction",
    "mismatch_capped_fraction",
    "chunks_mean",
    "entropy",
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "skipped",
    "skipped_total",
    "dropped_trajectories",
    "dropped_total",
    "policy_lag_mean",
    "policy_lag_max",
}


def _mesh2():
    return make_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:2])


def _write_data(path, n=8, seed=0):
    """n valid trajectories preceded by one unparsable line and one invalid trajectory (token id >= vocab)."""
    bad = synthetic_trajectories(1, vocab_size=1000, seed=99, min_len=30)[0]
    bad.uid = "bad-vocab"
    write_jsonl(path, [bad] + synthetic_trajectories(n, seed=seed))
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"uid": "truncated", "tokens": [1, 2\n')
        f.writelines(lines)
    return str(path)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """Six updates on the same 8 valid trajectories (the file loops): two IL-only warm-start steps, then four
    IPA steps; eval and after-update hooks."""
    tmp = tmp_path_factory.mktemp("offline")
    data = _write_data(tmp / "data.jsonl")
    exp = make_exp(
        f"train.data=('{data}',)", "train.batch_size=8", "logging.peak_tflops=1.0", "train.il_warmup_steps=2"
    )
    calls = {"after_update": 0, "eval": 0}

    def after_update(state):
        calls["after_update"] += 1

    def eval_fn(state, episodes):
        calls["eval"] += 1
        return {"success": 0.25 * calls["eval"]}

    run_dir = str(tmp / "run")
    learner = build_learner(
        exp,
        JsonlSource(exp.train.data),
        run_dir=run_dir,
        mesh=_mesh2(),
        after_update=after_update,
        eval_fn=eval_fn,
        extra={"anchors": [1, 2]},
    )
    state = learner.run()
    return dict(exp=exp, run_dir=run_dir, state=state, calls=calls, learner=learner)


def test_loss_decreases_and_metrics_are_written(offline_run):
    rows = RunFolder(offline_run["run_dir"]).read_metrics()
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert REQUIRED_METRICS <= set(train_rows[0])
    losses = [r["loss"] for r in train_rows]
    # Warm start: the IL term alone; then the IPA objective (il_weight 0) alone.
    assert [r["loss"] for r in train_rows[:2]] == pytest.approx([r["il_loss"] for r in train_rows[:2]], rel=1e-6)
    assert losses[2:] == pytest.approx([r["rl_loss"] for r in train_rows[2:]], rel=1e-6)
    assert losses[1] < losses[0]
    assert losses[-1] < losses[2] - 0.05 * abs(losses[2]), losses
    assert all(np.isfinite(losses)) and all(r["skipped"] == 0 for r in train_rows)
    # one invalid trajectory dropped per pass over the file, plus the unparsable line counted by the source
    assert train_rows[0]["dropped_trajectories"] == 1 and train_rows[0]["dropped_total"] == 2
    assert train_rows[-1]["dropped_total"] > train_rows[0]["dropped_total"]
    assert 0 < train_rows[0]["mfu"] < 1 and train_rows[0]["tokens_per_s"] > 0
    assert any(
        name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(offline_run["run_dir"], "tb"))
    )


def test_hooks_and_eval_history(offline_run):
    assert offline_run["calls"]["after_update"] == 7  # once before the first step, then after each update
    history = offline_run["learner"].eval_history
    assert [e["step"] for e in history] == [0, 2, 6]  # before, after the warm start, at the end
    rows = RunFolder(offline_run["run_dir"]).read_metrics()
    assert [r["eval/success"] for r in rows if "eval/success" in r] == [0.25, 0.5, 0.75]


@pytest.mark.parametrize("every_episodes, played", [(3, 3), (30, 8)])  # at most the 8 held-out tasks
def test_evaluations_between_the_warm_start_and_the_end_play_the_smaller_set(tmp_path, every_episodes, played):
    data = _write_data(tmp_path / "data.jsonl")
    exp = make_exp(
        f"train.data=('{data}',)",
        "train.batch_size=8",
        "train.il_warmup_steps=2",
        "train.steps=6",
        "train.eval_every=2",
        "train.eval_episodes=8",
        f"train.eval_every_episodes={every_episodes}",
        "checkpoint.every=0",
        "logging.tensorboard=False",
    )
    asked = []

    def eval_fn(state, episodes):
        asked.append((int(state.step), episodes))
        return {"success": 0.5, "episodes": float(episodes or 8)}

    run_dir = str(tmp_path / "run")
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=run_dir, mesh=_mesh2(), eval_fn=eval_fn)
    learner.run()
    # All 8 tasks before training, at the warm start's end (step 2) and at the end (step 6, also a multiple of
    # eval_every: the final evaluation, not a small one); the smaller set at RL step 2 (step 4).
    assert asked == [(0, None), (2, None), (4, played), (6, None)]
    assert [e["episodes"] for e in learner.eval_history] == [8, 8, played, 8]


def test_checkpoints_are_atomic_and_restorable(offline_run):
    ckpt_dir = os.path.join(offline_run["run_dir"], "checkpoints")
    # A save cut short by a kill leaves a temporary folder: it must never be listed or loaded.
    partial = os.path.join(ckpt_dir, "8.orbax-checkpoint-tmp-1234567")
    os.makedirs(os.path.join(partial, "state"))
    with open(os.path.join(partial, "state", "garbage"), "w") as f:
        f.write("partial")
    exp = offline_run["exp"]
    checkpointer = Checkpointer(ckpt_dir, exp.checkpoint)
    assert checkpointer.latest_step() == 6 and checkpointer.all_steps() == [2, 4, 6]
    # into a freshly built state, as a resume does (the template gives shapes and shardings, none of its values)
    restored, host = checkpointer.restore(build_state(exp, _mesh2()))
    assert int(restored.step) == 6
    jax.tree.map(np.testing.assert_array_equal, tree_copy(restored.params), tree_copy(offline_run["state"].params))
    jax.tree.map(
        np.testing.assert_array_equal, tree_copy(restored.opt_state), tree_copy(offline_run["state"].opt_state)
    )
    assert host["extra"] == {"anchors": [1, 2]} and host["source"]["epoch"] >= 1
    checkpointer.close()
    # Starting over in a folder that holds checkpoints, with resume off, is refused (never mixes two runs).
    learner = offline_run["learner"]
    fresh = dataclasses.replace(learner, checkpointer=Checkpointer(ckpt_dir, CheckpointConfig(resume=False)))
    with pytest.raises(ValueError, match="checkpoint.resume"):
        fresh.run()


def test_epochs_and_minibatches(tmp_path):
    """Four updates from one batch, with ROLL's recomputed old log-probs (objective preset ipa_roll)."""
    data = _write_data(tmp_path / "data.jsonl")
    exp = make_exp(
        f"train.data=('{data}',)",
        "train.batch_size=8",
        "train.epochs_per_batch=2",
        "train.minibatches=2",
        "train.steps=4",
        "checkpoint.every=0",
        "logging.tensorboard=False",
        "objective.preset=ipa_roll",
    )
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=str(tmp_path / "run"), mesh=_mesh2())
    state = learner.run()
    rows = RunFolder(tmp_path / "run").read_metrics()
    assert int(state.step) == 4 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert learner.source.state_dict()["offset"] > 0  # one batch of the file consumed for four updates
    assert len({round(r["loss"], 6) for r in rows}) == 4
    # The old log-probs are the parameters' before the batch's first update: the policy ratio is 1 there (up to
    # the float noise of a separate forward) and moves away from 1 as the later updates move the parameters.
    assert abs(rows[0]["is_ratio_max"] - 1) < 1e-4 and all(r["is_ratio_max"] > 1 + 1e-3 for r in rows[1:])
    assert Checkpointer(str(tmp_path / "run" / "checkpoints"), exp.checkpoint).all_steps() == [4]  # at exit


def test_a_stop_requested_during_the_processes_exchange_stops_at_the_next_boundary(tmp_path, monkeypatch):
    """A signal handled while the processes agree on stopping (`agreed_stop`, a collective) asks after this process
    sent its answer: the others said no, and the request must stay for the next batch boundary, not be lost."""
    data = _write_data(tmp_path / "data.jsonl")
    exp = make_exp(f"train.data=('{data}',)", "train.batch_size=8", "train.steps=4", "logging.tensorboard=False")
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=str(tmp_path / "run"), mesh=_mesh2())
    asked = []

    def exchange(reason):  # the first exchange: SIGTERM arrives once this process's answer (None) is sent
        asked.append(reason)
        if len(asked) == 1:
            learner.request_stop("received SIGTERM")
            return None
        return reason

    monkeypatch.setattr("ipa_jax.train.learner.agreed_stop", exchange)
    with pytest.raises(KeyboardInterrupt, match="received SIGTERM"):
        learner.run()
    assert asked == [None, "received SIGTERM"] and int(learner.state.step) == 2


def test_jsonl_source_resumes_at_its_position(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", synthetic_trajectories(3, seed=1))
    write_jsonl(tmp_path / "b.jsonl", synthetic_trajectories(2, seed=2))
    source = JsonlSource([str(tmp_path / "*.jsonl")])
    assert [t.uid for t in source.next_trajectories(4)] == ["traj-1-0", "traj-1-1", "traj-1-2", "traj-2-0"]
    position = json.loads(json.dumps(source.state_dict()))
    expected = [t.uid for t in source.next_trajectories(3)]
    assert expected == ["traj-2-1", "traj-1-0", "traj-1-1"] and source.epoch == 1
    again = JsonlSource([str(tmp_path / "*.jsonl")])
    again.load_state_dict(position)
    assert [t.uid for t in again.next_trajectories(3)] == expected
    with pytest.raises(ValueError, match="train.data"):
        JsonlSource([str(tmp_path / "missing*.jsonl")])


def test_metrics_truncated_to_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    log = RunFolder(tmp_path).metrics_log(LoggingConfig(tensorboard=False))
    log.start(resume_step=3)
    log.write(4, {"loss": np.float32(4.5), "grad_norm": float("nan")})
    log.close()
    rows = RunFolder(tmp_path).read_metrics()
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)]
    assert np.isnan(rows[-1]["grad_norm"])  # stored as the string "nan", read back as a float


@pytest.mark.parametrize("moe", [False, True])
def test_flop_count_matches_the_model_parameters(moe):
    exp = make_exp(*(MOE_ARCH if moe else ()))
    config = model_config(exp.model)
    params = nnx.state(nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    active = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or "embed_tokens" in name:
            continue  # norms do no matmul; the embedding is a lookup
        share = config.num_experts_per_tok / config.num_experts if "experts" in name else 1.0
        active += leaf.size * share
    assert active_params_per_token(config) == active
    seq = 64
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq
    assert train_flops_per_token(config, seq) == 6 * active + attention


def test_exported_policy_round_trips(offline_run, tmp_path):
    state = offline_run["state"]
    export_policy(state, None, str(tmp_path / "hf"))
    loaded = nnx.state(from_pretrained(str(tmp_path / "hf")), nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(loaded), tree_copy(state.params))


def test_warm_start_ends_on_its_greedy_match_target_and_resumes(tmp_path, capsys):
    """train.il_warmup_target: the warm start ends at the first step where the last il_warmup_window batches'
    mean il_greedy_match reaches the target; RL keeps its steps - il_warmup_steps updates, from there. The
    console's total stays train.steps: RL's steps count from the planned warm start's end."""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, synthetic_trajectories(8, seed=3, expert_every=1))  # every row has 2 imitation tokens
    warm, rl_steps, window = 40, 2, 2
    exp = make_exp(
        f"train.data=('{data}',)",
        "train.batch_size=8",
        f"train.il_warmup_steps={warm}",
        f"train.steps={warm + rl_steps}",
        "train.il_warmup_target=1.0",
        f"train.il_warmup_window={window}",
        "optimizer.il_lr=1e-2",
        "optimizer.warmup_steps=2",
        "checkpoint.every=0",
        "logging.tensorboard=False",
        "logging.console_every=1",
    )
    run_dir = str(tmp_path / "run")
    learner = build_learner(
        exp,
        JsonlSource(exp.train.data),
        run_dir=run_dir,
        mesh=_mesh2(),
        eval_fn=lambda state, episodes: {"success": 0.0},
    )
    state = learner.run()
    start = learner.rl_start
    assert 0 < start < warm, start  # memorising 16 token pairs takes a few steps, not 40
    assert int(state.step) == start + rl_steps == learner.total_steps and int(state.rl_start) == start
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, start + rl_steps + 1))
    match = [r["il_greedy_match"] for r in rows[:start]]
    assert np.mean(match[-window:]) >= 1.0
    assert all(np.mean(match[i - window : i]) < 1.0 for i in range(window, start))  # not reached earlier
    assert [r["rl_start"] for r in rows] == [warm] * (start - 1) + [start] * (rl_steps + 1)
    assert [e["step"] for e in learner.eval_history] == [0, start, start + rl_steps]
    counters = [line.split()[1:3] for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    total = warm + rl_steps
    assert counters == (
        [[f"{s}/{total}", "IL"] for s in range(1, start)]
        + [[f"{start}", f"({warm}/{total})"]]
        + [[f"{s}", f"({warm + s - start}/{total})"] for s in range(start + 1, start + rl_steps + 1)]
    )
    # IL-only updates before rl_start, the RL objective after; the learning rate follows the moved boundary.
    assert all(r["loss"] == pytest.approx(r["il_loss"], rel=1e-6) for r in rows[:start])
    assert all(r["loss"] == pytest.approx(r["rl_loss"], rel=1e-6) for r in rows[start:])
    schedule = make_schedule(exp.optimizer, exp.train.steps, warm)
    lrs = [float(schedule(r["step"] - 1, start)) for r in rows]
    assert [r["lr"] for r in rows] == pytest.approx(lrs, rel=1e-6)
    assert lrs[start] == 0.0 and lrs[start - 1] == pytest.approx(1e-2)  # RL's own warmup restarts from 0
    # The boundary is part of the checkpoint: a resumed learner knows where RL started and where it ends.
    again = build_learner(exp, JsonlSource(exp.train.data), run_dir=run_dir, mesh=_mesh2())
    assert again.restore_latest() == start + rl_steps
    assert again.rl_start == start and again.total_steps == start + rl_steps


def test_policy_lag_leaves_out_scripted_expert_episodes():
    sampled, expert = synthetic_trajectories(2, seed=5, expert_every=1)
    sampled.policy_version, expert.policy_version = 3, 0
    expert.expert_mask, expert.action_mask = expert.expert_mask | expert.action_mask, np.zeros_like(expert.action_mask)
    np.testing.assert_array_equal(policy_lag(7, [sampled, expert]), [4])
    assert policy_lag(7, [expert]).size == 0
