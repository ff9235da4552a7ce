"""LoRA adapters: the adapted model starts as its base model, its forward is x W + (alpha / r) (x A) B written out
in NumPy, and its merged weights export to a folder transformers (torch CPU float32) loads with the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import tiny_qwen3_config

from ipa_jax.models import LoraConfig, LoraParam, from_pretrained, init_model, merge_lora, save_pretrained
from ipa_jax.models.hf_io import gather_model, hf_tensors
from ipa_jax.models.lora import project

IDS = np.random.RandomState(0).randint(0, 128, (2, 9)).astype(np.int32)
# name -> (moe, scan_layers, LoraConfig)
CASES = {
    "dense": (False, False, LoraConfig(rank=2, alpha=4.0)),
    "dense_scan_attention_only": (False, True, LoraConfig(rank=3, alpha=3.0, targets=("q_proj", "v_proj"))),
    "moe_experts": (True, False, LoraConfig(rank=2, alpha=8.0, experts=True)),
    "moe_scan_no_experts": (True, True, LoraConfig(rank=2)),
}


def _perturbed(model, seed: int = 1):
    """`model` with every adapter matrix replaced by N(0, 0.3) draws (B is zeros at init: no update to check)."""
    rng = np.random.default_rng(seed)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), nnx.state(model, LoraParam))
    nnx.update(model, adapters)
    return model


def _models(name):
    moe, scan, lora = CASES[name]
    base = init_model(tiny_qwen3_config(moe=moe, scan_layers=scan, moe_impl="dense"), seed=3)
    adapted = init_model(tiny_qwen3_config(moe=moe, scan_layers=scan, moe_impl="dense", lora=lora), seed=3)
    return base, adapted, lora


@pytest.mark.parametrize("name", CASES)
def test_adapted_model_at_init_has_the_base_logits_and_only_targeted_adapters(name):
    base, adapted, lora = _models(name)
    np.testing.assert_array_equal(np.asarray(adapted(IDS).logits), np.asarray(base(IDS).logits))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(adapted, nnx.Param), nnx.state(base, nnx.Param))
    names = {str(path[-2]) for path, _ in nnx.to_flat_state(nnx.state(adapted, LoraParam))}
    expected = {f"{t}_lora" for t in lora.targets}
    if CASES[name][0] and not lora.experts:  # MoE layers: only attention's projections
        expected -= {"gate_proj_lora", "up_proj_lora", "down_proj_lora"}
    assert names == expected


def test_adapted_projection_is_w_plus_scaled_low_rank_product():
    """One dense layer's q projection against NumPy float64: x W + (alpha / r) (x A) B."""
    _, adapted, lora = _models("dense")
    attention = _perturbed(adapted).layers[0].self_attn
    x = np.random.default_rng(2).normal(size=(3, 32)).astype(np.float32)
    adapter = attention.q_proj_lora
    w, a, b = (np.asarray(v, np.float64) for v in (attention.q_proj[...], adapter.a[...], adapter.b[...]))
    expected = x @ w + lora.alpha / lora.rank * (x @ a) @ b
    got = np.asarray(project(jnp.asarray(x), attention.q_proj, attention.q_proj_lora))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_merged_model_is_plain_and_computes_the_adapted_logits(name):
    _, adapted, lora = _models(name)
    adapted = _perturbed(adapted)
    merged = merge_lora(adapted)
    assert merged.config.lora is None and not jax.tree.leaves(nnx.state(merged, LoraParam))
    got, want = np.asarray(merged(IDS).logits), np.asarray(adapted(IDS).logits)
    assert np.abs(want - np.asarray(init_model(merged.config, seed=3)(IDS).logits)).max() > 1e-2  # adapters matter
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # What engines receive (gather_model) and what an export writes (hf_tensors) are the merged weights.
    assert nnx.graphdef(gather_model(adapted)) == nnx.graphdef(merged)
    exported, plain = hf_tensors(adapted), hf_tensors(merged)
    assert exported.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(exported[key], plain[key])


@pytest.mark.parametrize("name", ["dense", "moe_experts"])
def test_merged_export_loads_in_transformers_with_the_merged_logits(name, tmp_path):
    import torch
    import transformers

    _, adapted, _ = _models(name)
    adapted = _perturbed(adapted)
    save_pretrained(adapted, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(hf_logits, np.asarray(merge_lora(adapted)(IDS).logits), rtol=1e-4, atol=1e-4)
    # Loading the export with adapters again starts from the merged weights (fresh adapters, B zeros).
    reloaded = from_pretrained(tmp_path, lora=LoraConfig(rank=2), moe_impl="dense")
    np.testing.assert_allclose(np.asarray(reloaded(IDS).logits), hf_logits, rtol=1e-4, atol=1e-4)


def test_lora_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="alpha"):
        LoraConfig(rank=2, alpha=float("nan"))
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(rank=2, targets=("q_proj", "qkv"))
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(rank=2, targets=())
