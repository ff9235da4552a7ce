"""Credit assignment: the per-token return G that multiplies the log-prob (the IPA ablation axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_starts
from ipa_jax.objectives.config import CREDITS
from ipa_jax.objectives.sequences import Sequences, as_slots, count_before, sequence_count, sequences_of, to_tokens


def credit_returns(
    advantages: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    credit: str,
    gamma: float,
    sequences: Sequences | None = None,
) -> jax.Array:
    """advantages [B] ([B, S] packed) -> per-token returns G [B, T] (0 outside actions).

    chunk:      G_{i,t} = gamma^(K_i - 1 - k(t)) * A_i   (k(t) = chunk of t, K_i chunks in sequence i)
    token:      G_{i,t} = gamma^(n_i - 1 - j(t)) * A_i   (j(t) = index of t among the n_i action tokens)
    trajectory: G_{i,t} = A_i
    branch:     as chunk (the credit of trajectories without branch values; `branch_credit` sets the others')
    """
    if credit not in CREDITS:
        raise ValueError(f"credit: {credit!r} is not one of {CREDITS}")
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    a = to_tokens(as_slots(advantages, seqs), seqs)
    if credit == "trajectory":
        return jnp.where(action_mask, a, 0).astype(a.dtype)
    if credit in ("chunk", "branch"):
        if chunk_ids is None:
            raise ValueError(f"chunk_ids: required for credit={credit!r}")
        # ids run 0, 1, ... along the row (a packed sequence continues its predecessor's numbering), so the last
        # chunk of sequence i is (chunks of the sequences before it) + K_i - 1
        k = sequence_count(chunk_starts(action_mask, chunk_ids), seqs)
        steps_to_end = to_tokens(count_before(k) + k - 1, seqs) - chunk_ids.astype(jnp.int32)
    else:
        # actions after t in its sequence = actions up to the sequence's end - actions up to t (row prefix counts)
        n = sequence_count(action_mask, seqs)
        steps_to_end = to_tokens(count_before(n) + n, seqs) - jnp.cumsum(action_mask, axis=1, dtype=jnp.int32)
    discount = jnp.power(jnp.asarray(gamma, a.dtype), jnp.maximum(steps_to_end, 0).astype(a.dtype))
    return jnp.where(action_mask, discount * a, 0)


def matched_token_gamma(gamma: float, chunks: int, action_tokens: int, first_chunk_tokens: int) -> float:
    """The token-credit discount g under which the first chunk's mean credit weight equals chunk credit's.

    Chunk credit gives chunk 0 gamma^(K-1); token credit gives its m tokens (1/m) sum_{j<m} g^(n-1-j) ~
    g^(n-(m+1)/2) (K chunks, n action tokens, m of them in chunk 0), so
    g = gamma^((K - 1) / (n - (m + 1) / 2)).
    """
    return gamma ** ((chunks - 1) / (action_tokens - (first_chunk_tokens + 1) / 2))


def branch_credit(
    fallback_returns: jax.Array,
    fallback_negatives: jax.Array,
    branch_advantages: jax.Array,
    branch_mask: jax.Array,
    action_mask: jax.Array,
    sign: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Branch credit: the chunk advantages of branched trajectories replace their returns. All inputs [B, T] ->
    (returns G [B, T], negative tokens bool[B, T]).

    G_{i,t} = sign * Abr_{i,t} where branch_mask (a branched trajectory's action token; Abr_{i,t} = V(k+1) - V(k)
    of t's chunk k, rollout/branch.py), fallback_returns (chunk credit of A_i) on other action tokens, 0 elsewhere.
    A branched token is negative iff its own G < 0 (its chunk's sign, not its row's); others keep fallback_negatives.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign: must be 1 or -1, got {sign!r}")
    branched = action_mask & branch_mask
    returns = jnp.where(branched, sign * branch_advantages.astype(fallback_returns.dtype), fallback_returns)
    return jnp.where(action_mask, returns, 0), jnp.where(branched, returns < 0, fallback_negatives)
