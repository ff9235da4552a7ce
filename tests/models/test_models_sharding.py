"""Sharded models on 8 fake CPU devices equal one device in logits and gradients; shards have the expected size."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ipa_jax.models import MeshConfig, batch_sharding, from_pretrained, init_model, make_mesh

MESHES = [(8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2)]
AXES = ("data", "fsdp", "expert", "tensor")
# Mesh axes each parameter is split over, written out by hand from the sharding design (not from the rules).
EXPECTED_SPLIT = {
    "embed_tokens": ("tensor", "fsdp"),
    "lm_head": ("fsdp", "tensor"),
    "q_proj": ("fsdp", "tensor"),
    "k_proj": ("fsdp", "tensor"),
    "v_proj": ("fsdp", "tensor"),
    "o_proj": ("tensor", "fsdp"),
    "gate_proj": ("fsdp", "tensor"),
    "up_proj": ("fsdp", "tensor"),
    "down_proj": ("tensor", "fsdp"),
    "gate": ("fsdp",),
    "weight": (),
}
EXPERT_SPLIT = ("expert", "fsdp", "tensor")


@pytest.fixture(scope="module")
def setup(hf_checkpoint):
    assert jax.device_count() == 8, "tests/conftest.py must force 8 host devices"
    path = hf_checkpoint("shard_moe", moe=True, num_hidden_layers=2, mlp_only_layers=[0])
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 128, (8, 8)), jnp.int32)
    mask = jnp.asarray(np.arange(8)[None] < np.array([8, 7, 6, 5, 8, 3, 8, 2])[:, None])

    def loss(params, graphdef, ids, mask):
        out = nnx.merge(graphdef, params)(ids, attention_mask=mask)
        logp = jax.nn.log_softmax(out.logits.astype(jnp.float32))
        return -jnp.sum(jnp.where(mask, logp[..., 0], 0.0)) + out.aux["load_balancing_loss"], out.logits

    grad_fn = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    graphdef, params = nnx.split(from_pretrained(path), nnx.Param)
    ref_grads, ref_logits = grad_fn(params, graphdef, ids, mask)
    return path, ids, mask, grad_fn, ref_grads, ref_logits


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_equals_single_device(setup, shape):
    path, ids, mask, grad_fn, ref_grads, ref_logits = setup
    mesh = make_mesh(MeshConfig(*shape))
    model = from_pretrained(path, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    sizes = dict(zip(AXES, shape))
    for path_, var in nnx.to_flat_state(params):
        arr = var[...]
        split = EXPERT_SPLIT if "experts" in path_ else EXPECTED_SPLIT[path_[-1]]
        want = arr.size // math.prod(sizes[a] for a in split)
        assert all(s.data.size == want for s in arr.addressable_shards), (path_, arr.sharding)

    data = batch_sharding(mesh)
    grads, logits = grad_fn(params, graphdef, jax.device_put(ids, data), jax.device_put(mask, data))
    # the batch is split over data x fsdp x expert (the vocab may stay split over tensor)
    assert len({s.index[0].start for s in logits.addressable_shards}) == shape[0] * shape[1] * shape[2]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
    for (p, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        b = np.asarray(b[...])
        np.testing.assert_allclose(np.asarray(a[...]), b, atol=1e-5 * np.abs(b).max(), err_msg=str(p))


def test_init_model_on_mesh_matches_unsharded():
    from tiny_models import tiny_qwen3_config

    cfg = tiny_qwen3_config(moe=True)
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))
    sharded, plain = init_model(cfg, seed=3, mesh=mesh), init_model(cfg, seed=3)
    for (p, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(sharded, nnx.Param)), nnx.to_flat_state(nnx.state(plain, nnx.Param))
    ):
        assert len(a[...].sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))
