"""Tiny random Qwen3 / Qwen3-MoE checkpoints and configs for tests (no hub access; float32, seconds on CPU)."""

from __future__ import annotations

import os

from ipa_jax.models.config import Qwen3Config

_BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1)


def tiny_hf_dict(moe: bool = True, **overrides) -> dict:
    """HF config fields of a tiny model (vocab 128, hidden 32, 2 layers, 4 heads / 2 KV heads, head_dim 16;
    MoE: 4 experts top-2, width 16)."""
    d = dict(_BASE, **(_MOE if moe else {}))
    d.update(overrides)
    return d


def tiny_qwen3_config(moe: bool = True, **overrides) -> Qwen3Config:
    """ipa_jax Qwen3Config of the tiny model (overrides: any Qwen3Config field)."""
    d = tiny_hf_dict(moe)
    d.update(overrides)
    return Qwen3Config(**d)


def make_tiny_hf_checkpoint(
    path: str | os.PathLike, *, moe: bool = True, seed: int = 0, family: str = "qwen3", **overrides
) -> str:
    """Builds a random transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM (float32) and save_pretrained's it.

    family="qwen2": a Qwen2ForCausalLM (Qwen2.5 architecture; needs moe=False).
    overrides: HF config fields (vocab_size=..., tie_word_embeddings=..., num_hidden_layers=...). Returns path.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    d = tiny_hf_dict(moe, **overrides)
    if family == "qwen2":
        if moe:
            raise ValueError("make_tiny_hf_checkpoint: family 'qwen2' has no MoE variant here")
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**d))
    elif moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**d))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**d))
    with torch.no_grad():  # unit norms and zero biases would hide mapping mistakes: perturb them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)
