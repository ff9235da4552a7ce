"""The reference-KL estimators k1/k2/k3, the "kl" loss term and the KL reward penalty against float64 NumPy
references written from Schulman's formulas (r = pi_ref / pi_theta of the sampled token), values and gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from objectives_reference import random_batch, reference

from ipa_jax.objectives import ObjectiveConfig, dr_grpo_config, objective_terms, policy_loss, term_denominators
from ipa_jax.objectives.kl import kl_estimate, kl_penalized_rewards, sequence_kl
from ipa_jax.objectives.sequences import sequences_of


def _estimators_float64(l, ref):
    """{name: (k, dk/dl)} in float64 from the formulas, log r = ref - l."""
    log_r = np.asarray(ref, np.float64) - np.asarray(l, np.float64)
    return {
        "k1": (-log_r, np.ones_like(log_r)),
        "k2": (0.5 * log_r**2, -log_r),
        "k3": (np.expm1(log_r) - log_r, -np.expm1(log_r)),  # r - 1 as expm1: no cancellation near r = 1
    }


def _log_probs(rng, shape, spread):
    l = -rng.exponential(1.5, shape)
    return l, np.minimum(l + spread * rng.standard_normal(shape), 0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("spread", [1e-4, 0.3, 3.0])
def test_estimators_match_float64_values_and_gradients(estimator, spread):
    l, ref = _log_probs(np.random.default_rng(0), (3, 7), spread)
    expected, expected_grad = _estimators_float64(l, ref)[estimator]
    with jax.enable_x64(True):  # scoped: the rest of the suite stays in 32-bit mode
        for dtype, rtol in ((jnp.float64, 1e-10), (jnp.float32, 1e-4)):
            lj, rj = jnp.asarray(l, dtype), jnp.asarray(ref, dtype)
            value = kl_estimate(lj, rj, estimator)
            grad = jax.grad(lambda x: jnp.sum(kl_estimate(x, rj, estimator)))(lj)  # noqa: B023
            # float32 rounds l and ref themselves: an absolute error of ~1e-7 in log r
            atol = 0 if dtype == jnp.float64 else 1e-6 * max(1.0, float(np.abs(ref - l).max()))
            np.testing.assert_allclose(np.asarray(value), expected, rtol=rtol, atol=atol * np.abs(expected_grad).max())
            np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=rtol, atol=atol)


def test_estimators_are_zero_at_the_reference_and_k2_k3_nonnegative():
    l, ref = _log_probs(np.random.default_rng(1), (4, 9), 2.0)
    for name in ("k1", "k2", "k3"):
        assert np.all(np.asarray(kl_estimate(jnp.asarray(l), jnp.asarray(l), name)) == 0)
    assert np.all(np.asarray(kl_estimate(jnp.asarray(l), jnp.asarray(ref), "k2")) >= 0)
    assert np.all(np.asarray(kl_estimate(jnp.asarray(l), jnp.asarray(ref), "k3")) >= 0)
    with pytest.raises(ValueError, match="'k4' is not one of"):
        kl_estimate(jnp.asarray(l), jnp.asarray(ref), "k4")


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    """E_{x ~ p}[k1] = E[k3] = KL(p || q) exactly, summed over a small vocabulary (not sampled)."""
    rng = np.random.default_rng(2)
    p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    exact = float(np.sum(p * np.log(p / q)))
    with jax.enable_x64(True):
        lp, lq = jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(q))
        for name in ("k1", "k3"):
            np.testing.assert_allclose(float(jnp.sum(p * kl_estimate(lp, lq, name))), exact, rtol=1e-12)


def _kl_term_float64(l, ref, action, estimator, aggregation, norm_length=0):
    """Agg(k) over action tokens in float64: (num, den, d num / d l)."""
    k, dk = _estimators_float64(np.where(action, l, 0), np.where(action, ref, 0))[estimator]
    if aggregation == "token_mean":
        scale, den = action.astype(np.float64), float(action.sum())
    elif aggregation == "token_sum_norm":  # Dr.GRPO: (1/B) sum_i sum_t k / L
        scale, den = action.astype(np.float64), float(action.any(axis=1).sum() * norm_length)
    else:  # sample_mean
        scale, den = action / np.maximum(action.sum(axis=1, keepdims=True), 1), float(action.any(axis=1).sum())
    return np.sum(scale * k), den, scale * dk


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean"])
def test_kl_term_matches_float64_reference(estimator, aggregation):
    config = ObjectiveConfig(aggregation=aggregation, il_weight=0.5, kl_weight=0.7, kl_estimator=estimator)
    batch = random_batch(np.random.default_rng(11), B=5, T=24)
    action = batch["action_mask"]
    ref_lp = np.where(
        action, np.minimum(batch["log_probs"] + 0.4 * np.random.default_rng(12).normal(size=action.shape), 0), 0
    )
    args = [batch[k] for k in ("behavior_log_probs", "rewards", "action_mask", "chunk_ids", "expert_mask")]

    def loss(l):
        return policy_loss(l, *args, config=config, extras={"ref_log_probs": jnp.asarray(ref_lp, jnp.float32)})

    (value, diag), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(batch["log_probs"]))
    base = reference(dataclasses.replace(config, kl_weight=0.0), batch["log_probs"], *args)
    num, den, dnum = _kl_term_float64(batch["log_probs"], ref_lp, action, estimator, aggregation)
    np.testing.assert_allclose(float(diag["kl_loss"]), num / den, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(value), base.loss + 0.7 * num / den, rtol=1e-5, atol=1e-6)
    expected_grad = base.grad + 0.7 * dnum / den
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4, atol=1e-6 * np.abs(expected_grad).max())


def test_kl_term_under_dr_grpo_divides_by_the_constant_length():
    """Dr.GRPO's token_sum_norm with the KL term: the term is (1/B) sum_i sum_t k / L like the policy-gradient term,
    and adds exactly weight * num / den and its gradient to the loss without it."""
    config = dataclasses.replace(dr_grpo_config(norm_length=32), kl_weight=0.7, kl_estimator="k3")
    batch = random_batch(np.random.default_rng(13), B=4, T=20)
    action = batch["action_mask"]
    ref_lp = np.where(
        action, np.minimum(batch["log_probs"] + 0.4 * np.random.default_rng(14).normal(size=action.shape), 0), 0
    )
    batch["group_ids"] = np.array([0, 0, 1, 1], np.int32)
    args = [batch[k] for k in ("behavior_log_probs", "rewards", "action_mask", "chunk_ids", "expert_mask", "group_ids")]
    with jax.enable_x64(True):
        extras = {"ref_log_probs": jnp.asarray(ref_lp, jnp.float64)}
        l64 = jnp.asarray(batch["log_probs"], jnp.float64)
        loss_of = lambda cfg: jax.value_and_grad(  # noqa: E731
            lambda l: policy_loss(l, *args, config=cfg, old_log_probs=l64, extras=extras), has_aux=True
        )(l64)
        (value, diag), grad = loss_of(config)
        (base, _), base_grad = loss_of(dataclasses.replace(config, kl_weight=0.0))
    num, den, dnum = _kl_term_float64(batch["log_probs"], ref_lp, action, "k3", "token_sum_norm", 32)
    np.testing.assert_allclose(float(diag["kl_loss"]), num / den, rtol=1e-10)
    np.testing.assert_allclose(float(value) - float(base), 0.7 * num / den, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(grad) - np.asarray(base_grad), 0.7 * dnum / den, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean", "chunk_mean"])
def test_kl_term_sums_exactly_over_microbatches(aggregation):
    config = ObjectiveConfig(aggregation=aggregation, kl_weight=0.5, kl_estimator="k3")
    batch = random_batch(np.random.default_rng(4), B=6, T=20)
    ref_lp = jnp.asarray(np.minimum(batch["log_probs"] + 0.5 * np.random.default_rng(5).normal(size=(6, 20)), 0))
    arrays = {k: jnp.asarray(v) for k, v in batch.items()}
    adv = arrays["rewards"] - arrays["rewards"].mean()

    def loss(l, rows, dens):
        terms, _ = objective_terms(
            l, arrays["behavior_log_probs"][rows], adv[rows], arrays["action_mask"][rows], arrays["chunk_ids"][rows],
            arrays["expert_mask"][rows], config, extras={"ref_log_probs": ref_lp[rows]},
        )  # fmt: skip
        return terms["kl"][0] / dens["kl"]  # the kl term's share, with the full batch's denominator

    dens = term_denominators(arrays["action_mask"], arrays["chunk_ids"], arrays["expert_mask"], config)
    full, full_grad = jax.value_and_grad(loss)(arrays["log_probs"], np.arange(6), dens)
    total, grad = 0.0, np.zeros((6, 20))
    for j in range(3):
        rows = np.arange(j, 6, 3)
        value, g = jax.value_and_grad(loss)(arrays["log_probs"][rows], rows, dens)
        total, grad[rows] = total + value, g
    assert float(full) != 0.0
    np.testing.assert_allclose(total, full, rtol=1e-6)
    np.testing.assert_allclose(grad, full_grad, rtol=1e-6, atol=1e-9)


def test_kl_term_needs_the_reference_log_probs():
    batch = random_batch(np.random.default_rng(6), B=2, T=8)
    args = [batch[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids")]
    with pytest.raises(ValueError, match="'kl' needs the per-token input 'ref_log_probs'"):
        policy_loss(*args, config=ObjectiveConfig(kl_weight=0.1))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_penalized_rewards_match_float64(estimator):
    """R'_i = R_i - beta * sum_{t in actions of i} k_t, also per sequence of packed rows."""
    batch = random_batch(np.random.default_rng(8), B=4, T=16)
    action, b = batch["action_mask"], batch["behavior_log_probs"]
    ref_lp = np.minimum(b + 0.3 * np.random.default_rng(9).normal(size=b.shape), 0)
    k, _ = _estimators_float64(b, ref_lp)[estimator]
    expected = batch["rewards"] - 0.2 * np.where(action, k, 0).sum(axis=1)
    with jax.enable_x64(True):
        kl = sequence_kl(jnp.asarray(b, jnp.float64), jnp.asarray(ref_lp), jnp.asarray(action), estimator)
        penalized = kl_penalized_rewards(jnp.asarray(batch["rewards"], jnp.float64), kl, 0.2)
        np.testing.assert_allclose(np.asarray(penalized), expected, rtol=1e-10, atol=1e-12)
        # two rows packed into one: each sequence's sum is its row's
        seg = np.repeat([1, 2], 16)[None]
        packed = sequence_kl(
            jnp.asarray(b[:2].reshape(1, 32), jnp.float64), jnp.asarray(ref_lp[:2].reshape(1, 32)),
            jnp.asarray(action[:2].reshape(1, 32)), estimator, sequences_of((1, 32), jnp.asarray(seg), 2),
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(packed)[0], np.where(action, k, 0).sum(axis=1)[:2], rtol=1e-10)


