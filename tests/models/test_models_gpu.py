"""The GPU fast paths on a real NVIDIA GPU: cuDNN fused attention and the grouped MoE paths (`jax.lax.ragged_dot`,
tokamax's kernels) against the reference paths, forward and gradients, and the whole bfloat16 model on the `auto`
paths against the reference paths. Skipped without a GPU (CI); on a GPU node, without conftest's XLA:CPU flags
(`--xla_cpu_*`, which another jaxlib may not know):
JAX_PLATFORMS=cuda XLA_FLAGS= python -m pytest tests/models/test_models_gpu.py

bfloat16 paths are judged by their error against the float32 reference, which must stay within a small multiple
of the error of the reference path run in bfloat16 itself (same inputs, same precision, no fused kernel)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_qwen3_config

from ipa_jax.models import init_model, token_logprobs
from ipa_jax.models.attention import attend, reference_attention, segment_positions, visible_keys
from ipa_jax.models.moe import DISPATCH

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda)")

B, T, D = 3, 128, 64


def _max_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _masks():
    """Row 0 right-padded, row 1 left-padded, row 2 packed (segments of 50, 60 and 18 tokens): mask, positions,
    segment ids."""
    mask = np.ones((B, T), bool)
    mask[0, 100:] = False
    mask[1, :20] = False
    segments = np.zeros((B, T), np.int32)
    segments[2] = np.repeat([0, 1, 2], [50, 60, 18])
    positions = np.stack(
        [
            np.arange(T),
            np.maximum(np.cumsum(mask[1]) - 1, 0),
            np.asarray(segment_positions(jnp.asarray(segments[2:])))[0],
        ]
    )
    return jnp.asarray(mask), jnp.asarray(positions), jnp.asarray(segments)


def test_cudnn_attention_is_as_accurate_as_the_reference_in_bfloat16():
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.randn(B, T, n, D), jnp.bfloat16) for n in (8, 4, 4))
    mask, positions, segments = _masks()
    visible = visible_keys(positions, positions, mask, segments, segments)
    real = mask[..., None]  # a left pad's query sees nothing: compare real queries

    def value_and_grads(fn, dtype):
        def f(q, k, v):
            return jnp.where(real, fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), visible, D**-0.5), 0.0)

        return jax.jit(
            lambda q, k, v: (
                f(q, k, v),
                jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), (0, 1, 2))(q, k, v),
            )
        )(q, k, v)

    want, want_grads = value_and_grads(reference_attention, jnp.float32)
    ref16, ref16_grads = value_and_grads(reference_attention, jnp.bfloat16)
    cudnn = lambda *a: attend(*a, impl="cudnn", query_block=64)  # noqa: E731
    got, got_grads = value_and_grads(cudnn, jnp.bfloat16)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert _max_err(got, want) <= 2 * _max_err(ref16, want) + 1e-3
    for g, r, w in zip(got_grads, ref16_grads, want_grads):
        assert _max_err(g, w) <= 2 * _max_err(r, w) + 1e-3


def _moe_value_and_grads(fn, dtype):
    """sum(sin(fn(...))) and its gradients w.r.t. x, weights and the expert weights (float32) of 512 tokens, 16
    experts top-4, routing skewed (expert 0 takes half the tokens' first choice); inputs cast to `dtype` in fn."""
    n, h, w, e, k = 512, 64, 32, 16, 4
    rng = np.random.RandomState(1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    x, weights = f32(rng.randn(n, h)), f32(rng.rand(n, k))
    wg, wu, wd = f32(0.2 * rng.randn(e, h, w)), f32(0.2 * rng.randn(e, h, w)), f32(0.2 * rng.randn(e, w, h))
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    experts = experts.at[: n // 2, 0].set(0)

    def loss(x, experts, *floats):
        return jnp.sum(jnp.sin(fn(x.astype(dtype), experts, *(a.astype(dtype) for a in floats)).astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5)))(x, experts, weights, wg, wu, wd)


# tokamax in float32: its Triton kernel (Mosaic GPU takes 16-bit inputs only).
@pytest.mark.parametrize("path", ["ragged", "tokamax"])
def test_grouped_moe_equals_dense_forward_and_gradients(path):
    want, want_grads = _moe_value_and_grads(DISPATCH["dense"], jnp.float32)
    got, got_grads = _moe_value_and_grads(DISPATCH[path], jnp.float32)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-4)
    for g, d in zip(got_grads, want_grads):
        assert _max_err(g, d) <= 1e-4 * float(np.abs(np.asarray(d)).max())


def test_tokamax_moe_is_as_accurate_as_dense_in_bfloat16():
    """On Hopper tokamax's Mosaic GPU kernels (forward, d lhs, d W), else Triton: the error against the float32
    dense path within a small multiple of the dense path's own in bfloat16."""
    want, want_grads = _moe_value_and_grads(DISPATCH["dense"], jnp.float32)
    ref16, ref16_grads = _moe_value_and_grads(DISPATCH["dense"], jnp.bfloat16)
    got, got_grads = _moe_value_and_grads(DISPATCH["tokamax"], jnp.bfloat16)
    assert np.isfinite(float(got))
    assert _max_err(got, want) <= 2 * _max_err(ref16, want) + 1e-2
    for g, r, w in zip(got_grads, ref16_grads, want_grads):
        assert _max_err(g, w) <= 2 * _max_err(r, w) + 1e-3 * float(np.abs(np.asarray(w)).max())


def test_bfloat16_model_on_auto_paths_matches_the_reference_paths():
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 128, (B, T)), jnp.int32)
    mask, positions, _ = _masks()

    def logprobs(dtype, attention_impl, moe_impl):
        config = tiny_qwen3_config(moe=True, head_dim=64, attention_impl=attention_impl, moe_impl=moe_impl)
        model = init_model(config, seed=0, dtype=dtype)
        logp, _, _ = token_logprobs(model, tokens, mask, positions)
        return jnp.where(mask, logp, 0.0)

    want = logprobs(jnp.float32, "reference", "dense")
    ref16 = logprobs(jnp.bfloat16, "reference", "dense")
    got = logprobs(jnp.bfloat16, "auto", "auto")
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert _max_err(got, want) <= 2 * _max_err(ref16, want) + 1e-2
