"""DAPO's overlong reward shaping (arXiv:2503.14476, section 3.4): a soft punishment of long episodes added to the
reward, and overlong filtering, which masks truncated episodes out of the loss.

An episode's length L is its number of action tokens (what the policy generated, every turn); an episode is
truncated when it ended by running out of tokens (Trajectory.truncated: finish reason "length" or "context").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.sequences import as_given, as_slots, sequence_count, sequences_of, to_tokens


def overlong_penalty(lengths: jax.Array, max_length: int, buffer_length: int, penalty: float) -> jax.Array:
    """lengths L [B] (any shape) -> R_len [B], float32 (float64 stays), DAPO's soft overlong punishment times
    `penalty`: 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max;
    -1 if L > L_max (L_max = max_length, L_cache = buffer_length)."""
    dtype = lengths.dtype if jnp.issubdtype(lengths.dtype, jnp.floating) else jnp.float32
    length = lengths.astype(dtype)
    start = max_length - buffer_length
    # R_len = 0 before the buffer, a linear ramp down to -1 across it, -1 beyond L_max
    ramp = jnp.where(length <= start, 0.0, jnp.where(length <= max_length, (start - length) / buffer_length, -1.0))
    return penalty * ramp


def shaped_rewards(
    rewards: jax.Array, action_mask: jax.Array, config: ObjectiveConfig, segment_ids: jax.Array | None = None
) -> jax.Array:
    """rewards [B] ([B, S] packed) -> rewards + R_len(L_i) with L_i the sequence's action tokens, when the config
    turns the punishment on (overlong_max_length > 0); the rewards unchanged otherwise."""
    if not config.overlong_shaping:
        return rewards
    seqs = sequences_of(action_mask.shape, segment_ids, rewards.shape[-1])
    lengths = as_given(sequence_count(action_mask.astype(bool), seqs), seqs)
    penalty = overlong_penalty(
        lengths, config.overlong_max_length, config.overlong_buffer_length, config.overlong_penalty
    )
    return rewards + penalty.astype(rewards.dtype)


def loss_action_mask(
    action_mask: jax.Array,
    truncated: jax.Array | None,
    config: ObjectiveConfig,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """bool[B, T]: the action tokens the loss covers: every one, or with overlong_filter those of the episodes not
    truncated (truncated bool[B], [B, S] packed; required then). Expert tokens are not action tokens: they stay."""
    action = action_mask.astype(bool)
    if not config.overlong_filter:
        return action
    if truncated is None:
        raise ValueError("truncated: required by overlong_filter (which episodes ran out of tokens)")
    seqs = sequences_of(action.shape, segment_ids, truncated.shape[-1] if segment_ids is not None else None)
    return action & ~to_tokens(as_slots(truncated.astype(bool), seqs), seqs)
