"""The off-policy options against the float64 NumPy reference (objectives_reference.py): old log-probs (policy
ratio current / old, mismatch ratio old / behaviour), the mismatch corrections at every level (range mask,
probability-difference filter, capped weight), sign_by, row_denominator, the published presets; the on-policy
case of "recompute", and microbatching with every option on."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from objectives_reference import random_batch, reference

from ipa_jax.objectives import (
    PRESETS,
    ObjectiveConfig,
    combine_terms,
    compute_advantages,
    flash_reinforce_config,
    ipa_config,
    ipa_roll_config,
    ipa_seed_config,
    objective_terms,
    policy_loss,
    term_denominators,
)

# name -> (config, what must happen in some batch: tokens dropped by the mismatch corrections, mismatch weights
# capped, policy ratios truncated, rows whose negative label by reward differs from A < 0).
CONFIGS = {
    "ipa_seed": (ipa_seed_config(), {"sign"}),
    "ipa_roll": (ipa_roll_config(), {"dropped", "sign"}),
    "recompute_sequence_mismatch_cap_diff_kept": (
        ObjectiveConfig(
            baseline="batch_mean",
            old_logprobs="recompute",
            is_level="token",
            is_apply_to="all",
            is_clip_max=1.02,
            mismatch_level="sequence",
            mismatch_range=(0.5, 2.0),
            mismatch_is_cap=1.05,
            mismatch_prob_diff=0.05,
            trust_region_level="sequence",
            trust_region_delta=3e-2,
            aggregation="sample_mean",
            row_denominator="kept",
            il_weight=0.5,
        ),
        {"dropped", "capped", "clipped"},
    ),
    "recompute_chunk_trust_region_token_mismatch": (
        ObjectiveConfig(
            baseline="group_mean",
            credit="token",
            gamma=0.9,
            old_logprobs="recompute",
            is_level="sequence",
            sign_by="reward",
            is_clip_max=0.5,
            mismatch_level="token",
            mismatch_range=(0.2, 5.0),
            mismatch_is_cap=1.2,
            mismatch_prob_diff=0.2,
            trust_region_level="chunk",
            trust_region_delta=1e-2,
            aggregation="chunk_mean",
        ),
        {"dropped", "capped", "clipped", "sign"},
    ),
    "behavior_reward_sign_entropy_filter": (
        ObjectiveConfig(
            baseline="batch_mean",
            credit="trajectory",
            sign_by="reward",
            is_level="token",
            is_clip_max=0.8,
            mismatch_level="chunk",
            mismatch_range=(0.0, 3.0),
            mismatch_is_cap=1.1,
            mismatch_prob_diff=0.1,
            negative_token_fraction=0.5,
            aggregation="token_mean",
            il_weight=0.0,
        ),
        {"dropped", "capped", "clipped", "sign"},
    ),
}
SEEDS = range(3)


def off_policy_batch(rng: np.random.Generator, B: int, T: int) -> dict:
    """random_batch plus old log-probs (the learner's at the start of the update: the behaviour's shifted per row
    by an engine mismatch, the current policy drifting from both) and graded rewards, a quarter of them 0."""
    batch = random_batch(rng, B=B, T=T)
    b, action = batch["behavior_log_probs"].astype(np.float64), batch["action_mask"]
    shift = rng.choice([-0.3, 0.0, 0.05, 0.3, 3.0], size=(B, 1))
    noise = rng.choice([0.02, 0.1, 0.4], size=(B, 1)) * rng.standard_normal(b.shape)
    old = np.where(action, np.minimum(b + shift + noise, -1e-3), 0.0)
    rewards = np.where(rng.random(B) < 0.25, 0.0, rng.uniform(-0.5, 1.5, B))
    return {**batch, "old_log_probs": old.astype(np.float32), "rewards": rewards.astype(np.float32)}


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
            old_log_probs=batch["old_log_probs"] if config.needs_old_log_probs else None,
        )

    (loss, diag), grad = jax.value_and_grad(f, has_aux=True)(batch["log_probs"])
    return loss, diag, grad


def run_reference(config: ObjectiveConfig, batch: dict):
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
        old=batch["old_log_probs"] if config.needs_old_log_probs else None,
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_float64_reference(name):
    config, must_happen = CONFIGS[name]
    rng = np.random.default_rng(2024)
    exercised = {"dropped": 0, "capped": 0, "clipped": 0, "sign": 0}
    for _ in SEEDS:
        batch = off_policy_batch(rng, B=5, T=40)
        loss, diag, grad = jax.device_get(loss_diag_grad(batch, config))
        ref = run_reference(config, batch)
        action = batch["action_mask"]
        np.testing.assert_allclose(loss, ref.loss, rtol=1e-6, atol=1e-6 * ref.scale_magnitude)
        np.testing.assert_allclose(grad, ref.grad, rtol=1e-6, atol=1e-6 * np.abs(ref.grad).max())
        np.testing.assert_allclose(diag["weights"], ref.weights, rtol=1e-6, atol=1e-6 * np.abs(ref.weights).max())
        np.testing.assert_array_equal(diag["retained_tokens"], ref.retained)
        np.testing.assert_array_equal(diag["negatives"], ref.negatives)
        np.testing.assert_array_equal(diag["admitted"], ref.admitted)
        np.testing.assert_allclose(diag["sequence_kl"], ref.sequence_kl, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(diag["acceptance_rate"], ref.acceptance_rate, rtol=1e-6)
        n_action, n_keep = action.sum(), max(ref.keep.sum(), 1)
        np.testing.assert_allclose(diag["mismatch_ratio_mean"], ref.mismatch_ratio.sum() / n_action, rtol=1e-5)
        np.testing.assert_allclose(diag["mismatch_masked_fraction"], ref.mismatch_dropped / n_action, rtol=1e-6)
        np.testing.assert_allclose(diag["mismatch_capped_fraction"], ref.mismatch_capped / n_keep, rtol=1e-6)
        np.testing.assert_allclose(diag["clip_fraction"], ref.clipped / n_keep, rtol=1e-6)
        np.testing.assert_allclose(diag["mean_kl"], ref.kl.sum() / n_action, rtol=1e-4, atol=1e-7)
        assert int(diag["nonfinite_weights"]) == 0
        exercised["dropped"] += ref.mismatch_dropped
        exercised["capped"] += ref.mismatch_capped
        exercised["clipped"] += ref.clipped
        exercised["sign"] += int((ref.negatives != (np.asarray(diag["advantages"]) < 0)).sum())
    assert all(exercised[what] for what in must_happen), exercised


def test_on_policy_recompute_is_the_behaviour_loss_with_behaviour_equal_to_current():
    """old_log_probs == log_probs: the policy ratio is exactly 1 (no truncation; the trust region's D = 0 admits
    every row even at delta 0), and loss and gradient equal the behaviour-ratio loss where behaviour == current.
    Without a mismatch correction the sampler's log-probs then do not matter at all."""
    config = dataclasses.replace(
        ipa_roll_config(),
        baseline="batch_mean",
        trust_region_level="sequence",
        trust_region_delta=0.0,
        mismatch_is_cap=1.2,
        mismatch_prob_diff=0.1,
    )
    batch = random_batch(np.random.default_rng(11), B=5, T=40)
    l = batch["log_probs"]
    on_policy = {**batch, "behavior_log_probs": l, "old_log_probs": l}
    want, _, want_grad = jax.device_get(loss_diag_grad(on_policy, dataclasses.replace(config, old_logprobs="behavior")))
    loss, diag, grad = jax.device_get(loss_diag_grad(on_policy, config))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)
    assert float(diag["mean_is_ratio"]) == float(diag["max_is_ratio"]) == 1.0 and float(diag["clip_fraction"]) == 0
    assert bool(diag["admitted"].all()) and float(diag["mismatch_ratio_mean"]) == 1.0
    assert np.any(diag["negatives"]) and float(diag["mismatch_capped_fraction"]) == 0
    # With b == l every mismatch correction passes everything, so the mismatch-free objective is the same loss;
    # and that objective, recomputed on the stale batch (b != l), does not see b.
    no_mismatch = dataclasses.replace(config, mismatch_level="none", mismatch_is_cap=None, mismatch_prob_diff=None)
    got, _, got_grad = jax.device_get(loss_diag_grad({**batch, "old_log_probs": l}, no_mismatch))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6, atol=1e-9)


