"""Qwen3 dense and Qwen3-MoE in flax.nnx: HF-exact numerics, dropless MoE, sharding, safetensors in and out."""

from ipa_jax.models.cache import KVCache, extend_kv_cache, init_kv_cache
from ipa_jax.models.config import Qwen3Config
from ipa_jax.models.hf_io import from_pretrained, save_pretrained
from ipa_jax.models.logprobs import blockwise_logprobs, token_logprobs
from ipa_jax.models.lora import LoraConfig, LoraParam
from ipa_jax.models.qwen3 import ModelOutput, Qwen3ForCausalLM, init_model, merge_lora
from ipa_jax.models.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    MeshConfig,
    batch_sharding,
    logical_to_spec,
    make_mesh,
    param_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "KVCache",
    "LoraConfig",
    "LoraParam",
    "MeshConfig",
    "ModelOutput",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "batch_sharding",
    "blockwise_logprobs",
    "extend_kv_cache",
    "from_pretrained",
    "init_kv_cache",
    "init_model",
    "logical_to_spec",
    "make_mesh",
    "merge_lora",
    "param_shardings",
    "save_pretrained",
    "token_logprobs",
]
