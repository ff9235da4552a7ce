"""Advantages A_i = R_i - baseline, computed once on the FULL batch (before any microbatching), and the rows that
count as negatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import compute_dtype
from ipa_jax.objectives.config import BASELINES, GROUP_OF_ONE, SIGN_BY


def compute_advantages(
    rewards: jax.Array,
    baseline: str,
    group_ids: jax.Array | None = None,
    rl_rows: jax.Array | None = None,
    sign: int = 1,
    *,
    norm: str = "none",
    eps: float = 1e-6,
    token_counts: jax.Array | None = None,
    group_of_one: str = "zero",
) -> jax.Array:
    """rewards [B] -> advantages [B] (any shape: [B, S] per sequence slot of packed rows, a baseline over all).

    none: A = R; batch_mean: A = R - mean_B(R); group_mean: A_i = R_i - mean{R_j : group_ids[j] == group_ids[i]}
    (group_ids int, same shape, any values; a group of one: A_i = 0, or with group_of_one="reward" verl's A_i = R_i,
    its group's mean taken as 0); rloo: A_i = R_i - mean{R_j : j != i in i's group} (a group of one: A_i = R_i).
    rl_rows bool (default: all) marks the rows with action tokens; every mean and std runs over them only and the
    other rows (pure imitation rows, padding, unused slots of packed rows) get A = 0. sign -1 negates
    every advantage (ObjectiveConfig.advantage_sign: a positive control). Then norm (ObjectiveConfig.advantage_norm):
    group_std divides by the group's reward std + eps, batch_std whitens over the batch's tokens
    (token_counts: each row's action tokens, its weight; default 1 per row).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline: {baseline!r} is not one of {BASELINES}")
    if group_of_one not in GROUP_OF_ONE:
        raise ValueError(f"group_of_one: {group_of_one!r} is not one of {GROUP_OF_ONE}")
    if sign not in (1, -1):
        raise ValueError(f"sign: must be 1 or -1, got {sign!r}")
    if sign == -1:  # -(R - b(R)) = (-R) - b(-R) for every baseline here (each is linear in R); stds are even
        rewards = -rewards
    shape = rewards.shape
    r = rewards.astype(compute_dtype(rewards)).reshape(-1)
    w = jnp.ones_like(r) if rl_rows is None else rl_rows.astype(r.dtype).reshape(-1)
    if baseline in ("group_mean", "rloo") or norm == "group_std":
        if group_ids is None:
            raise ValueError(f"group_ids: required for baseline={baseline!r} and advantage_norm={norm!r}")
        g = group_ids.reshape(-1)
        # [B, B] same-group indicator over rl rows: B is a batch of trajectories, so this is small.
        same = (g[:, None] == g[None, :]).astype(r.dtype) * w[None, :]
    if baseline == "none":
        adv = r
    elif baseline == "batch_mean":
        # A_i = R_i - sum_j w_j R_j / sum_j w_j
        adv = r - jnp.sum(w * r) / jnp.maximum(jnp.sum(w), 1)
    elif baseline == "group_mean":
        n = same.sum(axis=1)
        # A_i = R_i - mean_g R; a group of one: its own mean (A_i = 0), or verl's 0 (A_i = R_i)
        mean = jnp.where((n > 1) | (group_of_one == "zero"), (same @ r) / jnp.maximum(n, 1), 0)
        adv = r - mean
    else:
        # A_i = R_i - (sum_{j in g} R_j - R_i) / (n_g - 1); no other sample (n_g = 1): A_i = R_i
        n = same.sum(axis=1)
        adv = r - jnp.where(n > 1, (same @ r - r) / jnp.maximum(n - 1, 1), 0)
    adv = adv * w
    if norm == "group_std":
        adv = adv / (group_std(r, same) + eps)
    elif norm == "batch_std":
        adv = whiten(adv, w if token_counts is None else w * token_counts.astype(r.dtype).reshape(-1), eps)
    return adv.reshape(shape)


def group_std(rewards: jax.Array, same: jax.Array) -> jax.Array:
    """[B] rewards, [B, B] same-group weights (row i: the rows counted in i's group) -> [B] the unbiased std of
    each row's group, sqrt(sum_g (R_j - mean_g)^2 / (n_g - 1)); 1 for a group of one (nothing to scale by)."""
    n = same.sum(axis=1)
    mean = (same @ rewards) / jnp.maximum(n, 1)
    squares = jnp.sum(same * (rewards[None, :] - mean[:, None]) ** 2, axis=1)
    return jnp.where(n > 1, jnp.sqrt(squares / jnp.maximum(n - 1, 1)), 1)


def whiten(values: jax.Array, weights: jax.Array, eps: float) -> jax.Array:
    """[B] values, [B] weights (0 = left out) -> (v - mean_w) / (std_w + eps) on weighted rows, 0 elsewhere, with
    mean_w = sum w v / sum w and the unbiased std_w^2 = sum w (v - mean_w)^2 / (sum w - 1)."""
    total = jnp.sum(weights)
    mean = jnp.sum(weights * values) / jnp.maximum(total, 1)
    var = jnp.sum(weights * (values - mean) ** 2) / jnp.maximum(total - 1, 1)
    return jnp.where(weights > 0, (values - mean) / (jnp.sqrt(var) + eps), 0)


def negative_rows(advantages: jax.Array, rewards: jax.Array | None, sign_by: str) -> jax.Array:
    """advantages [B], rewards [B] -> bool[B] (any shape): the rows (sequences) TOPR treats as negatives.

    advantage: A_i < 0; reward: R_i <= 0 (the raw score: the ROME paper's pseudo-code and ROLL's TOPR count a
    trajectory positive iff its reward is > 0). The two agree for 0/1 rewards without a baseline.
    """
    if sign_by not in SIGN_BY:
        raise ValueError(f"sign_by: {sign_by!r} is not one of {SIGN_BY}")
    if sign_by == "advantage":
        return advantages < 0
    if rewards is None:
        raise ValueError("rewards: required for sign_by='reward'")
    return rewards <= 0
