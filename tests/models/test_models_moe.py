"""MoE router and dropless dispatch: dense reference vs ragged, blocked, megablox (Pallas interpreter) and tokamax
(its XLA implementation on CPU) paths vs float64 NumPy; every path expert-parallel in a sharded model on 8 fake
devices against the same model on one device (forward and gradients; tokens split over the expert axis or
replicated); routing replay and aux losses; the tokamax path's grouped backward; the "matmuls" remat policy."""

import collections
import functools
import math
import sys
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_models import tiny_qwen3_config

from ipa_jax.models import MeshConfig, batch_sharding, init_model, make_mesh
from ipa_jax.models import moe as moe_module
from ipa_jax.models.moe import (
    DISPATCH,
    MoeDispatch,
    SparseMoeBlock,
    expert_block_rows,
    expert_blocks,
    moe_dispatch,
    resolve_moe_impl,
    route,
)
from ipa_jax.models.sharding import DEFAULT_RULES, rule_mesh_axes

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
    return (
        f32(rng.randn(N, H)),
        f32(rng.rand(N, K)),
        f32(0.3 * rng.randn(E, H, W)),
        f32(0.3 * rng.randn(E, H, W)),
        f32(0.3 * rng.randn(E, W, H)),
    )


def _routings():
    rng = np.random.RandomState(1)
    random = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    one_expert = np.full((N, K), 3)  # every assignment to expert 3 (both slots): the capacity worst case
    skewed = np.where(rng.rand(N, K) < 0.8, 0, random)  # most to expert 0, some experts empty
    return {"random": random, "all_to_one": one_expert, "skewed": skewed}


def _loss(fn, x, experts, weights, wg, wu, wd):
    return jnp.sum(jnp.sin(fn(x, experts, weights, wg, wu, wd)))


# One compile per path, shared by every routing (same shapes).
_DISPATCH_GRADS = {
    name: jax.jit(jax.value_and_grad(lambda *a, fn=fn: _loss(fn, *a), argnums=(0, 2, 3, 4, 5)))
    for name, fn in DISPATCH.items()
}
_DISPATCH = {name: jax.jit(fn) for name, fn in DISPATCH.items()}


@pytest.mark.parametrize("routing", list(_routings()))
def test_dispatch_paths_agree_and_drop_nothing(expert_weights, routing):
    x, weights, wg, wu, wd = expert_weights
    experts = jnp.asarray(_routings()[routing], jnp.int32)
    want = _np_experts(x, experts, weights, wg, wu, wd)
    _, g_dense = _DISPATCH_GRADS["dense"](x, experts, weights, wg, wu, wd)
    for name in DISPATCH:
        assert _rel(_DISPATCH[name](x, experts, weights, wg, wu, wd), want) < 1e-5, name  # every token got all
        _, grads = _DISPATCH_GRADS[name](x, experts, weights, wg, wu, wd)
        for gd, g in zip(g_dense, grads):
            assert _rel(g, gd) < 1e-5, name


@pytest.mark.parametrize("block_rows", [5, 8, 48, 1000])  # 5: no run a multiple of it; 1000 > the 48 assignments
def test_blocked_path_at_any_block_size_equals_numpy_and_the_dense_gradients(expert_weights, block_rows):
    x, weights, wg, wu, wd = expert_weights
    blocked = lambda *a: moe_module.swiglu_experts_blocked(*a, block_rows=block_rows)  # noqa: E731
    grad_fn = jax.jit(jax.value_and_grad(lambda *a: _loss(blocked, *a), argnums=(0, 2, 3, 4, 5)))
    for routing in _routings().values():
        experts = jnp.asarray(routing, jnp.int32)
        assert (
            _rel(jax.jit(blocked)(x, experts, weights, wg, wu, wd), _np_experts(x, experts, weights, wg, wu, wd)) < 1e-5
        )
        _, g_dense = _DISPATCH_GRADS["dense"](x, experts, weights, wg, wu, wd)
        for gd, g in zip(g_dense, grad_fn(x, experts, weights, wg, wu, wd)[1]):
            assert _rel(g, gd) < 1e-5