def test_behavior_mode_is_the_one_ratio_objective():
    """old_logprobs="behavior" (no old log-probs) is the objective from before the option existed: the same float64
    reference with old = None, and recompute with old == behaviour gives the same loss (mismatch ratio 1)."""
    config = ObjectiveConfig(
        baseline="batch_mean",
        is_level="chunk",
        is_clip_max=1.0,
        mismatch_level="chunk",
        trust_region_level="sequence",
        trust_region_delta=5e-3,
        il_weight=0.5,
    )
    batch = random_batch(np.random.default_rng(5), B=5, T=40)
    batch["old_log_probs"] = batch["behavior_log_probs"]
    loss, _, grad = jax.device_get(loss_diag_grad(batch, config))
    ref = run_reference(config, batch)
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-6, atol=1e-6 * ref.scale_magnitude)
    recompute = dataclasses.replace(config, old_logprobs="recompute")
    loss_r, diag_r, grad_r = jax.device_get(loss_diag_grad(batch, recompute))
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    np.testing.assert_allclose(grad_r, grad, rtol=1e-6, atol=1e-9)
    assert float(diag_r["mismatch_ratio_mean"]) == 1.0 and float(diag_r["mismatch_masked_fraction"]) == 0


def test_sign_by_reward_splits_on_the_raw_score():
    """Graded rewards with a batch-mean baseline: R = 0.5 is a positive by reward (R > 0) but has A < 0; R = 0 is a
    negative either way. Negatives get min(rho, clip); the entropy filter's failures default to the negatives."""
    a = np.array([[0, 1, 1], [0, 1, 1], [0, 1, 1]], bool)
    l = np.where(a, -1.0, 0).astype(np.float32)
    b = np.where(a, -1.0 - np.log(2.0), 0).astype(np.float32)  # token ratio 2 everywhere
    r = np.array([0.5, 0.0, 2.5], np.float32)  # A = -0.5, -1, 1.5
    base = ObjectiveConfig(
        baseline="batch_mean",
        credit="trajectory",
        is_level="token",
        is_clip_max=1.0,
        mismatch_level="none",
        il_weight=0.0,
    )
    for sign_by, negatives in (("advantage", [True, True, False]), ("reward", [False, True, False])):
        _, diag = policy_loss(l, b, r, a, config=dataclasses.replace(base, sign_by=sign_by))
        np.testing.assert_array_equal(diag["negatives"], negatives)
        # rho: the ratio 2 truncated to 1 on negatives, not applied (1) on positives: w = A on every token.
        np.testing.assert_allclose(diag["weights"], np.where(a, np.array([-0.5, -1, 1.5])[:, None], 0), rtol=1e-6)
        np.testing.assert_allclose(diag["clip_fraction"], np.mean(negatives), rtol=1e-6)
    entropies = np.array([[0, 1, 2]] * 3, np.float32)
    filtered = dataclasses.replace(base, sign_by="reward", negative_token_fraction=0.5)
    _, diag = policy_loss(l, b, r, a, entropies=entropies, config=filtered)
    np.testing.assert_array_equal(diag["retained_tokens"], [2, 1, 2])  # the reward-negative row only
    _, diag = policy_loss(l, b, r, a, entropies=entropies, config=filtered, failures=r < 1.0)  # explicit labels
    np.testing.assert_array_equal(diag["retained_tokens"], [1, 1, 2])


