"""Metrics settings and FLOP/MFU accounting (the metrics themselves go to the run folder: ipa_jax.pipeline)."""

import os
import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

CREDIT_POSITIONS = 4  # chunk positions whose mean credit weight the learner logs (credit_weight_chunk<k>)


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics: metrics.jsonl, TensorBoard and optionally Weights & Biases.

    every: learner steps between metric lines.
    console_every: learner steps between progress lines when the output is not a terminal (a terminal gets a bar).
    tensorboard: also write TensorBoard events to <run_dir>/tb (tags grouped as train/, eval/, rollout/, queue/, perf/).
    entropy: compute the policy's token entropy every step (one extra logsumexp pass).
    peak_tflops: peak TFLOP/s per device for MFU; 0 = detect from the device kind (on CPU from the clock
        /proc/cpuinfo reports, which in a VM is often the base clock: set it to get a CPU MFU you can compare).
    wandb: also log the grouped scalars to Weights & Biases (pip install 'ipa_jax[wandb]'; WANDB_MODE=offline works).
    wandb_project: the W&B project.
    wandb_entity: the W&B entity (user or team); "" = your default entity.
    """

    every: int = 1
    console_every: int = 10
    tensorboard: bool = True
    entropy: bool = True
    peak_tflops: float = 0.0
    wandb: bool = False
    wandb_project: str = "ipa_jax"
    wandb_entity: str = ""

    def __post_init__(self):
        for name in ("every", "console_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"logging.{name}: must be >= 1, got {getattr(self, name)}")
        if self.peak_tflops < 0:
            raise ValueError(f"logging.peak_tflops: must be >= 0 (0 = detect), got {self.peak_tflops}")
        if self.wandb and not self.wandb_project:
            raise ValueError("logging.wandb_project: must be set when logging.wandb is on")


def chunk_position_weights(
    returns: np.ndarray, action_mask: np.ndarray, chunk_ids: np.ndarray, segment_ids: np.ndarray | None, positions: int
) -> np.ndarray:
    """Mean weight per chunk position (a manipulation check: what chunk vs token credit changes).

    returns float[B, T] (the per-token weights, e.g. credit_returns of unit advantages), action_mask bool[B, T],
    chunk_ids int[B, T], segment_ids int[B, T] (packed rows; None: one sequence per row) -> float[positions]:
    w_p = mean over the chunks at position p of their sequences (p = chunk id - the sequence's first chunk id) of the
    mean weight over the chunk's action tokens; nan where no sequence has a chunk p.
    """
    segments = np.ones_like(chunk_ids) if segment_ids is None else segment_ids
    rows, cols = np.nonzero(action_mask)
    sequence = rows.astype(np.int64) * (int(segments.max(initial=0)) + 1) + segments[rows, cols]
    chunk = chunk_ids[rows, cols].astype(np.int64)
    first = {}
    for s, c in zip(sequence, chunk):
        first[s] = min(first.get(s, c), c)
    position = chunk - np.array([first[s] for s in sequence], dtype=np.int64)
    per_chunk: dict[tuple[int, int], list[float]] = {}
    for s, p, w in zip(sequence, position, returns[rows, cols]):
        per_chunk.setdefault((int(s), int(p)), []).append(float(w))
    out = np.full(positions, np.nan)
    for p in range(positions):
        means = [np.mean(ws) for (_, q), ws in per_chunk.items() if q == p]
        if means:
            out[p] = float(np.mean(means))
    return out


def _is_moe_layer(config: Any, layer: int) -> bool:
    return (
        config.num_experts > 0
        and layer not in tuple(config.mlp_only_layers or ())
        and (layer + 1) % config.decoder_sparse_step == 0
    )


def active_params_per_token(config: Any) -> int:
    """Parameters used by one token's forward matmuls (embedding lookup excluded, LM head included)."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = 0
    for layer in range(config.num_hidden_layers):
        if _is_moe_layer(config, layer):
            mlp = h * config.num_experts + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
        else:
            mlp = 3 * h * config.intermediate_size
        total += attn + mlp
    return total + h * config.vocab_size


def train_flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_active + causal attention 6 * L * n_heads * head_dim * T.

    (Forward 2N per token for the matmuls, backward 4N; QK^T and AV are 4 * L * n_heads * head_dim * T
    per token forward, halved by the causal mask, times 3 for forward + backward.)
    """
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6.0 * active_params_per_token(config) + attention


# bf16 dense peak per device (TFLOP/s); matched against jax's device_kind.
_PEAK_TFLOPS = {
    r"H200|H100": 989.0,
    r"A100": 312.0,
    r"L4": 121.0,
    r"TPU v4": 275.0,
    r"TPU v5 lite|TPU v5e": 197.0,
    r"TPU v5p|TPU v5": 459.0,
    r"TPU v6": 918.0,
}


def peak_flops_per_device(device: jax.Device | None = None) -> float:
    """Peak FLOP/s of one device: a table for accelerators; for CPU, cores * clock * FMA width (float32).

    The CPU clock is what /proc/cpuinfo reports; a virtual machine often reports its base clock while the cores run
    faster (on an Intel Xeon VM reporting 2,100 MHz, float32 2048^3 matmuls ran at 1.5x (XLA) and 1.7x (PyTorch) this
    peak), so a CPU MFU from it can overstate; pass a measured peak (`logging.peak_tflops`, `bench_learner.py
    --peak_tflops`) to compare."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return _cpu_peak_flops() / max(jax.local_device_count(), 1)
    for pattern, tflops in _PEAK_TFLOPS.items():
        if re.search(pattern, device.device_kind):
            return tflops * 1e12
    raise ValueError(f"unknown peak FLOP/s for device kind {device.device_kind!r}: set logging.peak_tflops")


def _cpu_peak_flops() -> float:
    flags, mhz = "", 0.0
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = line
                elif line.startswith("cpu MHz"):
                    mhz = max(mhz, float(line.split(":")[1]))
    except OSError:
        pass
    # float32 FLOPs per cycle per core: 2 FMA units x vector width x 2 (multiply + add).
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 8
    return len(os.sched_getaffinity(0)) * (mhz or 2000.0) * 1e6 * per_cycle