def test_expert_blocks_cover_every_sorted_row_once_with_its_expert():
    rows = expert_block_rows(N * K, E)
    assert rows == 16  # 48 assignments over 6 experts: a quarter more than the mean (8), to a multiple of 8
    for routing in _routings().values():
        flat = routing.reshape(-1)
        counts = np.bincount(flat, minlength=E)
        blocks = expert_blocks(jnp.asarray(counts, jnp.int32), N * K, rows)
        expert, start, length = (np.asarray(a) for a in blocks[:3])
        used = int(blocks.num_blocks)
        assert used == np.sum(-(-counts // rows)) and len(expert) == N * K // rows + E  # the static bound
        sorted_expert = np.sort(flat, kind="stable")
        covered = np.concatenate([np.arange(s, s + n) for s, n in zip(start[:used], length[:used])])
        np.testing.assert_array_equal(np.sort(covered), np.arange(N * K))  # every sorted row exactly once ...
        np.testing.assert_array_equal(sorted_expert[covered], np.repeat(expert[:used], length[:used]))  # ... its own


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
    _, stats = nnx.jit(lambda b, x, m: b(x, m, None, MoeDispatch("blocked")))(block, x, mask)
    logits = np.asarray(x, np.float64).reshape(10, H) @ np.asarray(block.gate[...], np.float64)
    real = np.asarray(mask).reshape(-1)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(stats["z_sum"]), np.sum(lse[real] ** 2), rtol=1e-5)
    p = np.exp(logits - lse[:, None])
    np.testing.assert_allclose(np.asarray(stats["prob_sums"]), p[real].sum(0), rtol=1e-5)
    counts = np.bincount(np.argsort(-p, -1)[real, :K].reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(stats["expert_counts"]), counts)


MOE_CFG = dict(
    moe=True, num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=(1,), num_experts=8, num_experts_per_tok=2
)


def _moe_loss(mesh, rows: int = 4, **config):
    """(params, loss, own) of a 2-layer model (layer 1 dense; `config`: more Qwen3Config fields), sharded on
    `mesh` (None: one device), with a batch of `rows` rows of 9 tokens: loss(params, routed_experts, moe_impl) ->
    (loss, model output); routed_experts `own` (all -1) keeps the router's own choice. The same weights and batch on
    every mesh."""
    cfg = tiny_qwen3_config(**MOE_CFG, **config)
    model = init_model(cfg, seed=4, mesh=mesh)
    # Larger router weights give confident, non-uniform routing (init std 0.02 makes all experts tie).
    for i in cfg.moe_layers:
        model.layers[i].mlp.gate[...] = model.layers[i].mlp.gate[...] * 50
    if mesh is None:
        put = lambda a: a  # noqa: E731
    else:  # rows the batch axes do not divide stay on every device (the model then leaves them unsplit)
        split = rows % math.prod(mesh.shape[a] for a in rule_mesh_axes("batch", DEFAULT_RULES)) == 0
        put = lambda a: jax.device_put(a, batch_sharding(mesh) if split else NamedSharding(mesh, P()))  # noqa: E731
    ids = put(jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (4, 9))[:rows], jnp.int32))
    mask = put(jnp.arange(9)[None] < jnp.asarray([[9], [6], [9], [2]][:rows]))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, routed_experts, moe_impl):
        out = nnx.merge(graphdef, params)(ids, attention_mask=mask, routed_experts=routed_experts, moe_impl=moe_impl)
        nll = jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(out.logits), 0.0)[..., 0])
        return nll + out.aux["load_balancing_loss"] + out.aux["router_z_loss"], out

    return params, loss, jnp.full((rows, 9, 2, 2), -1, jnp.int32)


def _moe_grad_fn(mesh, rows: int = 4, **config):
    """(params, grad_fn, own) of `_moe_loss`: grad_fn(params, routed_experts, moe_impl) -> (grads, model output),
    jitted once per path."""
    params, loss, own = _moe_loss(mesh, rows, **config)
    return params, jax.jit(jax.grad(loss, has_aux=True), static_argnums=2), own


@pytest.fixture(scope="module")
def moe_model():
    """_moe_grad_fn on 8 fake devices (fsdp x expert x tensor, 2 x 2 x 2: each device holds 4 of the 8 experts;
    the batch of 4 rows split 4 ways)."""
    return _moe_grad_fn(make_mesh(MeshConfig(1, 2, 2, 2)))


@pytest.fixture(scope="module")
def moe_reference():
    """(grads, outputs) of the same model and batch on one device, no mesh, the dense path: what every sharded and
    expert-parallel path must reproduce."""
    params, grad_fn, own = _moe_grad_fn(None)
    return grad_fn(params, own, "dense")


def _assert_same_grads(got, want, tol=1e-5):
    for (path, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        assert _rel(a[...], b[...]) < tol, path


@pytest.mark.parametrize("path", ["dense", "blocked", "ragged", "megablox", "tokamax"])  # megablox: Pallas interpreter
def test_expert_parallel_paths_equal_the_unsharded_reference(moe_model, moe_reference, path):
    params, grad_fn, own = moe_model
    g_ref, out_ref = moe_reference
    g_path, out_path = grad_fn(params, own, path)
    assert _rel(out_path.logits, out_ref.logits) < 1e-5
    for name in ("load_balancing_loss", "router_z_loss"):
        np.testing.assert_allclose(float(out_path.aux[name]), float(out_ref.aux[name]), rtol=1e-6)
    _assert_same_grads(g_path, g_ref)
    # Routing replay of the reference's own experts on this path: the same function.
    g_replay, out_replay = grad_fn(params, out_ref.aux["routed_experts"], path)
    assert _rel(out_replay.logits, out_ref.logits) < 1e-5
    _assert_same_grads(g_replay, g_ref)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 4, 2), (1, 2, 4, 1)])
