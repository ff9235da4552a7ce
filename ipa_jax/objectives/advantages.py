"""Advantages A_i = R_i - baseline, computed once on the FULL batch (before any microbatching), and the rows that
count as negatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import compute_dtype
from ipa_jax.objectives.config import BASELINES, SIGN_BY


def compute_advantages(
    rewards: jax.Array,
    baseline: str,
    group_ids: jax.Array | None = None,
    rl_rows: jax.Array | None = None,
    sign: int = 1,
) -> jax.Array:
    """rewards [B] -> advantages [B] (any shape: [B, S] per sequence slot of packed rows, a baseline over all).

    none: A = R; batch_mean: A = R - mean_B(R); group_mean: A_i = R_i - mean{R_j : group_ids[j] == group_ids[i]}
    (group_ids int, same shape, any values). No std whitening. rl_rows bool (default: all) marks the rows with
    action tokens; the means run over them only and the other rows (pure imitation rows, padding, unused slots of
    packed rows) get A = 0. sign -1 negates every advantage (ObjectiveConfig.advantage_sign: a positive control).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline: {baseline!r} is not one of {BASELINES}")
    if sign not in (1, -1):
        raise ValueError(f"sign: must be 1 or -1, got {sign!r}")
    if sign == -1:  # -(R - b(R)) = (-R) - b(-R) for every baseline here (each is linear in R)
        rewards = -rewards
    shape = rewards.shape
    r = rewards.astype(compute_dtype(rewards)).reshape(-1)
    w = jnp.ones_like(r) if rl_rows is None else rl_rows.astype(r.dtype).reshape(-1)
    if baseline == "none":
        return (r * w).reshape(shape)
    if baseline == "batch_mean":
        # A_i = R_i - sum_j w_j R_j / sum_j w_j  (rows with w_i = 0: A_i = 0)
        return ((r - jnp.sum(w * r) / jnp.maximum(jnp.sum(w), 1)) * w).reshape(shape)
    if group_ids is None:
        raise ValueError("group_ids: required for baseline='group_mean'")
    g = group_ids.reshape(-1)
    # [B, B] same-group indicator: B is a batch of trajectories, so this is small and needs no id range.
    same = (g[:, None] == g[None, :]).astype(r.dtype) * w[None, :]
    return ((r - (same @ r) / jnp.maximum(same.sum(axis=1), 1)) * w).reshape(shape)


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
