"""Advantages A_i = R_i - baseline, computed once on the FULL batch (before any microbatching)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import compute_dtype
from ipa_jax.objectives.config import BASELINES


def compute_advantages(rewards: jax.Array, baseline: str, group_ids: jax.Array | None = None) -> jax.Array:
    """rewards [B] -> advantages [B].

    none: A = R; batch_mean: A = R - mean_B(R); group_mean: A_i = R_i - mean{R_j : group_ids[j] == group_ids[i]}
    (group_ids int[B], any values). No std whitening.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline: {baseline!r} is not one of {BASELINES}")
    r = rewards.astype(compute_dtype(rewards))
    if baseline == "none":
        return r
    if baseline == "batch_mean":
        return r - jnp.mean(r)
    if group_ids is None:
        raise ValueError("group_ids: required for baseline='group_mean'")
    # [B, B] same-group indicator: B is a batch of trajectories, so this is small and needs no id range.
    same = (group_ids[:, None] == group_ids[None, :]).astype(r.dtype)
    return r - (same @ r) / same.sum(axis=1)
