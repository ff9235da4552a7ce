"""Training with LoRA (model.lora_rank > 0): a step changes only the adapters, the optimizer state holds only
adapter-shaped leaves, a checkpoint restores them onto the same frozen base, engines are pushed the merged weights,
and the config keys are validated."""

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import MOE_ARCH, make_batch, make_exp, max_rel_diff, tree_copy

from ipa_jax.engines import EmbeddedEngine
from ipa_jax.models import LoraParam, MeshConfig, make_mesh, merge_lora
from ipa_jax.models.hf_io import gather_model, hf_tensors
from ipa_jax.pipeline import ConfigError
from ipa_jax.pipeline.build import build_mesh, build_state, build_steps, engine_model
from ipa_jax.train import CheckpointConfig, Checkpointer

LORA = ("model.lora_rank=2", "model.lora_alpha=4.0", "train.batch_size=8")


@pytest.fixture(scope="module", params=["dense", "moe_experts"])
def trained(request):
    """(exp, mesh, state before, state after one step) of the tiny offline config with adapters."""
    extra = MOE_ARCH + ("model.lora_experts=True",) if request.param == "moe_experts" else ()
    exp = make_exp(*LORA, *extra)
    mesh = build_mesh(exp.mesh)
    state = build_state(exp, mesh)
    before = tree_copy({"params": state.params, "rest": state.rest})
    step, _ = build_steps(exp, state, mesh)
    after, metrics = step(state, step.put_batch(make_batch(8, seed=1)))
    assert int(metrics["skipped"]) == 0
    return exp, mesh, before, after


def test_a_step_changes_only_the_adapters(trained):
    _, _, before, after = trained
    trained_leaves = nnx.to_flat_state(after.params)
    assert trained_leaves and all(isinstance(var, LoraParam) for _, var in trained_leaves)
    assert not any(isinstance(var, LoraParam) for _, var in nnx.to_flat_state(after.rest))
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), tree_copy(after.params), before["params"])
    assert any(jax.tree.leaves(changed))  # B moves on the first step (A's gradient is 0 while B is 0)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(after.rest), before["rest"])  # the base is frozen


def test_the_optimizer_state_holds_only_adapter_shaped_leaves(trained):
    _, _, _, after = trained
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(after.params))
    moment_shapes = [x.shape for x in jax.tree.leaves(after.opt_state) if x.ndim > 0]
    assert sorted(moment_shapes) == sorted(adapter_shapes * 2)  # Adam's mu and nu, nothing of the base model
    base_size = sum(x.size for x in jax.tree.leaves(after.rest))
    assert sum(x.size for x in jax.tree.leaves(after.opt_state)) < 0.5 * base_size


def test_a_sharded_mesh_step_equals_one_device():
    """Adapters take their weights' shardings (leading and in/out axes; the rank axis replicated): an update on a
    (data 2, fsdp 2, expert 2) mesh of an expert-adapted MoE equals the one-device update."""
    exp = make_exp(*LORA, *MOE_ARCH, "model.lora_experts=True", "optimizer.eps=1e-4")
    batch = make_batch(8, seed=3)
    results = []
    for sizes, devices in (((2, 2, 2, 1), jax.devices()), ((1, 1, 1, 1), jax.devices()[:1])):
        mesh = make_mesh(MeshConfig(*sizes), devices=devices)
        state = build_state(exp, mesh)
        step, _ = build_steps(exp, state, mesh)
        state, _ = step(state, step.put_batch(batch))
        results.append(tree_copy(state.params))
    assert max_rel_diff(results[0], results[1]) < 1e-5


def test_a_checkpoint_restores_the_adapters_onto_the_same_base(trained, tmp_path):
    exp, mesh, _, after = trained
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), CheckpointConfig(async_save=False))
    saved = tree_copy(after.checkpoint_tree())
    checkpointer.save(after, {"step": 1})
    restored, _ = checkpointer.restore(build_state(exp, mesh))
    checkpointer.close()
    jax.tree.map(np.testing.assert_array_equal, tree_copy(restored.checkpoint_tree()), saved)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(restored.rest), tree_copy(after.rest))


def test_engines_are_pushed_the_merged_weights(trained):
    exp, mesh, _, after = trained
    engine = EmbeddedEngine(engine_model(exp, mesh), max_len=64, max_batch=1)
    pushed = gather_model(after.model())
    asyncio.run(engine.push_weights(pushed, 1))
    merged = hf_tensors(merge_lora(after.model()))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        np.testing.assert_array_equal(engine.hf_tensor(name), merged[name])
    asyncio.run(engine.close())


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lora_rank=-1", "model.lora_rank"),
        ("model.lora_alpha=0.0", "model.lora_alpha"),
        ("model.lora_targets=('q_proj','qkv_proj')", "model.lora_targets"),
        ("model.lora_targets=()", "model.lora_targets"),
        ("model.lora_experts=True", "model.lora_experts"),  # rank 0
        ("model.lora_rnak=2", "model.lora_rnak"),
    ],
)
def test_bad_lora_config_is_an_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        make_exp(override)
    assert err.value.key == key


def test_expert_adapters_need_an_moe_model():
    with pytest.raises(ConfigError, match="needs an MoE model") as err:
        make_exp("model.lora_rank=2", "model.lora_experts=True")
    assert err.value.key == "model.lora_experts"