def test_policy_loss_applies_the_kl_reward_penalty():
    """policy_loss (the eager API) lowers the rewards by beta * KL_i before the baseline, as the train step does:
    its advantages are the float64 penalised rewards centred by the batch mean."""
    batch = random_batch(np.random.default_rng(10), B=4, T=16)
    action, b = batch["action_mask"], batch["behavior_log_probs"]
    ref_lp = np.minimum(b + 0.3 * np.random.default_rng(11).normal(size=b.shape), 0)
    k, _ = _estimators_float64(b, ref_lp)["k1"]
    penalized = batch["rewards"] - 0.2 * np.where(action, k, 0).sum(axis=1)
    config = ObjectiveConfig(kl_penalty=0.2, kl_penalty_estimator="k1", baseline="batch_mean")
    args = [batch[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids")]
    _, diagnostics = policy_loss(*args, config=config, extras={"ref_log_probs": ref_lp.astype(np.float32)})
    np.testing.assert_allclose(
        np.asarray(diagnostics["advantages"]), penalized - penalized.mean(), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="ref_log_probs: required by objective.kl_penalty"):
        policy_loss(*args, config=config)


def test_kl_penalty_can_read_the_old_log_probs_as_verl():
    """kl_penalty_logprobs "recompute" (verl's use_kl_in_reward): R'_i = R_i - beta * sum_t k(old_t, ref_t) with the
    learner's old log-probs in place of the sampler's, in float64; the default reads the sampler's."""
    batch = random_batch(np.random.default_rng(15), B=4, T=16)
    action, b = batch["action_mask"], batch["behavior_log_probs"]
    rng = np.random.default_rng(16)
    ref_lp = np.minimum(b + 0.3 * rng.normal(size=b.shape), 0)
    old = np.where(action, np.minimum(b + 0.2 * rng.normal(size=b.shape), 0), 0)
    args = [batch[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids")]
    for source, policy in (("behavior", b), ("recompute", old)):
        config = ObjectiveConfig(kl_penalty=0.3, kl_penalty_estimator="k3", kl_penalty_logprobs=source,
                                 old_logprobs="recompute", is_level="none", mismatch_level="none")  # fmt: skip
        k, _ = _estimators_float64(policy, ref_lp)["k3"]
        with jax.enable_x64(True):
            _, diag = policy_loss(
                *(jnp.asarray(x, jnp.float64) if x.dtype.kind == "f" else x for x in args), config=config,
                old_log_probs=jnp.asarray(old), extras={"ref_log_probs": jnp.asarray(ref_lp)},
            )  # fmt: skip
        expected = batch["rewards"] - 0.3 * np.where(action, k, 0).sum(axis=1)
        np.testing.assert_allclose(np.asarray(diag["advantages"]), expected, rtol=1e-12, atol=1e-12)
    assert np.abs(np.where(action, old - b, 0)).sum() > 1  # the two sources differ


def test_kl_config_is_validated():
    with pytest.raises(ValueError, match="kl_estimator: 'k5' is not one of"):
        ObjectiveConfig(kl_estimator="k5")
    with pytest.raises(ValueError, match="kl_penalty_estimator"):
        ObjectiveConfig(kl_penalty_estimator="low_var_kl")
    with pytest.raises(ValueError, match="kl_weight: must be a finite number"):
        ObjectiveConfig(kl_weight=float("inf"))
    with pytest.raises(ValueError, match="kl_penalty: must be a finite number >= 0"):
        ObjectiveConfig(kl_penalty=-0.1)
    with pytest.raises(ValueError, match="kl_penalty_logprobs: 'recompute' .* needs kl_penalty > 0 and old_logprobs"):
        ObjectiveConfig(kl_penalty=0.1, kl_penalty_logprobs="recompute")
    with pytest.raises(ValueError, match="kl_penalty_logprobs: 'recompute' .* needs kl_penalty > 0"):
        ObjectiveConfig(old_logprobs="recompute", kl_penalty_logprobs="recompute")
    with pytest.raises(ValueError, match="kl_penalty_logprobs: 'old' is not one of"):
        ObjectiveConfig(kl_penalty_logprobs="old")
    assert not ObjectiveConfig().needs_reference
    assert ObjectiveConfig(kl_penalty=0.01).needs_reference and ObjectiveConfig(kl_weight=0.1).needs_reference
