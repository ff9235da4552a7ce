"""Branch credit: chunk advantages from branched continuations as the per-token credit of the composed objective,
against a float64 NumPy reference written from the formulas (objectives/credit.py, branch_credit)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from objectives_reference import random_batch

from ipa_jax.objectives import ObjectiveConfig, branch_credit, combine_terms, compute_advantages, objective_terms

CONFIG = ObjectiveConfig(
    credit="branch", is_level="chunk", is_apply_to="negatives", is_clip_max=1.0, mismatch_level="none"
)


def branch_inputs(rng, batch):
    """Per-chunk advantages of the branched rows (every other row, at random), spread over their tokens."""
    action, cid = batch["action_mask"], batch["chunk_ids"]
    B, T = action.shape
    branched_rows = rng.random(B) < 0.5
    branched_rows[0], branched_rows[-1] = True, False  # both kinds in every batch
    chunk_adv = [rng.choice([-1.0, -0.5, 0.0, 0.25, 1.0], size=cid[i].max() + 1) for i in range(B)]
    adv = np.zeros((B, T))
    mask = np.zeros((B, T), bool)
    for i in np.flatnonzero(branched_rows):
        adv[i, action[i]] = chunk_adv[i][cid[i, action[i]]]
        mask[i] = action[i]
    return adv, mask, chunk_adv, branched_rows


def reference(cfg, batch, chunk_adv, branched_rows):
    """Row by row in float64: G = A_k (branched rows) or gamma^(K-1-k) R_i; negative tokens G < 0 (branched) or
    R_i < 0; rho = min(exp(mean_chunk(l - b)), 1) on negatives, 1 elsewhere; w = rho G;
    loss = -(1/B) sum_i (1/T_i) sum_t w_t l_t (sample mean), and d loss / d l = -w / (B T_i)."""
    l = batch["log_probs"].astype(np.float64)
    b = batch["behavior_log_probs"].astype(np.float64)
    R = batch["rewards"].astype(np.float64)
    action, cid = batch["action_mask"], batch["chunk_ids"]
    B, _ = l.shape
    returns, weights, grad = np.zeros_like(l), np.zeros_like(l), np.zeros_like(l)
    loss = 0.0
    for i in range(B):
        K = cid[i].max() + 1
        n = action[i].sum()
        for t in np.flatnonzero(action[i]):
            k = cid[i, t]
            if branched_rows[i]:
                g, negative = chunk_adv[i][k], chunk_adv[i][k] < 0
            else:
                g, negative = cfg.gamma ** (K - 1 - k) * R[i], R[i] < 0
            in_chunk = action[i] & (cid[i] == k)
            rho = min(np.exp(np.mean(l[i, in_chunk] - b[i, in_chunk])), 1.0) if negative else 1.0
            returns[i, t], weights[i, t] = g, rho * g
            loss -= rho * g * l[i, t] / (B * n)
            grad[i, t] = -rho * g / (B * n)
    return loss, returns, weights, grad


def branch_loss(log_probs, batch, branch_advantages=None, branch_mask=None):
    """(loss, diagnostics) of CONFIG on `batch` with log-probs `log_probs` (the differentiated input)."""
    advantages = compute_advantages(batch["rewards"], CONFIG.baseline)
    terms, diag = objective_terms(
        log_probs,
        batch["behavior_log_probs"],
        advantages,
        batch["action_mask"],
        batch["chunk_ids"],
        None,
        CONFIG,
        branch_advantages=branch_advantages,
        branch_mask=branch_mask,
    )
    return combine_terms(terms, CONFIG), diag


def test_branch_credit_matches_float64_reference():
    rng = np.random.default_rng(7)
    for _ in range(4):
        batch = random_batch(rng, B=6, T=40)
        adv, mask, chunk_adv, branched_rows = branch_inputs(rng, batch)
        (loss, diag), grad = jax.value_and_grad(branch_loss, has_aux=True)(
            batch["log_probs"], batch, adv.astype(np.float32), mask
        )
        ref_loss, ref_returns, ref_weights, ref_grad = reference(CONFIG, batch, chunk_adv, branched_rows)
        np.testing.assert_allclose(diag["chunk_returns"], ref_returns, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(diag["weights"], ref_weights, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        # The reference is not the chunk credit: some branched token differs from its row's discounted return.
        assert not np.isclose(float(branch_loss(batch["log_probs"], batch)[0]), ref_loss)


def test_branch_credit_without_branch_values_is_chunk_credit():
    batch = random_batch(np.random.default_rng(3), B=4, T=32)
    args = (batch["log_probs"], batch["behavior_log_probs"], batch["rewards"], batch["action_mask"])
    branch, _ = objective_terms(*args, batch["chunk_ids"], None, CONFIG)
    chunk, _ = objective_terms(*args, batch["chunk_ids"], None, dataclasses.replace(CONFIG, credit="chunk"))
    np.testing.assert_array_equal(branch["rl"][0], chunk["rl"][0])


def test_branch_credit_function_sign_and_masks():
    action = np.array([[False, True, True, True, False]])
    fallback = np.array([[9.0, 0.5, 0.5, 0.25, 9.0]], np.float32)
    fallback_negatives = np.zeros((1, 5), bool)
    adv = np.array([[7.0, 1.0, 1.0, -2.0, 7.0]], np.float32)
    mask = np.array([[True, True, True, False, True]])  # position 3: an action token of no branched trajectory
    for sign in (1, -1):
        g, negatives = branch_credit(fallback, fallback_negatives, adv, mask, action, sign)
        np.testing.assert_array_equal(g, [[0.0, sign, sign, 0.25, 0.0]])
        np.testing.assert_array_equal(negatives, [[False, sign < 0, sign < 0, False, False]])
    with pytest.raises(ValueError, match="sign"):
        branch_credit(fallback, fallback_negatives, adv, mask, action, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(branch_samples=0), "branch_samples"),
        (dict(branch_samples=2.0), "branch_samples"),
        (dict(branch_samples=True), "branch_samples"),
        (dict(branch_fraction=0.0), "branch_fraction"),
        (dict(branch_fraction=1.5), "branch_fraction"),
        (dict(branch_fraction=float("nan")), "branch_fraction"),
        (dict(credit="branches"), "credit"),
    ],
)
def test_branch_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"ObjectiveConfig.{message}"):
        ObjectiveConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kl_penalty=0.1), "kl_penalty"),
        (dict(overlong_max_length=64, overlong_buffer_length=16), "overlong_max_length"),
        (dict(baseline="group_mean", advantage_norm="group_std"), "advantage_norm"),
        (dict(advantage_norm="batch_std"), "advantage_norm"),
    ],
)
def test_branch_credit_refuses_reward_shaping(kwargs, field):
    """A branched chunk's V(k+1) - V(k) comes from the continuations' raw rewards, which the learner never sees:
    shaping only the episode's own reward would bias it, so the combination is a config error naming the field."""
    ObjectiveConfig(**kwargs)  # valid with the other credits
    with pytest.raises(ValueError, match=f"ObjectiveConfig.{field}: with credit 'branch'"):
        dataclasses.replace(CONFIG, **kwargs)


def test_gamma_discounts_only_the_unbranched_rows():
    """With credit "branch", gamma is the unbranched rows' chunk discount, gamma^(K-1-k) R_i; a branched row's
    credit is its chunk's A_k whatever gamma (the float64 reference for two discounts)."""
    rng = np.random.default_rng(11)
    batch = random_batch(rng, B=6, T=40)
    adv, mask, chunk_adv, branched_rows = branch_inputs(rng, batch)
    for gamma in (0.5, 1.0):
        cfg = dataclasses.replace(CONFIG, gamma=gamma)
        _, diag = objective_terms(
            batch["log_probs"], batch["behavior_log_probs"], compute_advantages(batch["rewards"], cfg.baseline),
            batch["action_mask"], batch["chunk_ids"], None, cfg, branch_advantages=adv.astype(np.float32),
            branch_mask=mask,
        )  # fmt: skip
        np.testing.assert_allclose(diag["chunk_returns"], reference(cfg, batch, chunk_adv, branched_rows)[1], rtol=1e-6)


def test_branch_credit_needs_chunks():
    assert ObjectiveConfig(credit="branch", is_level="token", mismatch_level="token").uses_chunks
