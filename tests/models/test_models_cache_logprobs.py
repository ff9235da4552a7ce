"""KV cache (batched right-padded prefill + per-row decode), blockwise log-probs/entropy, remat policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import tiny_qwen3_config

from ipa_jax.models import init_kv_cache, init_model, token_logprobs
from ipa_jax.models.attention import reference_attention, visible_keys
from ipa_jax.models.logprobs import blockwise_logprobs, reference_logprobs

B, T = 3, 11
_token_logprobs = nnx.jit(token_logprobs, static_argnames=("return_entropy", "block_size"))


@pytest.fixture(scope="module")
def model_and_fwd():
    # Layer 0 dense, layer 1 MoE: both layer kinds go through the cache; attention in query blocks of 4.
    cfg = tiny_qwen3_config(moe=True, num_hidden_layers=2, mlp_only_layers=(0,), attention_query_block=4)
    model = init_model(cfg, seed=7)
    graphdef, params = nnx.split(model)

    @jax.jit
    def fwd(params, ids, positions, mask, cache):
        return nnx.merge(graphdef, params)(ids, positions, mask, cache=cache)

    return model, params, fwd


def test_prefill_then_per_row_decode_equals_full_forward(model_and_fwd):
    model, params, fwd = model_and_fwd
    rng = np.random.RandomState(0)
    ids = rng.randint(1, 128, (B, T)).astype(np.int32)
    full = np.asarray(fwd(params, jnp.asarray(ids), None, None, None).logits)
    lengths = np.array([3, 6, 5])
    prompt_len = lengths.max()
    prompt_mask = np.arange(prompt_len)[None] < lengths[:, None]
    prompts = np.where(prompt_mask, ids[:, :prompt_len], 0)  # right-padded with a pad id unrelated to the sequence

    cache = init_kv_cache(model.config, B, 16, jnp.float32)
    out = fwd(params, jnp.asarray(prompts), None, jnp.asarray(prompt_mask), cache)
    np.testing.assert_array_equal(np.asarray(out.cache.valid), np.pad(prompt_mask, ((0, 0), (0, 16 - prompt_len))))
    for b in range(B):
        np.testing.assert_allclose(np.asarray(out.logits)[b, : lengths[b]], full[b, : lengths[b]], atol=1e-5)

    cache, pos = out.cache, lengths.copy()
    for _ in range(4):
        step = fwd(
            params,
            jnp.asarray(ids[np.arange(B), pos][:, None]),
            jnp.asarray(pos[:, None]),
            jnp.ones((B, 1), bool),
            cache,
        )
        np.testing.assert_allclose(np.asarray(step.logits)[:, 0], full[np.arange(B), pos], atol=1e-5)
        cache, pos = step.cache, pos + 1

    # A row whose step is masked (finished) writes nothing; the other rows are unaffected by it.
    before = cache
    step = fwd(
        params,
        jnp.asarray(ids[np.arange(B), pos][:, None]),
        jnp.asarray(pos[:, None]),
        jnp.asarray([[True], [False], [True]]),
        cache,
    )
    np.testing.assert_array_equal(np.asarray(step.cache.keys[1][1]), np.asarray(before.keys[1][1]))
    np.testing.assert_array_equal(np.asarray(step.cache.valid[1]), np.asarray(before.valid[1]))
    np.testing.assert_allclose(np.asarray(step.logits)[[0, 2], 0], full[[0, 2], pos[[0, 2]]], atol=1e-5)


def _np_attention(q, k, v, q_pos, k_pos, k_valid, scale):
    """float64 loop reference of GQA attention with the visibility rule k_valid & (k_pos <= q_pos)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    for i in range(b):
        for j in range(t):
            vis = np.asarray(k_valid[i]) & (np.asarray(k_pos[i]) <= int(q_pos[i, j]))
            for h in range(hq):
                s = np.where(vis, k[i, :, h // group] @ q[i, j, h] * scale, -np.inf)
                p = np.exp(s - s.max()) if vis.any() else np.ones_like(s)
                out[i, j, h] = (p / p.sum()) @ v[i, :, h // group]
    return out.reshape(b, t, hq * d)


def test_attention_query_blocks_equal_reference():
    rng = np.random.RandomState(5)
    q, k, v = (jnp.asarray(rng.randn(2, 7, n, 8), jnp.float32) for n in (4, 2, 2))
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 0, 0, 0]], jnp.int32)
    valid = jnp.asarray([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    want = _np_attention(q, k, v, pos, pos, valid, 8**-0.5)

    def value_and_grads(q, k, v, block):
        f = lambda q, k, v: reference_attention(q, k, v, visible_keys(pos, pos, valid), 8**-0.5, block)  # noqa: E731
        return f(q, k, v), jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)

    value_and_grads = jax.jit(value_and_grads, static_argnums=3)
    whole, g_whole = value_and_grads(q, k, v, 0)
    blocked, g_blocked = value_and_grads(q, k, v, 3)
    np.testing.assert_allclose(np.asarray(whole), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(blocked), want, atol=1e-5)
    for a, b in zip(g_blocked, g_whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def _naive(logits, ids, mask):
    """float64 NumPy: lp[t] = log softmax(logits[t-1])[ids[t]], H[t] = entropy of that softmax; 0 where not scored."""
    x = np.asarray(logits, np.float64)
    logp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    lp = np.zeros(ids.shape)
    ent = np.zeros(ids.shape)
    lp[:, 1:] = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
    ent[:, 1:] = -(np.exp(logp) * logp).sum(-1)[:, :-1]
    scored = mask & np.pad(mask[:, :-1], ((0, 0), (1, 0)))
    return np.where(scored, lp, 0), np.where(scored, ent, 0)


def test_token_logprobs_equal_naive(model_and_fwd, block_size=4):  # 4 does not divide T - 1 = 10
    model, params, fwd = model_and_fwd
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 128, (B, T)).astype(np.int32)
    mask = np.arange(T)[None] < np.array([[11], [8], [5]])
    logits = fwd(params, jnp.asarray(ids), None, jnp.asarray(mask), None).logits
    lp, ent, aux = _token_logprobs(
        model, jnp.asarray(ids), jnp.asarray(mask), return_entropy=True, block_size=block_size
    )
    want_lp, want_ent = _naive(logits, ids, mask)
    np.testing.assert_allclose(np.asarray(lp), want_lp, atol=2e-6)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=2e-6)
    assert "load_balancing_loss" in aux
    lp_only, none, _ = _token_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), block_size=block_size)
    assert none is None
    np.testing.assert_array_equal(np.asarray(lp_only), np.asarray(lp))


