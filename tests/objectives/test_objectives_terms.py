"""The registry of objective terms: the entropy bonus against a float64 NumPy reference (value and gradients), the
microbatch-exact aggregation of every registered term, a term with an extra per-token input, registry errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from objectives_reference import random_batch, reference

from ipa_jax.objectives import ObjectiveConfig, combine_terms, objective_terms, policy_loss, term_denominators
from ipa_jax.objectives.aggregation import aggregation_weights
from ipa_jax.objectives.terms import TERMS, ObjectiveTerm, register_term

CONFIG = ObjectiveConfig(baseline="batch_mean", aggregation="sample_mean", il_weight=0.5, entropy_weight=0.3)


def _entropy_reference(entropies, action, aggregation):
    """-Agg(H) over action tokens, float64: (num, den, d num / d H)."""
    h = np.asarray(entropies, np.float64)
    rows = action.any(axis=1)
    if aggregation == "token_mean":
        scale, den = action.astype(np.float64), float(action.sum())
    else:  # sample_mean: 1/T_i per token, B rows with actions
        scale = action / np.maximum(action.sum(axis=1, keepdims=True), 1)
        den = float(rows.sum())
    return -np.sum(scale * h), den, -scale


@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean"])
def test_entropy_bonus_matches_float64_reference(aggregation):
    config = dataclasses.replace(CONFIG, aggregation=aggregation)
    batch = random_batch(np.random.default_rng(7), B=5, T=24)
    action = batch["action_mask"]

    def loss(l, h):
        return policy_loss(
            l,
            batch["behavior_log_probs"],
            batch["rewards"],
            action,
            batch["chunk_ids"],
            batch["expert_mask"],
            entropies=h,
            config=config,
        )

    (value, diag), (grad_l, grad_h) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        jnp.asarray(batch["log_probs"]), jnp.asarray(batch["entropies"])
    )
    ref = reference(config, batch["log_probs"], batch["behavior_log_probs"], batch["rewards"], action,
                    batch["chunk_ids"], batch["expert_mask"])  # fmt: skip
    num_h, den_h, dnum_h = _entropy_reference(batch["entropies"], action, aggregation)
    expected = ref.loss + config.entropy_weight * num_h / den_h
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    np.testing.assert_allclose(float(diag["entropy_loss"]), num_h / den_h, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_h), config.entropy_weight * dnum_h / den_h, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(grad_l), ref.grad, rtol=1e-5, atol=1e-6 * np.abs(ref.grad).max())


def _microbatch_losses(batch, config, m, extras=None):
    """(full-batch loss, sum of the per-microbatch losses with full-batch denominators, their grads wrt l)."""
    adv = jnp.asarray(batch["rewards"] - batch["rewards"].mean())
    fields = ("log_probs", "behavior_log_probs", "action_mask", "chunk_ids", "expert_mask", "entropies")
    arrays = {k: jnp.asarray(batch[k]) for k in fields}
    extras = {k: jnp.asarray(v) for k, v in (extras or {}).items()}

    def loss(l, rows, dens):
        terms, _ = objective_terms(
            l,
            arrays["behavior_log_probs"][rows],
            adv[rows],
            arrays["action_mask"][rows],
            arrays["chunk_ids"][rows],
            arrays["expert_mask"][rows],
            config,
            arrays["entropies"][rows],
            extras={k: v[rows] for k, v in extras.items()},
        )
        return combine_terms(terms, config, dens)

    b = batch["log_probs"].shape[0]
    dens = term_denominators(arrays["action_mask"], arrays["chunk_ids"], arrays["expert_mask"], config)
    full, full_grad = jax.value_and_grad(loss)(arrays["log_probs"], np.arange(b), dens)
    total, grad = 0.0, np.zeros(batch["log_probs"].shape)
    for j in range(m):
        rows = np.arange(j, b, m)
        value, g = jax.value_and_grad(loss)(arrays["log_probs"][rows], rows, dens)
        total, grad[rows] = total + value, g
    return full, total, full_grad, grad


@pytest.mark.parametrize("aggregation", ["sample_mean", "token_mean", "chunk_mean"])
def test_every_term_sums_exactly_over_microbatches(aggregation):
    config = dataclasses.replace(CONFIG, aggregation=aggregation)
    full, total, full_grad, grad = _microbatch_losses(random_batch(np.random.default_rng(3), B=6, T=20), config, 3)
    np.testing.assert_allclose(total, full, rtol=1e-5)
    np.testing.assert_allclose(grad, full_grad, rtol=1e-5, atol=1e-7)


def _distance_term(batch, config):
    """num = sum_{t action} (l - r)^2 / 2 over the extra input r, den = action tokens: a term of the test only."""
    r = batch.extras["reference"].astype(batch.log_probs.dtype)
    num = jnp.sum(jnp.where(batch.masks.action, 0.5 * (batch.log_probs - r) ** 2, 0))
    return num, jnp.sum(batch.masks.action).astype(num.dtype)


def _distance_denominator(masks, config):
    return jnp.sum(masks.action).astype(jnp.float32)


def test_a_term_with_an_extra_per_token_input(monkeypatch):
    """A term registered with inputs=("reference",) reads extras["reference"]; microbatching splits it with the
    rows; without it, objective_terms names the term and the input."""
    monkeypatch.setitem(
        TERMS,
        "distance",
        ObjectiveTerm("distance", "entropy_weight", _distance_term, _distance_denominator, ("reference",)),
    )
    monkeypatch.delitem(TERMS, "entropy")
    batch = random_batch(np.random.default_rng(5), B=4, T=16)
    reference_lp = batch["log_probs"] + np.random.default_rng(6).normal(0, 0.3, batch["log_probs"].shape)
    config = dataclasses.replace(CONFIG, entropy_weight=2.0)
    full, total, full_grad, grad = _microbatch_losses(batch, config, 2, {"reference": reference_lp})
    np.testing.assert_allclose(total, full, rtol=1e-5)
    np.testing.assert_allclose(grad, full_grad, rtol=1e-5, atol=1e-7)
    # Its share of the gradient: weight * (l - r) / #action on action tokens (float64 from the formula).
    action = batch["action_mask"]
    no_term = dataclasses.replace(config, entropy_weight=0.0)
    _, _, base_grad, _ = _microbatch_losses(batch, no_term, 1)
    diff = np.where(action, batch["log_probs"].astype(np.float64) - reference_lp, 0) / action.sum()
    np.testing.assert_allclose(np.asarray(full_grad) - np.asarray(base_grad), 2.0 * diff, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="'distance' needs the per-token input 'reference'"):
        _microbatch_losses(batch, config, 1)


def test_disabled_terms_leave_the_loss_and_denominators():
    batch = random_batch(np.random.default_rng(9), B=3, T=12)
    a, c, e = (jnp.asarray(batch[k]) for k in ("action_mask", "chunk_ids", "expert_mask"))
    assert set(term_denominators(a, c, e, CONFIG)) == {"rl", "il", "entropy"}
    # rl and il are always computed (their metrics are in every log); entropy only when weighted
    assert set(term_denominators(a, c, e, ObjectiveConfig())) == {"rl", "il"}
    _, den = aggregation_weights(a, c, "sample_mean")
    assert float(term_denominators(a, c, e, CONFIG)["entropy"]) == float(den)


def test_register_term_rejects_a_taken_name_and_an_unknown_weight():
    term = TERMS["rl"]
    with pytest.raises(ValueError, match="'rl': already registered"):
        register_term(term)
    with pytest.raises(ValueError, match="weight 'kl_coef' is not an ObjectiveConfig field"):
        register_term(dataclasses.replace(term, name="other", weight="kl_coef"))
    assert "other" not in TERMS


def test_entropy_weight_is_validated():
    with pytest.raises(ValueError, match="entropy_weight: must be a finite number"):
        ObjectiveConfig(entropy_weight=float("nan"))
