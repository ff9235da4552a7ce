"""DAPO's overlong shaping: the soft punishment against float64 NumPy from its formula (alone and inside the
loss, values and gradients), overlong filtering (truncated rows carry no gradient and leave every statistic), and
the truncation flag from a trajectory's finish reason to the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from objectives_reference import random_batch, reference

from ipa_jax.objectives import (
    ObjectiveConfig,
    combine_terms,
    estimate_advantages,
    objective_terms,
    overlong_penalty,
    policy_loss,
    term_denominators,
)
from ipa_jax.trajectory import Trajectory, pack_batch, pad_batch


def reference_penalty(length, max_length, buffer_length, penalty):
    """DAPO eq. 13: 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if inside the buffer; -1 beyond."""
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return penalty * (start - length) / buffer_length
    return -penalty


def test_soft_punishment_matches_the_formula():
    lengths = np.arange(0, 30)
    with jax.enable_x64(True):
        got = np.asarray(overlong_penalty(jnp.asarray(lengths, jnp.float64), 20, 8, 0.5))
    expected = [reference_penalty(n, 20, 8, 0.5) for n in lengths]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    assert got[12] == 0 and got[16] == -0.25 and got[20] == -0.5 and got[21] == -0.5  # the buffer's ends


def _fields(batch):
    return [batch[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids")]


def test_shaped_rewards_in_the_loss_match_the_reference():
    """The punishment is added to the rewards before the baseline: the loss and gradient are the reference's on
    the shaped rewards (float64)."""
    config = ObjectiveConfig(baseline="batch_mean", overlong_max_length=8, overlong_buffer_length=4, il_weight=0.5)
    batch = random_batch(np.random.default_rng(0), B=6, T=24)
    l, b, r, a, c = _fields(batch)
    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(
            lambda x: policy_loss(x, b.astype(np.float64), r.astype(np.float64), a, c, batch["expert_mask"],
                                  config=config)[0]
        )(jnp.asarray(l, jnp.float64))  # fmt: skip
        loss, grad = float(loss), np.asarray(grad)
    shaped = r + np.array([reference_penalty(n, 8, 4, 1.0) for n in a.sum(axis=1)])
    assert np.abs(shaped - r).max() > 0  # some rows are punished
    plain = dataclasses.replace(config, overlong_max_length=0, overlong_buffer_length=0)
    ref = reference(plain, l, b, shaped, a, c, batch["expert_mask"])
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-10)
    np.testing.assert_allclose(grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_truncated_rows_carry_no_gradient():
    """With overlong_filter the truncated rows' action tokens leave the loss (their expert tokens stay): the loss
    and gradient are the reference's on the batch without those actions, and their rewards change nothing."""
    config = ObjectiveConfig(baseline="batch_mean", aggregation="token_mean", overlong_filter=True, il_weight=0.5)
    batch = random_batch(np.random.default_rng(1), B=6, T=24)
    l, b, r, a, c = _fields(batch)
    truncated = np.array([False, True, False, False, True, False])

    def loss_grad(rewards):
        with jax.enable_x64(True):
            value, grad = jax.value_and_grad(
                lambda x: policy_loss(x, b.astype(np.float64), rewards.astype(np.float64), a, c,
                                      batch["expert_mask"], config=config, truncated=truncated)[0]
            )(jnp.asarray(l, jnp.float64))  # fmt: skip
            return float(value), np.asarray(grad)

    loss, grad = loss_grad(r)
    kept = a & ~truncated[:, None]
    ref = reference(dataclasses.replace(config, overlong_filter=False), l, b, r, kept, np.where(kept, c, -1),
                    batch["expert_mask"])  # fmt: skip
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-10)
    np.testing.assert_allclose(grad, ref.grad, rtol=1e-10, atol=1e-12)
    assert not grad[truncated][a[truncated]].any() and grad[~truncated][a[~truncated]].any()
    # a truncated row's reward reaches neither its own tokens nor the others' baseline
    other = r.copy()
    other[truncated] += 7.0
    loss_other, grad_other = loss_grad(other)
    assert loss_other == loss
    np.testing.assert_array_equal(grad_other, grad)
    with pytest.raises(ValueError, match="truncated: required by overlong_filter"):
        policy_loss(l, b, r, a, c, config=config)


def test_filter_sums_exactly_over_microbatches():
    config = ObjectiveConfig(baseline="batch_mean", aggregation="token_mean", overlong_filter=True, il_weight=0.5)
    batch = random_batch(np.random.default_rng(2), B=6, T=20)
    l, b, r, a, c = (jnp.asarray(x) for x in _fields(batch))
    e = jnp.asarray(batch["expert_mask"])
    truncated = jnp.asarray([True, False, False, True, False, False])
    adv = estimate_advantages(r, a, None, config, truncated=truncated)
    dens = term_denominators(a, c, e, config, truncated=truncated)

    def loss(x, rows):
        terms, _ = objective_terms(x, b[rows], adv[rows], a[rows], c[rows], e[rows], config, truncated=truncated[rows])
        return combine_terms(terms, config, dens)

    full, full_grad = jax.value_and_grad(loss)(l, np.arange(6))
    total, grad = 0.0, np.zeros(l.shape)
    for j in range(2):
        rows = np.arange(j, 6, 2)
        value, g = jax.value_and_grad(loss)(l[rows], rows)
        total, grad[rows] = total + value, g
    np.testing.assert_allclose(total, full, rtol=1e-6)
    np.testing.assert_allclose(grad, full_grad, rtol=1e-6, atol=1e-8)
    assert float(dens["rl"]) == float(jnp.sum(a & ~truncated[:, None]))


def _trajectory(uid, finish, n_actions=4):
    tokens = np.arange(2 + n_actions, dtype=np.int32)
    action = np.r_[False, False, np.ones(n_actions, bool)]
    return Trajectory(
        uid=uid,
        tokens=tokens,
        action_mask=action,
        behavior_logprobs=np.where(action, -1.0, 0.0),
        chunk_ids=np.where(action, 0, -1),
        expert_mask=np.zeros(len(tokens), bool),
        reward=1.0,
        policy_version=0,
        info={"finish_reason": finish},
    )


def test_truncation_travels_from_the_finish_reason_to_the_batch():
    trajs = [_trajectory(f"t{i}", f) for i, f in enumerate(["answer", "length", "context", "max_turns"])]
    assert [t.truncated for t in trajs] == [False, True, True, False]
    np.testing.assert_array_equal(pad_batch(trajs, (8,)).truncated, [False, True, True, False])
    packed, slots = pack_batch(trajs, (16,))
    np.testing.assert_array_equal(packed.truncated, np.where(slots >= 0, np.isin(slots, [1, 2]), False))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(overlong_max_length=16), r"overlong_buffer_length: must be in \(0, overlong_max_length=16\]"),
        (dict(overlong_max_length=16, overlong_buffer_length=17), "overlong_buffer_length: must be in"),
        (dict(overlong_buffer_length=4), "overlong_buffer_length: needs overlong_max_length > 0"),
        (dict(overlong_max_length=-1), "overlong_max_length: must be an integer >= 0"),
        (dict(overlong_max_length=8, overlong_buffer_length=4, overlong_penalty=-1.0), "overlong_penalty: must be"),
        (dict(overlong_filter=1), "overlong_filter: must be True or False"),
    ],
)
def test_overlong_values_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ObjectiveConfig(**kwargs)