def test_token_logprobs_gradients_equal_naive(model_and_fwd):
    model, _, _ = model_and_fwd
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 128, (B, T)), jnp.int32)
    mask = jnp.arange(T)[None] < jnp.asarray([[11], [9], [4]])
    w = jnp.asarray(np.random.RandomState(3).randn(B, T), jnp.float32)

    def blockwise(p):
        lp, ent, _ = token_logprobs(nnx.merge(graphdef, p), ids, mask, return_entropy=True, block_size=4)
        return jnp.sum(w * lp) + 0.1 * jnp.sum(w * ent)

    def naive(p):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, p)(ids, attention_mask=mask).logits)
        lp = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)[:, :-1]
        scored = mask[:, 1:] & mask[:, :-1]
        return jnp.sum(jnp.where(scored, w[:, 1:] * lp + 0.1 * w[:, 1:] * ent, 0.0))

    g_block, g_naive = jax.jit(jax.grad(blockwise))(params), jax.jit(jax.grad(naive))(params)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_block), nnx.to_flat_state(g_naive)):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-4, atol=1e-6, err_msg=str(path))


def test_scored_positions_alone_are_computed(model_and_fwd):
    """With `scored`, the scored positions hold the naive log-probs and entropies, every other position 0, and a
    loss over the scored positions has the naive gradient. Scored positions in every block (of 4) of the 10 targets
    are computed first, in one block per row."""
    model, fwd_params, fwd = model_and_fwd
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.RandomState(4)
    ids = jnp.asarray(rng.randint(0, 128, (B, T)), jnp.int32)
    mask = jnp.arange(T)[None] < jnp.asarray([[11], [9], [7]])
    scored = np.zeros((B, T), bool)  # targets 1..10 form blocks [1-4], [5-8], [9-10]
    scored[0, [2, 6, 10]], scored[2, [1, 5]] = True, True
    w = jnp.asarray(rng.randn(B, T), jnp.float32)

    def forward(p, scored):
        return token_logprobs(nnx.merge(graphdef, p), ids, mask, return_entropy=True, block_size=4, scored=scored)

    lp, ent, _ = forward(params, jnp.asarray(scored))
    want_lp, want_ent = _naive(fwd(fwd_params, ids, None, mask, None).logits, np.asarray(ids), np.asarray(mask))
    np.testing.assert_allclose(np.asarray(lp), np.where(scored, want_lp, 0), atol=2e-6)
    np.testing.assert_allclose(np.asarray(ent), np.where(scored, want_ent, 0), atol=2e-6)
    assert np.all(want_lp[0, ~scored[0]][1:] != 0)  # the other positions of the full row do have log-probs

    def loss(p, skip: bool):
        lp, ent, _ = forward(p, jnp.asarray(scored) if skip else None)
        return jnp.sum(jnp.where(jnp.asarray(scored), w * lp + 0.1 * w * ent, 0.0))

    g_skip = jax.jit(jax.grad(lambda p: loss(p, True)))(params)
    g_all = jax.jit(jax.grad(lambda p: loss(p, False)))(params)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_skip), nnx.to_flat_state(g_all)):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_blockwise_logprobs_computes_only_the_blocks_the_scored_positions_fill():
    """Every block of 4 holds a scored position, but no row has more than 4, so one block is computed: a row's
    scored positions and then its first others fill it. Hidden states at every position outside it are NaN and
    neither the outputs nor the gradients see them (computing a block with a NaN row would put NaN in d lm_head).
    Values and gradients equal the reference at the scored positions."""
    rng = np.random.RandomState(5)
    scored = np.zeros((2, 16), bool)
    scored[0, [0, 5, 10, 15]], scored[1, [3, 7]] = True, True
    in_block = scored | (np.cumsum(~scored, axis=1) <= 4 - scored.sum(1, keepdims=True))  # row 1: also 0 and 1
    hidden = rng.randn(2, 16, 8).astype(np.float32)
    head = jnp.asarray(rng.randn(8, 40) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.randint(0, 40, (2, 16)), jnp.int32)
    w = jnp.asarray(rng.randn(2, 16), jnp.float32)

    def loss(fn):
        def f(h, head):
            lp, ent = fn(h, head)
            return jnp.sum(jnp.where(scored, w * lp + 0.1 * w * ent, 0.0))

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    def blocked(h, head):
        return blockwise_logprobs(h, head, targets, block_size=4, return_entropy=True, scored=jnp.asarray(scored))

    reference = lambda h, head: reference_logprobs(h, head, targets, return_entropy=True)  # noqa: E731
    (got, (g_h, g_head)), (want, (want_h, want_head)) = (
        loss(blocked)(jnp.asarray(np.where(in_block[..., None], hidden, np.nan)), head),
        loss(reference)(jnp.asarray(hidden), head),
    )
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_head), np.asarray(want_head), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_h)[scored], np.asarray(want_h)[scored], rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(g_h)[~scored] == 0)
    lp, ent = blocked(jnp.asarray(hidden), head)
    want_lp, want_ent = reference(jnp.asarray(hidden), head)
    np.testing.assert_allclose(np.asarray(lp), np.where(scored, want_lp, 0), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), np.where(scored, want_ent, 0), atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_blockwise_logprobs_gathers_a_groups_scored_positions_into_shared_blocks(groups):
    """Rows of 6, 1, 2 and 3 scored positions in blocks of 4: one row at a time that is ceil(6 / 4) = 2 blocks of
    4 positions per row; gathered per group of rows (4 rows in 1 group, or 2 groups of 2), one block of 4 positions
    per row of the group holds them all (7 and 5 scored of 8 with 2 groups, 12 of 16 with 1). Hidden states at every
    position outside that block are NaN: values and gradients equal the reference at the scored positions. The
    control: one row at a time computes the second block and its NaN reach lm_head's gradient."""
    rng = np.random.RandomState(6)
    counts = [6, 1, 2, 3]
    scored = np.zeros((4, 16), bool)
    for row, count in enumerate(counts):
        scored[row, rng.choice(16, count, replace=False)] = True
    rows = 4 // groups
    # The computed block of each group: its scored positions (rows in order), then its first others, 4 per row.
    in_block = np.zeros_like(scored)
    for g in range(groups):
        flat_scored = scored[g * rows : (g + 1) * rows].reshape(-1)
        others = np.flatnonzero(~flat_scored)[: 4 * rows - flat_scored.sum()]
        flat = flat_scored.copy()
        flat[others] = True
        in_block[g * rows : (g + 1) * rows] = flat.reshape(rows, 16)
    hidden = rng.randn(4, 16, 8).astype(np.float32)
    head = jnp.asarray(rng.randn(8, 40) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.randint(0, 40, (4, 16)), jnp.int32)
    w = jnp.asarray(rng.randn(4, 16), jnp.float32)

    def value_and_grads(fn, h):
        def f(h, head):
            lp, ent = fn(h, head)
            return jnp.sum(jnp.where(scored, w * lp + 0.1 * w * ent, 0.0))

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, head)

    def blocked(groups):
        return lambda h, head: blockwise_logprobs(
            h, head, targets, block_size=4, return_entropy=True, scored=jnp.asarray(scored), groups=groups
        )

    nan_outside = jnp.asarray(np.where(in_block[..., None], hidden, np.nan))
    got, (g_h, g_head) = value_and_grads(blocked(groups), nan_outside)
    reference = lambda h, head: reference_logprobs(h, head, targets, return_entropy=True)  # noqa: E731
    want, (want_h, want_head) = value_and_grads(reference, jnp.asarray(hidden))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_head), np.asarray(want_head), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_h)[scored], np.asarray(want_h)[scored], rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(g_h)[~scored] == 0)
    lp, ent = blocked(groups)(jnp.asarray(hidden), head)
    want_lp, want_ent = reference(jnp.asarray(hidden), head)
    np.testing.assert_allclose(np.asarray(lp), np.where(scored, want_lp, 0), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), np.where(scored, want_ent, 0), atol=1e-5)
    _, (_, per_row_head) = value_and_grads(blocked(None), nan_outside)
    assert np.isnan(np.asarray(per_row_head)).any()


