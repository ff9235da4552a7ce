"""The CPU quickstart trained through LoRA adapters only: the base weights stay at their random init (embeddings and
LM head included), and adapters of rank 64 (half the width) on every attention, MLP and expert projection carry the
imitation warm start and the RL updates.

    python experiments/train.py --config=configs/quickstart_lora.py

The optimizer state and the checkpoints hold the adapters alone; the evaluations, the weight pushes to the embedded
engine and <run_dir>/hf carry the merged weights W + (alpha / r) A B (a plain Qwen3-MoE folder).
"""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("quickstart.py"))
    c.model.lora_rank = 64
    c.model.lora_alpha = 128.0
    c.model.lora_experts = True
    # Adapters learn at a larger step size than full fine-tuning (B starts at zero; updates are rank-limited).
    c.optimizer.il_lr = 1e-2
    c.optimizer.lr = 3e-3
    c.train.name = "quickstart_lora"
    return c