def test_kept_row_denominator_divides_each_row_by_its_kept_tokens():
    """Row 0's second chunk is masked by the mismatch range: "action" divides row 0 by its 4 action tokens,
    "kept" by its 2 kept ones; the batch denominator is B = 2 either way."""
    a = np.array([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]], bool)
    c = np.array([[-1, 0, 0, -1, 1, 1], [-1, 0, 0, 0, -1, -1]], np.int32)
    l = np.where(a, -1.0, 0).astype(np.float32)
    b = l.copy()
    b[0, 4:] = -3.0  # chunk ratio e^2 > 2: masked
    r = np.array([1.0, 1.0], np.float32)
    base = ObjectiveConfig(gamma=1.0, mismatch_range=(0.0, 2.0), il_weight=0.0)
    loss_action, _ = policy_loss(l, b, r, a, c, config=base)
    loss_kept, diag = policy_loss(l, b, r, a, c, config=dataclasses.replace(base, row_denominator="kept"))
    np.testing.assert_array_equal(diag["retained_tokens"], [2, 3])
    np.testing.assert_allclose(loss_action, -(-2 / 4 + -3 / 3) / 2, rtol=1e-6)
    np.testing.assert_allclose(loss_kept, -(-2 / 2 + -3 / 3) / 2, rtol=1e-6)
    assert float(term_denominators(a, c, None, base)["rl"]) == 2


