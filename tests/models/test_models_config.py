"""Qwen3Config from/to HF config.json, the MoE layer rule, RoPE tables against transformers, mesh config."""

import json

import numpy as np
import pytest
from tiny_models import tiny_hf_dict, tiny_qwen3_config

from ipa_jax.models import MeshConfig, Qwen3Config, init_model, logical_to_spec, make_mesh


def _hf_config(moe: bool, **overrides):
    import transformers

    cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    return cls(**tiny_hf_dict(moe, **overrides))


@pytest.mark.parametrize("moe", [False, True])
def test_reads_transformers_config_json(moe, tmp_path):
    hf = _hf_config(moe, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    cfg = Qwen3Config.from_pretrained_dir(tmp_path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (128, 32, 4, 16)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.is_moe == moe
    if moe:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 16)
        # transformers' rule: layer i is sparse iff i not in mlp_only_layers and (i + 1) % step == 0
        assert cfg.moe_layers == (1,)
    # Our config.json is read back by transformers with the same fields.
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    import transformers

    back = transformers.AutoConfig.from_pretrained(tmp_path)
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(back, key) == getattr(hf, key), key
    assert back.rope_parameters["rope_theta"] == 10000.0
    if moe:
        assert (back.num_experts, back.decoder_sparse_step, back.mlp_only_layers) == (4, 2, [3])
    assert Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(model_type="qwen3"), "dense but sets"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(some_new_feature=3), "some_new_feature"),
        (dict(model_type="llama"), "model_type"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    ],
)
def test_unsupported_fields_raise(bad, match):
    d = dict(tiny_hf_dict(True), model_type="qwen3_moe")
    d.update(bad)
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf_dict(d)


def test_invalid_config_values_raise():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_qwen3_config(moe=True, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_qwen3_config(moe=False, num_key_value_heads=3)
    with pytest.raises(ValueError, match="moe_impl"):
        tiny_qwen3_config(moe_impl="sparse")
    with pytest.raises(ValueError, match="moe_block_rows"):
        tiny_qwen3_config(moe_block_rows=-8)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 1e4,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config(False, rope_parameters=rope, max_position_embeddings=512)
    cfg = Qwen3Config.from_hf_dict(hf.to_dict())
    inv_freq, scale = cfg.rope_inv_freq()
    if rope["rope_type"] == "default":
        want = 1.0 / rope["rope_theta"] ** (np.arange(0, 16, 2, dtype=np.float32) / 16)
        want_scale = 1.0
    else:
        want_t, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None)
        want = want_t.numpy()
    np.testing.assert_allclose(inv_freq, want, rtol=1e-6)
    assert scale == pytest.approx(want_scale)


def test_mesh_config_and_rules():
    assert MeshConfig(data=-1, fsdp=2).resolved(8) == (4, 2, 1, 1)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=-1))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, fsdp=-1).resolved(8)
    with pytest.raises(ValueError, match="needs 6 devices"):
        MeshConfig(data=3, fsdp=2).resolved(8)
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_spec(("embed", "emb"))
    # k_proj has 2 KV heads x head_dim 2 = 4 columns: they cannot be split 8 ways over "tensor".
    with pytest.raises(ValueError, match=r"k_proj.*cannot be split 8 ways"):
        init_model(
            tiny_qwen3_config(moe=False, head_dim=2, num_attention_heads=4, num_key_value_heads=2),
            mesh=make_mesh(MeshConfig(1, 1, 1, 8)),
        )
