"""rollout.schedule = "lockstep": the same command gives the same run, also while other processes load the CPU; the
arms of a seed share the warm start, the tasks and the episodes' keys (common random numbers), so what differs
between two arms is what their configs change.

Four runs of the tiny online setting (2 IL steps, then 3 RL steps on rollouts one update stale): the reference; the
same command again with two CPU hogs beside it; the same with another rollout seed (the control: another run,
whose warm start is the same); an arm that changes the RL objective only (its first RL batch is the reference's,
played by the same warm start with the same tasks and keys, and what follows differs)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_pipeline import tiny_config

from ipa_jax.pipeline import RunFolder, run
from ipa_jax.pipeline.run_folder import is_timing_metric
from ipa_jax.trajectory import read_jsonl

IL_STEPS, STEPS = 2, 5
LOCKSTEP = {
    "rollout.schedule": "lockstep",
    "queue.max_policy_lag": 1,
    "train.steps": STEPS,
    "train.il_warmup_steps": IL_STEPS,
    "train.il_warmup_target": 0.0,
    "train.eval_every": 2,
    "rollout.max_turns": 3,
    "optimizer.warmup_steps": 0,  # RL's first update moves the weights (a warmup would start it at lr 0)
}


def _run(tmp_path_factory, tokenizer_dir, name, **overrides):
    run_dir = tmp_path_factory.mktemp(name)
    run(tiny_config(run_dir, **{"model.tokenizer": tokenizer_dir, **LOCKSTEP, **overrides}))
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer_dir):
    return _run(tmp_path_factory, tokenizer_dir, "reference")


def _metrics(run_dir):
    """metrics.jsonl without its timing fields."""
    rows = RunFolder(run_dir).read_metrics()
    return [{k: v for k, v in row.items() if not is_timing_metric(k)} for row in rows]


def _trained_on(run_dir):
    """The learner's batches: (uid, tokens, behaviour log-probs, reward) of trajectories/train.jsonl, in order."""
    return [
        (t.uid, t.tokens.tolist(), t.behavior_logprobs.tolist(), t.reward)
        for t in read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl"))
    ]


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf", "model.safetensors"))


@pytest.mark.slow
def test_the_same_command_gives_the_same_run_beside_a_cpu_hog(tmp_path_factory, tokenizer_dir, reference):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        again = _run(tmp_path_factory, tokenizer_dir, "again")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    rows = _metrics(reference)
    assert [r for r in rows if "loss" in r] and [r for r in rows if "eval/success" in r]
    assert any(r.get("source/rollout_episodes") for r in rows)  # RL steps on the policy's own episodes
    assert _metrics(again) == rows
    assert _trained_on(again) == _trained_on(reference)
    want, got = _weights(reference), _weights(again)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
def test_arms_share_the_warm_start_tasks_and_keys(tmp_path_factory, tokenizer_dir, reference):
    """Another rollout seed (rollout.seed_offset): the same warm start, other rollouts. Another RL phase (rewards
    flipped on half the episodes): the same first RL batches (the warm start's weights, the same tasks and keys), then
    its own."""
    reseeded = _run(tmp_path_factory, tokenizer_dir, "reseeded", **{"rollout.seed_offset": 1000})
    other_arm = _run(tmp_path_factory, tokenizer_dir, "other_arm", **{"train.reward_flip_fraction": 0.5})
    rows, batch = _metrics(reference), _trained_on(reference)
    warm = 8 * IL_STEPS  # the warm start's expert episodes
    for arm in (reseeded, other_arm):
        assert _metrics(arm)[: IL_STEPS + 1] == rows[: IL_STEPS + 1]  # step 0's evaluation and the IL steps
        assert _trained_on(arm)[:warm] == batch[:warm]
    # The first RL batches: of the same warm start for both (lag 1: the first two batches), same tasks
    first_rl = slice(warm, warm + 16)
    assert [uid for uid, *_ in _trained_on(reseeded)[first_rl]] == [uid for uid, *_ in batch[first_rl]]
    assert [t[1] for t in _trained_on(reseeded)[first_rl]] != [t[1] for t in batch[first_rl]]  # other keys
    assert _trained_on(other_arm)[first_rl] == batch[first_rl]  # same keys: the same episodes
    assert _trained_on(other_arm)[warm + 16 :] != batch[warm + 16 :]  # then its own weights


@pytest.mark.slow
def test_evaluations_leave_the_training_run_as_it_is(tmp_path_factory, tokenizer_dir, reference):
    """An evaluation after every RL step on 2 of the 4 held-out tasks instead of every 2 steps on all 4: the same
    batches, metrics and weights (evaluations play their own keys on the weights they are given)."""
    denser = _run(tmp_path_factory, tokenizer_dir, "denser", **{"train.eval_every": 1, "train.eval_every_episodes": 2})
    evals = [r for r in RunFolder(denser).read_metrics() if "eval/success" in r]
    assert [(r["step"], r["eval/episodes"]) for r in evals] == [(0, 4), (2, 4), (3, 2), (4, 2), (5, 4)]
    assert _trained_on(denser) == _trained_on(reference)
    training = [r for r in _metrics(reference) if "loss" in r]
    assert [r for r in _metrics(denser) if "loss" in r] == training and training
    want, got = _weights(reference), _weights(denser)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
