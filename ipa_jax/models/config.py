"""Qwen3 / Qwen3-MoE model configuration read from (and written to) a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from ipa_jax.models.lora import LoraConfig

FAMILIES = ("qwen3", "qwen2")
MOE_IMPLS = ("auto", "dense", "ragged", "blocked", "megablox", "tokamax")
ATTENTION_IMPLS = ("auto", "reference", "blocked", "xla", "cudnn", "splash")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "matmuls")
ROPE_TYPES = ("default", "linear", "yarn")

# HF keys that carry no information for the computation (bookkeeping, generation, inference-only knobs).
_IGNORED_HF_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "initializer_range",
        "use_cache",
        "output_router_logits",
        "router_aux_loss_coef",
        "max_window_layers",
        "sliding_window",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_dropout",
        "hidden_act",
        "use_sliding_window",
        "layer_types",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "num_local_experts",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "is_encoder_decoder",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "generation_config",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "torchscript",
    }
)


# Qwen3Config fields that choose how the model computes, not what: the learner's choice, not the checkpoint's.
LEARNER_SIDE_FIELDS = (
    "moe_impl",
    "moe_block_rows",
    "attention_impl",
    "remat_policy",
    "attention_query_block",
    "scan_layers",
)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture of a Qwen3 dense or Qwen3-MoE causal LM (HF field names), plus learner-side options.

    `family` "qwen2" is the Qwen2 / Qwen2.5 dense variant (q/k/v biases, no QK-norm); `attention_bias` is Qwen3's
    option of biases on q/k/v/o. `num_experts == 0` means a dense model. A layer i is MoE iff num_experts > 0, i not
    in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (the transformers rule). `rope_scaling` is a sorted
    tuple of (key, value) pairs (hashable, so the config can be a static attribute under jit) or None.
    Learner-side (not written to config.json): `moe_impl` (models/moe.py: "auto" = "megablox" on TPU, "tokamax" on
    GPU when the tokamax package is installed, else "blocked" on GPU and CPU, or on CPU "dense" for calls with few
    tokens such as decode steps; "dense" is the reference),
    `moe_block_rows` (rows per block of the blocked MoE path, at most the call's assignments; 0 = its rule:
    `expert_block_rows`, at most 256, the fastest on CPU),
    `attention_impl` (models/attention.py: "auto" = "cudnn" on NVIDIA GPUs in 16-bit dtypes, "splash" on TPU when
    head_dim is a multiple of 128, "blocked" on CPU, "xla" elsewhere; "reference" is the einsum reference),
    `remat_policy` ("none" | "full" | "dots" | "dots_no_batch" | "matmuls", applied per decoder layer; "matmuls"
    keeps the unbatched dots' and the MoE grouped matmuls' outputs),
    `attention_query_block` (queries per attention block when a call has more; 0 = one block: bounds the
    float32 attention scores held at once to [B, H, block, S]), `scan_layers` (the decoder layers' parameters
    stacked on a leading axis and run under `nnx.scan`, so compile time does not grow with depth; every layer
    must be of one kind, all MoE or all dense).
    `lora` (models/lora.py: low-rank adapters, trained while the base weights stay frozen; None = none) is the
    learner's too, but no computation path: a checkpoint's config.json never holds it and engines serve the merged
    weights of a plain model, so it is not in `learner_side()`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    family: str = "qwen3"
    attention_bias: bool = False
    moe_impl: str = "auto"
    moe_block_rows: int = 0
    attention_impl: str = "auto"
    remat_policy: str = "none"
    attention_query_block: int = 128
    scan_layers: bool = False
    lora: LoraConfig | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts < 0:
            raise ValueError(f"Qwen3Config.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"Qwen3Config.num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"Qwen3Config.moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
                )
            if self.decoder_sparse_step <= 0:
                raise ValueError(f"Qwen3Config.decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
        if self.family not in FAMILIES:
            raise ValueError(f"Qwen3Config.family must be one of {FAMILIES}, got {self.family!r}")
        if self.family == "qwen2" and (self.num_experts or self.attention_bias):
            raise ValueError(
                "Qwen3Config: family 'qwen2' has fixed q/k/v biases and no experts "
                f"(num_experts={self.num_experts}, attention_bias={self.attention_bias})"
            )
        if self.attention_query_block < 0:
            raise ValueError(f"Qwen3Config.attention_query_block must be >= 0, got {self.attention_query_block}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"Qwen3Config.moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.moe_block_rows < 0:
            raise ValueError(f"Qwen3Config.moe_block_rows must be >= 0 (0 = automatic), got {self.moe_block_rows}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"Qwen3Config.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
            )
        if self.scan_layers and 0 < len(self.moe_layers) < self.num_hidden_layers:
            raise ValueError(
                f"Qwen3Config.scan_layers needs layers of one kind, but layers {self.moe_layers} of "
                f"{self.num_hidden_layers} are MoE (mlp_only_layers / decoder_sparse_step)"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"Qwen3Config.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        if self.rope_scaling is not None:
            rope_type = dict(self.rope_scaling).get("rope_type")
            if rope_type not in ROPE_TYPES:
                raise ValueError(
                    f"Qwen3Config.rope_scaling rope_type {rope_type!r} unsupported (use one of {ROPE_TYPES})"
                )

    # ------------------------------------------------------------------ derived
    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.family == "qwen2"

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """RoPE inverse frequencies float32[head_dim // 2] and the cos/sin scale (attention factor), as transformers."""
        dim = self.head_dim
        base = self.rope_theta
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        params = dict(self.rope_scaling or ())
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            return (1.0 / pos_freqs).astype(np.float32), 1.0
        factor = float(params["factor"])
        if rope_type == "linear":
            return (1.0 / pos_freqs / factor).astype(np.float32), 1.0
        # yarn: blend interpolated and extrapolated frequencies with a linear ramp (transformers' formula).
        original = params.get("original_max_position_embeddings") or self.max_position_embeddings
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(num_rotations):
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation_factor = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
        return inv_freq.astype(np.float32), float(attention_factor)

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> Qwen3Config:
        """Reads a HF config dict of Qwen3ForCausalLM / Qwen3MoeForCausalLM / Qwen2ForCausalLM; unsupported
        settings raise ValueError."""
        model_type = d.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe", "qwen2"):
            raise ValueError(f"config.json model_type must be 'qwen3', 'qwen3_moe' or 'qwen2', got {model_type!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={d['hidden_act']!r} unsupported (only 'silu')")
        if d.get("use_sliding_window", False):
            raise ValueError("config.json use_sliding_window=true unsupported")
        if any(t != "full_attention" for t in d.get("layer_types") or ()):
            raise ValueError(f"config.json layer_types {d['layer_types']} unsupported (only full_attention)")
        if d.get("attention_dropout", 0.0):
            raise ValueError(f"config.json attention_dropout={d['attention_dropout']} unsupported (must be 0)")
        moe_keys = [k for k in ("num_experts", "num_local_experts", "num_experts_per_tok") if d.get(k)]
        if model_type != "qwen3_moe" and moe_keys:
            raise ValueError(f"config.json model_type {model_type!r} is dense but sets {moe_keys}")
        if d.get("quantization_config"):
            raise ValueError("config.json quantization_config unsupported")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_HF_KEYS and not k.startswith("_"))
        if unknown:
            raise ValueError(f"config.json has fields this implementation does not understand: {unknown}")

        # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; older files rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", d.get("rope_theta", 1_000_000.0))
        if not rope and d.get("rope_scaling"):
            rope = dict(d["rope_scaling"])
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
        rope_scaling = None if rope.get("rope_type", "default") == "default" else tuple(sorted(rope.items()))
        eos = d.get("eos_token_id")
        kw: dict[str, Any] = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            family="qwen2" if model_type == "qwen2" else "qwen3",
            attention_bias=bool(d.get("attention_bias", False)) and model_type != "qwen2",
        )
        if model_type == "qwen3_moe":
            kw.update(
                num_experts=d.get("num_experts", d.get("num_local_experts", 0)),
                num_experts_per_tok=d.get("num_experts_per_tok", 0),
                moe_intermediate_size=d.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, **overrides) -> Qwen3Config:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """HF config dict in the classic Qwen layout (rope_theta/rope_scaling, num_experts), read by every version."""
        moe = self.num_experts > 0
        model_type = "qwen2" if self.family == "qwen2" else "qwen3_moe" if moe else "qwen3"
        d: dict[str, Any] = {
            "architectures": [
                {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[
                    model_type
                ]
            ],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d

    def replace(self, **kw) -> Qwen3Config:
        return dataclasses.replace(self, **kw)

    def learner_side(self) -> dict[str, Any]:
        """The learner-side fields (class doc), which a checkpoint's config.json does not hold: the overrides that
        load a checkpoint into a model of this config's computation paths."""
        return {name: getattr(self, name) for name in LEARNER_SIDE_FIELDS}
