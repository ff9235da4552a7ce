"""LoRA: low-rank adapters on the attention and MLP projections, optionally on the MoE experts.

A targeted projection W [in, out] gains A [in, r] and B [r, out], B zeros at init so that the adapted model starts
as the base model: y = x W + (alpha / r) (x A) B. Adapters are `LoraParam` variables, not `nnx.Param`: the train
state (`ipa_jax.train.TrainState`) trains only them when a model has adapters and keeps the base weights frozen
beside them; HF exports and weight syncs see the merged weights W + (alpha / r) A B (`ipa_jax.models.merge_lora`),
so engines and transformers load a plain model.

Expert adapters (experts=True) are per expert, A [E, H, r] and B [E, r, I] (down: [E, I, r], [E, r, H]), merged
into the expert weights in the forward: every MoE path (grouped-matmul kernels included) takes whole expert weights.
The router is never adapted.

Why not qwix's LoraProvider: it adds adapters by intercepting dot_general / einsum in a first call, which on this
model fails under nnx.scan (scan_layers), needs its method jit turned off, adapts the MoE router and not the expert
matmuls, and copies each base weight's sharding and HF-layout metadata onto its adapters.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS


class LoraParam(nnx.Variable):
    """A LoRA adapter matrix (metadata: logical_axes for sharding, init "lora_a" | "zeros" for init_model)."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r >= 1; alpha: the update is scaled by alpha / r; targets: projection names (TARGETS) that get adapters
    in every layer (gate/up/down: the dense MLP's, and the experts' with experts=True)."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    experts: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoraConfig.rank: must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraConfig.alpha: must be finite and > 0, got {self.alpha}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoraConfig.targets: must be distinct names among {TARGETS}, got {tuple(self.targets)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_a_bound(shape: tuple[int, ...]) -> float:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) for A [..., in, r]: PEFT's default (kaiming-uniform with a = sqrt(5))."""
    return 1.0 / math.sqrt(shape[-2])


def lora_a_init(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    bound = lora_a_bound(shape)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def lora_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """(alpha / r) A B in float32: a [..., in, r], b [..., r, out] -> [..., in, out] (leading axes: layers, experts)."""
    return scale * jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))


class LoraAdapter(nnx.Module):
    """The adapter of one weight of shape [..., in, out] with logical axes `axes`: A [..., in, r], B [..., r, out]
    (leading axes and their sharding as the weight's; the rank axis replicated)."""

    def __init__(self, shape: tuple[int, ...], axes: tuple, lora: LoraConfig, dtype, rngs: nnx.Rngs):
        *lead, fan_in, fan_out = shape
        r = lora.rank
        a = lora_a_init(rngs.params(), (*lead, fan_in, r)).astype(dtype)
        self.a = LoraParam(a, logical_axes=(*axes[:-1], None), init="lora_a")
        b = jnp.zeros((*lead, r, fan_out), dtype)
        self.b = LoraParam(b, logical_axes=(*axes[:-2], None, axes[-1]), init="zeros")
        self.scale = lora.scale

    def __call__(self, x: jax.Array) -> jax.Array:
        """(alpha / r) (x A) B: x [..., in] -> [..., out] (unstacked, non-expert weights)."""
        return ((x @ self.a[...]) @ self.b[...]) * jnp.asarray(self.scale, x.dtype)

    def merged(self, weight: jax.Array) -> jax.Array:
        """W + (alpha / r) A B in W's dtype."""
        return (weight.astype(jnp.float32) + lora_delta(self.a[...], self.b[...], self.scale)).astype(weight.dtype)


def make_adapter(
    lora: LoraConfig | None, name: str, weight: nnx.Param, rngs: nnx.Rngs, *, experts: bool = False
) -> LoraAdapter | None:
    """The adapter of projection `name` (weight [..., in, out]) when `lora` targets it (expert weights: only with
    lora.experts), else None."""
    if lora is None or name not in lora.targets or (experts and not lora.experts):
        return None
    return LoraAdapter(tuple(weight.shape), tuple(weight.get_metadata()["logical_axes"]), lora, weight.dtype, rngs)


def project(x: jax.Array, weight: nnx.Param, adapter: LoraAdapter | None) -> jax.Array:
    """x W (+ (alpha / r) (x A) B with an adapter): x [..., in] -> [..., out]."""
    y = x @ weight[...]
    return y if adapter is None else y + adapter(x)


def adapted_weight(weight: nnx.Param, adapter: LoraAdapter | None) -> jax.Array:
    """W, or W + (alpha / r) A B with an adapter (expert weights, which the MoE paths take whole)."""
    return weight[...] if adapter is None else adapter.merged(weight[...])
