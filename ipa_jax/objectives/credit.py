"""Credit assignment: the per-token return G that multiplies the log-prob (the IPA ablation axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.chunks import chunk_starts, compute_dtype
from ipa_jax.objectives.config import CREDITS
from ipa_jax.objectives.sequences import (
    Sequences,
    as_given,
    as_slots,
    count_before,
    sequence_count,
    sequence_sum,
    sequences_of,
    to_tokens,
)


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


def scored_units(
    action_mask: jax.Array, chunk_ids: jax.Array | None, credit: str, sequences: Sequences | None = None
) -> jax.Array:
    """The units that each share one return, marked by one token each: bool[B, T].

    chunk: the first action token of each chunk; token: every action token; trajectory: the first action token of
    each sequence. A return baseline averages the returns of these tokens, so each unit counts once.
    """
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    if credit == "token":
        return action_mask
    if credit == "chunk":
        if chunk_ids is None:
            raise ValueError("chunk_ids: required for credit='chunk'")
        return chunk_starts(action_mask, chunk_ids)
    if credit == "trajectory":  # slot ids grow along a row like chunk ids: a sequence is one chunk
        return chunk_starts(action_mask, seqs.slot)
    raise ValueError(f"credit: {credit!r} has no scored units for a return baseline (chunk, token or trajectory)")


def return_baselines(
    returns: jax.Array,
    units: jax.Array,
    baseline: str,
    group_ids: jax.Array | None = None,
    sequences: Sequences | None = None,
) -> jax.Array:
    """returns G [B, T], units bool[B, T] (`scored_units`) -> the baseline b_i of each sequence, [B] ([B, S] packed).

    With U_j the units of sequence j: batch_mean: b = sum_{j, u in U_j} G_u / sum_j |U_j| (all sequences);
    group_mean: the same over the sequences j of i's group (group_ids, per sequence like the advantages);
    rloo: over the other sequences j != i of i's group, b_i = 0 when they have no unit. A sequence without a unit
    (no action token: imitation only, padding, an unused slot) gets b_i = 0.
    """
    seqs = sequences_of(returns.shape) if sequences is None else sequences
    dtype = compute_dtype(returns)
    unit_sums = sequence_sum(returns.astype(dtype), units, seqs)
    unit_counts = sequence_count(units, seqs).astype(dtype)
    scored = unit_counts > 0
    if baseline == "batch_mean":
        mean = jnp.sum(unit_sums) / jnp.maximum(jnp.sum(unit_counts), 1)
        return as_given(jnp.where(scored, mean, 0), seqs)
    if baseline not in ("group_mean", "rloo"):
        raise ValueError(f"baseline: {baseline!r} is not a return baseline (batch_mean, group_mean or rloo)")
    if group_ids is None:
        raise ValueError(f"group_ids: required for baseline={baseline!r}")
    g = as_slots(group_ids, seqs).reshape(-1)
    same = (g[:, None] == g[None, :]).astype(dtype)  # [BS, BS]: B is a batch of trajectories, so this is small
    sums, counts = same @ unit_sums.reshape(-1), same @ unit_counts.reshape(-1)
    if baseline == "rloo":
        sums, counts = sums - unit_sums.reshape(-1), counts - unit_counts.reshape(-1)
    means = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0).reshape(unit_sums.shape)
    return as_given(jnp.where(scored, means, 0), seqs)


def baselined_returns(
    returns: jax.Array, baselines: jax.Array, action_mask: jax.Array, sequences: Sequences | None = None
) -> jax.Array:
    """returns G [B, T], baselines b [B] ([B, S] packed) -> A_{i,t} = G_{i,t} - b_i on action tokens, 0 elsewhere."""
    seqs = sequences_of(action_mask.shape) if sequences is None else sequences
    b = to_tokens(as_slots(baselines.astype(returns.dtype), seqs), seqs)
    return jnp.where(action_mask, returns - b, 0)


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
