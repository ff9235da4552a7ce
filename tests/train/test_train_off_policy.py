"""The train step's off-policy inputs: recomputed old log-probs (on-policy they give the behaviour-ratio
update; microbatched == full batch, from the step's own forward or passed in), and the failure labels of the
entropy filter (reward < resample.success_reward), checked against the objective called directly."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import make_batch, make_exp, max_rel_diff, tree_copy

from ipa_jax.models import MeshConfig, make_mesh, token_logprobs
from ipa_jax.objectives import policy_loss
from ipa_jax.pipeline.build import build_state, build_steps

# ROLL's recipe (recomputed old log-probs, negatives by reward, kept-token row mean) with negatives that carry
# gradient (batch-mean baseline), the capped mismatch weight, and the entropy filter on failed rows.
OFF_POLICY = (
    "objective.preset=ipa_roll",
    "objective.baseline=batch_mean",
    "objective.mismatch_is_cap=1.1",
    "objective.negative_token_fraction=0.5",
    "resample.success_reward=0.4",
)
EPS = "optimizer.eps=1e-4"  # see test_train_step.py: compares gradients, not Adam's normalisation of tiny ones
# Graded rewards: by R < 0.4 the failures are rows 0-3; the negatives by reward (R <= 0) only rows 0 and 1.
REWARDS = np.array([0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0], np.float32)
# Metrics that must agree between two runs of one update.
COMPARED = (
    "loss",
    "rl_loss",
    "grad_norm",
    "kept_token_fraction",
    "is_ratio_mean",
    "clip_fraction",
    "mismatch_ratio_mean",
    "mismatch_masked_fraction",
    "mismatch_capped_fraction",
    "entropy",
)


def _copy_state(state):
    return jax.tree.map(lambda x: x.copy(), state)


@pytest.fixture(scope="module")
def off_policy():
    """Initial state, steps by name (recompute / recompute with 4 microbatches / behaviour) and a graded batch."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:2])
    exps = {
        "recompute": make_exp("train.batch_size=8", EPS, *OFF_POLICY),
        "recompute_micro": make_exp("train.batch_size=8", "train.microbatches=4", EPS, *OFF_POLICY),
        "behavior": make_exp("train.batch_size=8", EPS, *OFF_POLICY, "objective.old_logprobs=behavior"),
    }
    state = build_state(exps["recompute"], mesh)
    steps = {name: build_steps(exp, state, mesh)[0] for name, exp in exps.items()}
    batch = make_batch(8, seed=4)._replace(rewards=REWARDS)
    return state, steps, batch


def _update(step, state, batch, old=None):
    state, metrics = step(_copy_state(state), step.put_batch(batch), None, None if old is None else step.put_batch(old))
    return tree_copy(state.params), jax.device_get(metrics)


def _assert_same_update(a, b, tol, keys=COMPARED):
    (params_a, metrics_a), (params_b, metrics_b) = a, b
    assert max_rel_diff(params_a, params_b) < tol
    for key in keys:
        # abs_tol: the loss is a small sum of larger terms of both signs (float32 reassociation across microbatches)
        assert math.isclose(float(metrics_a[key]), float(metrics_b[key]), rel_tol=1e-5, abs_tol=1e-6), key


def test_recompute_on_policy_is_the_behaviour_ratio_update(off_policy):
    state, steps, batch = off_policy
    params0 = tree_copy(state.params)
    on_policy = batch._replace(behavior_logprobs=steps["recompute"].old_log_probs(state, batch))
    recompute = _update(steps["recompute"], state, on_policy)
    assert max_rel_diff(recompute[0], params0) > 1e-4  # the update is not a no-op
    # A separate forward's log-probs may differ from the step's by float noise: a policy ratio of 1 + 1e-7 counts
    # as truncated at 1 (without effect), so clip_fraction is not compared.
    keys = tuple(k for k in COMPARED if k != "clip_fraction")
    _assert_same_update(recompute, _update(steps["behavior"], state, on_policy), 1e-5, keys)

    # Off-policy (the sampler's log-probs are not the learner's): the policy ratio is the learner's own, exactly 1,
    # and the whole drift is in the mismatch ratio; with behaviour log-probs the policy ratio carries it.
    _, off = _update(steps["recompute"], state, batch)
    _, off_behavior = _update(steps["behavior"], state, batch)
    assert float(off["is_ratio_mean"]) == 1.0 and float(off["clip_fraction"]) == 0.0
    assert abs(float(off_behavior["is_ratio_mean"]) - 1) > 1e-3
    assert math.isclose(float(off_behavior["mismatch_ratio_mean"]), float(off["mismatch_ratio_mean"]), rel_tol=1e-5)


def test_recompute_microbatched_equals_full_batch(off_policy):
    """The step's own old log-probs, and old log-probs passed in (the learner's path for a batch's later updates),
    with and without microbatches."""
    state, steps, batch = off_policy
    full, micro = steps["recompute"], steps["recompute_micro"]
    current = full.old_log_probs(state, batch)
    np.testing.assert_allclose(micro.old_log_probs(state, batch), current, rtol=1e-6, atol=1e-6)
    reference = _update(full, state, batch)
    keys = tuple(k for k in COMPARED if k != "clip_fraction")  # as in the on-policy test
    _assert_same_update(_update(full, state, batch, current), reference, 1e-5, keys)
    _assert_same_update(_update(micro, state, batch, current), reference, 1e-5, keys)
    # Old log-probs of a policy some updates away: the policy ratio truncates negatives and the mismatch weight is
    # capped, so each microbatch must get its own rows of them.
    noise = np.random.default_rng(0).normal(0, 0.5, current.shape).astype(np.float32)
    stale = np.where(batch.action_mask, current + noise, 0.0)
    full_update = _update(full, state, batch, stale)
    _assert_same_update(_update(micro, state, batch, stale), full_update, 1e-6)
    assert float(full_update[1]["clip_fraction"]) > 0 and float(full_update[1]["mismatch_capped_fraction"]) > 0


def test_failure_labels_are_reward_below_the_success_threshold(off_policy):
    state, steps, batch = off_policy
    step = steps["recompute"]
    assert step.options.success_reward == 0.4  # resample.success_reward, the one definition of success
    forward = jax.jit(
        lambda params: token_logprobs(
            nnx.merge(state.graphdef, params, state.rest),
            batch.tokens,
            batch.attention_mask,
            batch.positions,
            return_entropy=True,
            block_size=step.options.logprob_block_size,
        )[:2]
    )
    logp, entropy = forward(state.params)

    def direct_loss(failures):
        loss, _ = policy_loss(
            logp,
            batch.behavior_logprobs,
            batch.rewards,
            batch.action_mask,
            batch.chunk_ids,
            batch.expert_mask,
            batch.group_ids,
            entropy,
            step.options.objective,
            failures=failures,
            old_log_probs=logp,
        )
        return float(loss)

    want = direct_loss(REWARDS < 0.4)
    # The labels matter here: the objective's default (its negatives, R <= 0) and another threshold give other losses.
    assert min(abs(want - direct_loss(None)), abs(want - direct_loss(REWARDS < 1.0))) > 1e-4 * abs(want)
    _, metrics = _update(step, state, batch)
    assert math.isclose(float(metrics["loss"]), want, rel_tol=1e-5, abs_tol=1e-6)  # abs_tol: see _assert_same_update
