"""The train step with the baseline after discounting (objective.baseline_stage = "return"): the baseline is a
full-batch statistic like the advantages (microbatches change nothing; given advantages come with their batch's
baselines), and credit_negative_share_success counts the successes' action tokens whose credit is negative."""

import math

import jax
import numpy as np
import pytest
from train_helpers import make_batch, make_exp, max_rel_diff, synthetic_trajectories, tree_copy

from ipa_jax.models import MeshConfig, make_mesh
from ipa_jax.objectives import estimate_return_baselines, policy_loss
from ipa_jax.pipeline import RunFolder
from ipa_jax.pipeline.build import build_learner, build_state, build_steps
from ipa_jax.train import JsonlSource
from ipa_jax.train.step import batch_advantages
from ipa_jax.trajectory import write_jsonl

OBJECTIVE = (
    "objective.preset=ipa",
    "objective.baseline=batch_mean",
    "objective.baseline_stage=return",
    "objective.gamma=0.5",
    "objective.il_weight=0.5",
    "optimizer.eps=1e-4",  # see test_train_step.py: compare the gradients' accumulation, not Adam's eps noise
)


def one_device():
    return make_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def setup():
    mesh = one_device()
    full = make_exp("train.batch_size=8", *OBJECTIVE)
    micro = make_exp("train.batch_size=8", "train.microbatches=4", *OBJECTIVE)
    state = build_state(full, mesh)
    step_full, _ = build_steps(full, state, mesh)
    step_micro, _ = build_steps(micro, state, mesh)
    return state, step_full, step_micro, full


def _copy(state):
    return jax.tree.map(lambda x: x.copy(), state)


def test_microbatches_and_given_baselines_equal_the_full_batch_update(setup):
    state, step_full, step_micro, exp = setup
    batch = make_batch(8, seed=3)
    s_full, m_full = step_full(_copy(state), step_full.put_batch(batch))
    s_micro, m_micro = step_micro(_copy(state), step_micro.put_batch(batch))
    assert max_rel_diff(tree_copy(s_micro.params), tree_copy(s_full.params)) < 1e-6
    for key in ("loss", "rl_loss", "grad_norm", "credit_negative_share_success"):
        assert math.isclose(float(m_micro[key]), float(m_full[key]), rel_tol=1e-5, abs_tol=1e-7), key

    # The learner's minibatch path: advantages and baselines of the whole batch, given
    adv = np.asarray(batch_advantages(batch, exp.objective))
    base = estimate_return_baselines(
        adv, batch.action_mask, batch.chunk_ids, batch.group_ids, exp.objective, batch.segment_ids, batch.truncated
    )
    put = step_full.put_batch
    s_given, m_given = step_full(_copy(state), put(batch), put(adv), None, None, put(np.asarray(base)))
    assert max_rel_diff(tree_copy(s_given.params), tree_copy(s_full.params)) < 1e-6
    with pytest.raises(ValueError, match="baselines: required for baseline_stage='return'"):
        step_full(_copy(state), put(batch), put(adv))


def test_credit_negative_share_success_counts_negative_credit_of_successes(setup):
    state, step_full, _, exp = setup
    batch = make_batch(8, seed=3)
    _, metrics = step_full(_copy(state), step_full.put_batch(batch))
    _, diag = policy_loss(
        batch.behavior_logprobs,
        batch.behavior_logprobs,
        batch.rewards,
        batch.action_mask,
        batch.chunk_ids,
        config=exp.objective,
    )
    success = batch.action_mask & (batch.rewards >= step_full.options.success_reward)[:, None]
    negative = success & (np.asarray(diag["chunk_returns"]) < 0)
    assert 0 < negative.sum() < success.sum()  # gamma 1/2: the successes' early chunks fall below the baseline
    assert float(metrics["credit_negative_share_success"]) == pytest.approx(negative.sum() / success.sum())


def test_learner_minibatches_take_the_whole_batch_baselines(tmp_path):
    """train.minibatches: the learner computes the baselines on the whole batch and gives each update its rows."""
    write_jsonl(tmp_path / "data.jsonl", synthetic_trajectories(8, seed=4))
    exp = make_exp(
        f"train.data=('{tmp_path / 'data.jsonl'}',)",
        "train.batch_size=8",
        "train.minibatches=2",
        "train.steps=2",
        "checkpoint.every=0",
        "logging.tensorboard=False",
        *OBJECTIVE,
    )
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=str(tmp_path / "run"), mesh=one_device())
    assert int(learner.run().step) == 2
    rows = RunFolder(tmp_path / "run").read_metrics()
    assert all(math.isfinite(r["loss"]) and 0 <= r["credit_negative_share_success"] <= 1 for r in rows)
