"""Qwen3 building blocks: parameters with logical axes, RMSNorm, RoPE, GQA attention with QK-norm, SwiGLU MLP.

Numerics follow transformers' Qwen3 (float32 RMSNorm statistics cast back to the model dtype, QK-norm per head
before RoPE, float32 RoPE tables cast to the model dtype, float32 attention softmax). Weights are stored
[in, out] (the transpose of torch's Linear). Each Param carries `logical_axes` (sharding) and `hf_layout`
(how it maps to a HF tensor: "linear" = transposed torch Linear weight, "copy" = same layout, "experts" = one
transposed Linear per expert stacked on axis 0) and `init` ("normal" | "ones" | "zeros", for init_model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ipa_jax.models.attention import AttentionMesh, attend, attend_cache, resolve_attention_impl
from ipa_jax.models.cache import write_heads
from ipa_jax.models.config import Qwen3Config
from ipa_jax.models.lora import LoraConfig, make_adapter, project

INIT_STD = 0.02  # transformers' initializer_range default for Qwen3


def make_param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    logical_axes: tuple[str | None, ...],
    dtype,
    hf_layout: str,
    init: str = "normal",
) -> nnx.Param:
    """A Param initialised N(0, 0.02) ("normal"), to ones or to zeros, tagged with its sharding and HF layout."""
    if init in ("ones", "zeros"):
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    else:
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=logical_axes, hf_layout=hf_layout, init=init)


class RMSNorm(nnx.Module):
    """y = w * cast(x / sqrt(mean(x^2) + eps)), statistics in float32. x [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float, dtype, logical_axis: str = "norm"):
        self.weight = make_param(None, (dim,), (logical_axis,), dtype, "copy", init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope_tables(config: Qwen3Config, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim / 2] for int positions [B, T]: angle = pos * inv_freq (float32). (transformers
    duplicates the halves to [.., head_dim]; both halves of a head use the same angles.)"""
    inv_freq, scale = config.rope_inv_freq()
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin with x = [x1, x2] halves: [x1 cos - x2 sin, x2 cos + x1 sin].

    x [B, T, N, D], cos/sin [B, T, D / 2] -> [B, T, N, D]. (Per half, not on the duplicated tables: no
    concatenated rotation whose backward adds two full-size gradients.)"""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """Qwen3 self-attention: q/k/v projections (+ biases: Qwen2 family or attention_bias), per-head RMSNorm on q
    and k (Qwen3 family), RoPE, GQA, output projection (+ bias with attention_bias)."""

    def __init__(self, config: Qwen3Config, dtype, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.impl, self.query_block = config.attention_impl, config.attention_query_block
        self.q_proj = make_param(rngs, (h, self.num_heads * d), ("embed", "q_heads"), dtype, "linear")
        self.k_proj = make_param(rngs, (h, self.num_kv_heads * d), ("embed", "kv_heads"), dtype, "linear")
        self.v_proj = make_param(rngs, (h, self.num_kv_heads * d), ("embed", "kv_heads"), dtype, "linear")
        self.o_proj = make_param(rngs, (self.num_heads * d, h), ("q_heads", "embed"), dtype, "linear")
        self.qk_norm, self.qkv_bias, self.o_bias = config.qk_norm, config.qkv_bias, config.attention_bias
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, "head_dim")
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, "head_dim")
        if self.qkv_bias:  # HF names q_proj.bias etc.
            self.q_proj_bias = make_param(None, (self.num_heads * d,), ("q_heads",), dtype, "copy", init="zeros")
            self.k_proj_bias = make_param(None, (self.num_kv_heads * d,), ("kv_heads",), dtype, "copy", init="zeros")
            self.v_proj_bias = make_param(None, (self.num_kv_heads * d,), ("kv_heads",), dtype, "copy", init="zeros")
        if self.o_bias:
            self.o_proj_bias = make_param(None, (h,), ("embed",), dtype, "copy", init="zeros")
        self.q_proj_lora = make_adapter(config.lora, "q_proj", self.q_proj, rngs)
        self.k_proj_lora = make_adapter(config.lora, "k_proj", self.k_proj, rngs)
        self.v_proj_lora = make_adapter(config.lora, "v_proj", self.v_proj, rngs)
        self.o_proj_lora = make_adapter(config.lora, "o_proj", self.o_proj, rngs)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        visible: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array] | None,
        slots: jax.Array | None,
        segments: jax.Array | None = None,
        mesh: AttentionMesh | None = None,
    ):
        """x [B, T, H] -> (out [B, T, H], updated (k, v) cache buffers or None). segments int32[B, T] and mesh: what
        the splash path reads (models/attention.py).

        Without a cache, keys are this call's tokens and visible is bool[B, T, T]; with a cache (head-major
        buffers, models/cache.py), the new keys are written at `slots` and the queries attend to all slots (slot
        index = key position) with visible bool[B, T, S] (models/attention.py).
        """
        b, t, _ = x.shape
        q = project(x, self.q_proj, self.q_proj_lora)
        k = project(x, self.k_proj, self.k_proj_lora)
        v = project(x, self.v_proj, self.v_proj_lora)
        if self.qkv_bias:
            q, k, v = q + self.q_proj_bias[...], k + self.k_proj_bias[...], v + self.v_proj_bias[...]
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        impl, scale = resolve_attention_impl(self.impl, x.dtype, self.head_dim), self.head_dim**-0.5
        new_cache = None
        if kv_cache is None:
            out = attend(q, k, v, visible, scale, impl=impl, query_block=self.query_block, segments=segments, mesh=mesh)
        else:
            new_cache = (write_heads(kv_cache[0], slots, k, slots_last=True), write_heads(kv_cache[1], slots, v))
            out = attend_cache(q, new_cache[0].astype(x.dtype), new_cache[1].astype(x.dtype), visible, scale, impl=impl)
        out = project(out, self.o_proj, self.o_proj_lora)
        return (out + self.o_proj_bias[...] if self.o_bias else out), new_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)). x [..., H] -> [..., H]. (lora: adapters, models/lora.py.)"""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        self.gate_proj = make_param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, "linear")
        self.up_proj = make_param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, "linear")
        self.down_proj = make_param(rngs, (intermediate, hidden), ("mlp", "embed"), dtype, "linear")
        self.gate_proj_lora = make_adapter(lora, "gate_proj", self.gate_proj, rngs)
        self.up_proj_lora = make_adapter(lora, "up_proj", self.up_proj, rngs)
        self.down_proj_lora = make_adapter(lora, "down_proj", self.down_proj, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jax.nn.silu(project(x, self.gate_proj, self.gate_proj_lora))
        return project(gate * project(x, self.up_proj, self.up_proj_lora), self.down_proj, self.down_proj_lora)
