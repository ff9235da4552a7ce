"""The building blocks (advantages, credit, level ratios, Bernoulli KL, masks, aggregation, imitation) one by one
against float64 NumPy written from their formulas, on hypothesis-drawn ragged batches of a fixed [4, 16] shape
(fixed so that the compiled kernels are reused)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ipa_jax.objectives import (
    aggregation_weights,
    bernoulli_kl,
    compute_advantages,
    credit_returns,
    imitation_term,
    level_log_ratio,
    mismatch_mask,
    sequence_divergence,
)

B, T = 4, 16


@st.composite
def ragged_batches(draw):
    """Rows of random length with action turns (one chunk each) separated by observation tokens."""
    action = np.zeros((B, T), bool)
    chunk_ids = np.full((B, T), -1, np.int32)
    for i in range(B):
        length = draw(st.integers(2, T))
        t, k = draw(st.integers(1, length - 1)), 0
        while t < length:
            turn = draw(st.integers(1, 4))
            action[i, t : min(t + turn, length)] = True
            chunk_ids[i, t : min(t + turn, length)] = k
            t, k = t + turn + draw(st.integers(0, 2)), k + 1
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    l = np.where(action, -rng.exponential(1.0, (B, T)), 0).astype(np.float32)
    b = np.where(action, -np.abs(l + rng.normal(0, 0.3, (B, T))), 0).astype(np.float32)
    rewards = rng.normal(size=B).astype(np.float32)
    groups = rng.integers(0, 3, B).astype(np.int32)
    return l, b, action, chunk_ids, rewards, groups


@functools.partial(jax.jit, static_argnames=("credit", "gamma", "level", "aggregation"))
def blocks(l, b, action, chunk_ids, adv, credit, gamma, level, aggregation):
    return {
        "returns": credit_returns(adv, action, chunk_ids, credit, gamma),
        "log_rho": level_log_ratio(jnp.where(action, l - b, 0), action, chunk_ids, level),
        "kl": bernoulli_kl(b, l),
        "aggregation": aggregation_weights(action, chunk_ids, aggregation),
    }


def np_rows(action, chunk_ids):
    for i in range(B):
        acts = np.flatnonzero(action[i])
        yield i, acts, chunk_ids[i, acts]


@settings(max_examples=25, deadline=None)
@given(
    ragged_batches(),
    st.sampled_from(["chunk", "token", "trajectory"]),
    st.sampled_from(["token", "chunk", "sequence"]),
    st.sampled_from(["sample_mean", "token_mean", "chunk_mean", "sequence_sum"]),
    st.sampled_from(["none", "batch_mean", "group_mean"]),
)
def test_blocks_match_numpy(batch, credit, level, aggregation, baseline):
    l, b, action, chunk_ids, rewards, groups = batch
    adv = compute_advantages(jnp.asarray(rewards), baseline, jnp.asarray(groups))
    r64 = rewards.astype(np.float64)
    ref_adv = {
        "none": r64,
        "batch_mean": r64 - r64.mean(),
        "group_mean": np.array([r64[i] - r64[groups == groups[i]].mean() for i in range(B)]),
    }[baseline]
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-6, atol=1e-6)
    # Restricted to the rows with actions (here: all but row 1): means over those rows only, 0 elsewhere.
    rl = np.arange(B) != 1
    adv_rl = compute_advantages(jnp.asarray(rewards), baseline, jnp.asarray(groups), jnp.asarray(rl))
    ref_rl = {
        "none": r64,
        "batch_mean": r64 - (r64[rl].mean() if rl.any() else 0.0),
        "group_mean": np.array([r64[i] - r64[(groups == groups[i]) & rl].mean() if rl[i] else 0.0 for i in range(B)]),
    }[baseline]
    np.testing.assert_allclose(adv_rl, np.where(rl, ref_rl, 0.0), rtol=1e-6, atol=1e-6)
    out = jax.device_get(blocks(l, b, action, chunk_ids, adv, credit, 0.9, level, aggregation))
    ref_g, ref_rho, ref_scale = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T))
    rows = 0
    for i, acts, ck in np_rows(action, chunk_ids):
        n = len(acts)
        if n == 0:
            continue
        rows += 1
        K = ck.max() + 1
        steps = {"chunk": K - 1 - ck, "token": n - 1 - np.arange(n), "trajectory": np.zeros(n)}[credit]
        ref_g[i, acts] = 0.9**steps * ref_adv[i]
        x = l[i, acts].astype(np.float64) - b[i, acts]
        ref_rho[i, acts] = {
            "token": x,
            "chunk": np.array([x[ck == k].mean() for k in ck]),
            "sequence": np.full(n, x.mean()),
        }[level]
        ref_scale[i, acts] = {
            "sample_mean": np.full(n, 1 / n),
            "token_mean": np.ones(n),
            "sequence_sum": np.ones(n),
            "chunk_mean": np.array([1 / (K * (ck == k).sum()) for k in ck]),
        }[aggregation]
    np.testing.assert_allclose(out["returns"], ref_g, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["log_rho"], ref_rho, rtol=1e-6, atol=1e-6)
    scale, den = out["aggregation"]
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-6)
    assert float(den) == (action.sum() if aggregation == "token_mean" else rows)
    # Bernoulli KL proxy: the float64 formula with the [1e-6, 1 - 1e-6] clamp.
    p = np.clip(np.exp(b.astype(np.float64)), 1e-6, 1 - 1e-6)
    q = np.clip(np.exp(l.astype(np.float64)), 1e-6, 1 - 1e-6)
    d = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    np.testing.assert_allclose(np.where(action, out["kl"], 0), np.where(action, d, 0), rtol=1e-4, atol=2e-7)


def test_sequence_divergence_clamps_round_off_at_zero_and_mismatch_mask_is_inclusive():
    kl = jnp.array([[0.0, -1e-9, -2e-9, 0.0]])
    action = jnp.array([[False, True, True, False]])
    np.testing.assert_array_equal(sequence_divergence(kl, action), [0.0])
    log_rho = jnp.array([[0.0, 0.0, 1e-3, -1e-3, 1000.0]])  # exp(1000) overflows to inf: masked, not NaN
    keep = mismatch_mask(log_rho, jnp.array([[False, True, True, True, True]]), (1.0, 1.0))
    np.testing.assert_array_equal(keep, [[False, True, False, False, False]])


def test_imitation_term_counts_expert_tokens():
    l = jnp.array([[0.0, -1.0, -2.0, -4.0]])
    num, den = imitation_term(l, jnp.array([[False, True, False, True]]))
    assert float(num) == 5.0 and float(den) == 2.0
    num, den = imitation_term(l, jnp.zeros((1, 4), bool))
    assert float(num) == 0.0 and float(den) == 0.0  # combine_terms divides by max(den, 1)