def test_expert_parallel_over_four_devices_with_split_and_replicated_tokens(moe_reference, mesh_shape):
    """Two experts per device. (1, 1, 4, 2): the 4 rows split over the expert axis (all-gather, reduce-scatter);
    (1, 2, 4, 1): 4 rows do not split 8 ways, so every device has every token (psum over the expert axis)."""
    params, grad_fn, own = _moe_grad_fn(make_mesh(MeshConfig(*mesh_shape)))
    g_ref, out_ref = moe_reference
    g_path, out_path = grad_fn(params, own, "blocked")
    assert _rel(out_path.logits, out_ref.logits) < 1e-5
    np.testing.assert_array_equal(np.asarray(out_path.aux["routed_experts"]), np.asarray(out_ref.aux["routed_experts"]))
    _assert_same_grads(g_path, g_ref)


def test_tokamax_per_batch_shard_under_shard_map_equals_the_unsharded_reference(moe_reference):
    """fsdp 4 x tensor 2, no expert axis: each of the 4 batch shards sorts and multiplies its own tokens in a
    shard_map instance (tokamax's ragged_dot, like jax's, has no vmap rule with shared weights)."""
    mesh = make_mesh(MeshConfig(1, 4, 1, 2))
    assert moe_dispatch("tokamax", 4, mesh, ("data", "fsdp", "expert")) == MoeDispatch(
        "tokamax", 4, mesh, ("data", "fsdp", "expert")
    )
    params, grad_fn, own = _moe_grad_fn(mesh)
    g_ref, out_ref = moe_reference
    g_path, out_path = grad_fn(params, own, "tokamax")
    assert _rel(out_path.logits, out_ref.logits) < 1e-5
    _assert_same_grads(g_path, g_ref)


def test_the_configs_block_rows_reach_the_blocked_path_and_keep_the_function(monkeypatch, moe_reference):
    """moe_block_rows=5 on 8 fake devices, expert-parallel: every blocked call runs in blocks of 5 rows (recorded
    while tracing), and the model still equals the one-device dense reference."""
    seen = []
    grouped = moe_module.grouped_swiglu
    monkeypatch.setattr(moe_module, "grouped_swiglu", lambda *a: seen.append(a[-1]) or grouped(*a))
    params, grad_fn, own = _moe_grad_fn(make_mesh(MeshConfig(1, 2, 2, 2)), moe_block_rows=5)
    g_ref, out_ref = moe_reference
    g_path, out_path = grad_fn(params, own, "blocked")
    assert seen and set(seen) == {5}
    assert _rel(out_path.logits, out_ref.logits) < 1e-5
    _assert_same_grads(g_path, g_ref)
    # Only the blocked path has blocks: the others ignore the setting.
    assert moe_dispatch("blocked", 2, block_rows=5).block_rows == 5
    assert moe_dispatch("dense", 2, block_rows=5) == MoeDispatch("dense", 2)


def test_auto_is_blocked_on_cpu_dense_for_few_tokens_and_tokens_group_by_batch_shard():
    assert resolve_moe_impl("auto") == "blocked"
    assert resolve_moe_impl("auto", tokens=2048, num_experts=16) == "blocked"
    assert resolve_moe_impl("auto", tokens=8, num_experts=16) == "dense"  # a decode step of batch 8
    assert resolve_moe_impl("auto", tokens=32, num_experts=16) == "blocked"  # ... of batch 32
    assert resolve_moe_impl("auto", tokens=32, num_experts=128) == "blocked"
    assert resolve_moe_impl("blocked", tokens=8, num_experts=16) == "blocked"  # an explicit path is kept
    assert moe_dispatch("blocked", 4) == MoeDispatch("blocked", 4)
    assert moe_dispatch("ragged", 4) == MoeDispatch("ragged", 1)  # ragged_dot cannot be vmapped over groups
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))  # megablox's groups are shard_map instances over the batch axes
    assert moe_dispatch("megablox", 4, mesh, ("data", "fsdp", "expert")) == MoeDispatch(
        "megablox", 4, mesh, ("data", "fsdp", "expert")
    )
    assert moe_dispatch("megablox", 1, mesh, ("data",)) == MoeDispatch("megablox", 1)
    # Experts split over the expert axis: expert parallelism for every path (an axis of size 1 is none).
    assert moe_dispatch("ragged", 4, mesh, ("data", "fsdp", "expert"), ("expert",)) == MoeDispatch(
        "ragged", 4, mesh, ("data", "fsdp", "expert"), ("expert",)
    )
    assert moe_dispatch("blocked", 1, mesh, ("data", "fsdp", "expert"), ("expert",)) == MoeDispatch(
        "blocked", 1, mesh, (), ("expert",)
    )
    assert moe_dispatch("blocked", 4, mesh, ("data", "fsdp", "expert"), ("data",)) == MoeDispatch("blocked", 4)
    with pytest.raises(ValueError, match="moe_impl"):
        resolve_moe_impl("sparse")


