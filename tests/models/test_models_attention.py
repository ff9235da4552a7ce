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


def test_visible_keys_with_a_shared_prefix():
    """Row: segment 1 at positions 0..4, segment 2 continuing segment 1's first 3 tokens (positions 3..5),
    segment 3 on its own (0..1), one pad. The mask from the rule written out key by key."""
    seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 0]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 0]], np.int32)
    pre = np.array([[0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]], np.int32)
    valid = seg > 0
    got = np.asarray(visible_keys(*map(jnp.asarray, (pos, pos, valid, seg, seg, pre))))[0]
    want = np.zeros((11, 11), bool)
    for q in range(11):
        for k in range(11):
            own = seg[0, k] == seg[0, q] and pos[0, k] <= pos[0, q]
            prefix = pre[0, q] > 0 and seg[0, k] == pre[0, q] and pos[0, k] < 3
            want[q, k] = valid[0, k] and (own or prefix)
    np.testing.assert_array_equal(got, want)
    assert got[5, :3].all() and not got[5, 3:5].any()  # segment 2 reads positions 0-2 of segment 1, not 3-4


@pytest.mark.parametrize("impl", ["blocked", "xla", "reference"])
def test_shared_prefix_row_scores_like_the_whole_trajectories(impl):
    """Two trajectories sharing their first 6 tokens, alone in two rows, and packed in one row where the second
    holds only its tokens from position 6 on: the same log-probs at every token the second holds but its first."""
    model = init_model(tiny_qwen3_config(attention_impl=impl, attention_query_block=4), seed=1)
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 128, 13), rng.integers(0, 128, 10)
    second[:6] = first[:6]
    alone = np.zeros((2, 13), np.int32)
    alone[0], alone[1, :10] = first, second
    mask = np.arange(13)[None] < np.array([[13], [10]])
    want = np.asarray(token_logprobs(model, jnp.asarray(alone), jnp.asarray(mask))[0])
    row = np.concatenate([first, second[6:], [0, 0, 0]])[None].astype(np.int32)
    seg = np.array([[1] * 13 + [2] * 4 + [0] * 3], np.int32)
    pos = np.array([list(range(13)) + list(range(6, 10)) + [0, 0, 0]], np.int32)
    pre = np.where(seg == 2, 1, 0).astype(np.int32)
    args = (jnp.asarray(row), jnp.asarray(seg > 0), jnp.asarray(pos))
    got = np.asarray(token_logprobs(model, *args, segment_ids=jnp.asarray(seg), prefix_segment_ids=pre)[0])
    np.testing.assert_allclose(got[0, :13], want[0], atol=2e-6)
    np.testing.assert_allclose(got[0, 14:17], want[1, 7:10], atol=2e-6)
    blind = np.asarray(token_logprobs(model, *args, segment_ids=jnp.asarray(seg))[0])  # without the prefix
    assert np.abs(blind[0, 14:17] - want[1, 7:10]).max() > 1e-3
    with pytest.raises(ValueError, match="needs the packed rows' segment_ids"):
        token_logprobs(model, *args, prefix_segment_ids=pre)


def test_splash_refuses_a_shared_prefix():
    model = init_model(tiny_qwen3_config(attention_impl="splash"), seed=1)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="splash' reads segment ids only"):
        token_logprobs(model, jnp.zeros((1, 8), jnp.int32), segment_ids=seg, prefix_segment_ids=seg)
