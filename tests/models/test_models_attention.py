"""Attention paths (blocked, xla, splash in Pallas' interpreter) equal the einsum reference, forward and gradients,
with causal, padding and segment masks; in a sharded model on 8 fake devices; packed rows (segment ids) score like
separate rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import tiny_qwen3_config

from ipa_jax.models import MeshConfig, batch_sharding, init_model, make_mesh, token_logprobs
from ipa_jax.models.attention import (
    attend,
    attend_cache,
    reference_attention,
    resolve_attention_impl,
    segment_positions,
    visible_keys,
)

B, T = 3, 11
# row 0 right-padded, row 1 left-padded (pads at position 0), row 2 packed: segments of 4, 5 and 2 tokens
MASK = np.array([[1] * 8 + [0] * 3, [0] * 3 + [1] * 8, [1] * 11], bool)
SEGMENTS = np.array([[0] * 11, [0] * 11, [0] * 4 + [1] * 5 + [2] * 2], np.int32)


def _positions():
    left = np.maximum(np.cumsum(MASK[1]) - 1, 0)
    return jnp.asarray(np.stack([np.arange(T), left, np.asarray(segment_positions(jnp.asarray(SEGMENTS[2:])))[0]]))


def test_segment_positions_restart_per_segment():
    np.testing.assert_array_equal(np.asarray(_positions()[2]), [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1])


@pytest.mark.parametrize("impl", ["blocked", "xla", "reference", "splash"])  # splash: in Pallas' interpreter
def test_paths_equal_reference_forward_and_gradients(impl):
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.randn(B, T, n, 8), jnp.float32) for n in (4, 2, 2))
    pos, seg = _positions(), jnp.asarray(SEGMENTS)
    self_visible = visible_keys(pos, pos, jnp.asarray(MASK), seg, seg)
    # a KV cache's view: 16 slots, some written, queries at positions 5..15
    slot_valid = jnp.asarray(rng.rand(B, 16) < 0.7)
    k16, v16 = (jnp.asarray(rng.randn(B, 16, 2, 8), jnp.float32) for _ in range(2))
    cache_visible = visible_keys(pos + 5, jnp.broadcast_to(jnp.arange(16), (B, 16)), slot_valid)

    real = jnp.asarray(MASK)[..., None]  # a left pad may see a later key (never used): compare real queries

    def value_and_grads(fn, k, v, visible):
        f = lambda q, k, v: jnp.where(real, fn(q, k, v, visible, 8**-0.5), 0.0)  # noqa: E731
        return f(q, k, v), jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)

    segments = jnp.where(jnp.asarray(MASK), seg + 1, 0)  # what splash reads instead of `visible`
    self_path = lambda *a: attend(*a, impl=impl, query_block=4, segments=segments)  # noqa: E731

    # the cache path reads head-major buffers, keys [B, Hkv, D, S] and values [B, Hkv, S, D] (models/cache.py)
    def cache_path(q, k, v, *a):
        return attend_cache(q, k.transpose(0, 2, 3, 1), v.swapaxes(1, 2), *a, impl=impl)

    for fn_path, k_, v_, visible, name in (
        (self_path, k, v, self_visible, "self"),
        (cache_path, k16, v16, cache_visible, "cache"),
    ):
        want, want_grads = jax.jit(lambda k, v, vis: value_and_grads(reference_attention, k, v, vis))(k_, v_, visible)
        got, got_grads = jax.jit(lambda k, v, vis, f=fn_path: value_and_grads(f, k, v, vis))(k_, v_, visible)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, err_msg=name)
        for a, b in zip(got_grads, want_grads):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, err_msg=name)


def test_auto_is_blocked_on_cpu():
    assert resolve_attention_impl("auto", jnp.float32) == "blocked"
    assert resolve_attention_impl("auto", jnp.bfloat16, head_dim=128) == "blocked"  # splash is TPU-only
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_attention_impl("flash", jnp.float32)


@pytest.fixture(scope="module")
def packed_batch():
    """Rows of two packed sequences each (and padding), their unpacked rows, and how they map to each other."""
    rng = np.random.RandomState(1)
    lengths = [(5, 4), (3, 3), (6, 2), (2, 7)]  # per packed row: the two sequences' lengths
    t = 10
    packed, segments, mask, pieces = [], [], [], []
    for first, second in lengths:
        seqs = [rng.randint(1, 128, first), rng.randint(1, 128, second)]
        row = np.concatenate(seqs + [np.zeros(t - first - second, int)])
        packed.append(row)
        segments.append(np.repeat([0, 1, 2], [first, second, t - first - second]))
        mask.append(np.arange(t) < first + second)
        pieces.extend(seqs)
    unpacked = np.stack([np.pad(p, (0, t - len(p))) for p in pieces])
    unpacked_mask = np.stack([np.arange(t) < len(p) for p in pieces])
    return (
        np.stack(packed).astype(np.int32),
        np.stack(segments).astype(np.int32),
        np.stack(mask),
        unpacked.astype(np.int32),
        unpacked_mask,
        lengths,
    )


@pytest.mark.parametrize("impl", ["blocked", "splash"])  # splash: shard_map instances, Pallas' interpreter
def test_sharded_packed_model_path_equals_reference_and_separate_rows(packed_batch, impl):
    ids, segments, mask, unpacked, unpacked_mask, lengths = packed_batch
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))
    data = batch_sharding(mesh)
    cfg = tiny_qwen3_config(moe=True, num_hidden_layers=1, attention_query_block=4)
    graphdef, params = nnx.split(init_model(cfg.replace(attention_impl=impl), seed=3, mesh=mesh), nnx.Param)
    graphdef_ref = nnx.graphdef(init_model(cfg.replace(attention_impl="reference"), seed=3, mesh=mesh))
    weights = jnp.asarray(np.random.RandomState(2).randn(*ids.shape), jnp.float32)

    def loss(params, graphdef, ids, segments, mask):
        lp, _, aux = token_logprobs(nnx.merge(graphdef, params), ids, mask, segment_ids=segments, block_size=4)
        return jnp.sum(weights * lp) + aux["load_balancing_loss"], lp

    grad_fn = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    batch = [jax.device_put(jnp.asarray(a), data) for a in (ids, segments, mask)]
    grads, lp = grad_fn(params, graphdef, *batch)
    ref_grads, ref_lp = grad_fn(params, graphdef_ref, *batch)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=2e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        b = np.asarray(b[...])
        np.testing.assert_allclose(np.asarray(a[...]), b, atol=1e-5 * np.abs(b).max(), err_msg=str(path))

    # Each packed sequence scores exactly as its own row (one segment): a segment's first token is not scored.
    halves = [
        [
            jax.device_put(jnp.asarray(a), data)
            for a in (unpacked[i : i + 4], np.zeros_like(ids), unpacked_mask[i : i + 4])
        ]
        for i in (0, 4)
    ]
    alone = np.concatenate([np.asarray(grad_fn(params, graphdef, *half)[1]) for half in halves])
    want = np.zeros(lp.shape)
    for row, (first, second) in enumerate(lengths):
        want[row, :first] = alone[2 * row, :first]
        want[row, first : first + second] = alone[2 * row + 1, :second]
    np.testing.assert_allclose(np.asarray(lp), want, atol=2e-6)
