"""Credit assignment: the per-token return G that multiplies the log-prob (the IPA ablation axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import num_chunks
from ipa_jax.objectives.config import CREDITS


def credit_returns(advantages: jax.Array, action_mask: jax.Array, chunk_ids: jax.Array | None, credit: str,
                   gamma: float) -> jax.Array:
    """advantages [B] -> per-token returns G [B, T] (0 outside actions).

    chunk:      G_{i,t} = gamma^(K_i - 1 - k(t)) * A_i   (k(t) = chunk of t, K_i chunks in row i)
    token:      G_{i,t} = gamma^(n_i - 1 - j(t)) * A_i   (j(t) = index of t among the n_i action tokens)
    trajectory: G_{i,t} = A_i
    """
    if credit not in CREDITS:
        raise ValueError(f"credit: {credit!r} is not one of {CREDITS}")
    a = advantages[:, None]
    if credit == "trajectory":
        return jnp.where(action_mask, a, 0).astype(a.dtype)
    if credit == "chunk":
        if chunk_ids is None:
            raise ValueError("chunk_ids: required for credit='chunk'")
        steps_to_end = num_chunks(action_mask, chunk_ids)[:, None] - 1 - chunk_ids
    else:
        index = jnp.cumsum(action_mask, axis=1, dtype=jnp.int32) - 1
        steps_to_end = action_mask.sum(axis=1, dtype=jnp.int32)[:, None] - 1 - index
    discount = jnp.power(jnp.asarray(gamma, a.dtype), jnp.maximum(steps_to_end, 0).astype(a.dtype))
    return jnp.where(action_mask, discount * a, 0)
