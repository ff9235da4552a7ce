"""scan_layers: the stacked layers under nnx.scan (with a remat policy) equal the unrolled model on 8 fake devices,
forward, aux losses, routing replay and gradients; HF I/O and the KV-cache path work on the stacked layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from tiny_models import tiny_qwen3_config

from ipa_jax.models import (
    MeshConfig,
    batch_sharding,
    from_pretrained,
    init_kv_cache,
    init_model,
    make_mesh,
    save_pretrained,
)

L, B, T = 2, 4, 9
OWN_ROUTING = jnp.full((B, T, L, 2), -1, jnp.int32)  # replay rows of -1: each layer's own routing


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(unrolled model, scanned model with remat "full" (the same weights, read back from HF safetensors),
    grad_fn, batch, the unrolled model's (grads, output) with its own routing) on 8 fake devices."""
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))
    unrolled = init_model(tiny_qwen3_config(moe=True, num_hidden_layers=L), seed=1, mesh=mesh)
    path = tmp_path_factory.mktemp("scan_moe")
    save_pretrained(unrolled, path)
    scanned = from_pretrained(path, mesh=mesh, scan_layers=True, remat_policy="full")
    data = batch_sharding(mesh)
    ids = jax.device_put(jnp.asarray(np.random.RandomState(0).randint(0, 128, (B, T)), jnp.int32), data)
    mask = jax.device_put(jnp.arange(T)[None] < jnp.asarray([[9], [5], [9], [7]]), data)

    def loss(params, graphdef, routed_experts):
        out = nnx.merge(graphdef, params)(ids, attention_mask=mask, routed_experts=routed_experts)
        nll = -jnp.sum(jnp.where(mask, jax.nn.log_softmax(out.logits)[..., 1], 0.0))
        return nll + out.aux["load_balancing_loss"] + out.aux["router_z_loss"], out

    grad_fn = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    reference = grad_fn(nnx.state(unrolled, nnx.Param), nnx.graphdef(unrolled), OWN_ROUTING)
    return unrolled, scanned, grad_fn, (ids, mask), reference


def _by_layer(stacked_grads) -> dict:
    """Flat {path: array} of a scanned model's state with stacked paths split into unrolled per-layer paths."""
    out = {}
    for path, var in nnx.to_flat_state(stacked_grads):
        if path[0] == "layers":
            out.update({(path[0], i) + path[1:]: np.asarray(var[...][i]) for i in range(L)})
        else:
            out[path] = np.asarray(var[...])
    return out


def test_scanned_equals_unrolled_forward_replay_and_gradients(models):
    _, scanned, grad_fn, _, (g_ref, out_ref) = models
    params = nnx.state(scanned, nnx.Param)
    for routed in (OWN_ROUTING, out_ref.aux["routed_experts"]):  # own routing, then the unrolled model's replayed
        g_scan, out_scan = grad_fn(params, nnx.graphdef(scanned), routed)
        np.testing.assert_allclose(np.asarray(out_scan.logits), np.asarray(out_ref.logits), atol=1e-5)
        np.testing.assert_array_equal(
            np.asarray(out_scan.aux["routed_experts"]), np.asarray(out_ref.aux["routed_experts"])
        )
        for name in ("load_balancing_loss", "router_z_loss"):
            np.testing.assert_allclose(float(out_scan.aux[name]), float(out_ref.aux[name]), rtol=1e-6)
        want = {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(g_ref)}
        got = _by_layer(g_scan)
        assert sorted(got) == sorted(want)
        for path, b in want.items():
            np.testing.assert_allclose(got[path], b, atol=1e-5 * np.abs(b).max(), err_msg=str(path))


def test_stacked_parameters_shard_like_unrolled_ones(models):
    unrolled, scanned, _, _, _ = models
    assert scanned.layers.self_attn.q_proj[...].sharding.spec == P(None, "fsdp", "tensor")
    assert scanned.layers.mlp.experts.down_proj[...].sharding.spec == P(None, "expert", "tensor", "fsdp")
    assert unrolled.layers[0].self_attn.q_proj[...].sharding.spec == P("fsdp", "tensor")


def test_scanned_save_and_cache_prefill(models, tmp_path):
    unrolled, scanned, _, (ids, mask), (_, out_ref) = models
    save_pretrained(scanned, tmp_path)  # per-layer HF tensors, read back unrolled
    reloaded = from_pretrained(tmp_path)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(reloaded, nnx.Param)), nnx.to_flat_state(nnx.state(unrolled, nnx.Param))
    ):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    # With a KV cache the stacked layers run one by one (their parameter slices): same logits as without.
    prefill = nnx.jit(lambda m, ids, mask, cache: m(ids, attention_mask=mask, cache=cache).logits)
    with_cache = np.asarray(prefill(scanned, ids, mask, init_kv_cache(scanned.config, B, 16)))
    real = np.asarray(mask)
    np.testing.assert_allclose(with_cache[real], np.asarray(out_ref.logits)[real], atol=1e-5)


def test_scan_needs_layers_of_one_kind():
    with pytest.raises(ValueError, match="scan_layers"):
        tiny_qwen3_config(moe=True, num_hidden_layers=2, mlp_only_layers=(0,), scan_layers=True)
