"""Position-addressed KV cache for batched prefill + per-row decode.

Slot s of a row holds the key/value of the token at position s. A forward pass with a cache writes the keys and
values of its valid tokens (attention_mask True) at their `positions`, marks those slots valid, then every query at
position p attends to the valid slots s <= p. So right-padded prompts prefill in one call and each row then
decodes at its own position with [B, 1] steps; pads are never written, never attended.

Keys and values are stored head-major, the layouts the attention kernels multiply in, so a decode step reads the
cache as it is (a [B, S, heads, D] cache was transposed whole at every step): values [B, num_kv_heads, S, head_dim],
keys with the slots last, [B, num_kv_heads, head_dim, S], so that q K^T is a plain matmul (XLA:CPU ran the
transposed-operand product of a [B, 1] decode step 2.7x slower; the whole step took 9% longer on
bench_engine.py's MoE model at batch 32).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ipa_jax.models.config import Qwen3Config


class KVCache(NamedTuple):
    """keys: one [B, num_kv_heads, head_dim, S] array per layer (post-RoPE keys, slots last); values: one
    [B, num_kv_heads, S, head_dim] array per layer; valid: bool[B, S]."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def init_kv_cache(config: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` positions (positions must be < max_len)."""
    heads, layers = config.num_key_value_heads, config.num_hidden_layers
    return KVCache(
        keys=tuple(jnp.zeros((batch, heads, config.head_dim, max_len), dtype) for _ in range(layers)),
        values=tuple(jnp.zeros((batch, heads, max_len, config.head_dim), dtype) for _ in range(layers)),
        valid=jnp.zeros((batch, max_len), bool),
    )


def extend_kv_cache(cache: KVCache, max_len: int) -> KVCache:
    """The cache with `max_len` >= cache.max_len slots: the new slots empty (invalid), the others as they were."""
    extra = max_len - cache.max_len
    if extra < 0:
        raise ValueError(f"cannot shrink a KV cache of {cache.max_len} slots to {max_len}")
    pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    return KVCache(
        keys=tuple(pad(k, 3) for k in cache.keys),
        values=tuple(pad(v, 2) for v in cache.values),
        valid=pad(cache.valid, 1),
    )


def write_slots(positions: jax.Array, attention_mask: jax.Array, max_len: int) -> jax.Array:
    """Cache slot of each token int32[B, T]: its position, or max_len (out of range, dropped) for padding."""
    return jnp.where(attention_mask, positions, max_len).astype(jnp.int32)


def scatter_rows(buf: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """buf[b, slots[b, t]] = new[b, t] for every in-range slot. buf [B, S, ...], slots [B, T], new [B, T, ...]."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, slots].set(new.astype(buf.dtype), mode="drop")


def write_heads(buf: jax.Array, slots: jax.Array, new: jax.Array, slots_last: bool = False) -> jax.Array:
    """buf[b, h, slots[b, t]] = new[b, t, h] for every in-range slot of a head-major cache buffer buf [B, H, S, D]
    (with slots_last, buf [B, H, D, S]: buf[b, h, :, slots[b, t]] = new[b, t, h]); slots [B, T], new [B, T, H, D]."""
    rows = jnp.arange(buf.shape[0])[:, None, None]
    heads = jnp.arange(buf.shape[1])[None, :, None]
    # Either way the indexed elements come in [B, H, T, D] order (NumPy's rule for indices split by a slice).
    index = (rows, heads, slice(None), slots[:, None, :]) if slots_last else (rows, heads, slots[:, None, :])
    return buf.at[index].set(new.swapaxes(1, 2).astype(buf.dtype), mode="drop")
