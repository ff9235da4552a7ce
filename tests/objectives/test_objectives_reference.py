"""Every objective option against the float64 NumPy reference (objectives_reference.py) on ragged batches:
loss, gradient with respect to log_probs (= the analytic weight / denominator), and per-token diagnostics."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from objectives_reference import random_batch, reference

from ipa_jax.objectives import ObjectiveConfig, flash_reinforce_config, ipa_config, policy_loss

CONFIGS = {
    "ipa_default": ObjectiveConfig(),
    "flash_reinforce": flash_reinforce_config(),
    "flash_entropy_filter": flash_reinforce_config(delta=1e-2, negative_token_fraction=0.5),
    "ipa_batch_mean_chunk_mean": ipa_config(gamma=0.9, baseline="batch_mean", aggregation="chunk_mean"),
    "group_token_sequence_is": ObjectiveConfig(
        baseline="group_mean",
        credit="token",
        gamma=0.9,
        is_level="sequence",
        is_apply_to="all",
        is_clip_max=2.0,
        mismatch_level="token",
        mismatch_range=(0.5, 2.0),
        trust_region_level="chunk",
        trust_region_delta=1e-2,
        aggregation="token_mean",
        rl_weight=1.0,
        il_weight=0.5,
    ),
    "trajectory_no_is_sequence_sum": ObjectiveConfig(
        baseline="batch_mean",
        credit="trajectory",
        is_level="none",
        mismatch_level="none",
        trust_region_level="sequence",
        trust_region_delta=float("inf"),
        aggregation="sequence_sum",
        rl_weight=0.7,
        il_weight=2.0,
    ),
    "token_is_negatives_unclipped": ObjectiveConfig(
        baseline="none",
        credit="chunk",
        gamma=1.0,
        is_level="token",
        is_apply_to="negatives",
        is_clip_max=None,
        mismatch_level="token",
        mismatch_range=(0.0, 3.0),
        aggregation="sample_mean",
        il_weight=0.0,
    ),
    # The positive control: every advantage negated (successes become the negatives the IS ratio weights).
    "ipa_advantage_sign_flipped": dataclasses.replace(ipa_config(), advantage_sign=-1),
    "flash_group_advantage_sign_flipped": dataclasses.replace(
        flash_reinforce_config(), baseline="group_mean", advantage_sign=-1
    ),
    # The baseline after discounting: each token's credit and sign its own (TOPR's negatives per token).
    "ipa_return_baseline_batch_mean": dataclasses.replace(
        ipa_config(gamma=0.7, baseline="batch_mean"), baseline_stage="return"
    ),
    "return_baseline_group_token_filtered": ObjectiveConfig(
        baseline="group_mean",
        baseline_stage="return",
        credit="token",
        gamma=0.9,
        is_level="token",
        is_clip_max=1.0,
        mismatch_level="none",
        negative_token_fraction=0.5,
        aggregation="token_mean",
    ),
    "return_baseline_rloo_flipped": ObjectiveConfig(
        baseline="rloo", baseline_stage="return", gamma=0.8, advantage_sign=-1, aggregation="chunk_mean"
    ),
}
SEEDS = range(8)


@functools.partial(jax.jit, static_argnames="config")
def loss_diag_grad(batch: dict, config: ObjectiveConfig):
    def f(log_probs):
        return policy_loss(
            log_probs,
            batch["behavior_log_probs"],
            batch["rewards"],
            batch["action_mask"],
            batch["chunk_ids"],
            batch["expert_mask"],
            batch["group_ids"],
            batch["entropies"],
            config,
        )

    (loss, diag), grad = jax.value_and_grad(f, has_aux=True)(batch["log_probs"])
    return loss, diag, grad


def run_reference(config, batch):
    return reference(
        config,
        batch["log_probs"],
        batch["behavior_log_probs"],
        batch["rewards"],
        batch["action_mask"],
        batch["chunk_ids"],
        batch["expert_mask"],
        batch["group_ids"],
        batch["entropies"],
    )


def assert_close_to(actual, expected, magnitude, rtol=1e-6):
    """|actual - expected| <= rtol * (|expected| + magnitude): relative to the size of the summed terms, which
    is what float32 round-off scales with (the loss itself can cancel to ~0)."""
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * magnitude)


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_float64_reference(name):
    config = CONFIGS[name]
    rng = np.random.default_rng(1234)
    decisions = {"admitted": 0, "rejected": 0}
    for _ in SEEDS:
        batch = random_batch(rng, B=5, T=40)
        loss, diag, grad = jax.device_get(loss_diag_grad(batch, config))
        ref = run_reference(config, batch)
        assert loss.dtype == np.float32
        assert_close_to(loss, ref.loss, ref.scale_magnitude)
        action = batch["action_mask"]
        np.testing.assert_allclose(grad, ref.grad, rtol=1e-6, atol=1e-6 * np.abs(ref.grad).max())
        np.testing.assert_allclose(diag["weights"], ref.weights, rtol=1e-6, atol=1e-6 * np.abs(ref.weights).max())
        # atol relative to the returns' size: a return baseline's G - b cancels in float32
        returns_atol = 1e-7 * max(1.0, np.abs(ref.returns).max())
        np.testing.assert_allclose(diag["chunk_returns"], ref.returns, rtol=1e-6, atol=returns_atol)
        np.testing.assert_allclose(np.where(action, diag["chunk_ratios"], 0), ref.chunk_ratios, rtol=1e-6)
        # The KL proxy is O((l-b)^2) from O(l-b) terms that cancel: float32 keeps it to ~1e-6 absolute.
        np.testing.assert_allclose(diag["sequence_kl"], ref.sequence_kl, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(diag["admitted"], ref.admitted)
        np.testing.assert_array_equal(diag["retained_tokens"], ref.retained)
        np.testing.assert_array_equal(diag["policy_tokens"], action.sum(1))
        # Scalar diagnostics, from the reference's masks.
        cid = batch["chunk_ids"]
        K = cid.max(1) + 1
        np.testing.assert_array_equal(diag["num_chunks"], K)
        kept_chunks = sum(ref.keep[i][cid[i] == k].any() for i in range(len(K)) for k in range(K[i]))
        np.testing.assert_allclose(diag["kept_fraction"], kept_chunks / K.sum(), rtol=1e-6)
        np.testing.assert_allclose(diag["kept_token_fraction"], ref.keep.sum() / action.sum(), rtol=1e-6)
        np.testing.assert_allclose(diag["acceptance_rate"], ref.acceptance_rate, rtol=1e-6)
        x = np.where(action, batch["log_probs"].astype(np.float64) - batch["behavior_log_probs"], 0)
        np.testing.assert_allclose(diag["mean_abs_log_ratio"], np.abs(x).sum() / action.sum(), rtol=1e-5)
        np.testing.assert_allclose(diag["mean_kl"], ref.kl.sum() / action.sum(), rtol=1e-4, atol=1e-7)
        assert int(diag["nonfinite_weights"]) == 0
        decisions["admitted"] += int(ref.admitted.sum())
        decisions["rejected"] += int((~ref.admitted).sum())
    if config.trust_region_level != "none" and np.isfinite(config.trust_region_delta):
        assert decisions["admitted"] and decisions["rejected"], decisions  # both branches were exercised


@pytest.mark.parametrize("preset", ["flash_reinforce", "ipa"])
def test_preset_gradient_is_weight_over_denominator(preset):
    """jax.grad of each public preset = -w / (T_i B) (sample_mean), w the analytic weight of the formula."""
    from ipa_jax.objectives import flash_reinforce_loss, ipa_loss

    rng = np.random.default_rng(7)
    batch = random_batch(rng, B=4, T=24)
    l, b, r, a, c = (batch[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids"))
    if preset == "flash_reinforce":
        fn = jax.jit(lambda x: flash_reinforce_loss(x, b, r, a, delta=5e-3)[0])
        A = r.astype(np.float64) - r.mean(dtype=np.float64)
        x = l.astype(np.float64) - b
        d = np.array([np.mean(kl) for kl in [_kl(b[i][a[i]], l[i][a[i]]) for i in range(len(r))]])
        admitted = np.maximum(d, 0) <= 5e-3
        w = np.where(a & admitted[:, None], np.exp(x) * A[:, None], 0)
    else:
        fn = jax.jit(lambda x: ipa_loss(x, b, r, a, c, gamma=0.9, baseline="batch_mean")[0])
        A = r.astype(np.float64) - r.mean(dtype=np.float64)
        w = np.zeros(l.shape)
        for i in range(len(r)):
            K = c[i].max() + 1
            for k in range(K):
                tok = c[i] == k
                ratio = np.exp(np.mean(l[i][tok].astype(np.float64) - b[i][tok]))
                if ratio <= 5.0:
                    w[i][tok] = 0.9 ** (K - 1 - k) * A[i] * (1.0 if A[i] >= 0 else min(ratio, 1.0))
    T_i = a.sum(1, keepdims=True)
    expected = -w / (T_i * len(r))
    np.testing.assert_allclose(np.asarray(jax.grad(fn)(l)), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


def _kl(b, l):
    p = np.clip(np.exp(b.astype(np.float64)), 1e-6, 1 - 1e-6)
    q = np.clip(np.exp(l.astype(np.float64)), 1e-6, 1 - 1e-6)
    return p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))


def test_failures_override_selects_the_filtered_rows():
    """flash_reinforce_loss(failures=R <= 0) filters those rows (not the A < 0 default) as the reference does."""
    from ipa_jax.objectives import flash_reinforce_loss

    flash = jax.jit(flash_reinforce_loss, static_argnames=("delta", "negative_token_fraction"))
    config = flash_reinforce_config(delta=float("inf"), negative_token_fraction=0.3)
    batch = random_batch(np.random.default_rng(99), B=5, T=40)
    batch["rewards"] = np.array([0.0, 1.0, 0.0, 3.0, 1.0], np.float32)  # A < 0 for rows 0, 1, 2, 4
    failures = batch["rewards"] <= 0
    loss, diag = flash(
        batch["log_probs"],
        batch["behavior_log_probs"],
        batch["rewards"],
        batch["action_mask"],
        delta=float("inf"),
        negative_token_fraction=0.3,
        entropies=batch["entropies"],
        failures=failures,
    )
    ref = reference(
        config,
        batch["log_probs"],
        batch["behavior_log_probs"],
        batch["rewards"],
        batch["action_mask"],
        None,
        None,
        entropies=batch["entropies"],
        failures=failures,
    )
    assert_close_to(loss, ref.loss, ref.scale_magnitude)
    filtered = np.asarray(diag["retained_tokens"]) < batch["action_mask"].sum(1)
    np.testing.assert_array_equal(filtered, failures)
    np.testing.assert_array_equal(diag["retained_tokens"], ref.retained)
