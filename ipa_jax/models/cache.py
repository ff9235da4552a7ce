"""Position-addressed KV cache for batched prefill + per-row decode.

Slot s of a row holds the key/value of the token at position s. A forward pass with a cache writes the keys and
values of its valid tokens (attention_mask True) at their `positions`, marks those slots valid, then every query at
position p attends to the valid slots s <= p. So right-padded prompts prefill in one call and each row then
decodes at its own position with [B, 1] steps; pads are never written, never attended.

Keys and values are stored head-major, [B, num_kv_heads, S, head_dim]: the layout the attention kernels multiply
in, so a decode step reads the cache as it is (a [B, S, heads, D] cache was transposed whole at every step).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ipa_jax.models.config import Qwen3Config


class KVCache(NamedTuple):
    """keys/values: one [B, num_kv_heads, S, head_dim] array per layer (post-RoPE keys); valid: bool[B, S]."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def init_kv_cache(config: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` positions (positions must be < max_len)."""
    shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
    return KVCache(keys=zeros, values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers)),
                   valid=jnp.zeros((batch, max_len), bool))


def write_slots(positions: jax.Array, attention_mask: jax.Array, max_len: int) -> jax.Array:
    """Cache slot of each token int32[B, T]: its position, or max_len (out of range, dropped) for padding."""
    return jnp.where(attention_mask, positions, max_len).astype(jnp.int32)


def scatter_rows(buf: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """buf[b, slots[b, t]] = new[b, t] for every in-range slot. buf [B, S, ...], slots [B, T], new [B, T, ...]."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, slots].set(new.astype(buf.dtype), mode="drop")


def write_heads(buf: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """buf[b, h, slots[b, t]] = new[b, t, h] for every in-range slot: a head-major cache buffer buf [B, H, S, D],
    slots [B, T], new [B, T, H, D]."""
    rows = jnp.arange(buf.shape[0])[:, None, None]
    heads = jnp.arange(buf.shape[1])[None, :, None]
    return buf.at[rows, heads, slots[:, None, :]].set(new.swapaxes(1, 2).astype(buf.dtype), mode="drop")
