"""Logit parity with transformers (torch CPU float32) in both directions through safetensors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ipa_jax.models import Qwen3Config, from_pretrained, save_pretrained
from ipa_jax.models.hf_io import SafetensorsReader, write_safetensors

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}

# name -> (moe, HF overrides): several layers, GQA, tied/untied, norm_topk_prob both ways, sparse step > 1;
# plus Qwen3's attention_bias option and the Qwen2 / Qwen2.5 family (q/k/v biases, no QK-norm).
CONFIGS = {
    "dense_untied_yarn": (False, dict(num_hidden_layers=3, rope_parameters=YARN)),
    "dense_tied_mqa": (False, dict(num_hidden_layers=2, tie_word_embeddings=True, num_key_value_heads=1)),
    "moe_norm_mlp_only": (True, dict(num_hidden_layers=3, norm_topk_prob=True, mlp_only_layers=[0])),
    "moe_nonorm_step2_tied": (
        True,
        dict(
            num_hidden_layers=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_attention_bias": (False, dict(attention_bias=True)),
    "qwen2_tied": (False, dict(family="qwen2", tie_word_embeddings=True)),
}
B, T = 3, 11
_forward = nnx.jit(lambda model, ids, positions, mask: model(ids, positions, mask))
LENGTHS = np.array([11, 7, 4])


def _inputs():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 128, (B, T)).astype(np.int32)
    mask = np.arange(T)[None, :] < LENGTHS[:, None]
    return ids, mask


def _hf_logits(path, ids, mask, position_ids=None, **kw):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=None if position_ids is None else torch.tensor(position_ids, dtype=torch.long),
            **kw,
        )
    return out


def _assert_same_params(a, b):
    flat_a, flat_b = nnx.to_flat_state(nnx.state(a, nnx.Param)), nnx.to_flat_state(nnx.state(b, nnx.Param))
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def _max_err_valid(a, b, mask):
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask].max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_ipa_logits_padded(hf_checkpoint, name):
    moe, overrides = CONFIGS[name]
    path = hf_checkpoint(name, moe=moe, **overrides)
    ids, mask = _inputs()
    model = from_pretrained(path)
    ours = _forward(model, jnp.asarray(ids), None, jnp.asarray(mask))
    ref = _hf_logits(path, ids, mask, output_router_logits=moe)
    assert _max_err_valid(ours.logits, ref.logits.numpy(), mask) < 1e-4
    if moe:  # Switch load-balancing loss pooled over MoE layers and real tokens, as transformers computes it
        np.testing.assert_allclose(float(ours.aux["load_balancing_loss"]), float(ref.aux_loss), rtol=1e-5)


def test_hf_to_ipa_left_padded_explicit_positions(hf_checkpoint):
    path = hf_checkpoint("moe_norm_mlp_only", moe=True, **CONFIGS["moe_norm_mlp_only"][1])
    ids, right_mask = _inputs()
    mask = right_mask[:, ::-1].copy()  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    model = from_pretrained(path)
    ours = _forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))
    ref = _hf_logits(path, ids, mask, position_ids=positions)
    assert _max_err_valid(ours.logits, ref.logits.numpy(), mask) < 1e-4


@pytest.mark.parametrize("name", ["moe_nonorm_step2_tied", "dense_untied_yarn", "qwen2_tied"])
def test_ipa_to_hf_roundtrip(hf_checkpoint, tmp_path, name):
    moe, overrides = CONFIGS[name]
    model = from_pretrained(hf_checkpoint(name, moe=moe, **overrides))
    # Perturb every parameter so the test sees our weights, not a copy of the files we read.
    nnx.update(model, jax.tree.map(lambda x: x * 1.01 + 0.001, nnx.state(model, nnx.Param)))
    save_pretrained(model, tmp_path)
    ids, mask = _inputs()
    ours = _forward(model, jnp.asarray(ids), None, jnp.asarray(mask)).logits
    ref = _hf_logits(str(tmp_path), ids, mask).logits.numpy()
    assert _max_err_valid(ours, ref, mask) < 1e-4
    reloaded = from_pretrained(tmp_path)
    assert Qwen3Config.from_pretrained_dir(tmp_path) == model.config
    _assert_same_params(model, reloaded)


def test_sharded_save_writes_index_and_loads_in_transformers(hf_checkpoint, tmp_path):
    moe, overrides = CONFIGS["moe_norm_mlp_only"]
    model = from_pretrained(hf_checkpoint("moe_norm_mlp_only", moe=moe, **overrides))
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).exists() for f in files)
    assert not (tmp_path / "model.safetensors").exists()
    ids, mask = _inputs()
    ours = _forward(model, jnp.asarray(ids), None, jnp.asarray(mask)).logits
    ref = _hf_logits(str(tmp_path), ids, mask).logits.numpy()
    assert _max_err_valid(ours, ref, mask) < 1e-4
    reloaded = from_pretrained(tmp_path)
    _assert_same_params(model, reloaded)


def test_fused_expert_layout_loads_like_per_expert(hf_checkpoint, tmp_path):
    """transformers 5 in-memory layout: mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I]."""
    moe, overrides = CONFIGS["moe_norm_mlp_only"]
    src = hf_checkpoint("moe_norm_mlp_only", moe=moe, **overrides)
    reader = SafetensorsReader(src)
    fused, per_expert = {}, {}
    for key in reader.keys():
        if ".mlp.experts." in key:
            per_expert[key] = np.array(reader.get(key))
        else:
            fused[key] = np.array(reader.get(key))
    for layer in (1, 2):
        base = f"model.layers.{layer}.mlp.experts"
        experts = range(4)
        fused[f"{base}.gate_up_proj"] = np.stack(
            [
                np.concatenate([per_expert[f"{base}.{e}.gate_proj.weight"], per_expert[f"{base}.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        fused[f"{base}.down_proj"] = np.stack([per_expert[f"{base}.{e}.down_proj.weight"] for e in experts])
    write_safetensors(str(tmp_path / "model.safetensors"), fused)
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    a, b = from_pretrained(src), from_pretrained(tmp_path)
    _assert_same_params(a, b)


def test_bfloat16_checkpoint(hf_checkpoint, tmp_path):
    import torch
    import transformers

    path = hf_checkpoint("dense_tied_mqa", moe=False, **CONFIGS["dense_tied_mqa"][1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    want = hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(model.layers[0].self_attn.q_proj[...], np.float32), want)
    ids, mask = _inputs()
    ours = np.asarray(_forward(model, jnp.asarray(ids), None, jnp.asarray(mask)).logits, np.float32)
    with torch.no_grad():
        ref = (
            hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask.astype(np.int64)))
            .logits.float()
            .numpy()
        )
    # bf16 rounding differs op by op between XLA and torch: only the scale of the agreement is checked.
    assert _max_err_valid(ours, ref, mask) < 0.05 * np.abs(ref).max()


def test_unexpected_checkpoint_tensor_raises(hf_checkpoint, tmp_path):
    path = hf_checkpoint("dense_tied_mqa", moe=False, **CONFIGS["dense_tied_mqa"][1])
    reader = SafetensorsReader(path)
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    with pytest.raises(ValueError, match="not used by the model"):
        from_pretrained(tmp_path)