@pytest.mark.parametrize(
    "platform, tokamax, want", [("gpu", True, "tokamax"), ("gpu", False, "blocked"), ("tpu", True, "megablox")]
)
def test_auto_on_accelerators(monkeypatch, platform, tokamax, want):
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform=platform)])
    if not tokamax:
        _without_tokamax(monkeypatch)
    for tokens in (None, 8, 4096):  # the few-token dense shortcut is CPU-only
        assert resolve_moe_impl("auto", tokens=tokens, num_experts=16) == want


def _without_tokamax(monkeypatch):
    """As if the tokamax package were not installed (an import of it raises ImportError)."""
    monkeypatch.setitem(sys.modules, "tokamax", None)
    monkeypatch.setattr(moe_module, "tokamax_ragged_dot", functools.cache(moe_module.tokamax_ragged_dot.__wrapped__))


def test_tokamax_path_without_the_package_says_how_to_install_it(monkeypatch, expert_weights):
    _without_tokamax(monkeypatch)
    x, weights, wg, wu, wd = expert_weights
    with pytest.raises(ImportError, match="pip install tokamax"):
        moe_module.swiglu_experts_tokamax(x, jnp.zeros((N, K), jnp.int32), weights, wg, wu, wd)


def test_tokamax_backward_is_grouped(expert_weights):
    """The tokamax path's gradient program (what its GPU kernels receive): every matmul with expert weights is
    grouped, with the dimension numbers tokamax's Mosaic GPU and Triton kernels implement: per grouped matmul
    (gate-up, down) the forward, d lhs = dy W_e^T (the weights' last dimension contracted) and d W_e = lhs_e^T dy_e
    (the ragged rows contracted, [E, K, N] out); no dot_general forms a per-expert product."""
    x, weights, wg, wu, wd = expert_weights
    experts = jnp.asarray(_routings()["random"], jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: _loss(moe_module.swiglu_experts_tokamax, *a), argnums=(0, 3, 4, 5)))(
        x, experts, weights, wg, wu, wd
    )

    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from eqns(sub)

    kinds = collections.Counter()
    for eqn in eqns(jaxpr.jaxpr):
        if eqn.primitive.name == "ragged_dot_general":
            contract, _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
            kinds[tuple(map(tuple, contract)), eqn.outvars[0].aval.shape[0]] += 1
        else:
            assert eqn.primitive.name != "dot_general" or eqn.outvars[0].aval.shape[0] != E, eqn
    rows = N * K
    assert kinds == {(((1,), (1,)), rows): 2, (((1,), (2,)), rows): 2, (((0,), (0,)), E): 2}, kinds


def test_matmuls_remat_keeps_the_grouped_matmuls_and_trains_like_no_remat(capsys):
    """remat_policy="matmuls" on the tokamax path: the saved residuals include the grouped matmuls' outputs, and
    three SGD steps give the same losses, gradients and parameters as without remat."""
    trained = {}
    for policy in ("none", "matmuls"):
        params, loss, own = _moe_loss(None, remat_policy=policy)
        step = jax.jit(jax.value_and_grad(lambda p, loss=loss, own=own: loss(p, own, "tokamax")[0]))
        losses = []
        for _ in range(3):
            value, grads = step(params)
            params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
            losses.append(float(value))
        trained[policy] = losses, grads, params
        if policy == "matmuls":
            jax.ad_checkpoint.print_saved_residuals(lambda p, loss=loss, own=own: loss(p, own, "tokamax")[0], params)
    assert "named 'moe_grouped_matmul'" in capsys.readouterr().out
    # float32: XLA fuses the recomputed forward differently, so sums may be reordered (3.5e-6 seen on AMD EPYC)
    np.testing.assert_allclose(trained["matmuls"][0], trained["none"][0], rtol=1e-5)
    _assert_same_grads(trained["matmuls"][1], trained["none"][1])
    _assert_same_grads(trained["matmuls"][2], trained["none"][2])