@functools.partial(jax.jit, static_argnames="config")
def terms_and_grads(batch, adv, config, denominators):
    def f(l):
        terms, _ = objective_terms(
            l,
            batch["behavior_log_probs"],
            adv,
            batch["action_mask"],
            batch["chunk_ids"],
            batch["expert_mask"],
            config,
            batch["entropies"],
            old_log_probs=batch["old"],
            rewards=batch["rewards"],
        )
        return combine_terms(terms, config, denominators), terms

    (loss, terms), grad = jax.value_and_grad(f, has_aux=True)(batch["log_probs"])
    return loss, terms, grad


def test_microbatching_with_every_off_policy_option():
    """Old log-probs, rewards, the kept row denominator and a sequence mismatch level: per-row quantities are
    whole in each microbatch and the denominators are mask-only, so the microbatch losses and gradients sum and
    concatenate to the full batch's."""
    config = CONFIGS["recompute_sequence_mismatch_cap_diff_kept"][0]
    config = dataclasses.replace(config, sign_by="reward", is_apply_to="negatives", negative_token_fraction=0.5)
    batch = off_policy_batch(np.random.default_rng(4), B=6, T=32)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    batch["old"] = batch.pop("old_log_probs")
    adv = compute_advantages(batch["rewards"], config.baseline, batch["group_ids"])
    dens = term_denominators(batch["action_mask"], batch["chunk_ids"], batch["expert_mask"], config)
    full_loss, full_terms, full_grad = terms_and_grads(batch, adv, config, dens)
    assert {k: float(v) for k, v in dens.items()} == {k: float(full_terms[k][1]) for k in full_terms}
    pieces = [np.arange(6) % 3 == j for j in range(3)]  # rows j, j + 3: the train step's interleaved split
    results = [terms_and_grads({k: v[p] for k, v in batch.items()}, adv[p], config, dens) for p in pieces]
    np.testing.assert_allclose(sum(float(res[0]) for res in results), full_loss, rtol=1e-6)
    grad = np.zeros_like(full_grad)
    for p, res in zip(pieces, results):
        grad[p] = res[2]
    np.testing.assert_allclose(grad, full_grad, rtol=1e-6, atol=1e-9)


def test_presets_reproduce_the_published_settings():
    published = {
        "ipa": ipa_config(),
        "ipa_seed": ipa_seed_config(),
        "ipa_roll": ipa_roll_config(),
        "flash_reinforce": flash_reinforce_config(),
    }
    assert {name: PRESETS[name] for name in published} == published
    assert set(PRESETS) - set(published) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo_dual_clip"}
    seed = ipa_seed_config()  # the ROME paper's pseudo-code: discount, IS clip, mismatch threshold, R > 0, sum / B
    assert (seed.gamma, seed.is_clip_max, seed.mismatch_range, seed.mismatch_level) == (0.95, 10.0, (0.0, 5.0), "token")
    assert (seed.sign_by, seed.is_level, seed.is_apply_to, seed.aggregation) == (
        "reward",
        "chunk",
        "negatives",
        "sequence_sum",
    )
    roll = ipa_roll_config()  # ROLL: TOPR in [0, 1] on scores <= 0, segment ratios, mean over kept tokens per row
    assert (roll.old_logprobs, roll.sign_by, roll.is_clip_max, roll.is_level, roll.row_denominator) == (
        "recompute",
        "reward",
        1.0,
        "chunk",
        "kept",
    )
    assert (roll.mismatch_level, roll.mismatch_range, roll.mismatch_is_cap) == ("chunk", (0.0, 5.0), float("inf"))
    assert ipa_config().old_logprobs == "behavior" and ipa_config().sign_by == "advantage"