def test_blockwise_logprobs_groups_must_divide_the_rows():
    h, head, targets = jnp.ones((4, 8, 2)), jnp.ones((2, 5)), jnp.zeros((4, 8), jnp.int32)
    with pytest.raises(ValueError, match="divide the batch's 4 rows"):
        blockwise_logprobs(h, head, targets, block_size=4, scored=jnp.ones((4, 8), bool), groups=3)


def test_token_logprobs_never_builds_full_float32_logits(model_and_fwd):
    model, _, _ = model_and_fwd
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.zeros((2, 64), jnp.int32)
    vocab = model.config.vocab_size

    def loss(p):
        lp, ent, _ = token_logprobs(nnx.merge(graphdef, p), ids, return_entropy=True, block_size=16)
        return jnp.sum(lp) + jnp.sum(ent)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                yield getattr(v.aval, "shape", ()), getattr(v.aval, "dtype", None)
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    all_shapes = list(shapes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
    assert ((2, 16, vocab), jnp.float32) in all_shapes  # the per-block logits exist ...
    big = [s for s, d in all_shapes if d == jnp.float32 and s[-1:] == (vocab,) and np.prod(s) >= 2 * 63 * vocab]
    assert not big, big  # ... but nothing as large as [B, T-1, V]


@pytest.fixture(scope="module")
def plain_grads(model_and_fwd):
    model, _, _ = model_and_fwd
    ids = jnp.asarray(np.random.RandomState(4).randint(0, 128, (2, 8)), jnp.int32)

    def grad_fn(m):
        graphdef, params = nnx.split(m, nnx.Param)
        return jax.grad(lambda p: jnp.sum(jnp.tanh(nnx.merge(graphdef, p)(ids).logits))), params

    fn, params = grad_fn(model)
    return grad_fn, jax.jit(fn)(params)


@pytest.mark.parametrize("policy", ["full", "dots", "matmuls"])
def test_remat_policy_same_gradients(model_and_fwd, plain_grads, policy):
    model, _, _ = model_and_fwd
    grad_fn, plain = plain_grads
    fn, params = grad_fn(init_model(model.config.replace(remat_policy=policy), seed=7))
    assert "remat" in str(jax.make_jaxpr(fn)(params))  # the layers really are rematerialised
    for (path, a), (_, b) in zip(nnx.to_flat_state(jax.jit(fn)(params)), nnx.to_flat_state(plain)):
        b = np.asarray(b[...])
        np.testing.assert_allclose(np.asarray(a[...]), b, atol=1e-5 * np.abs(b).max(), err_msg=str(path))


@pytest.mark.parametrize("keep_logits_bytes", [0, 1 << 20])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_blockwise_logprobs_vjp_equals_reference(with_entropy, keep_logits_bytes):
    """The hand-written backward of blockwise_logprobs against autodiff of the full-logits reference: values and
    gradients w.r.t. hidden and lm_head, N = 13 not a multiple of the block (5), the logits recomputed or kept;
    bfloat16 inputs keep their dtype."""
    rng = np.random.RandomState(4)
    hidden = jnp.asarray(rng.randn(2, 13, 8), jnp.float32)
    head = jnp.asarray(rng.randn(8, 40) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.randint(0, 40, (2, 13)), jnp.int32)
    w_lp, w_ent = (jnp.asarray(rng.randn(2, 13), jnp.float32) for _ in range(2))

    def loss(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(w_lp * lp) + (jnp.sum(w_ent * ent) if with_entropy else 0.0)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    def blocked(h, w):
        return blockwise_logprobs(
            h, w, targets, block_size=5, return_entropy=with_entropy, keep_logits_bytes=keep_logits_bytes
        )

    reference = lambda h, w: reference_logprobs(h, w, targets, return_entropy=with_entropy)  # noqa: E731
    (got, got_grads), (want, want_grads) = loss(blocked)(hidden, head), loss(reference)(hidden, head)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    lp, ent = blocked(hidden, head)
    want_lp, want_ent = reference(hidden, head)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-5)
    assert (ent is None) == (not with_entropy)
    _, (g_h, g_w) = loss(blocked)(hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16))
    assert g_h.dtype == jnp.bfloat16 and g_w.dtype == jnp.bfloat16


@pytest.mark.parametrize("keep_logits_bytes, logits_matmuls", [(0, 2), (2 * 15 * 40 * 4, 1), (2 * 15 * 40 * 4 - 1, 2)])
def test_kept_logits_are_not_recomputed(keep_logits_bytes, logits_matmuls):
    """The gradient computes the [.., V] logits once (forward) when their 2 x 15 x 40 float32 (N = 13 in blocks of
    5) fit in keep_logits_bytes, twice (forward, backward) otherwise."""
    hidden, head = jnp.ones((2, 13, 8)), jnp.ones((8, 40))
    targets = jnp.zeros((2, 13), jnp.int32)

    def loss(h, w):
        return jnp.sum(blockwise_logprobs(h, w, targets, block_size=5, keep_logits_bytes=keep_logits_bytes)[0])

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape == (2, 5, 40):  # a block's logits
                yield eqn
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from dots(sub)

    assert len(list(dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, head).jaxpr))) == logits_matmuls
