"""Invariants of the objective: on-policy ratios, trust-region edge cases, sample-mean weighting, chunk returns,
the denominator of rejected rows, microbatching, dtypes, jit of the presets."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from objectives_reference import random_batch, reference

from ipa_jax.objectives import (
    ObjectiveConfig,
    aggregation_weights,
    combine_terms,
    compute_advantages,
    credit_returns,
    entropy_filter_mask,
    flash_reinforce_config,
    flash_reinforce_loss,
    ipa_loss,
    objective_terms,
    policy_loss,
    term_denominators,
)

ALL_CHUNK_OPTIONS = ObjectiveConfig(
    baseline="group_mean",
    credit="chunk",
    is_level="chunk",
    is_apply_to="all",
    is_clip_max=1.5,
    mismatch_level="chunk",
    mismatch_range=(0.2, 5.0),
    trust_region_level="chunk",
    trust_region_delta=1e-2,
    aggregation="chunk_mean",
    il_weight=0.5,
)


@functools.partial(jax.jit, static_argnames="config")
def terms_and_grads(log_probs, behavior, advantages, action, chunk_ids, expert, config, denominators=None):
    """Per-microbatch terms and d(loss with the given full-batch denominators)/d log_probs."""

    def f(l):
        terms, diag = objective_terms(l, behavior, advantages, action, chunk_ids, expert, config)
        return combine_terms(terms, config, denominators), (terms, diag)

    (loss, (terms, diag)), grad = jax.value_and_grad(f, has_aux=True)(log_probs)
    return loss, terms, diag, grad


def _fields(batch):
    return (
        batch["log_probs"],
        batch["behavior_log_probs"],
        batch["rewards"],
        batch["action_mask"],
        batch["chunk_ids"],
        batch["expert_mask"],
        batch["group_ids"],
    )


def test_on_policy_every_ratio_is_one_and_everything_admitted():
    batch = random_batch(np.random.default_rng(0), B=6, T=32)
    l, _, r, a, c, e, g = _fields(batch)
    config = ObjectiveConfig(
        **{**ALL_CHUNK_OPTIONS.__dict__, "trust_region_level": "sequence", "trust_region_delta": 0.0}
    )
    _, _, diag, _ = terms_and_grads(l, l, compute_advantages(r, "group_mean", g), a, c, e, config)
    np.testing.assert_array_equal(np.asarray(diag["chunk_ratios"])[a], 1.0)
    np.testing.assert_array_equal(diag["sequence_kl"], 0.0)  # clamped at 0: delta = 0 still admits
    assert bool(np.all(diag["admitted"])) and float(diag["acceptance_rate"]) == 1.0
    assert float(diag["mean_is_ratio"]) == 1.0 and float(diag["max_is_ratio"]) == 1.0
    assert float(diag["kept_fraction"]) == 1.0 and float(diag["mean_abs_log_ratio"]) == 0.0


def test_infinite_delta_admits_everything():
    batch = random_batch(np.random.default_rng(1), B=6, T=32, drift=3.0)
    l, b, r, a, *_ = _fields(batch)
    strict = jax.device_get(flash_reinforce_loss(l, b, r, a, delta=1e-3)[1])
    assert not strict["admitted"].all()
    diag = jax.device_get(flash_reinforce_loss(l, b, r, a, delta=float("inf"))[1])
    assert diag["admitted"].all() and diag["acceptance_rate"] == 1.0
    np.testing.assert_array_equal(diag["retained_tokens"], a.sum(1))


@pytest.mark.parametrize("aggregation", ["sample_mean", "chunk_mean"])
def test_every_trajectory_weighs_one_over_B(aggregation):
    batch = random_batch(np.random.default_rng(2), B=5, T=40)
    a, c = batch["action_mask"], batch["chunk_ids"]
    scale, den = aggregation_weights(jnp.asarray(a), jnp.asarray(c), aggregation)
    np.testing.assert_allclose(np.asarray(scale).sum(1) / float(den), 1 / 5, rtol=1e-6)
    # Same through the loss: with A = 1 and every ratio 1, d loss / d l sums to -1/B in every row.
    l = batch["log_probs"]
    grad = jax.grad(lambda x: ipa_loss(x, x, np.ones(5, np.float32), a, c, gamma=1.0, aggregation=aggregation)[0])(l)
    np.testing.assert_allclose(np.asarray(grad).sum(1), -1 / 5, rtol=1e-6)


def test_chunk_returns_are_discounted_advantages():
    a = np.array([[0, 1, 1, 0, 1, 0, 1, 1, 1, 0]], bool)
    c = np.array([[-1, 0, 0, -1, 1, -1, 2, 2, 2, -1]], np.int32)
    g = np.asarray(credit_returns(jnp.array([2.0]), a, c, "chunk", 0.5))
    np.testing.assert_allclose(g, [[0, 0.5, 0.5, 0, 1, 0, 2, 2, 2, 0]])
    g = np.asarray(credit_returns(jnp.array([2.0]), a, c, "token", 0.5))
    np.testing.assert_allclose(g, [[0, 2 * 0.5**5, 2 * 0.5**4, 0, 2 * 0.5**3, 0, 0.5, 1, 2, 0]])
    np.testing.assert_allclose(credit_returns(jnp.array([2.0]), a, c, "trajectory", 0.5), 2 * a)
    diag = ipa_loss(
        np.where(a, -1.0, 0).astype(np.float32),
        np.where(a, -1.0, 0).astype(np.float32),
        np.array([3.0], np.float32),
        a,
        c,
        gamma=0.9,
    )[1]
    np.testing.assert_allclose(diag["chunk_returns"], np.where(a, 3 * 0.9 ** (2 - c), 0), rtol=1e-6)
    np.testing.assert_array_equal(diag["num_chunks"], [3])


def test_rejected_trajectory_keeps_B_in_the_denominator():
    rng = np.random.default_rng(3)
    batch = random_batch(rng, B=4, T=32, drift=0.0)
    l, b, r, a, *_ = _fields(batch)
    b = b.copy()
    b[0] = np.where(a[0], -np.abs(b[0] - 3.0), 0)  # row 0 drifts far: rejected
    loss, diag = flash_reinforce_loss(l, b, r, a, delta=3e-3)
    assert list(np.asarray(diag["admitted"])) == [False, True, True, True]
    A = np.asarray(diag["advantages"], np.float64)
    expected = -sum((A[i] * l[i][a[i]].astype(np.float64)).sum() / a[i].sum() for i in (1, 2, 3)) / 4
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert int(diag["retained_tokens"][0]) == 0 and int(diag["policy_tokens"][0]) == a[0].sum()


@pytest.mark.parametrize("config", [ALL_CHUNK_OPTIONS, flash_reinforce_config(delta=1e-2)], ids=["chunk", "flash"])
def test_microbatching_gives_the_full_batch_loss_and_gradient(config):
    batch = random_batch(np.random.default_rng(4), B=6, T=32)
    l, b, r, a, c, e, g = _fields(batch)
    adv = compute_advantages(jnp.asarray(r), config.baseline, jnp.asarray(g))  # on the FULL batch
    dens = term_denominators(jnp.asarray(a), jnp.asarray(c), jnp.asarray(e), config)
    full_loss, full_terms, _, full_grad = terms_and_grads(l, b, adv, a, c, e, config, dens)
    assert {k: float(v) for k, v in dens.items()} == {k: float(full_terms[k][1]) for k in full_terms}
    pieces = [slice(0, 2), slice(2, 4), slice(4, 6)]
    results = [terms_and_grads(l[s], b[s], adv[s], a[s], c[s], e[s], config, dens) for s in pieces]
    # Numerators and denominators add across microbatches (denominators exactly) ...
    summed = {k: tuple(sum(res[1][k][j] for res in results) for j in (0, 1)) for k in full_terms}
    for k in full_terms:
        assert float(summed[k][1]) == float(full_terms[k][1])
    np.testing.assert_allclose(combine_terms(summed, config), full_loss, rtol=1e-6)
    # ... and the per-microbatch losses with the full-batch denominators sum to the full loss; gradients concatenate.
    np.testing.assert_allclose(sum(float(res[0]) for res in results), full_loss, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([res[3] for res in results]), full_grad, rtol=1e-6, atol=1e-9)


def test_padding_rows_contribute_nothing():
    """5 real rows + 1 padding row (no actions, any advantage) = the float64 reference on the 5 real rows."""
    config = ALL_CHUNK_OPTIONS
    batch = random_batch(np.random.default_rng(5), B=6, T=32)
    l, b, r, a, c, e, g = _fields(batch)
    a[5], c[5], e[5], l[5], b[5] = False, -1, False, 0.0, 0.0
    adv = compute_advantages(jnp.asarray(r[:5]), config.baseline, jnp.asarray(g[:5]))
    adv = jnp.append(adv, 5.0)
    dens = term_denominators(jnp.asarray(a), jnp.asarray(c), jnp.asarray(e), config)
    loss, terms, _, grad = terms_and_grads(l, b, adv, a, c, e, config, dens)
    ref = reference(config, l[:5], b[:5], r[:5], a[:5], c[:5], e[:5], g[:5])
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-6, atol=1e-6 * ref.scale_magnitude)
    assert float(terms["rl"][1]) == ref.den_rl == 5
    np.testing.assert_array_equal(grad[5], 0)


def test_pure_imitation_row_adds_only_its_nll():
    """A row of expert tokens only (a scripted expert's episode) joins the IL term and nothing else: the RL
    weights of the other rows, their baseline included, equal the float64 reference without that row."""
    config = ObjectiveConfig(baseline="batch_mean", credit="chunk", is_level="chunk", il_weight=0.5)
    batch = random_batch(np.random.default_rng(7), B=6, T=32)
    l, b, r, a, c, e, g = _fields(batch)
    a[5], c[5], b[5], r[5] = False, -1, 0.0, 1.0
    e[5] = np.arange(32) % 3 == 1
    loss, diag = policy_loss(l, b, r, a, c, e, g, config=config)
    ref = reference(config, l, b, r, a, c, e, g)
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-6, atol=1e-6 * ref.scale_magnitude)
    without = reference(config, l[:5], b[:5], r[:5], a[:5], c[:5], e[:5], g[:5])
    np.testing.assert_allclose(diag["weights"][:5], without.weights, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(diag["advantages"][5], 0)
    assert ref.den_rl == without.den_rl == 5 and ref.den_il == without.den_il + e[5].sum()


def test_bf16_inputs_give_the_float32_result_within_bf16_rounding():
    batch = random_batch(np.random.default_rng(6), B=4, T=32, drift=0.01)
    l, b, r, a, c, *_ = _fields(batch)
    run = jax.jit(lambda x, y: ipa_loss(x, y, r, a, c, baseline="batch_mean"))
    loss32, diag32 = run(l, b)
    l16, b16 = jnp.asarray(l, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    loss16, diag16 = run(l16, b16)
    assert loss16.dtype == jnp.float32 and diag16["weights"].dtype == jnp.float32
    # Exactly the float32 computation on the bf16-rounded values ...
    loss_rounded, _ = run(np.asarray(l16, np.float32), np.asarray(b16, np.float32))
    np.testing.assert_allclose(loss16, loss_rounded, rtol=1e-6)
    # ... hence within bf16 rounding of the float32 result: each term w * l / T_i moves by a few bf16 ulps
    # (2^-8 relative: l, and exp(l - b) through l - b), relative to the summed term magnitudes.
    magnitude = np.sum(np.abs(np.asarray(diag32["weights"]) * l) / a.sum(1, keepdims=True)) / len(r)
    np.testing.assert_allclose(loss16, loss32, rtol=0, atol=4 * 2**-8 * magnitude)
    assert abs(float(loss16) - float(loss32)) > 0  # the inputs really were rounded
    grad16 = jax.grad(lambda x: run(x, b16)[0])(l16)
    assert grad16.dtype == jnp.bfloat16


def test_float64_stays_float64():
    with jax.enable_x64(True):  # scoped: the rest of the suite stays in 32-bit mode
        batch = random_batch(np.random.default_rng(7), B=3, T=16)
        l, b, r, a, c, e, g = _fields(batch)
        loss, diag = policy_loss(
            l.astype(np.float64), b.astype(np.float64), r.astype(np.float64), a, c, e, config=ObjectiveConfig()
        )
        assert loss.dtype == jnp.float64 and diag["weights"].dtype == jnp.float64
        loss32, _ = policy_loss(l, b, r, a, c, e, config=ObjectiveConfig())
        assert loss32.dtype == jnp.float32


def test_presets_run_under_jit_with_static_options():
    batch = random_batch(np.random.default_rng(8), B=3, T=16)
    l, b, r, a, c, *_ = _fields(batch)
    ent = batch["entropies"]
    flash = jax.jit(flash_reinforce_loss, static_argnames=("delta", "negative_token_fraction"))
    eager_loss, eager_diag = flash_reinforce_loss(l, b, r, a, delta=1e-2, negative_token_fraction=0.5, entropies=ent)
    jit_loss, jit_diag = flash(l, b, r, a, delta=1e-2, negative_token_fraction=0.5, entropies=ent)
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=1e-6)
    for key in ("advantages", "sequence_kl", "admitted", "acceptance_rate", "policy_tokens", "retained_tokens"):
        np.testing.assert_allclose(jit_diag[key], eager_diag[key], rtol=1e-6)
    ipa = jax.jit(
        ipa_loss, static_argnames=("gamma", "baseline", "negative_is_clip", "chunk_ratio_range", "aggregation")
    )
    loss, diag = ipa(l, b, r, a, c, gamma=0.9, chunk_ratio_range=(0.0, 5.0))
    assert np.isfinite(float(loss))
    for key in ("chunk_returns", "chunk_ratios", "kept_fraction", "num_chunks"):
        assert key in diag


def test_entropy_filter_keeps_ceil_q_T_highest_entropy_tokens_of_failures():
    a = np.array([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]], bool)
    ent = np.array([[0, 5, 1, 4, 2, 3], [0, 5, 1, 4, 2, 3]], np.float32)
    keep = np.asarray(entropy_filter_mask(jnp.asarray(ent), jnp.asarray(a), jnp.array([True, False]), 0.2))
    # ceil(0.2 * 5) = 1 exactly (in float32 0.2 * 5 rounds above 1 in some orders): keep only the max.
    np.testing.assert_array_equal(keep[0], [0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(keep[1], a[1])  # successes keep everything
    keep = np.asarray(entropy_filter_mask(jnp.asarray(ent), jnp.asarray(a), jnp.array([True, True]), 0.5))
    np.testing.assert_array_equal(keep[0], [0, 1, 0, 1, 0, 1])  # ceil(2.5) = 3
    keep = np.asarray(entropy_filter_mask(jnp.asarray(ent), jnp.asarray(a), jnp.array([True, True]), 0.0))
    assert not keep.any()


def test_group_mean_advantages():
    r = jnp.array([1.0, 0.0, 3.0, 5.0])
    np.testing.assert_allclose(compute_advantages(r, "group_mean", jnp.array([7, 7, 2, 7])), [-1, -2, 0, 3])
    np.testing.assert_allclose(compute_advantages(r, "batch_mean"), r - 2.25)
    np.testing.assert_allclose(compute_advantages(r, "none"), r)


def test_ratio_diagnostics_on_a_handcrafted_batch():
    """Row 0 (A = -0.5): chunk ratios 2 (truncated to 1) and 0.5; row 1 (A = +0.5) on-policy."""
    ln2 = np.log(2.0)
    a = np.array([[0, 1, 1, 1], [0, 1, 1, 1]], bool)
    c = np.array([[-1, 0, 0, 1], [-1, 0, 0, 1]], np.int32)
    l = np.array([[0, -1, -1, -1], [0, -1, -1, -1]], np.float32)
    b = np.array([[0, -1 - ln2, -1 - ln2, -1 + ln2], [0, -1, -1, -1]], np.float32)
    loss, diag = ipa_loss(l, b, np.array([0.0, 1.0], np.float32), a, c, gamma=0.5, baseline="batch_mean")
    np.testing.assert_allclose(diag["mean_is_ratio"], (2 + 2 + 0.5 + 3) / 6, rtol=1e-6)
    np.testing.assert_allclose(diag["max_is_ratio"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(diag["clip_fraction"], 2 / 6, rtol=1e-6)
    # w = G * min(r, 1) on the negative row, G on the positive one; G = 0.5^(K-1-k) * A.
    np.testing.assert_allclose(diag["weights"], [[0, -0.25, -0.25, -0.25], [0, 0.25, 0.25, 0.5]], rtol=1e-6)
    # loss = -(1/B) sum_i (1/T_i) sum_t w l, l = -1 on every action.
    np.testing.assert_allclose(loss, -((-0.75 * -1) / 3 + (1.0 * -1) / 3) / 2, rtol=1e-6)
