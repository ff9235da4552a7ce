"""MoE router and dropless dispatch: dense reference vs ragged path vs float64 NumPy; routing replay; aux losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import tiny_qwen3_config

from ipa_jax.models import init_model
from ipa_jax.models.moe import SparseMoeBlock, route, swiglu_experts_dense, swiglu_experts_ragged

N, H, W, E, K = 24, 16, 8, 6, 2


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _np_experts(x, experts, weights, wg, wu, wd):
    """float64 per-token loop: out[n] = sum_j w[n, j] * down_e(silu(x gate_e) * (x up_e)), e = experts[n, j]."""
    x, wg, wu, wd, weights = (np.asarray(a, np.float64) for a in (x, wg, wu, wd, weights))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(np.asarray(experts)[n]):
            g = x[n] @ wg[e]
            out[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * (x[n] @ wu[e])) @ wd[e])
    return out


@pytest.fixture(scope="module")
def expert_weights():
    rng = np.random.RandomState(0)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return (f32(rng.randn(N, H)), f32(rng.rand(N, K)), f32(0.3 * rng.randn(E, H, W)), f32(0.3 * rng.randn(E, H, W)),
            f32(0.3 * rng.randn(E, W, H)))


def _routings():
    rng = np.random.RandomState(1)
    random = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    one_expert = np.full((N, K), 3)  # every assignment to expert 3 (both slots): the capacity worst case
    skewed = np.where(rng.rand(N, K) < 0.8, 0, random)  # most to expert 0, some experts empty
    return {"random": random, "all_to_one": one_expert, "skewed": skewed}


def _loss(fn, x, experts, weights, wg, wu, wd):
    return jnp.sum(jnp.sin(fn(x, experts, weights, wg, wu, wd)))


# One compile per path, shared by every routing (same shapes).
_DISPATCH_GRADS = {name: jax.jit(jax.value_and_grad(lambda *a, fn=fn: _loss(fn, *a), argnums=(0, 2, 3, 4, 5)))
                   for name, fn in (("dense", swiglu_experts_dense), ("ragged", swiglu_experts_ragged))}
_DISPATCH = {"dense": jax.jit(swiglu_experts_dense), "ragged": jax.jit(swiglu_experts_ragged)}


@pytest.mark.parametrize("routing", list(_routings()))
def test_dense_and_ragged_agree_and_drop_nothing(expert_weights, routing):
    x, weights, wg, wu, wd = expert_weights
    experts = jnp.asarray(_routings()[routing], jnp.int32)
    want = _np_experts(x, experts, weights, wg, wu, wd)
    dense = _DISPATCH["dense"](x, experts, weights, wg, wu, wd)
    ragged = _DISPATCH["ragged"](x, experts, weights, wg, wu, wd)
    assert _rel(dense, want) < 1e-5 and _rel(ragged, want) < 1e-5  # every token got all its experts
    _, g_dense = _DISPATCH_GRADS["dense"](x, experts, weights, wg, wu, wd)
    _, g_ragged = _DISPATCH_GRADS["ragged"](x, experts, weights, wg, wu, wd)
    for gd, gr in zip(g_dense, g_ragged):
        assert _rel(gr, gd) < 1e-5


def test_router_matches_numpy():
    rng = np.random.RandomState(2)
    x, w = rng.randn(N, H).astype(np.float32), rng.randn(H, E).astype(np.float32)
    logits = x.astype(np.float64) @ w
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :K]
    for norm in (False, True):
        weights, experts, got_logits = route(jnp.asarray(x), jnp.asarray(w), K, norm)
        want_w = np.take_along_axis(p, top, -1)
        if norm:
            want_w = want_w / want_w.sum(-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(experts), top)
        np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got_logits), logits, rtol=1e-5, atol=1e-5)
    # Replay: given experts are used with this router's probabilities; rows with a negative entry keep top-k.
    replay = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    replay[5] = -1
    weights, experts, _ = route(jnp.asarray(x), jnp.asarray(w), K, False, jnp.asarray(replay))
    want_experts = replay.copy()
    want_experts[5] = top[5]
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(p, want_experts, -1), rtol=1e-5)


def test_block_router_statistics_match_numpy():
    cfg = tiny_qwen3_config(moe=True, num_experts=E, num_experts_per_tok=K, hidden_size=H)
    block = init_model(cfg, seed=0).layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = jnp.asarray(np.random.RandomState(3).randn(2, 5, H), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    _, stats = nnx.jit(lambda b, x, m: b(x, m, None, "ragged"))(block, x, mask)
    logits = np.asarray(x, np.float64).reshape(10, H) @ np.asarray(block.gate[...], np.float64)
    real = np.asarray(mask).reshape(-1)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(stats["z_sum"]), np.sum(lse[real] ** 2), rtol=1e-5)
    p = np.exp(logits - lse[:, None])
    np.testing.assert_allclose(np.asarray(stats["prob_sums"]), p[real].sum(0), rtol=1e-5)
    counts = np.bincount(np.argsort(-p, -1)[real, :K].reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(stats["expert_counts"]), counts)


@pytest.fixture(scope="module")
def moe_model():
    """(params, grad_fn) of a 2-layer model (layer 1 dense); grad_fn(params, routed_experts, moe_impl) is jitted
    once."""
    cfg = tiny_qwen3_config(moe=True, num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=(1,),
                            num_experts=8, num_experts_per_tok=2)
    model = init_model(cfg, seed=4)
    # Larger router weights give confident, non-uniform routing (init std 0.02 makes all experts tie).
    for i in cfg.moe_layers:
        model.layers[i].mlp.gate[...] = model.layers[i].mlp.gate[...] * 50
    ids = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
    mask = jnp.asarray([[1] * 9, [1] * 6 + [0] * 3], bool)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, routed_experts, moe_impl):
        out = nnx.merge(graphdef, params)(ids, attention_mask=mask, routed_experts=routed_experts, moe_impl=moe_impl)
        nll = jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(out.logits), 0.0)[..., 0])
        return nll + out.aux["load_balancing_loss"] + out.aux["router_z_loss"], out

    grad_fn = jax.jit(jax.grad(loss, has_aux=True), static_argnums=2)
    return params, grad_fn


def test_model_dense_and_ragged_paths_agree(moe_model):
    params, grad_fn = moe_model
    g_ragged, out_ragged = grad_fn(params, None, "ragged")
    g_dense, out_dense = grad_fn(params, None, "dense")
    assert _rel(out_ragged.logits, out_dense.logits) < 1e-5
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_ragged), nnx.to_flat_state(g_dense)):
        assert _rel(a[...], b[...]) < 1e-5, path


def test_routing_replay(moe_model):
    params, grad_fn = moe_model
    g_own, out_own = grad_fn(params, None, "ragged")
    routed = out_own.aux["routed_experts"]
    assert routed.shape == (2, 9, 2, 2) and bool(jnp.all(routed[:, :, 1] == -1))  # layer 1 is dense
    g_replay, out_replay = grad_fn(params, routed, "ragged")
    np.testing.assert_array_equal(np.asarray(out_replay.logits), np.asarray(out_own.logits))
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_own), nnx.to_flat_state(g_replay)):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-6, atol=1e-7, err_msg=str(path))
    # Replaying other experts changes the output, uses exactly those experts, and still trains the router.
    other = jnp.where(routed >= 0, (routed + 1) % 8, routed)
    g_other, out_other = grad_fn(params, other, "ragged")
    np.testing.assert_array_equal(np.asarray(out_other.aux["routed_experts"]), np.asarray(other))
    assert _rel(out_other.logits, out_own.logits) > 1e-3
    assert float(jnp.abs(g_other["layers"][0]["mlp"]["gate"][...]).max()) > 0
