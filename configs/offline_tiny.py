"""A tiny dense Qwen3 trained offline from Trajectory JSONL files: CPU tests and smoke runs.

python experiments/train.py --config=configs/offline_tiny.py --config.train.data='("trajs.jsonl",)'
"""

from ipa_jax.pipeline import base_config


def get_config():
    c = base_config()
    c.model.arch.update(
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
        )
    )
    c.mesh.data, c.mesh.fsdp = -1, 1
    c.objective.preset = "ipa"
    c.optimizer.lr = 3e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_ratio = 0.0
    c.optimizer.weight_decay = 0.0
    c.train.name = "offline_tiny"
    c.train.steps = 6
    c.train.batch_size = 4
    c.train.buckets = (32, 64)
    c.checkpoint.every = 2
    c.logging.peak_tflops = 0.0
    return c
